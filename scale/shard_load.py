"""Loading an agent straight into FSDP2 shards, so no rank ever holds it whole (``--shard-frozen``).

Loading whole and sharding afterwards would cost every rank the whole team at load time (3 x Qwen3-8B in bf16:
48 GB of host memory per rank). Instead (``load_into_shards``):

1. the model is built on the meta device from its ``config.json``;
2. it is sharded with ``distributed.shard_layers`` (the layout of every other sharded copy in the run);
3. each rank allocates only its shards (``to_empty``) and reads from the safetensors files only the rows its shard
   holds (``get_slice(name)[lo:hi]``, the rows FSDP2's Shard(0) assigns: torch.chunk sizes), cast to the dtype;
4. a tied head is the embedding (stored once); non-persistent buffers (the rotary ``inv_freq``) are computed from
   the config, as ``from_pretrained`` does.

The entry point is ``load_agent_sharded``. A tiny agent has no files: it is built whole and sharded with the team
(``scale.torchrun.Torchrun.adopt``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from harness.config import resolve_agent_spec
from harness.loading import folder_spec, hub_offline, load_agent, prepare_tokenizer
from scale import distributed
from team import Agent, AgentSpec

WEIGHT_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja")  # config, weights, tokenizer


def load_agent_sharded(spec: AgentSpec | str | Path, device: str, dtype: torch.dtype, seed: int = 0) -> Agent:
    """An ``Agent`` whose model is read straight into FSDP2 shards in ``dtype`` (a collective: every rank calls it).

    ``spec``: an ``AgentSpec`` or a name (``harness.config.resolve_agent_spec``: a hub id, a short name, a
    folder), or a folder written by ``harness.loading.save_agent`` (a checkpoint's ``agent_k``: its ``agent.json``
    names the agent). A tiny spec is built whole by ``load_agent(spec, device, dtype, seed)``; ``Torchrun.adopt``
    shards it later."""
    spec = folder_spec(spec if isinstance(spec, AgentSpec) else _spec_of(str(spec)))  # a GGUF file: its folder
    if spec.kind == "tiny":
        return load_agent(spec, device=device, dtype=dtype, seed=seed)
    from transformers import AutoTokenizer

    folder = snapshot_folder(spec.source)
    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(folder), spec.name, spec.source)
    return Agent(spec, load_into_shards(folder, dtype, device), tokenizer)


def _spec_of(name: str) -> AgentSpec:
    """The spec of a folder saved by ``Agent.save`` (its original name kept), else of an agent name."""
    meta = Path(name) / "agent.json"
    if meta.exists():
        return AgentSpec(name=json.loads(meta.read_text())["name"], kind="local", source=name)
    return resolve_agent_spec(name)


def snapshot_folder(source: str) -> Path:
    """The local folder of a checkpoint: a folder as it is; a hub name its snapshot in the hub cache (config,
    safetensors and tokenizer files only; downloaded when the hub can be reached, else the cache or one line)."""
    if os.path.isdir(source):
        return Path(source)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, allow_patterns=list(WEIGHT_FILES), local_files_only=hub_offline()))
    except Exception as err:  # not cached and offline, or a wrong id
        raise RuntimeError(f"could not load model '{source}' ({type(err).__name__}); download it first "
                           f"(huggingface-cli download {source}) or pass a local checkpoint folder") from err


def tensor_files(folder: Path) -> dict[str, Path]:
    """Parameter name -> the safetensors file that holds it (one file, or a split checkpoint's index)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return {name: folder / f for name, f in json.loads(index.read_text())["weight_map"].items()}
    single = folder / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{folder} has no model.safetensors (nor its index): loading into shards reads "
                                "safetensors only; re-save the checkpoint with save_pretrained, or drop --shard-frozen")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def local_slice(param) -> tuple[int, int]:
    """Rows [lo, hi) of a sharded parameter's whole tensor that this rank's shard holds (as the DTensor reports)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return offset[0], offset[0] + shape[0]


@torch.no_grad()
def init_nonpersistent_buffers(model: torch.nn.Module, device) -> None:
    """Buffers that are not in a checkpoint (the rotary ``inv_freq``), computed from the config as a freshly built
    module has them."""
    for module in model.modules():
        names = [n for n in getattr(module, "_non_persistent_buffers_set", ()) if getattr(module, n, None) is not None]
        if not names:
            continue
        if not hasattr(module, "config"):
            raise ValueError(f"cannot rebuild the buffers {names} of {type(module).__name__} (no config): "
                             "drop --shard-frozen to load this model whole")
        with torch.device(device):
            fresh = type(module)(module.config)
        for n in names:
            getattr(module, n).copy_(getattr(fresh, n))


@torch.no_grad()
def load_into_shards(folder: str | Path, dtype: torch.dtype, device: str = "cpu", reads: list | None = None):
    """The model of ``folder`` as a frozen ``distributed.ShardedLM`` in ``dtype``, each rank reading only its rows of
    each parameter. ``reads`` (a list) receives (name, shape read) per read, so a test can check that no rank read a
    whole sharded tensor. A collective."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    folder = Path(folder)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype)
    wrapped = distributed.shard_layers(distributed.ShardedLM(lm))
    wrapped.to_empty(device=device)
    files = tensor_files(folder)
    handles = {}
    try:
        for name, p in lm.named_parameters():  # a tied head is the embedding: listed once
            if name not in files:
                raise KeyError(f"{folder} has no tensor '{name}' for {type(lm).__name__}: not a checkpoint of this "
                               "architecture; drop --shard-frozen to load it whole")
            f = handles.get(files[name]) or handles.setdefault(files[name], safe_open(str(files[name]), framework="pt"))
            lo, hi = local_slice(p)
            rows = f.get_slice(name)[lo:hi]  # [hi - lo, ...] only this rank's rows
            if reads is not None:
                reads.append((name, tuple(rows.shape)))
            p.to_local().copy_(rows.to(dtype))
    finally:
        handles.clear()
    lm.tie_weights()
    init_nonpersistent_buffers(lm, device)
    if (folder / "generation_config.json").exists():
        lm.generation_config = GenerationConfig.from_pretrained(folder)
    return distributed.finish_sharding(wrapped)
