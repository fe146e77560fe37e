"""--lora RANK: each agent a base plus its own PEFT LoRA adapter, agents of one base sharing one copy of it.

``adapter.py`` holds what the algorithm sees (an agent's own parameters, a reference that shares the base); this
module holds PEFT: the adapter's config, putting it into a model (``with_adapter``), checking the targets a user
names, and an adapter's files in PEFT's own layout (``adapter_config.json`` + ``adapter_model.safetensors``, what
``peft.PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` load), next to ``agent.json`` naming its base.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from adapter import Adapter, LoraSettings, own_named_parameters
from team import Agent, AgentSpec, Team

ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer but the LM head
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # how PeftModel.save_pretrained prefixes an adapter's keys


def lora_settings(rank: int | None, alpha: float, targets: str) -> LoraSettings | None:
    """The run's adapter settings (``Config.lora``, ``lora_alpha``, ``lora_targets``); None without --lora."""
    if rank is None:
        return None
    names = tuple(t.strip() for t in targets.split(",") if t.strip())
    return LoraSettings(rank=rank, alpha=alpha, targets=names)


def peft_config(settings: LoraSettings):
    """PEFT's LoraConfig of ``settings``: no dropout (the behaviour log-probs, the trained policy and pi_cur must be
    one function), no bias terms (the base's biases stay shared)."""
    from peft import LoraConfig

    targets = ALL_LINEAR if settings.targets == (ALL_LINEAR,) else list(settings.targets)
    return LoraConfig(r=settings.rank, lora_alpha=settings.alpha, target_modules=targets, lora_dropout=0.0,
                      bias="none")


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The last name part of every linear layer of ``model`` but its LM head: what --lora-targets may name."""
    head = model.get_output_embeddings()
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and m is not head})


def check_targets(model: torch.nn.Module, settings: LoraSettings, name: str) -> None:
    """One line when --lora-targets names a module ``model`` lacks (before PEFT's own, longer error)."""
    if settings.targets == (ALL_LINEAR,):
        return
    known = linear_module_names(model)
    missing = [t for t in settings.targets if t not in known]
    if missing:
        raise ValueError(f"--lora-targets {','.join(missing)}: agent '{name}' has no such linear layer; choose "
                         f"from {','.join(known)} (or all-linear)")


def shared_skeleton(model: torch.nn.Module) -> torch.nn.Module:
    """A new module tree of ``model`` whose parameters and buffers are ``model``'s own tensors (no copy)."""
    import copy

    tensors = list(model.parameters()) + list(model.buffers())
    return copy.deepcopy(model, memo={id(t): t for t in tensors})


def with_adapter(base: Agent, adapter: Adapter, seed: int, spec: AgentSpec | None = None) -> Agent:
    """An agent of ``spec`` (default ``base``'s) and ``base``'s tokenizer whose model is ``base``'s weights (the same
    tensors) plus a fresh LoRA adapter (B = 0: the agent starts as the base; A drawn from ``seed``, outside the run's
    random stream)."""
    from peft import inject_adapter_in_model

    check_targets(base.model, adapter.settings, base.spec.name)
    model = shared_skeleton(base.model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(peft_config(adapter.settings), model)
    model.requires_grad_(False)
    agent = Agent(spec or base.spec, model, base.tokenizer, base.procs, adapter=adapter)
    agent.base = base
    return agent


def bases_team(team: Team) -> Team:
    """The team of the agents' bases, slot by slot (one object for the slots of one base): what the tiny warm start
    trains under --lora, so that a shared base stands in for a pretrained model and every adapter starts at B = 0 on
    it. Its agents are marked as owning a trained base (``Adapter.base_trained``): checkpoints carry it."""
    for agent in team.agents:
        agent.adapter = replace(agent.adapter, base_trained=True)
    return Team([agent.base for agent in team.agents], team.config)


def base_folder_name(adapter: Adapter) -> str:
    """The folder next to the agents' in a team folder that holds a base the run trained (``bases_team``)."""
    return f"base_{adapter.base_seed}"


def base_key(spec: AgentSpec) -> tuple:
    """Agents whose specs give the same key share one base: the same weights (a tiny base: the first such slot's
    seed builds it)."""
    return spec.kind, spec.source, spec.tiny_layers


def saved_base_key(spec: AgentSpec, adapter: Adapter) -> tuple:
    """Agents of a checkpoint share one base when their keys match: ``base_key``, and for a base the run trained
    (``Adapter.base_trained``) its seed too, since two trained tiny bases of one shape are different weights (the
    team's warm-started base and an upgraded slot's own, ``replacement_agent``)."""
    return base_key(spec) + ((adapter.base_seed,) if adapter.base_trained else ())


def team_agent_of_base(team: Team, spec: AgentSpec) -> Agent | None:
    """A team agent whose adapter sits on the base ``spec`` names (``base_key``), if one does. A base the run trained
    (the tiny warm start, ``bases_team``) counts: in that run it is what the spec's model is."""
    return next((a for a in team.agents if a.adapter is not None and base_key(a.spec) == base_key(spec)), None)


def replacement_agent(team: Team, spec: AgentSpec, settings: LoraSettings, seed: int, load_base, warm_base=None
                      ) -> Agent:
    """--upgrade SLOT=MODEL with --lora: MODEL's base with a fresh adapter (B = 0, so it starts as the base itself,
    the pi_pre of Stage-0). The base is the team's copy where an agent already sits on the same one
    (``team_agent_of_base``), else ``load_base(spec, seed)``; ``warm_base(base)``, if given (a tiny replacement's warm
    start, standing in for a stronger pretrained model), trains a base of its own first, which checkpoints then carry
    (``base_trained``)."""
    owner = None if warm_base is not None else team_agent_of_base(team, spec)
    if owner is not None:
        return with_adapter(owner.base, replace(owner.adapter, settings=settings), seed, spec)
    base = load_base(spec, seed)
    if warm_base is not None:
        warm_base(base)
    return with_adapter(base, Adapter(settings, seed, base_trained=warm_base is not None), seed)


def adapter_meta(agent: Agent) -> dict:
    """agent.json of an adapter agent: its base's spec and seed and the adapter's settings."""
    s = agent.adapter.settings
    return {"name": agent.spec.name, "kind": agent.spec.kind, "source": agent.spec.source,
            "tiny_layers": agent.spec.tiny_layers, "base_seed": agent.adapter.base_seed,
            "base_trained": agent.adapter.base_trained,
            "lora": {"rank": s.rank, "alpha": s.alpha, "targets": list(s.targets)}}


def adapter_of(meta: dict) -> tuple[AgentSpec, Adapter] | None:
    """(base spec, adapter) of an agent.json written by ``save_adapter``; None for a whole model's."""
    if "lora" not in meta:
        return None
    lora = meta["lora"]
    spec = AgentSpec(name=meta["name"], kind=meta["kind"], source=meta["source"], tiny_layers=meta["tiny_layers"])
    settings = LoraSettings(lora["rank"], lora["alpha"], tuple(lora["targets"]))
    return spec, Adapter(settings, meta["base_seed"], meta["base_trained"])


def save_adapter(agent: Agent, path: str | Path) -> None:
    """The agent's adapter in PEFT's layout (``peft.PeftModel.from_pretrained(base, path)`` loads it) and
    agent.json; the base is not written (its spec names it), unless the run trained it (``bases_team``: then once
    per team folder, ``base_folder_name``)."""
    path = Path(path)
    write_peft_folder(agent, path)
    (path / "agent.json").write_text(json.dumps(adapter_meta(agent)))
    base_folder = path.parent / base_folder_name(agent.adapter)
    if agent.adapter.base_trained and not base_folder.is_dir():
        agent.base.model.save_pretrained(base_folder)
        agent.base.tokenizer.save_pretrained(base_folder)


def write_peft_folder(agent: Agent, path: str | Path) -> None:
    """The agent's adapter alone in PEFT's layout (adapter_config.json + adapter_model.safetensors, its targets
    resolved to module names): what ``peft.PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` load."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = peft_config(agent.adapter.settings)
    config.base_model_name_or_path = agent.spec.source
    config.target_modules = sorted({n.split(".lora_")[0].rsplit(".", 1)[-1]
                                    for n, _ in own_named_parameters(agent.model)})  # "all-linear", resolved
    config.save_pretrained(str(path))
    state = get_peft_model_state_dict(agent.model)  # {key without the adapter name: tensor}
    save_file({PEFT_PREFIX + k: v.detach().contiguous().cpu() for k, v in state.items()}, str(path / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})


@torch.no_grad()
def load_adapter_weights(agent: Agent, path: str | Path) -> None:
    """The adapter weights of ``path`` (``save_adapter``) into the agent's adapter, every one of them."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    saved = load_file(str(Path(path) / ADAPTER_WEIGHTS))
    state = {k.removeprefix(PEFT_PREFIX): v for k, v in saved.items()}
    result = set_peft_model_state_dict(agent.model, state)
    if result.unexpected_keys or len(state) != len(own_named_parameters(agent.model)):
        raise ValueError(f"{path}: its adapter does not fit agent '{agent.spec.name}' ({len(state)} tensors for "
                         f"{len(own_named_parameters(agent.model))} adapter parameters); load it with the settings "
                         "it was trained with")


def check_resume_lora(checkpoint: Path, settings: LoraSettings | None) -> None:
    """One line when --resume's team and --lora disagree: a checkpoint of adapters continues with the settings it was
    trained with, one of whole models without --lora."""
    meta_file = Path(checkpoint) / "team" / "agent_0" / "agent.json"
    saved = adapter_of(json.loads(meta_file.read_text())) if meta_file.exists() else None
    if saved is None and settings is not None:
        raise ValueError(f"--lora: {checkpoint} holds whole models, not adapters; resume it without --lora")
    if saved is not None and saved[1].settings != settings:
        s = saved[1].settings
        raise ValueError(f"{checkpoint} holds LoRA adapters: resume it with --lora {s.rank} --lora-alpha {s.alpha} "
                         f"--lora-targets {','.join(s.targets)}")
