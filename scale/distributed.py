"""torchrun data parallelism and FSDP2 (paper, Section 6.1: four 80 GB GPUs per run; Algorithm 1).

SAT is unchanged when the work is shared over N ranks, provided every statistic that decides something is computed
on the whole batch:

- rollouts (Alg. 1 line 4) in seeded blocks (``scale.torchrun.rollout_in_blocks``): rank r generates blocks r,
  r + N, ... and every rank receives the union, so the batch does not depend on N and groups are never split;
- the trained agent is an fp32 FSDP2 copy (``shard_model``; a bf16 agent's fp32 shards are its master weights, kept
  on the host between turns); each rank computes the loss of its rows (``scale.torchrun.Torchrun.rows``), so the
  step is the one-process step up to float summation order;
- the exact per-state KL (Alg. 1 line 10) and Stage-0 (Eqs. (6)-(7)): each rank measures its rows and the values
  are gathered, so quantiles and accept/reject decisions agree; ``--reuse regenerate`` redraws on rank 0
  (``on_main``);
- ``--shard-frozen`` (default on CUDA): every agent, the reference pi_j,cur and the line-search snapshots are FSDP2
  shards (``shard_in_place``, ``frozen_copy``, ``local_parameters``); HF generate runs through the shards with
  ``synced_gpus=True``, the callers agree on the number of calls (``extra_calls``) so every all-gather meets its
  peers, and whole weights exist only for the HF export, gathered layer by layer (``whole_copy_on_main``).

With one process every function here is the identity. This module imports only torch and numpy.
"""
from __future__ import annotations

import atexit
import copy
import functools
import os
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import NoReturn

import torch
import torch.distributed as dist


# -- process group ---------------------------------------------------------------------------------------------
def setup(device: str) -> str:
    """Join torchrun's process group when WORLD_SIZE > 1 (gloo on CPU, nccl on CUDA); returns this rank's device
    (cuda:LOCAL_RANK under torchrun)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return device
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return device


def rank_main(main):
    """``main`` (returning an exit code; None is 0) as this process's whole part in torchrun's group; without a
    group (one process) just ``main``. Under torchrun the rank then leaves the group (``leave``) and ends
    (``end_rank``); an exception becomes one line on stderr (``one_line``) and exit code 1, the group aborted so
    that no other rank waits for this one."""

    @functools.wraps(main)
    def run(*args, **kwargs) -> int:
        try:
            code = main(*args, **kwargs) or 0
        except Exception as err:
            if not dist.is_initialized():
                raise
            print(one_line(err), file=sys.stderr, flush=True)
            code = 1
        if not dist.is_initialized():
            return code
        try:
            leave(ok=code == 0)
        except Exception as err:  # the last barrier fails when another rank failed after this one's work
            print(one_line(err), file=sys.stderr, flush=True)
            code = code or 1
            leave(ok=False)
        end_rank(code)

    return run


def one_line(err: BaseException) -> str:
    """``<script>: error: rank r of N: <type>: <message> (<file>:<line> where it was raised)``."""
    where = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
    at = f" ({Path(where.filename).name}:{where.lineno})" if where else ""
    return (f"{Path(sys.argv[0]).name}: error: rank {rank()} of {world()}: {type(err).__name__}: "
            f"{' '.join(str(err).split())}{at}")


def leave(ok: bool = True) -> None:
    """Leave torchrun's group (nothing without one). ``ok``: every rank meets at one barrier, then the group is
    destroyed. Not ok (this rank failed): no barrier, which could meet another rank's collective; the group is
    aborted, closing this rank's connections, so a collective the others wait in fails at once instead of after
    the group's timeout."""
    if not dist.is_initialized():
        return
    if ok:
        barrier()
        dist.destroy_process_group()
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)  # torch >= 2.3
    (abort or dist.destroy_process_group)()


def end_rank(code: int) -> NoReturn:
    """End this torchrun rank with ``code``: exit handlers run and output is flushed, but the interpreter is not
    finalized. The group's gloo threads outlive ``destroy_process_group`` (FSDP2 modules and DTensor's meshes keep
    the group object), and a gloo thread that frees a collective's tensor once finalization has begun must take
    the GIL, is ended by Python inside a C++ destructor and aborts the process ("terminate called without an
    active exception", exit -6), at random, more often on a busy machine."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def world() -> int:
    """Processes in torchrun's group (1 before ``setup`` or without torchrun)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in torchrun's group (0 before ``setup`` or without torchrun)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def device_kind(device: str) -> str:
    """The accelerator's name (the GPU model) or "cpu"."""
    return torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else "cpu"


def active() -> bool:
    return world() > 1


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if active():  # nccl: on this rank's GPU (without device_ids it guesses, and warns)
        dist.barrier(device_ids=[torch.cuda.current_device()] if dist.get_backend() == "nccl" else None)


def _comm_device() -> torch.device:
    """Where collective buffers live: the rank's GPU under nccl, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


# -- gathers -----------------------------------------------------------------------------------------------------------
def sum_ranks(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks."""
    if not active():
        return t
    buf = t.detach().to(_comm_device(), copy=True)
    dist.all_reduce(buf)
    return buf.to(t.device)


def gather_objects(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank."""
    if not active():
        return [obj]
    out = [None] * world()
    dist.all_gather_object(out, obj)
    return out


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on some rank."""
    return bool(sum_ranks(torch.tensor([float(flag)]))[0] > 0) if active() else flag


def extra_calls(n: int) -> int:
    """Dummy calls this rank adds so every rank makes as many calls into a sharded model as the busiest (each
    call's all-gathers must meet their peers'): max over ranks of n, minus n."""
    return max(gather_objects(n)) - n if active() else 0


def on_main(fn):
    """``fn()`` on rank 0 only; every rank receives its result and continues from rank 0's torch RNG state (CPU and
    the current GPU), so the ranks draw the same minibatch permutations and rollout seeds afterwards."""
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
    """The whole tensor of a DTensor shard (a collective); a plain tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@torch.no_grad()
def broadcast_module(module: torch.nn.Module) -> None:
    """Rank 0's weights on every rank (after loading or the warm start, so no rank starts from weights that differ
    in the last bit). A sharded model is left as it is: every rank read its rows from the same files."""
    if not active() or is_sharded(module):
        return
    for p in list(module.parameters()) + list(module.buffers()):
        buf = p.data.to(_comm_device())
        dist.broadcast(buf, 0)
        p.data.copy_(buf)


# -- FSDP2 models ------------------------------------------------------------------------------------------------
class ShardedLM(torch.nn.Module):
    """A causal LM under FSDP2, seen by the rest of the project as the LM itself.

    ``logprobs.response_hidden_states`` calls ``model.base_model(...)``, which here goes through this module's
    ``__call__``, so FSDP2's root hooks all-gather the embeddings / final norm / (tied) head and reduce-scatter
    their gradients; the root stays gathered after the forward (until its backward), which is when
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
        """HF ``generate`` through the shards (a collective). generate calls the inner model, so the root is
        gathered first; each decoder layer gathers itself. ``synced_gpus=True``: a rank whose rows are done keeps
        running the forward until every rank's are, so the layers' all-gathers stay matched."""
        self.unshard()
        return self.lm.generate(synced_gpus=True, **kwargs)


def is_sharded(model) -> bool:
    return isinstance(model, ShardedLM)


def _policy(low: torch.dtype):
    """FSDP2 mixed precision of an fp32 training copy: compute in the agent's dtype, reduce gradients in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low != torch.float32 else None


def shard_layers(wrapped: ShardedLM, policy=None, cast=None) -> ShardedLM:
    """The project's one FSDP2 layout: ``fully_shard`` on each decoder layer, then on the whole. ``cast`` (a dtype)
    is applied to each unit just before it is sharded, so at most one unit exists in both dtypes at once."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = policy or MixedPrecisionPolicy()
    for layer in wrapped.lm.base_model.layers:
        fully_shard(layer.to(cast) if cast else layer, mp_policy=policy)
    fully_shard(wrapped.to(cast) if cast else wrapped, mp_policy=policy)
    return wrapped


def finish_sharding(wrapped: ShardedLM) -> ShardedLM:
    """Make ``wrapped`` FSDP2's root now (its first forward would otherwise be a decoder layer's, inside
    ``generate``), frozen and in eval mode."""
    wrapped._get_fsdp_state()._lazy_init()
    wrapped.eval()
    wrapped.requires_grad_(False)
    return wrapped


@torch.no_grad()
def _restore_masters(locals_: list[torch.Tensor], masters: list[torch.Tensor] | None, low: torch.dtype) -> None:
    """Put a bf16 agent's kept fp32 master shards back where the bf16 weight still equals round(master), as
    ``team.MasterWeightAdamW`` does with one process, so progress below a bf16 rounding step accumulates across
    turns; elsewhere (a backtracked or rejected step) the master restarts from the bf16 weight."""
    if masters is None or low == torch.float32 or [m.shape for m in masters] != [p.shape for p in locals_]:
        return
    for local, m in zip(locals_, masters):  # local: [rows of this rank, ...] fp32 = the bf16 weight, cast
        m = m.to(local.device)
        local.copy_(torch.where(m.to(low) == local.to(low), m, local))


def shard_model(model: torch.nn.Module, masters: list[torch.Tensor] | None = None) -> ShardedLM:
    """The fp32 FSDP2 copy of a whole agent that trains for its turn (each unit cast to fp32 just before it is
    sharded, so a rank holds at most one fp32 layer besides the agent's weights); ``masters``: this rank's shards
    kept from the agent's last turn (``_restore_masters``)."""
    low = next(model.parameters()).dtype
    wrapped = shard_layers(ShardedLM(copy.deepcopy(model)), _policy(low), cast=torch.float32)
    _restore_masters([p.to_local() for p in wrapped.lm.parameters()], masters, low)
    return wrapped


def master_shards_of(sharded: ShardedLM) -> list[torch.Tensor]:
    """This rank's fp32 shards of a sharded agent, on the host (kept between turns)."""
    sharded.reshard()
    return [p.to_local().detach().to("cpu", copy=True) for p in sharded.lm.parameters()]


def shard_in_place(model: torch.nn.Module) -> ShardedLM:
    """A frozen agent held as FSDP2 shards in its own dtype, sharded in place (the whole weights are freed unit by
    unit). Generation, behaviour log-probs and the KL's forwards gather one layer at a time."""
    return finish_sharding(shard_layers(ShardedLM(model)))


def reshard(model) -> None:
    """Free a sharded model's gathered root (FSDP2 keeps it after a no-grad forward), so the next forward gathers
    the shards' current values. Nothing for a plain model."""
    if is_sharded(model):
        model.reshard()


def _meta_lm(lm: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A model of ``lm``'s class and config on the meta device (no memory)."""
    attn = getattr(lm.config, "_attn_implementation", None)
    with torch.device("meta"):
        return type(lm)._from_config(lm.config, dtype=dtype, attn_implementation=attn)


@torch.no_grad()
def sharded_copy(src: ShardedLM, dtype: torch.dtype | None = None, policy=None) -> ShardedLM:
    """A new sharded model with ``src``'s values (cast to ``dtype``): built on the meta device, sharded the same way
    (so its shards line up with ``src``'s), then each rank copies its own shards; nothing is gathered. FSDP2 modules
    cannot be deep-copied."""
    src.reshard()
    copy_ = shard_layers(ShardedLM(_meta_lm(src.lm, dtype or next(src.parameters()).dtype)), policy)
    copy_.to_empty(device=next(src.parameters()).device)
    for p, q in zip(copy_.parameters(), src.parameters(), strict=True):
        p.to_local().copy_(q.to_local())
    for b, c in zip(copy_.buffers(), src.buffers(), strict=True):  # rotary frequencies
        b.copy_(c)
    return finish_sharding(copy_)


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy (the reference pi_j,cur): sharded like ``model`` when it is sharded."""
    return sharded_copy(model) if is_sharded(model) else copy.deepcopy(model)


def training_copy(frozen: ShardedLM, masters: list[torch.Tensor] | None = None) -> ShardedLM:
    """``shard_model`` for an agent held as shards: the fp32 training copy built shard by shard, never whole."""
    low = next(frozen.parameters()).dtype
    wrapped = sharded_copy(frozen, torch.float32, _policy(low))
    _restore_masters([p.to_local() for p in wrapped.lm.parameters()], masters, low)
    return wrapped


def local_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's shards of a sharded model's parameters (views: writing them changes the model from its next
    forward on), else the parameters. The line search interpolates elementwise, so it works shard by shard."""
    if not is_sharded(model):
        return list(model.parameters())
    model.reshard()
    return [p.to_local() for p in model.parameters()]


@torch.no_grad()
def copy_local_into(src: ShardedLM, dst: ShardedLM) -> None:
    """Write ``src``'s shards into ``dst``'s (same layout), cast to ``dst``'s dtype: no communication."""
    for p, q in zip(local_parameters(dst), local_parameters(src), strict=True):
        p.copy_(q)


# -- whole weights from shards -----------------------------------------------------------------------------------
@torch.no_grad()
def full_weights_by_layer(sharded: ShardedLM, dtype: torch.dtype | None = None):
    """Yield a sharded model's whole weights one FSDP2 unit at a time as [(name, whole tensor)]: the root's own
    (embeddings, final norm, an untied head), then each decoder layer, with the plain model's names. A collective.
    Nothing of a group is kept once the next is gathered, so a rank holds at most one whole layer (what a weight push
    into an inference engine, or ``copy_full_into``, needs). ``dtype``: cast each tensor (e.g. to the engine's)."""
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
    """Write a sharded model's weights into the plain model, one layer at a time, cast to its dtype."""
    params = dict(plain.named_parameters())
    for group in full_weights_by_layer(sharded):
        for name, tensor in group:
            params[name].copy_(tensor.to(params[name].dtype))


@torch.no_grad()
def whole_copy_on_main(model: torch.nn.Module):
    """A plain model with a sharded model's whole weights on rank 0 (on the host), gathered one layer at a time;
    None on the other ranks. A collective. A plain model is returned as it is."""
    if not is_sharded(model):
        return model
    if not is_main():  # the other ranks take part in every gather
        for _ in full_weights_by_layer(model):
            pass
        return None
    plain = _meta_lm(model.lm, next(model.parameters()).dtype)
    plain.to_empty(device="cpu")
    plain.tie_weights()
    for b, c in zip(plain.buffers(), model.lm.buffers(), strict=True):
        b.copy_(c.cpu())
    plain.generation_config = model.lm.generation_config
    copy_full_into(model, plain)
    return plain


# -- shards of whole tensors (the sharded checkpoints of harness/training_state.py) ------------------------------------
def device_mesh():
    """The 1-D mesh of all ranks (FSDP2's default layout: Shard(0)), built from the current process group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(_comm_device().type, (world(),))


def local_rows(t: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a whole tensor in FSDP2's layout (torch.chunk along dim 0; ranks past the last chunk hold
    none); a sharded parameter's own shard; the tensor itself with one process."""
    if not active():
        return t
    if hasattr(t, "to_local"):
        return t.to_local()
    chunks, r = t.chunk(world(), 0), rank()
    return chunks[r] if r < len(chunks) else t[:0]


def as_sharded(local: torch.Tensor, shape: torch.Size):
    """A DTensor (Shard(0) over all ranks) from this rank's rows of a tensor of ``shape``; ``local`` with one
    process."""
    if not active():
        return local
    from torch.distributed.tensor import DTensor, Shard

    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local.to(_comm_device()), device_mesh(), [Shard(0)], run_check=False, shape=shape,
                              stride=stride)
