"""The agents' fp32 training state in a checkpoint (``checkpoints/stage_XXXX/sharded``),
written and read with ``torch.distributed.checkpoint``: each rank writes its Shard(0) rows, and
any number of processes can read them back (DCP reshards on load). A bf16 agent's fp32 master
weights and, with --keep-optimizer-state, its AdamW moments live here; with one process the
tensors are whole."""
from __future__ import annotations

from pathlib import Path

import torch

from harness.training_state import kept_moments, single_process_quiet
from scale import distributed
from team import Team


def fp32_state(agent) -> list[torch.Tensor]:
    """This rank's part of the agent's fp32 training state, one tensor per
    parameter: the master weights of a bf16 agent where it has them (its shards
    under torchrun), else its weights in fp32 (the rank's rows under torchrun)."""
    distributed.reshard(agent.model)  # a sharded agent (--shard-frozen): its parameters are its shards
    params = [p.detach() for p in agent.model.parameters()]
    kept = agent.master_shards if distributed.active() else agent.master_weights
    if kept is None:
        return [distributed.local_rows(p).float() for p in params]
    shapes = [distributed.local_rows(p).shape for p in params]
    if [k.shape for k in kept] != shapes:  # a bug, not a state to save around: the masters belong to other weights
        raise RuntimeError(f"agent {agent.spec.name}: its fp32 master weights do not match its parameters "
                           f"({len(kept)} tensors vs {len(shapes)}); the checkpoint would lose them")
    return list(kept)


def _sharded_dict(agent, parts: list[torch.Tensor], moments: bool = True) -> dict:
    """{parameter name: DTensor (Shard(0)) of this rank's part} (plain tensors with one process),
    and {optimizer.IDX.exp_avg(_sq): ...} for the AdamW moments kept by --keep-optimizer-state."""
    names = [n for n, _ in getattr(agent.model, "lm", agent.model).named_parameters()]  # a ShardedLM's: the plain names
    out = {n: distributed.as_sharded(t, p.shape)
           for n, t, p in zip(names, parts, agent.model.parameters(), strict=True)}
    if moments:
        out.update({key: distributed.as_sharded(t, shape) for key, t, shape in kept_moments(agent)})
    return out


def save_sharded(folder: Path, team: Team) -> None:
    """sharded/agent_K for every agent with ``torch.distributed.checkpoint``:
    each rank writes its Shard(0) rows of the fp32 state (one agent at a time,
    so at most one agent's shards are on the accelerator). Loadable under any
    number of processes (``load_sharded``: DCP reshards on load)."""
    import torch.distributed.checkpoint as dcp

    for k, agent in enumerate(team.agents):
        with single_process_quiet():
            dcp.save(_sharded_dict(agent, fp32_state(agent)), checkpoint_id=str(folder / f"agent_{k}"))


def load_sharded(folder: Path, team: Team) -> None:
    """Read sharded/agent_K into this run's layout (any number of processes):
    a bf16 agent gets its fp32 master weights back (``master_weights``, or this
    rank's ``master_shards`` under torchrun), an fp32 agent its weights."""
    import torch.distributed.checkpoint as dcp

    for k, agent in enumerate(team.agents):
        params = [p.detach() for p in agent.model.parameters()]
        state = _sharded_dict(agent, [distributed.local_rows(p).float().clone() for p in params], moments=False)
        for key, value, shape in kept_moments(agent):  # None in state.pt: room for this rank's part
            if value is None:
                state[key] = distributed.as_sharded(
                    torch.zeros(distributed.local_rows(torch.empty(shape, device="meta")).shape), shape)
        with single_process_quiet():
            dcp.load(state, checkpoint_id=str(folder / f"agent_{k}"))
        moments = {key for key, value, _ in kept_moments(agent) if value is None}
        for idx, st in (agent.saved_optimizer_state or {}).get("state", {}).items():
            for name in st:
                if f"optimizer.{idx}.{name}" in moments:
                    part = state.pop(f"optimizer.{idx}.{name}")
                    st[name] = (part.to_local() if hasattr(part, "to_local") else part).to("cpu", copy=True)
        values = list(state.values())
        if agent.dtype == torch.float32:
            with torch.no_grad():
                for p, v in zip(params, values):
                    if hasattr(p, "to_local"):  # loaded into shards (shard_load): the same Shard(0) rows
                        p.to_local().copy_(v.to_local())
                    else:
                        p.copy_(distributed.full(v).to(p.device))
        elif distributed.active():
            agent.master_shards = [v.to_local().to("cpu", copy=True) for v in values]
        else:
            agent.master_weights = [v.to("cpu", copy=True) for v in values]
