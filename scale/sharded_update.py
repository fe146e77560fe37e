"""FSDP2 for the agent being trained (torchrun): ``train_sharded`` wraps one
``update.train_agents`` call so that the trained agent is an FSDP2-sharded fp32
copy while it trains, and a plain (or ``--shard-frozen``-sharded) model again
for the trust-region check afterwards. With one process it just calls ``train()``."""
from __future__ import annotations

import torch

from harness.training_state import MOMENTS
from scale import distributed
from team import Agent, Team


def train_sharded(team: Team, slots: int | list[int], train):
    """``train()`` (``train_agents`` of one agent j, or of every slot for
    ``--update joint``) with each trained agent replaced by an FSDP2-sharded
    fp32 copy under torchrun; afterwards the whole trained weights are written
    back into each agent's own model (and the in-loop anchor made whole), so
    the trust-region check sees plain models. A bf16 agent's fp32 shards are
    its master weights: this rank's shards stay on the host (``master_shards``)
    for its next turn, as one process keeps ``master_weights``. With
    ``--shard-frozen`` the agent is sharded already: the fp32 copy is built
    from its shards and written back into them, so no rank ever holds it
    whole (``distributed.training_copy``, ``copy_local_into``). With one
    process: just ``train()``."""
    if not distributed.active():
        return train()
    single = isinstance(slots, int)
    slots = [slots] if single else list(slots)
    plains = {j: team.agents[j] for j in slots}
    for j, plain in plains.items():
        low = plain.dtype != torch.float32
        masters = plain.master_shards if low else None
        if distributed.is_sharded(plain.model):  # --shard-frozen: built shard by shard, no whole copy
            copy_ = distributed.training_copy(plain.model, masters)
        else:
            copy_ = distributed.shard_model(plain.model, masters)
        team.agents[j] = Agent(plain.spec, copy_, plain.tokenizer, plain.procs)
        if plain.saved_optimizer_state is not None:  # --keep-optimizer-state: this rank's shards of the moments
            team.agents[j].saved_optimizer_state = sharded_optimizer_state(
                plain.saved_optimizer_state, list(team.agents[j].model.parameters()))
            plain.saved_optimizer_state = None
    try:
        out = train()
    finally:
        sharded = {j: team.agents[j] for j in slots}
        for j, plain in plains.items():
            team.agents[j] = plain
    for j, plain in plains.items():
        if plain.dtype != torch.float32:
            plain.master_shards = distributed.master_shards_of(sharded[j].model)
        plain.saved_optimizer_state = sharded[j].saved_optimizer_state  # host shards (team._to_cpu), or None
        sharded[j].model.reshard()
        stats = out if single else out[j]
        if distributed.is_sharded(plain.model):  # --shard-frozen: the agent stays sharded, each rank its shards
            distributed.copy_local_into(sharded[j].model, plain.model)
            if stats.anchor is not None:  # this rank's rows of each (the root's may have been gathered)
                stats.anchor = [distributed.local_rows(a).to(p.dtype) for a, p in
                                zip(stats.anchor, distributed.local_parameters(plain.model), strict=True)]
            continue
        distributed.copy_full_into(sharded[j].model, plain.model)
        if stats.anchor is not None:
            stats.anchor = [distributed.full(a).to(p.dtype) for a, p in zip(stats.anchor, plain.model.parameters(),
                                                                           strict=True)]
    return out


def sharded_optimizer_state(saved: dict, params: list) -> dict:
    """An AdamW state_dict kept between turns as this rank's shards (host tensors), its moments made DTensors again
    for the sharded agent's ``params``, so ``load_state_dict`` gives the step the moments it had."""
    state = {idx: {k: distributed.as_sharded(v, params[int(idx)].shape) if k in MOMENTS else v for k, v in st.items()}
             for idx, st in saved["state"].items()}
    return {**saved, "state": state}
