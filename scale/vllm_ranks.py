"""The vLLM engines across ranks: where each rank's engine runs, and the layer-by-layer weight push.

Paper, Section 6.1 (the runs used four 80 GB GPUs) and Algorithm 1: line 4
(ROLLOUT under pi_cur) is shared out over the ranks of a torchrun run, and
after line 12 (promote pi_j,cur <- pi_tar^j) every rank's engine for agent j
must sample from the promoted weights. ``rollout_vllm.py`` drives one engine
per agent; this module holds what changes when there are several ranks, and
the push that serves them all:

- data parallel (``--vllm-tensor-parallel 1``, the default): each rank has
  its own engine per agent, started with torchrun's variables hidden
  (``engine_environment``) so vLLM's process group is its own, on CUDA on the
  rank's own GPU; rank r generates blocks r, r + N, ... (``engine_blocks``);
- tensor parallel (K > 1, CUDA): one engine spans K consecutive ranks through
  vLLM's ``external_launcher`` (``start_llm``); the K ranks take the same
  blocks; refused in one line where it cannot work (``check_tensor_parallel``);
- the weight push, one group at a time (``push_layers``): the agent's own
  parameters by decoder layer, or under torchrun
  ``distributed.full_weights_by_layer`` of its FSDP2 shards, so no rank holds
  a whole agent more than one layer at a time besides its engine;
- what an engine starts from (``engine_source``), on every rank: a folder
  where transformers did not write one (``write_engine_folder``);
- sharded agents (``--shard-frozen``): an engine starts from the agent's
  config with dummy weights (``sharded_engine_kwargs``), and every push is
  gathered from the FSDP2 shards layer by layer (``push_layers``), a
  collective, so it happens on every rank at once: at the start of the run and
  after each promotion (``rollout_vllm.sync_weights``, staleness agreed over
  the ranks), never lazily inside a generate call. The weight version of a
  sharded agent is the fingerprint of this rank's shards
  (``vllm_weights.weights_fingerprint`` of ``distributed.local_parameters``: no
  collective).

vLLM is imported only inside the functions that start an engine.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from scale import distributed
from scale.vllm_weights import check_group, layer_groups, parameter_specs, payload_for, vllm_group

TENSOR_PARALLEL_CPU_ERROR = ("--vllm-tensor-parallel > 1 needs CUDA GPUs (engines spanning several ranks through vLLM's "
                             "external launcher); on CPU use --vllm-tensor-parallel 1 (one engine per agent per rank)")
# What torchrun puts in a rank's environment. A data-parallel engine runs in its own processes with its own
# one-process torch.distributed group: it must not see these, or it would try to join the trainers' group.
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                      "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


# ---------------------------------------------------------------------------
# Several processes (torchrun): where each rank's engines run (pure)
# ---------------------------------------------------------------------------
def engine_environment(environ: dict, device: str, tensor_parallel: int = 1) -> dict:
    """The environment a rank's engine starts in (its processes inherit it).

    Data parallel (K = 1): the engine is this rank's own, in its own processes
    with vLLM's own one-process torch.distributed group, so torchrun's
    variables are removed (vLLM would otherwise read RANK / MASTER_* and try
    to join the trainers' group), and on CUDA the engine sees only the rank's
    GPU (CUDA_VISIBLE_DEVICES = the LOCAL_RANK-th visible device; it is the
    engine's device 0, and IPC handles are opened there:
    ``vllm_weights._materialize``). One process: unchanged. Tensor parallel
    (K > 1): unchanged, the external launcher needs RANK, LOCAL_RANK and
    MASTER_* to join torchrun's group."""
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
    """One line for a --vllm-tensor-parallel K that cannot work: K >= 1; K > 1
    needs CUDA; K must divide the number of processes (an engine spans K
    consecutive ranks); there must be at least one rollout block per engine
    group; ``--reuse regenerate`` redraws on rank 0 alone, which a K-rank
    engine cannot serve."""
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
        raise ValueError(f"--rollout-blocks {n_blocks} leaves engine groups idle: use at least {world // tensor_parallel} "
                         f"(processes / --vllm-tensor-parallel)")
    if reuse == "regenerate":
        raise ValueError("--reuse regenerate is not supported with --vllm-tensor-parallel > 1 yet (rank 0 redraws alone, "
                         "a tensor-parallel engine needs all its ranks): use --reuse weights, or --vllm-tensor-parallel 1")


def engine_blocks(n_blocks: int, rank: int, world: int, tensor_parallel: int = 1) -> range:
    """The rollout blocks this rank generates: rank r of N takes blocks r, r + N,
    ... (data parallel); with K-rank tensor-parallel engines, the K ranks of
    engine group g = r // K all take blocks g, g + N/K, ... (they run one
    engine together, each receiving every output)."""
    groups = world // tensor_parallel
    return range(rank // tensor_parallel, n_blocks, groups)


class _environment:
    """``os.environ`` made ``env`` for the duration (while an engine's processes
    are spawned): only the variables that differ are removed or set, and only
    they are put back afterwards (what vLLM sets meanwhile stays)."""

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


# ---------------------------------------------------------------------------
# Starting a rank's engine
# ---------------------------------------------------------------------------
def prepare_environment() -> None:
    """Before the first engine starts: let the engine processes import the
    worker extension whatever their working directory; keep vLLM's
    processes talking over loopback (one node); quiet vLLM's info logs
    unless the user asked for them."""
    here = str(Path(__file__).resolve().parent)
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
    """``vllm.LLM(**kwargs)`` started where this rank's engine runs: in this
    process, in torchrun's group, for a K-rank tensor-parallel engine (the
    external launcher); else in its own processes, spawned in the rank's
    engine environment (``engine_environment``)."""
    from vllm import LLM  # optional extra

    if tensor_parallel > 1:  # the external launcher runs the engine in this process, in torchrun's group
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        return LLM(**kwargs)
    with _environment(engine_environment(os.environ, device)):  # torchrun: the rank's own engine
        return LLM(**kwargs)


def engine_source(agent, tmp_root: str) -> str:
    """What an engine is created from: the agent's checkpoint folder or hub
    id; an agent built in memory (tiny) is written to a temporary folder (on
    every rank; a sharded agent's as its config only, ``write_engine_config``).
    Only its architecture matters: the in-memory weights are pushed right after."""
    spec = agent.spec
    if spec.kind in ("local", "hub"):
        return spec.source
    path = Path(tmp_root) / f"agent_{id(agent):x}"
    if distributed.is_sharded(agent.model):  # dummy weights: the shards are pushed right after
        write_engine_config(agent.model, path)
    if not (path / "config.json").exists():
        agent.model.save_pretrained(path)
        agent.tokenizer.save_pretrained(path)
    if not (path / "config.json").exists():  # under torchrun transformers writes on rank 0 only: every rank needs its own
        write_engine_folder(agent.model, path)
    return str(path)


def write_engine_folder(model, path: Path) -> None:
    """The config and weights an engine starts from, written by this rank:
    under torchrun transformers' ``save_pretrained`` writes on rank 0 only,
    and every rank's engine needs a folder."""
    from safetensors.torch import save_file

    model.config.save_pretrained(path)
    tensors = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters()}  # a tied matrix once,
    save_file(tensors, str(Path(path) / "model.safetensors"), metadata={"format": "pt"})  # under its embedding name


# ---------------------------------------------------------------------------
# The weight push, one layer at a time
# ---------------------------------------------------------------------------
def push_layers(llm, model, name: str) -> None:
    """Push a model's weights into its engine one group at a time: groups of
    (HF name, whole tensor), the model's own parameters by decoder layer
    (``vllm_weights.layer_groups``), for a sharded model
    ``distributed.full_weights_by_layer`` of its FSDP2 shards (a collective). Each group is
    checked (names, shapes, dtype, nothing twice) before it is sent and the
    push must cover every parameter; the engine loads it layerwise."""
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


# ---------------------------------------------------------------------------
# Sharded agents (--shard-frozen)
# ---------------------------------------------------------------------------
def sharded_engine_kwargs(model) -> dict:
    """``vllm.LLM`` overrides for a sharded agent's engine: dummy weights
    (nothing read from disk, no whole copy written by the trainer); the real
    ones arrive by the first push, from the shards."""
    return {"load_format": "dummy"} if distributed.is_sharded(model) else {}


def write_engine_config(model, path: Path) -> None:
    """A sharded agent's engine folder: its config only (dummy weights), with
    the architecture that ``save_pretrained`` records (vLLM picks its model
    class by it; without it a tiny agent's engine is taken for a pooling model)."""
    lm = getattr(model, "lm", model)
    lm.config.architectures = [type(lm).__name__]
    lm.config.save_pretrained(path)
