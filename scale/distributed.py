"""Several processes: torchrun data parallelism and FSDP2 for the agent being trained.

Paper, Section 6.1 (the runs used four 80 GB GPUs) and Algorithm 1: nothing in
SAT changes when the work is shared out over ranks, provided every statistic
that decides something is computed on the whole batch. Under
``torchrun --nproc-per-node N sat.py ...``:

- rollouts (Alg. 1 line 4): the B prompts are cut into ``--rollout-blocks``
  blocks, each generated under its own seed (``rollout.rollout_in_blocks``);
  rank r generates blocks r, r + N, ... and every rank receives the union, so
  the batch does not depend on N and groups are never split (Eq. (2)'s group
  baselines, the ESS, the certificate and held-out accuracy are global);
- the agent being trained: an fp32 copy sharded with FSDP2 (``fully_shard``
  per decoder layer, then the whole model; mixed precision when the agents are
  held in bf16), each rank computing the loss of its rows of every minibatch
  (``row_range``); gradients are reduce-scattered, so the step is the
  one-process step up to float summation order; a bf16 agent's fp32 shards
  are its master weights, kept on the host between its turns
  (``Agent.master_shards``), and ``--keep-optimizer-state`` keeps the AdamW
  moments' shards the same way; GAE's value head is whole on every rank, its
  gradient averaged over them (``update._gradient_step``);
- ``--reuse regenerate``: rank 0 redraws, and every rank continues from its
  batch and RNG state (``on_main``);
- plug-and-play Stage-0 (Eqs. (6)-(7)): the replacement's trainable copy is
  sharded like the trained agent, each rank fits its share of every
  micro-batch and measures its share of the states (``row_share``), the
  per-state values gathered (``plug_and_play.measure_all``); with
  ``--shard-frozen`` pi_pre, the incumbent and the replacement are shards too;
- the exact per-state KL (Alg. 1 line 10): each rank measures its rows and the
  values are gathered, so the quantile, the backtracking fraction and the
  accept/reject decision are the same on every rank;
- ``--shard-frozen`` (default on CUDA, unless ``--vllm-tensor-parallel`` > 1):
  every agent is held as FSDP2 shards in its own dtype (``shard_in_place``);
  with ``--backend vllm`` each rank's engines are fed from the shards one
  layer at a time (``vllm_ranks.push_layers``); HF generate runs
  through the shards with ``synced_gpus=True`` (``ShardedLM.generate``), and
  the callers agree on the number of calls into a sharded agent before the
  first (``extra_calls``: dummy calls, a dummy rollout block), so every
  all-gather meets its peers; the trained agent's fp32 copy is built from its
  shards (``training_copy``) and written back into them (``copy_local_into``),
  so it is never whole; the reference pi_j,cur is a sharded copy
  (``frozen_copy``, built on the meta device: FSDP2 modules cannot be
  deep-copied) and the line search keeps and interpolates this rank's shards
  only (``local_parameters``; the decision comes from the gathered KL,
  ``any_rank`` agrees on the rest). ``--reuse regenerate`` then runs on every
  rank. The whole weights exist only for the HF export of a checkpoint,
  gathered layer by layer on rank 0 (``whole_copy_on_main``); an agent with
  files (a hub model, a checkpoint on ``--resume``) is read straight into
  this layout, each rank reading only its rows (``shard_load.py``);
- without it the agents and the reference pi_j,cur are held whole on every
  rank (they generate with the HF backend and compute behaviour log-probs); on
  CUDA the frozen agents wait in host memory during another agent's turn
  (``frozen_on_host``); only rank 0 writes files, except the sharded
  checkpoint, where every rank writes its shards (``records.save_sharded``).

With one process (plain ``python sat.py``) every function here is the
identity, and nothing is initialised.

This module imports only torch: the project modules call into it.

The process's CPU threads (``configure_threads``) and seeds (``seed_everything``)
are set here too, once per process.
"""
from __future__ import annotations

import copy
import os
import random
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

STATE = SimpleNamespace(rank=0, world=1, device_kind="cpu", mesh=None)


# ---------------------------------------------------------------------------
# Process group
# ---------------------------------------------------------------------------
def setup(device: str) -> str:
    """Join torchrun's process group when WORLD_SIZE > 1 (gloo on CPU, nccl on
    CUDA); returns the device this rank uses (cuda:LOCAL_RANK under torchrun)."""
    STATE.device_kind = torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else "cpu"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return device
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    STATE.rank, STATE.world = dist.get_rank(), dist.get_world_size()
    return device


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    STATE.rank, STATE.world, STATE.mesh = 0, 1, None


def active() -> bool:
    return STATE.world > 1


def is_main() -> bool:
    return STATE.rank == 0


def barrier() -> None:
    if active():
        dist.barrier()


def _comm_device() -> torch.device:
    """Where collective buffers live: the rank's GPU under nccl, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


# ---------------------------------------------------------------------------
# Rows and gathers
# ---------------------------------------------------------------------------
def row_range(n: int) -> tuple[int, int]:
    """This rank's contiguous rows of n: every rank gets n / N rows, so every
    rank makes the same number of (collective) forward calls."""
    if n % STATE.world:
        raise ValueError(f"{n} rows cannot be shared evenly by {STATE.world} processes: "
                         f"use --batch-size and --minibatch-size that are multiples of the number of processes")
    per = n // STATE.world
    return STATE.rank * per, (STATE.rank + 1) * per


def row_share(n: int) -> tuple[int, int]:
    """This rank's contiguous rows of n when the shares need not be equal (work
    with no collective inside, whose results are then gathered in rank order,
    e.g. Stage-0's per-state measurements): the first n % N ranks get one row
    more; (0, n) with one process."""
    per, extra = divmod(n, STATE.world)
    lo = STATE.rank * per + min(STATE.rank, extra)
    return lo, lo + per + (1 if STATE.rank < extra else 0)


def sum_ranks(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (the identity with one process)."""
    if not active():
        return t
    buf = t.detach().to(_comm_device(), copy=True)
    dist.all_reduce(buf)
    return buf.to(t.device)


def gather_objects(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank ([obj] with one process)."""
    if not active():
        return [obj]
    out = [None] * STATE.world
    dist.all_gather_object(out, obj)
    return out


def on_main(fn):
    """``fn()`` on rank 0 only; every rank receives its result and continues
    from rank 0's torch RNG state (CPU, and the current GPU's), so the ranks
    draw the same minibatch permutations and rollout seeds afterwards. With
    one process: just ``fn()``."""
    if not active():
        return fn()
    cuda = torch.cuda.is_available()
    payload = (fn(), torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None) if is_main() else None
    result, cpu_state, cuda_state = gather_objects(payload)[0]
    torch.set_rng_state(cpu_state)
    if cuda_state is not None:
        torch.cuda.set_rng_state(cuda_state)
    return result


def as_float(x) -> float:
    """float() of a tensor or a DTensor (a sharded model's gradient norm)."""
    return float(x.full_tensor()) if hasattr(x, "full_tensor") else float(x)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (a collective: call on every rank); a plain tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@torch.no_grad()
def broadcast_module(module: torch.nn.Module) -> None:
    """Rank 0's weights on every rank (after loading or the warm start, so no
    rank starts from weights that differ in the last bit). A model loaded
    straight into shards (``shard_load``) is left as it is: every rank read
    its rows from the same files."""
    if not active() or is_sharded(module):
        return
    for p in list(module.parameters()) + list(module.buffers()):
        buf = p.data.to(_comm_device())
        dist.broadcast(buf, 0)
        p.data.copy_(buf)


# ---------------------------------------------------------------------------
# FSDP2 for the agent being trained
# ---------------------------------------------------------------------------
class ShardedLM(torch.nn.Module):
    """A causal LM under FSDP2, seen by the rest of the project as the LM itself.

    ``logprobs.response_hidden_states`` calls ``model.base_model(...)``; here
    that call goes through this module's ``__call__``, so FSDP2's root hooks
    all-gather the embeddings / final norm / (tied) LM head and reduce-scatter
    their gradients; the root's parameters stay gathered after the forward
    (FSDP2 keeps the root unsharded until its backward), which is when
    ``token_logprobs_from_hidden`` applies the LM head in chunks."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm
        self.config = lm.config

    def forward(self, **inputs) -> torch.Tensor:
        return self.lm.base_model(**inputs).last_hidden_state  # [N, L, H]

    @property
    def base_model(self):
        return lambda **inputs: SimpleNamespace(last_hidden_state=self(**inputs))

    def get_output_embeddings(self):
        return self.lm.get_output_embeddings()

    def gradient_checkpointing_enable(self, **kwargs):
        self.lm.gradient_checkpointing_enable(**kwargs)

    def gradient_checkpointing_disable(self):
        self.lm.gradient_checkpointing_disable()

    def generate(self, **kwargs):
        """HF ``generate`` through the shards (a collective: every rank calls
        it as many times). generate calls the inner model, not this module, so
        the root's embeddings / final norm / head are gathered first; each
        decoder layer gathers itself. ``synced_gpus=True``: a rank whose rows
        are done keeps running the forward (without sampling) until every
        rank's are, so the layers' all-gathers stay matched."""
        self.unshard()
        return self.lm.generate(synced_gpus=True, **kwargs)


def shard_model(model: torch.nn.Module, masters: list[torch.Tensor] | None = None) -> ShardedLM:
    """An fp32 copy of ``model`` sharded with FSDP2: ``fully_shard`` on each
    decoder layer, then on the whole. Agents held in bf16 compute in bf16 and
    reduce gradients in fp32 (MixedPrecisionPolicy); fp32 agents (CPU) in fp32.
    Each layer is cast to fp32 just before it is sharded, so a rank holds at
    most one full fp32 layer besides the agent's own low-precision weights.

    The sharded fp32 parameters are the master weights of a bf16 agent (the
    forward runs on their bf16 cast, the agent's own weights). ``masters``
    (this rank's shards kept from the agent's last turn, ``master_shards``)
    are restored where the bf16 weight still equals round(master), as
    ``team.MasterWeightAdamW`` does with one process, so progress below a bf16
    rounding step accumulates across turns; elsewhere (a backtracked or
    rejected step) the master restarts from the bf16 weight."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    low = next(model.parameters()).dtype
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low != torch.float32 else MixedPrecisionPolicy()
    wrapped = ShardedLM(copy.deepcopy(model))
    for layer in wrapped.lm.base_model.layers:
        fully_shard(layer.float(), mp_policy=policy)
    fully_shard(wrapped.float(), mp_policy=policy)
    params = list(wrapped.lm.parameters())
    if masters is not None and low != torch.float32 and [m.shape for m in masters] == [p.to_local().shape for p in params]:
        with torch.no_grad():
            for p, m in zip(params, masters):
                local = p.to_local()  # [rows of this rank, ...] fp32 = the bf16 weight, cast
                m = m.to(local.device)
                local.copy_(torch.where(m.to(low) == local.to(low), m, local))
    return wrapped


def master_shards_of(sharded: ShardedLM) -> list[torch.Tensor]:
    """This rank's fp32 shards of a sharded agent, on the host (kept between turns)."""
    sharded.reshard()
    return [p.to_local().detach().to("cpu", copy=True) for p in sharded.lm.parameters()]


@torch.no_grad()
def full_weights_by_layer(sharded: ShardedLM, dtype: torch.dtype | None = None):
    """Yield the whole weights of a sharded model one FSDP2 unit at a time, as
    [(parameter name, whole tensor)]: first the root's own (embeddings, final
    norm, an untied head), then each decoder layer. A collective: every rank
    iterates. Nothing of a group is kept once the next is gathered, so a rank
    holds the whole model at most one layer at a time (what a weight push into
    an inference engine, or ``copy_full_into``, needs); names are the plain
    model's. ``dtype``: cast each tensor (e.g. to the engine's bf16)."""
    sharded.reshard()  # the root may still be gathered after a no-grad forward
    lm = sharded.lm
    layers = lm.base_model.layers
    prefix = next(n for n, m in lm.named_modules() if m is layers)  # "model.layers"
    in_layers = {id(p) for p in layers.parameters()}
    groups = [[(n, p) for n, p in lm.named_parameters() if id(p) not in in_layers]]
    groups += [[(f"{prefix}.{i}.{n}", p) for n, p in layer.named_parameters()] for i, layer in enumerate(layers)]
    for group in groups:
        yield [(n, full(p.detach()).to(dtype or p.dtype)) for n, p in group]


@torch.no_grad()
def copy_full_into(sharded: ShardedLM, plain: torch.nn.Module) -> None:
    """Write a sharded model's weights into the plain model, one layer at a
    time (``full_weights_by_layer``, cast to the plain model's dtype)."""
    params = dict(plain.named_parameters())
    for group in full_weights_by_layer(sharded):
        for name, tensor in group:
            params[name].copy_(tensor.to(params[name].dtype))


@contextmanager
def frozen_on_host(team, j: int, on: bool):
    """During agent j's turn (its update and trust-region check) the other
    agents wait in host memory, so the accelerator holds one agent's weights
    besides the trained agent's sharded state (``--offload-frozen``, on under
    torchrun on CUDA; memory.py's ``frozen_offload``); they come back before
    the next rollout. Their values never change (no effect on CPU)."""
    others = [a for k, a in enumerate(team.agents) if k != j and not is_sharded(a.model)] if on else []  # shards stay
    devices = [a.device for a in others]
    for agent in others:
        agent.model.to("cpu")
    if others and torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        yield
    finally:
        for agent, device in zip(others, devices):
            agent.model.to(device)


# ---------------------------------------------------------------------------
# Frozen agents, the reference and the line-search snapshots as FSDP2 shards (--shard-frozen)
# ---------------------------------------------------------------------------
def rng_devices(device) -> list[int]:
    """The CUDA devices whose RNG ``torch.random.fork_rng`` must save: the
    current one when ``device`` is a CUDA device, none otherwise (asking a CPU
    run for ``torch.cuda.current_device()`` would start CUDA, and a process
    with CUDA started forks no children: ``parallel.spare_core``)."""
    return [torch.cuda.current_device()] if str(device).startswith("cuda") and torch.cuda.is_available() else []


def is_sharded(model) -> bool:
    return isinstance(model, ShardedLM)


def _finish_sharding(wrapped: ShardedLM) -> ShardedLM:
    """Make ``wrapped`` FSDP2's root now (its first forward would otherwise be
    a decoder layer's, inside ``generate``), frozen and in eval mode."""
    wrapped._get_fsdp_state()._lazy_init()
    wrapped.eval()
    wrapped.requires_grad_(False)
    return wrapped


def shard_in_place(model: torch.nn.Module) -> ShardedLM:
    """A frozen agent held as FSDP2 shards in its own dtype: ``fully_shard`` on
    each decoder layer, then on the whole, in place (the whole weights are
    freed as each unit is sharded). Generation (``ShardedLM.generate``),
    behaviour log-probs and the KL's forwards gather one layer at a time."""
    from torch.distributed.fsdp import fully_shard

    wrapped = ShardedLM(model)
    for layer in model.base_model.layers:
        fully_shard(layer)
    fully_shard(wrapped)
    return _finish_sharding(wrapped)


def shard_team(team, on: bool) -> None:
    """``--shard-frozen``: every agent of the team held as shards from now on
    (the trained one is sharded already during its turn and stays so after)."""
    if not (on and active()):
        return
    for agent in team.agents:
        if not is_sharded(agent.model):
            agent.model = shard_in_place(agent.model)


def reshard(model) -> None:
    """Free a sharded model's gathered root (FSDP2 keeps it after a no-grad
    forward): its parameters are the shards again, and the next forward
    gathers their current values. Nothing for a plain model."""
    if is_sharded(model):
        model.reshard()


@torch.no_grad()
def sharded_copy(src: ShardedLM, dtype: torch.dtype | None = None, policy=None) -> ShardedLM:
    """A new sharded model with ``src``'s values (cast to ``dtype``): built on
    the meta device, sharded the same way (so every rank's shards line up with
    ``src``'s), then each rank copies its own shards; no rank gathers
    anything. FSDP2 modules cannot be deep-copied."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    src.reshard()
    dtype = dtype or next(src.parameters()).dtype
    config = src.lm.config
    with torch.device("meta"):
        lm = type(src.lm)._from_config(config, dtype=dtype, attn_implementation=getattr(config, "_attn_implementation", None))
    copy_ = ShardedLM(lm)
    for layer in lm.base_model.layers:
        fully_shard(layer, mp_policy=policy or MixedPrecisionPolicy())
    fully_shard(copy_, mp_policy=policy or MixedPrecisionPolicy())
    copy_.to_empty(device=next(src.parameters()).device)
    for p, q in zip(copy_.parameters(), src.parameters(), strict=True):
        p.to_local().copy_(q.to_local())
    for b, c in zip(copy_.buffers(), src.buffers(), strict=True):  # rotary frequencies
        b.copy_(c)
    return _finish_sharding(copy_)


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy (the reference pi_j,cur): sharded like ``model`` when it is sharded."""
    return sharded_copy(model) if is_sharded(model) else copy.deepcopy(model)


def local_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's shards of a sharded model's parameters (views: writing them
    changes the model from its next forward on), else the parameters. The
    line search interpolates elementwise, so it works shard by shard."""
    if not is_sharded(model):
        return list(model.parameters())
    model.reshard()
    return [p.to_local() for p in model.parameters()]


def training_copy(frozen: ShardedLM, masters: list[torch.Tensor] | None = None) -> ShardedLM:
    """The fp32 sharded copy that trains for the agent's turn (as ``shard_model``
    makes from a whole agent), built from a sharded frozen agent shard by
    shard; a bf16 agent computes in bf16 and reduces in fp32, and its kept
    fp32 master shards are restored where the bf16 weight still equals
    round(master) (``shard_model``'s rule)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    low = next(frozen.parameters()).dtype
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low != torch.float32 else None
    wrapped = sharded_copy(frozen, torch.float32, policy)
    params = [p.to_local() for p in wrapped.lm.parameters()]
    if masters is not None and low != torch.float32 and [m.shape for m in masters] == [p.shape for p in params]:
        with torch.no_grad():
            for local, m in zip(params, masters):
                m = m.to(local.device)
                local.copy_(torch.where(m.to(low) == local.to(low), m, local))
    return wrapped


@torch.no_grad()
def copy_local_into(src: ShardedLM, dst: ShardedLM) -> None:
    """Write ``src``'s shards into ``dst``'s (same layout), cast to ``dst``'s dtype: no communication."""
    for p, q in zip(local_parameters(dst), local_parameters(src), strict=True):
        p.copy_(q)


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on some rank (the identity with one process)."""
    return bool(sum_ranks(torch.tensor([float(flag)]))[0] > 0) if active() else flag


def extra_calls(n: int) -> int:
    """How many dummy calls this rank adds so that every rank makes as many
    calls into a sharded model as the busiest (each call's all-gathers must
    meet their peers'): max over ranks of ``n`` - ``n``. 0 with one process."""
    return max(gather_objects(n)) - n if active() else 0


@torch.no_grad()
def whole_copy_on_main(model: torch.nn.Module):
    """A plain model with a sharded model's whole weights on rank 0 (on the
    host), gathered one layer at a time (``full_weights_by_layer``); None on
    the other ranks. A collective. A plain model is returned as it is."""
    if not is_sharded(model):
        return model
    dtype = next(model.parameters()).dtype
    plain = None
    if is_main():
        config = model.lm.config
        with torch.device("meta"):
            plain = type(model.lm)._from_config(config, dtype=dtype, attn_implementation=getattr(config, "_attn_implementation", None))
        plain.to_empty(device="cpu")
        plain.tie_weights()
        for b, c in zip(plain.buffers(), model.lm.buffers(), strict=True):
            b.copy_(c.cpu())
        plain.generation_config = model.lm.generation_config
    if plain is not None:
        copy_full_into(model, plain)
    else:  # the other ranks take part in every gather
        for _ in full_weights_by_layer(model):
            pass
    return plain


# ---------------------------------------------------------------------------
# Shards of whole tensors (the sharded checkpoints of records.py)
# ---------------------------------------------------------------------------
def device_mesh():
    """The 1-D mesh of all ranks (FSDP2's default layout: Shard(0))."""
    if STATE.mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        STATE.mesh = init_device_mesh(_comm_device().type, (STATE.world,))
    return STATE.mesh


def local_rows(t: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a whole tensor in FSDP2's layout (torch.chunk along
    dim 0; ranks past the last chunk hold 0 rows); the tensor itself with one process."""
    if not active():
        return t
    if hasattr(t, "to_local"):  # a sharded agent's parameter: its rows are this rank's shard
        return t.to_local()
    chunks = t.chunk(STATE.world, 0)
    return chunks[STATE.rank] if STATE.rank < len(chunks) else t[:0]


def as_sharded(local: torch.Tensor, shape: torch.Size):
    """A DTensor (Shard(0) over all ranks) from this rank's rows of a tensor of
    ``shape``; the tensor itself with one process."""
    if not active():
        return local
    from torch.distributed.tensor import DTensor, Shard

    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local.to(_comm_device()), device_mesh(), [Shard(0)], run_check=False, shape=shape, stride=stride)


MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter state, shaped like the parameter


def sharded_optimizer_state(saved: dict, params: list) -> dict:
    """An AdamW state_dict kept between turns as this rank's shards (host
    tensors) with its moments made DTensors again for ``params`` (the sharded
    agent's), so ``load_state_dict`` gives the step the moments it had."""
    state = {idx: {k: as_sharded(v, params[int(idx)].shape) if k in MOMENTS else v for k, v in st.items()}
             for idx, st in saved["state"].items()}
    return {**saved, "state": state}


# ---------------------------------------------------------------------------
# What a torchrun run supports
# ---------------------------------------------------------------------------
def check_options(cfg) -> None:
    """One clear line per option a multi-process run does not support (yet);
    turns on the seeded rollout blocks, which make the batch independent of N."""
    if not active():
        return
    cfg.shard_rollouts = True
    unsupported: dict[str, bool] = {}  # flag -> used (--upgrade runs since Stage-0 is sharded: plug_and_play.fit_stage0)
    for flag, used in unsupported.items():
        if used:
            raise ValueError(f"{flag} is not supported under torchrun yet: run it with one process (python sat.py ...)")
    if getattr(cfg, "shard_frozen", None) and int(getattr(cfg, "vllm_tensor_parallel", 1) or 1) > 1:
        raise ValueError("--shard-frozen with --vllm-tensor-parallel > 1 is not supported yet (the K ranks of an engine "
                         "must take the same rollout blocks): use --vllm-tensor-parallel 1 or --no-shard-frozen")
    for name in ("batch_size", "minibatch_size"):
        if getattr(cfg, name) % STATE.world:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(cfg, name)} must be a multiple of the number of "
                             f"processes ({STATE.world}) so every rank trains on as many rows")


# ---------------------------------------------------------------------------
# How this process uses its CPU: threads and seeds
# ---------------------------------------------------------------------------
def configure_threads(threads: int | None, device: str) -> int:
    """torch's CPU threads: ``--threads``, else $OMP_NUM_THREADS, else 1.

    Not torch's default (one per core): with two threads on two cores, a
    second busy process made every parallel region wait for a descheduled
    thread (measured: a 4-stage tiny run took 446 s instead of 51 s next to
    one other process), and the thread count changes float summation order, so
    the same seed gave different metrics on machines with other core counts.
    One thread is reproducible everywhere and the tiny agents' matrices are
    small. On CUDA the host threads only feed the GPU and are left alone."""
    if threads is None:
        env = os.environ.get("OMP_NUM_THREADS", "")
        threads = int(env) if env.isdigit() and int(env) > 0 else 1
    if not str(device).startswith("cuda"):
        torch.set_num_threads(threads)
    return threads


def seed_everything(seed: int) -> random.Random:
    torch.manual_seed(seed)
    np.random.seed(seed)
    return random.Random(seed)
