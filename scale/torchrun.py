"""torchrun's side of the seam (``processes.OneProcess``): the answers Algorithm 1 gets when several
processes run it data-parallel, each with a share of every batch's rows, the trained agent as FSDP2
shards, and (``--shard-frozen``) every agent held as shards. ``harness.run.resolve`` picks it under torchrun and
for a one-process ``--shard-rollouts`` run (the seeded rollout blocks, so one process draws the batch
that N processes draw), and the core never asks which it has.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch

from harness.processes import OneProcess
from rollout import TeamBatch, Turn, rng_devices, rollout
from scale import distributed
from scale.checkpoint_state import load_sharded, save_sharded
from scale.shard_load import load_agent_sharded
from scale.sharded_update import train_sharded
from scale.vllm_ranks import engine_blocks


class Torchrun(OneProcess):
    """Rank ``rank`` of ``world`` processes. ``shard_frozen``: agents held as FSDP2 shards between turns.
    ``n_blocks``: seeded rollout blocks per batch (``rollout``)."""

    def __init__(self, rank: int = 0, world: int = 1, device_kind: str = "cpu", shard_frozen: bool = False,
                 n_blocks: int = 8):
        self.rank, self.world, self.device_kind = rank, world, device_kind
        self.shard_frozen, self.n_blocks = shard_frozen, n_blocks

    @classmethod
    def join(cls, cfg) -> tuple["Torchrun", object]:
        """Join torchrun's process group (none with one process: a ``--shard-rollouts`` run); (the processes,
        ``cfg`` with torchrun's defaults: this rank's device, seeded rollout blocks, --shard-frozen on CUDA)."""
        cfg = replace(cfg, device=distributed.setup(cfg.device))
        world = distributed.world()
        if world > 1:
            cfg = check_config(cfg, world)
        cfg = replace(cfg, shard_frozen=bool(cfg.shard_frozen) and world > 1)  # one process: nothing to shard
        return cls(distributed.rank(), world, distributed.device_kind(cfg.device), cfg.shard_frozen,
                   cfg.rollout_blocks), cfg

    @classmethod
    def current(cls, device: str = "cpu", shard_frozen: bool = False, n_blocks: int = 8) -> "Torchrun":
        """This process as ``distributed.setup`` left it (one process before it)."""
        return cls(distributed.rank(), distributed.world(), distributed.device_kind(device), shard_frozen, n_blocks)

    @property
    def main(self) -> bool:
        return self.rank == 0

    # -- rows of a batch -------------------------------------------------------------------------------
    def rows(self, n: int) -> tuple[int, int]:
        """Equal contiguous shares, so every rank makes as many (collective) forward calls."""
        if n % self.world:
            raise ValueError(f"{n} rows cannot be shared evenly by {self.world} processes: "
                             f"use --batch-size and --minibatch-size that are multiples of the number of processes")
        per = n // self.world
        return self.rank * per, (self.rank + 1) * per

    def share(self, n: int) -> tuple[int, int]:
        """Shares that may differ by one (work without collectives whose results are gathered in rank order)."""
        per, extra = divmod(n, self.world)
        lo = self.rank * per + min(self.rank, extra)
        return lo, lo + per + (1 if self.rank < extra else 0)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return distributed.sum_ranks(t)

    def gather(self, obj) -> list:
        return distributed.gather_objects(obj)

    def on_main(self, fn):
        """Rank 0 computes; every rank receives the result and rank 0's torch RNG state. With --shard-frozen every
        rank computes (a sharded agent's forwards are collectives)."""
        return fn() if self.shard_frozen else distributed.on_main(fn)

    def barrier(self) -> None:
        distributed.barrier()

    def blocks(self, n_blocks: int, backend, sharded: bool) -> range:
        """The rollout blocks this rank draws: r, r + N, ...; the K ranks of one K-rank tensor-parallel vLLM
        engine take the same blocks (``vllm_ranks.engine_blocks``). The union is every block once. Sharded
        agents: every rank draws as many blocks, one past the last redoing one (discarded)."""
        if sharded:
            return range(self.rank, -(-n_blocks // self.world) * self.world, self.world)
        return engine_blocks(n_blocks, self.rank, self.world, backend.tensor_parallel)

    def rollout(self, draw, team, problems: list, group_size: int, sampling, backend, score: bool):
        """``rollout_in_blocks`` under a seed from torch's global RNG (the same draw on every rank)."""
        seed = int(torch.randint(0, 2 ** 62, ()))
        return rollout_in_blocks(team, problems, group_size, sampling, seed, self.n_blocks, backend, score, self, draw)

    # -- models ----------------------------------------------------------------------------------------
    def frozen_copy(self, model: torch.nn.Module) -> torch.nn.Module:
        return distributed.frozen_copy(model)  # sharded like the model when it is sharded

    def parameters(self, model: torch.nn.Module) -> list[torch.Tensor]:
        return distributed.local_parameters(model)  # this rank's shards (the interpolation is elementwise)

    def release(self, model: torch.nn.Module) -> None:
        distributed.reshard(model)

    def synced_forwards(self, model: torch.nn.Module) -> bool:
        return distributed.is_sharded(model)  # an FSDP2 forward all-gathers each layer's shards

    def lockstep(self, model: torch.nn.Module, calls: int, dummy):
        """A sharded model's forwards are collectives: every rank makes as many calls as the busiest, agreed
        before the first; this rank's extra calls are ``dummy()``, their results discarded."""
        return _padded_calls(calls, dummy) if distributed.is_sharded(model) else super().lockstep(model, calls, dummy)

    def backward(self, loss: torch.Tensor) -> None:
        """FSDP2 averages gradients over ranks; the loss is a sum over them."""
        (loss * self.world if self.world > 1 else loss).backward()

    def average_gradients(self, params) -> None:
        if self.world > 1:
            for p in params:
                p.grad = distributed.sum_ranks(p.grad) / self.world

    def number(self, x) -> float:
        return distributed.as_float(x)  # a sharded model's gradient norm is a DTensor

    def train(self, team, slots, train):
        return train_sharded(team, slots, train)  # the trained agent an FSDP2 fp32 copy while it trains

    def trainable(self, model: torch.nn.Module) -> torch.nn.Module:
        """An fp32 FSDP2 copy whose shards are the master weights (--shard-frozen: built shard by shard)."""
        if distributed.is_sharded(model):
            trained = distributed.training_copy(model)
            if model.lm.is_gradient_checkpointing:
                trained.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return trained
        return distributed.shard_model(model) if self.world > 1 else model

    def write_back(self, trained: torch.nn.Module, model: torch.nn.Module) -> None:
        if distributed.is_sharded(model):  # --shard-frozen: each rank writes its shards, no communication
            distributed.copy_local_into(trained, model)
        elif trained is not model:  # the whole weights on every rank, one layer at a time
            trained.reshard()
            distributed.copy_full_into(trained, model)

    def kept_masters(self, trained: torch.nn.Module) -> list[torch.Tensor] | None:
        return distributed.master_shards_of(trained) if distributed.is_sharded(trained) else None

    # -- the team --------------------------------------------------------------------------------------
    def load_agent(self, load, spec, device: str, dtype: torch.dtype, **kwargs):
        """--shard-frozen: read straight into FSDP2 shards, never whole on one rank."""
        return (load_agent_sharded if self.shard_frozen else load)(spec, device, dtype, **kwargs)

    def whole_copy(self, model: torch.nn.Module) -> torch.nn.Module | None:
        return distributed.whole_copy_on_main(model)  # a collective for a sharded model, layer by layer

    def save_state(self, folder, team) -> None:
        save_sharded(folder, team)  # every rank its Shard(0) rows

    def load_state(self, folder, team) -> None:
        load_sharded(folder, team)  # DCP reshards to this run's ranks

    def adopt(self, agents) -> None:
        """Rank 0's weights on every rank, held as shards with --shard-frozen."""
        for agent in agents:
            distributed.broadcast_module(agent.model)
            if self.shard_frozen and self.world > 1 and not distributed.is_sharded(agent.model):
                agent.model = distributed.shard_in_place(agent.model)
            agent.procs = self

    def describe(self, device: str) -> dict:
        return {"world_size": self.world, "device_kind": self.device_kind}


def check_config(cfg, world: int):
    """``cfg`` with torchrun's defaults (seeded blocks: the batch does not depend on the number of processes; on
    CUDA the frozen agents held as shards), or its refusal (docs/errors.md, "Under torchrun")."""
    shard_frozen = cfg.device.startswith("cuda") and cfg.vllm_tensor_parallel == 1
    cfg = replace(cfg, shard_rollouts=True, shard_frozen=shard_frozen if cfg.shard_frozen is None else cfg.shard_frozen)
    if cfg.shard_frozen and cfg.vllm_tensor_parallel > 1:
        raise ValueError("--shard-frozen with --vllm-tensor-parallel > 1 is not supported yet (the K ranks of an "
                         "engine must take the same rollout blocks): use --vllm-tensor-parallel 1 or --no-shard-frozen")
    for name in ("batch_size", "minibatch_size"):
        if getattr(cfg, name) % world:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(cfg, name)} must be a multiple of the number of "
                             f"processes ({world}) so every rank trains on as many rows")
    return cfg


def rollout_in_blocks(team, problems: list, group_size: int, sampling, seed: int, n_blocks: int, backend,
                      score: bool = True, procs: Torchrun | None = None, draw=rollout):
    """``draw`` (``rollout.rollout``) in ``n_blocks`` blocks of whole groups, block b sampled under the seed
    ``seed + b``; each rank draws its blocks (``Torchrun.blocks``) and every rank receives the union, so the
    batch is the same for any number of processes."""
    procs = procs or Torchrun.current()
    size = -(-len(problems) // max(1, n_blocks))  # problems per block
    starts = list(range(0, len(problems), size))
    mine = {}
    for b in procs.blocks(len(starts), backend, any(distributed.is_sharded(a.model) for a in team.agents)):
        start = starts[b % len(starts)]
        with torch.random.fork_rng(devices=rng_devices(team.agents[0].device)):
            torch.manual_seed(seed + b)
            part = draw(team, problems[start: start + size], group_size, sampling, backend, score)
        if b < len(starts):
            mine[b] = part
    parts = {b: part for gathered in procs.gather(mine) for b, part in gathered.items()}
    return concat_batches([parts[b] for b in range(len(starts))], [a.tokenizer.pad_token_id for a in team.agents])


def concat_batches(parts: list[TeamBatch], pad_ids: list[int]) -> TeamBatch:
    """One TeamBatch from consecutive blocks: contexts re-padded on the left, responses on the right,
    group ids offset so groups stay distinct."""
    def pad_to(x, width, value, left):
        fill = x.new_full((x.shape[0], width - x.shape[1]), value)  # [n, width - L]
        return torch.cat([fill, x] if left else [x, fill], dim=1)  # [n, width]

    turns = []
    for k, pad in enumerate(pad_ids):
        ts = [p.turns[k] for p in parts]
        lc, lr = max(t.context_ids.shape[1] for t in ts), max(t.response_ids.shape[1] for t in ts)
        sampler = None if any(t.sampler_logprobs is None for t in ts) else [r for t in ts for r in t.sampler_logprobs]
        turns.append(Turn(k, torch.cat([pad_to(t.context_ids, lc, pad, True) for t in ts]),
                          torch.cat([pad_to(t.context_mask, lc, 0, True) for t in ts]),
                          torch.cat([pad_to(t.response_ids, lr, pad, False) for t in ts]),
                          torch.cat([pad_to(t.response_mask, lr, 0, False) for t in ts]),
                          torch.cat([pad_to(t.behaviour_logprobs, lr, 0.0, False) for t in ts]),
                          [x for t in ts for x in t.texts], [x for t in ts for x in t.answers],
                          torch.cat([t.truncated for t in ts]), sampler))
    offsets = torch.tensor([0] + [len(set(p.group_ids.tolist())) for p in parts]).cumsum(0)  # [n_parts + 1]
    counterfactual = (None if any(p.counterfactual is None for p in parts)  # per group; blocks hold whole groups
                      else torch.cat([p.counterfactual for p in parts], dim=1))
    return TeamBatch([x for p in parts for x in p.problems],
                     torch.cat([p.group_ids + offsets[i] for i, p in enumerate(parts)]), turns,
                     [x for p in parts for x in p.team_answers], torch.cat([p.rewards for p in parts]),
                     torch.cat([p.agent_reward for p in parts], dim=1), counterfactual)


@contextmanager
def _padded_calls(calls: int, dummy):
    extra = distributed.extra_calls(calls)
    yield
    for _ in range(extra):
        dummy()
