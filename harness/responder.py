"""The responder model an environment asks (``Environment.ask``), sharing the team's weights where it can.

A responder is frozen and never trained, so a model the team already holds need not be loaded twice:

- With ``--lora`` the agents are adapters on shared bases; a responder of an agent's base model is that base itself
  (``Agent.base``, the plain model, no adapter in it), shared for the whole run: the adapters train, the base never.
  On ``--backend vllm`` the base's engine serves it too, its requests with no adapter (``scale.vllm_lora``).
- Otherwise a responder of the same model as an agent shares that agent's weight tensors for as long as the agent
  has not moved: at a run's start, until the agent first gets an optimizer (``Agent.before_training``), when the
  responder takes a frozen copy of the weights as they were, so its replies never change.

Not shared: tiny agents (built from their slot's seed and warm-started, so no responder spec names their
weights), a resumed run's whole agents (they moved), and runs under torchrun (a sharded update writes its
result back into the agent's tensors outside ``start_training``).
"""
from __future__ import annotations

import copy

from harness.lora import base_key
from team import Agent, AgentSpec, Team


def sharable(spec: AgentSpec) -> bool:
    """Whether a responder of ``spec`` may share an agent's weights: a pretrained model (hub, folder, GGUF), not a
    tiny one."""
    return spec.kind != "tiny"


def lora_base(team: Team, spec: AgentSpec) -> Agent | None:
    """The base (a whole, frozen agent) of the team's first adapter agent whose base is ``spec``'s model; None
    without one (or without --lora)."""
    if not sharable(spec):
        return None
    return next((a.base for a in team.agents
                 if a.adapter is not None and a.base is not None and base_key(a.spec) == base_key(spec)), None)


def share_until_trained(agent: Agent) -> Agent:
    """A responder on ``agent``'s own weight tensors (no copy) until ``agent`` first starts training; then, before
    its first step, the responder's model becomes a frozen copy of those weights as they still are."""
    responder = Agent(agent.spec, agent.model, agent.tokenizer)

    def take_own_copy() -> None:
        responder.model = copy.deepcopy(agent.model).requires_grad_(False).eval()

    agent.before_training.append(take_own_copy)
    return responder


def shared_responder(team: Team, spec: AgentSpec, at_start: bool, one_process: bool) -> Agent | None:
    """The responder of ``spec`` built on the team's weights (module docstring), or None where it must be loaded on
    its own. ``at_start``: the team is as loaded (no agent has moved); ``one_process``: not under torchrun."""
    base = lora_base(team, spec)
    if base is not None:
        return Agent(base.spec, base.model, base.tokenizer)
    if not (at_start and one_process and sharable(spec)):
        return None
    same = next((a for a in team.agents if a.adapter is None and base_key(a.spec) == base_key(spec)), None)
    return share_until_trained(same) if same is not None else None


def responder_base(team: Team) -> Agent | None:
    """The --lora base (a whole, frozen agent) whose very model the team's responder is (``shared_responder``), None
    where it holds weights of its own. On ``--backend vllm`` that base's engine serves it, with no adapter."""
    responder = team.config.responder
    if responder is None:
        return None
    return next((a.base for a in team.agents if a.base is not None and a.base.model is responder.model), None)


def shares_weights(team: Team) -> bool:
    """Whether the team's responder holds no weights of its own (a --lora base: for the whole run); what the memory
    planner leaves out. A responder sharing a whole agent until it trains is counted: it takes a copy then."""
    return responder_base(team) is not None
