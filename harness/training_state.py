"""The agents' fp32 training state in a checkpoint (``checkpoints/stage_XXXX/sharded/agent_K``): a bf16
agent's fp32 master weights (else its weights in fp32) and, with --keep-optimizer-state, its AdamW moments.
Written with ``torch.distributed.checkpoint`` (DCP), so that any number of processes reads it back: here
one process writes and reads whole tensors; under torchrun each rank writes its Shard(0) rows
(``scale.checkpoint_state``) and DCP reshards on load. The optimizer's param groups and steps go to
state.pt (``optimizer_skeleton``).
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from adapter import own_named_parameters, own_parameters

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter state, shaped like the parameter


def kept_moments(agent) -> list[tuple[str, torch.Tensor | None, torch.Size]]:
    """(key, value or None, parameter shape) of each kept AdamW moment of the agent's parameters (state
    index i is parameter i); a value head's stay in state.pt."""
    saved, shapes = agent.saved_optimizer_state, [p.shape for p in own_parameters(agent.model)]
    if saved is None:
        return []
    return [(f"optimizer.{idx}.{k}", v, shapes[int(idx)]) for idx, st in saved["state"].items() for k, v in st.items()
            if k in MOMENTS and int(idx) < len(shapes)]


def optimizer_skeleton(agent) -> dict:
    """The kept AdamW state_dict for state.pt: param groups and steps, with the moments (saved with the
    fp32 state) left as None."""
    saved, moved = agent.saved_optimizer_state, {key for key, _, _ in kept_moments(agent)}
    return {**saved, "state": {idx: {k: None if f"optimizer.{idx}.{k}" in moved else v for k, v in st.items()}
                               for idx, st in saved["state"].items()}}


def parameter_names(agent) -> list[str]:
    """The names of the plain model's own parameters (``team.own_named_parameters``: an adapter's under --lora; a
    torchrun-sharded model's are those of the LM inside)."""
    return [n for n, _ in own_named_parameters(getattr(agent.model, "lm", agent.model))]


def fp32_state(agent) -> dict[str, torch.Tensor]:
    """{parameter name: fp32 tensor} (the master weights of a bf16 agent where it has them) and the moments."""
    params = [p.detach() for p in own_parameters(agent.model)]
    kept = agent.master_weights or [p.float() for p in params]
    if [k.shape for k in kept] != [p.shape for p in params]:  # a bug: the masters belong to other weights
        raise RuntimeError(f"agent {agent.spec.name}: its fp32 master weights do not match its parameters "
                           f"({len(kept)} tensors vs {len(params)}); the checkpoint would lose them")
    return {**dict(zip(parameter_names(agent), kept, strict=True)), **{key: v for key, v, _ in kept_moments(agent)}}


def save(folder: Path, team) -> None:
    """sharded/agent_K for every agent of a one-process team."""
    import torch.distributed.checkpoint as dcp

    for k, agent in enumerate(team.agents):
        with single_process_quiet():
            dcp.save(fp32_state(agent), checkpoint_id=str(folder / f"agent_{k}"))


@torch.no_grad()
def load(folder: Path, team) -> None:
    """Read sharded/agent_K (written by any number of processes) into a one-process team: a bf16 agent
    gets its fp32 master weights back, an fp32 agent its weights, each its kept moments."""
    import torch.distributed.checkpoint as dcp

    for k, agent in enumerate(team.agents):
        params = [p.detach() for p in own_parameters(agent.model)]
        state = {n: p.float().cpu().clone() for n, p in zip(parameter_names(agent), params, strict=True)}
        state.update({key: torch.zeros(shape) for key, value, shape in kept_moments(agent) if value is None})
        with single_process_quiet():
            dcp.load(state, checkpoint_id=str(folder / f"agent_{k}"))
        for idx, st in (agent.saved_optimizer_state or {}).get("state", {}).items():
            for name in st:
                if st[name] is None and f"optimizer.{idx}.{name}" in state:
                    st[name] = state.pop(f"optimizer.{idx}.{name}")
        values = [state[n] for n in parameter_names(agent)]
        if agent.dtype == torch.float32:
            for p, v in zip(params, values):
                p.copy_(v.to(p.device))
        else:
            agent.master_weights = values


@contextmanager
def single_process_quiet():
    """DCP warns that it assumes one process when no process group exists: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield
