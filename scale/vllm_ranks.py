"""The vLLM engines across ranks: where each rank's engine runs, and the layer-by-layer weight push.

Paper, Section 6.1 (four 80 GB GPUs) and Algorithm 1 (Section 5): ROLLOUT is shared out over the ranks of a
torchrun run, and after the promotion of line 12 every rank's engine for agent j samples the new weights.

- data parallel (``--vllm-tensor-parallel 1``): each rank has its own engine per agent, started with
  torchrun's variables hidden (``engine_environment``); rank r generates blocks r, r + N, ...
  (``engine_blocks``);
- tensor parallel (K > 1, CUDA): one engine spans K consecutive ranks through vLLM's
  ``external_launcher`` (``start_llm``); the K ranks take the same blocks (``check_tensor_parallel``);
- the push, one group at a time (``push_layers``): the agent's parameters by decoder layer, or
  ``distributed.full_weights_by_layer`` of its FSDP2 shards (a collective), so no rank holds a whole
  agent more than one layer at a time besides its engine;
- sharded agents (``--shard-frozen``): the engine starts from the config with dummy weights
  (``sharded_engine_kwargs``) and is fed from the shards at the start and after each promotion.

vLLM is imported only inside the functions that start an engine.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from scale import distributed
from scale.vllm_weights import check_group, layer_groups, parameter_specs, payload_for, vllm_group

TENSOR_PARALLEL_CPU_ERROR = ("--vllm-tensor-parallel > 1 needs CUDA GPUs (engines spanning several ranks through "
                             "vLLM's external launcher); on CPU use --vllm-tensor-parallel 1 (one engine per agent "
                             "per rank)")
# What torchrun puts in a rank's environment. A data-parallel engine runs in its own processes with its own
# one-process torch.distributed group: it must not see these, or it would try to join the trainers' group.
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                      "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


# -- Several processes (torchrun): where each rank's engines run (pure) ----------------------------------
def engine_environment(environ: dict, device: str, tensor_parallel: int = 1) -> dict:
    """The environment a rank's engine starts in (its processes inherit it). Data parallel under
    torchrun: torchrun's variables removed (vLLM would read RANK / MASTER_* and join the trainers'
    group) and on CUDA only the rank's GPU visible (the LOCAL_RANK-th; the engine's device 0, where IPC
    handles are opened: ``vllm_weights._materialize``). One process, or tensor parallel (the external
    launcher joins torchrun's group): unchanged."""
    env = dict(environ)
    if tensor_parallel > 1 or int(env.get("WORLD_SIZE", "1")) <= 1:
        return env
    local = int(env.get("LOCAL_RANK", "0"))
    for name in TORCHRUN_VARIABLES:
        env.pop(name, None)
    if device != "cpu":
        visible = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        if visible and local >= len(visible):
            raise ValueError(f"LOCAL_RANK {local} but CUDA_VISIBLE_DEVICES lists {len(visible)} GPUs: start one "
                             "process per visible GPU (torchrun --nproc-per-node)")
        env["CUDA_VISIBLE_DEVICES"] = visible[local] if visible else str(local)
    return env


def check_tensor_parallel(tensor_parallel: int, world: int, device: str, n_blocks: int, reuse: str) -> None:
    """One line for a --vllm-tensor-parallel K that cannot work: K >= 1; K > 1 needs CUDA and must
    divide the number of processes (an engine spans K consecutive ranks); at least one rollout block per
    engine group; not with ``--reuse regenerate`` (rank 0 redraws alone)."""
    if tensor_parallel < 1:
        raise ValueError(f"--vllm-tensor-parallel must be >= 1 (got {tensor_parallel})")
    if tensor_parallel == 1:
        return
    if not device.startswith("cuda"):
        raise ValueError(TENSOR_PARALLEL_CPU_ERROR)
    if world % tensor_parallel:
        raise ValueError(f"--vllm-tensor-parallel {tensor_parallel} must divide the number of processes ({world}): "
                         "each engine spans that many consecutive ranks")
    if n_blocks < world // tensor_parallel:
        raise ValueError(f"--rollout-blocks {n_blocks} leaves engine groups idle: use at least "
                         f"{world // tensor_parallel} (processes / --vllm-tensor-parallel)")
    if reuse == "regenerate":
        raise ValueError("--reuse regenerate is not supported with --vllm-tensor-parallel > 1 yet (rank 0 redraws "
                         "alone, a tensor-parallel engine needs all its ranks): use --reuse weights, or "
                         "--vllm-tensor-parallel 1")


def engine_blocks(n_blocks: int, rank: int, world: int, tensor_parallel: int = 1) -> range:
    """The rollout blocks of rank r of N: r, r + N, ... (data parallel); with K-rank tensor-parallel
    engines the K ranks of engine group g = r // K all take g, g + N/K, ... (one engine, every output)."""
    groups = world // tensor_parallel
    return range(rank // tensor_parallel, n_blocks, groups)


class _environment:
    """``os.environ`` made ``env`` while an engine's processes are spawned: only the variables that
    differ are removed or set, and only they are put back (what vLLM sets meanwhile stays)."""

    def __init__(self, env: dict):
        self.env = env

    def __enter__(self):
        self.saved = {k: v for k, v in os.environ.items() if self.env.get(k) != v}  # removed or changed
        self.added = [k for k in self.env if k not in os.environ]
        for k in self.saved:
            os.environ.pop(k)
        os.environ.update({k: self.env[k] for k in list(self.saved) + self.added if k in self.env})

    def __exit__(self, *exc):
        for k in self.added:
            os.environ.pop(k, None)
        os.environ.update(self.saved)


def engine_in_process() -> bool:
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"


# -- Starting a rank's engine ----------------------------------------------------------------------------
def prepare_environment() -> None:
    """Before the first engine starts: the engine processes can import the worker extension
    (``scale.vllm_weights``) whatever their working directory; vLLM's processes talk over loopback;
    vLLM's info logs are quiet unless the user asked for them."""
    here = str(Path(__file__).resolve().parents[1])  # the repository root, above scale/
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if here not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([here] + paths)
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def engine_platform() -> tuple[str, bool]:
    """(device type, sleep mode available) of the installed vLLM's platform."""
    from vllm.platforms import current_platform  # optional extra

    device = "cpu" if current_platform.is_cpu() else str(getattr(current_platform, "device_type", "cuda"))
    return device, bool(current_platform.is_sleep_mode_available())


def start_llm(kwargs: dict, device: str, tensor_parallel: int = 1):
    """``vllm.LLM(**kwargs)`` where this rank's engine runs: in this process, in torchrun's group, for a
    K-rank tensor-parallel engine (the external launcher); else in its own processes, spawned in the
    rank's ``engine_environment``."""
    from vllm import LLM  # optional extra

    if tensor_parallel > 1:  # the external launcher runs the engine in this process, in torchrun's group
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        return LLM(**kwargs)
    with _environment(engine_environment(os.environ, device)):  # torchrun: the rank's own engine
        return LLM(**kwargs)


def engine_source(agent, tmp_root: str) -> str:
    """What an engine is created from: the agent's checkpoint folder or hub id, or for an agent built in
    memory (tiny) a temporary folder on every rank (a sharded agent's config only). Only the architecture
    matters: the in-memory weights are pushed right after."""
    spec = agent.spec
    if spec.kind in ("local", "hub"):
        return spec.source
    path = Path(tmp_root) / f"agent_{id(agent):x}"
    if distributed.is_sharded(agent.model):  # dummy weights: the shards are pushed right after
        write_engine_config(agent.model, path)
    if not (path / "config.json").exists():
        agent.model.save_pretrained(path)
        agent.tokenizer.save_pretrained(path)
    if not (path / "config.json").exists():  # under torchrun transformers writes on rank 0 only: every rank its own
        write_engine_folder(agent.model, path)
    return str(path)


def write_engine_folder(model, path: Path) -> None:
    """The config and weights an engine starts from, written by this rank (under torchrun
    ``save_pretrained`` writes on rank 0 only)."""
    from safetensors.torch import save_file

    model.config.save_pretrained(path)
    tensors = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters()}  # a tied matrix once,
    save_file(tensors, str(Path(path) / "model.safetensors"), metadata={"format": "pt"})  # under its embedding name


# -- The weight push, one layer at a time ----------------------------------------------------------------
def push_layers(llm, model, name: str) -> None:
    """Push a model's weights into its engine one group of (HF name, whole tensor) at a time: its
    parameters by decoder layer (``vllm_weights.layer_groups``), or for a sharded model
    ``distributed.full_weights_by_layer`` of its FSDP2 shards (a collective). Each group is checked
    (names, shapes, dtype, nothing twice) before it is sent; the push must cover every parameter."""
    groups = None
    if distributed.is_sharded(model):  # --shard-frozen: whole tensors one FSDP2 unit at a time, on every rank at once
        groups = distributed.full_weights_by_layer(model)
        model = model.lm  # the plain model's names and (global) shapes
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    specs, seen, in_process = parameter_specs(model), set(), engine_in_process()
    llm.collective_rpc("sat_begin_push")
    missing = None
    try:
        for group in (layer_groups(model) if groups is None else groups):
            named = vllm_group(group, tied)
            check_group(named, specs, seen)
            if not named:
                continue
            if any(t.is_cuda for _, t in named):
                torch.cuda.synchronize()  # IPC readers do not follow our stream order: finish the writes first
            llm.collective_rpc("sat_load_group", args=(payload_for(named, in_process),))
            del named
    finally:  # always close the push: layers not (yet) loaded get their previous tensors back
        results = llm.collective_rpc("sat_end_push")
        missing = results[0] if results else None
    if set(specs) - seen:
        raise RuntimeError(f"agent {name}: the weight push lacked {len(set(specs) - seen)} parameters "
                           f"(e.g. {sorted(set(specs) - seen)[:3]}): push every layer")
    if missing:
        raise RuntimeError(f"agent {name}: the vLLM engine did not receive {len(missing)} of its parameters "
                           f"(e.g. {missing[:3]}): the weight names do not match this model class")


# -- Sharded agents (--shard-frozen) ---------------------------------------------------------------------
def sharded_engine_kwargs(model) -> dict:
    """``vllm.LLM`` overrides for a sharded agent's engine: dummy weights (nothing read from disk, no
    whole copy written); the real ones arrive by the first push, from the shards."""
    return {"load_format": "dummy"} if distributed.is_sharded(model) else {}


def write_engine_config(model, path: Path) -> None:
    """A sharded agent's engine folder: its config only, naming the architecture (vLLM picks its model
    class by it; without it a tiny agent's engine is taken for a pooling model)."""
    lm = getattr(model, "lm", model)
    lm.config.architectures = [type(lm).__name__]
    lm.config.save_pretrained(path)
