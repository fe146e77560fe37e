"""Loading an agent straight into FSDP2 shards: no rank ever holds it whole.

Paper, Section 6.1 (four 80 GB GPUs per run; Table 3's Qwen3-8B agents):
under ``torchrun ... --shard-frozen`` every agent is held as FSDP2 shards
(``distributed.shard_in_place``). Loading each agent whole first and sharding
it afterwards would cost every rank the whole team at load time (3 x Qwen3-8B
in bf16: 48 GB of host memory per rank). Here instead:

1. the model is built on the meta device from its ``config.json`` (no memory);
2. it is sharded with the layout of ``shard_in_place`` (``fully_shard`` on each
   decoder layer, then on the whole), so its shards line up with every other
   sharded copy in the run (``sharded_copy``, ``training_copy``);
3. each rank allocates only its local shards (``to_empty``) and reads, from
   the checkpoint's safetensors files, only the rows of each parameter that
   its shard holds (``safe_open(...).get_slice(name)[lo:hi]``), cast to the
   agent's dtype. The rows come from the DTensor itself
   (``compute_local_shape_and_global_offset``: FSDP2's Shard(0), torch.chunk
   sizes, ranks past the last chunk hold none);
4. tied embeddings are one parameter (the checkpoint holds it once), and the
   non-persistent buffers (the rotary ``inv_freq``) are computed from the
   config, as ``from_pretrained`` does.

A hub name resolves to its local snapshot folder through the hub client's
cache (``snapshot_folder``; downloaded first when the hub can be reached).
Tiny agents have no files (built from a config and a seed, then warm-started):
they keep the whole-then-shard path.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from scale import distributed

WEIGHT_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja")  # config, weights, tokenizer


def snapshot_folder(source: str) -> Path:
    """The local folder of a checkpoint: a folder as it is; a hub name its
    snapshot in the hub cache (only the config, safetensors and tokenizer
    files; downloaded when the hub can be reached, else the cache or one line)."""
    if os.path.isdir(source):
        return Path(source)
    from huggingface_hub import snapshot_download

    from team import hub_offline

    try:
        return Path(snapshot_download(source, allow_patterns=list(WEIGHT_FILES), local_files_only=hub_offline()))
    except Exception as err:  # not cached and offline, or a wrong id
        raise RuntimeError(f"could not load model '{source}' ({type(err).__name__}); download it first "
                           f"(huggingface-cli download {source}) or pass a local checkpoint folder") from err


def tensor_files(folder: Path) -> dict[str, Path]:
    """Parameter name -> the safetensors file that holds it (one file, or the
    index of a checkpoint split over several)."""
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
    """Rows [lo, hi) of a sharded parameter's whole tensor that this rank's
    shard holds (FSDP2's Shard(0), as the DTensor reports it)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return offset[0], offset[0] + shape[0]


def meta_model(folder: Path, dtype: torch.dtype):
    """The causal LM of ``folder``'s config, built on the meta device (no weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


@torch.no_grad()
def init_nonpersistent_buffers(model: torch.nn.Module, device) -> None:
    """Buffers that are not in a checkpoint (the rotary ``inv_freq``) computed
    from the config, as a freshly built module has them."""
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
    """A frozen agent of ``folder`` held as FSDP2 shards in ``dtype``
    (``distributed.ShardedLM``), each rank reading only its own rows of each
    parameter. ``reads`` (a list) receives (name, shape read) for every read,
    so a test can check that no rank read a whole sharded tensor. A collective
    (``fully_shard`` builds the mesh): every rank calls it."""
    from safetensors import safe_open
    from torch.distributed.fsdp import fully_shard
    from transformers import GenerationConfig

    folder = Path(folder)
    lm = meta_model(folder, dtype)
    wrapped = distributed.ShardedLM(lm)
    for layer in lm.base_model.layers:  # distributed.shard_in_place's layout
        fully_shard(layer)
    fully_shard(wrapped)
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
    return distributed._finish_sharding(wrapped)


def load_agent_sharded(spec, source: str, device: str, dtype: torch.dtype):
    """An ``team.Agent`` of ``source`` (a folder or a hub name) whose model is
    loaded straight into shards (``load_into_shards``); its tokenizer
    prepared as every agent's (``team.prepare_tokenizer``)."""
    from transformers import AutoTokenizer

    from team import Agent, prepare_tokenizer

    folder = snapshot_folder(source)
    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(folder), spec.name, source)
    return Agent(spec, load_into_shards(folder, dtype, device), tokenizer)
