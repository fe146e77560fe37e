"""Weights for the vLLM engines: names, versions, transport, and the engine-side loader.

Paper, Algorithm 1, line 12 (promote pi_j,cur <- pi_tar^j): from then on every rollout samples the
promoted weights. What that takes with vLLM:

- names: the checkpoint names vLLM's model classes load (``vllm_weight_name``);
- versions: a fingerprint of the training weights and a version per agent, so that a generate call
  refuses an engine that holds other weights;
- transport: CUDA IPC handles (no copy); on CPU the tensors pickled by us into one bytes object
  (vLLM forwards bytes unchanged, not tensors whose memory it does not own); in-process engines get
  the tensors themselves;
- ``WeightSyncExtension``, mixed into vLLM's worker (``worker_extension_cls``) and called through
  ``LLM.collective_rpc``: a layerwise reload (CPU kernels keep repacked copies of the weights, so the
  post-load processing must run again) that reports any parameter not loaded.

The engine unpickles only this process's own payloads. Nothing here imports vLLM.
"""
from __future__ import annotations

import pickle

import torch

EXTENSION_CLS = "scale.vllm_weights.WeightSyncExtension"  # imported by name inside each engine process
# Wrappers that prefix parameter names without changing the model
# (torch.compile, DistributedDataParallel, FSDP1).
WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_fsdp_wrapped_module.")


# -- Names and tensors -----------------------------------------------------------------------------------
def vllm_weight_name(name: str, tie_word_embeddings: bool) -> str | None:
    """The checkpoint name vLLM's ``load_weights`` expects for an HF parameter name, or None for what is
    not sent. vLLM fuses q/k/v and gate/up itself, so HF names pass through; wrapper prefixes are
    stripped, RoPE buffers dropped (vLLM computes its own), and a tied ``lm_head`` dropped."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix):], True
    if "rotary_emb." in name:
        return None
    if tie_word_embeddings and name.startswith("lm_head."):
        return None
    return name


def weights_for_vllm(model) -> list[tuple[str, torch.Tensor]]:
    """(vLLM name, tensor) of every parameter to push: the training parameters themselves, detached."""
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    out = []
    for name, p in model.named_parameters():
        target = vllm_weight_name(name, tied)
        if target is not None:
            out.append((target, p.detach()))
    return out


def layer_groups(model) -> list[list[tuple[str, torch.Tensor]]]:
    """A model's parameters in the order of ``distributed.full_weights_by_layer``: everything outside the
    decoder layers (embeddings, final norm, an untied head), then one group per decoder layer."""
    named = list(model.named_parameters())
    layers = {}
    root = []
    for name, p in named:
        parts = name.split(".")
        idx = next((i for i in range(len(parts) - 1) if parts[i] == "layers" and parts[i + 1].isdigit()), None)
        if idx is None:
            root.append((name, p.detach()))
        else:
            layers.setdefault(int(parts[idx + 1]), []).append((name, p.detach()))
    return [root] + [layers[k] for k in sorted(layers)]


def parameter_specs(model) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """vLLM name -> (shape, dtype) of every parameter a push must deliver (``check_group``)."""
    return {name: (tuple(t.shape), t.dtype) for name, t in weights_for_vllm(model)}


def vllm_group(group, tied: bool) -> list[tuple[str, torch.Tensor]]:
    """One group of (HF name, tensor) as (vLLM name, tensor), RoPE buffers and a tied head dropped."""
    return [(target, t) for name, t in group if (target := vllm_weight_name(name, tied)) is not None]


def check_group(named: list[tuple[str, torch.Tensor]], specs: dict, seen: set) -> None:
    """Before a group is sent: every name is a parameter of the agent, not sent before in this push, with
    the agent's shape and dtype (anything else would load wrongly or fail deep inside the engine)."""
    for name, t in named:
        if name not in specs:
            raise RuntimeError(f"weight push: {name!r} is not a parameter of the agent's model (names must be the "
                               "plain model's, wrapper prefixes stripped)")
        if name in seen:
            raise RuntimeError(f"weight push: {name!r} sent twice in one push")
        shape, dtype = specs[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise RuntimeError(f"weight push: {name!r} is {tuple(t.shape)} {t.dtype} but the engine's model has "
                               f"{shape} {dtype}: push the whole tensor (not a shard) in the agent's dtype")
        seen.add(name)


# -- Versions --------------------------------------------------------------------------------------------
@torch.no_grad()
def weights_fingerprint(params) -> tuple[float, ...]:
    """Per-parameter float64 sums: any optimizer step or line-search interpolation changes them. A sharded
    model's ``params`` are this rank's shards (``distributed.local_parameters``: no collective)."""
    sums = [p.detach().sum(dtype=torch.float64) for p in params]
    return tuple(torch.stack(sums).tolist()) if sums else ()


class VersionBook:
    """Weight versions per key (agent): 0 at the first observation, +1 at each new fingerprint."""

    def __init__(self):
        self._seen: dict = {}  # key -> (version, fingerprint)

    def observe(self, key, fingerprint) -> int:
        version, seen = self._seen.get(key, (-1, None))
        if seen is None or fingerprint != seen:
            version += 1
        self._seen[key] = (version, fingerprint)
        return version

    def version(self, key) -> int | None:
        return self._seen[key][0] if key in self._seen else None


def check_in_sync(engine_version: int, agent_version: int, name: str) -> None:
    """Before every generate: an engine never samples from weights other than the agent's current ones."""
    if engine_version != agent_version:
        held = "its checkpoint's weights (never pushed)" if engine_version < 0 else f"weight version {engine_version}"
        raise RuntimeError(
            f"agent {name}: its vLLM engine holds {held} but the agent is at version {agent_version}: refusing to "
            "sample from stale weights; call backend.sync(agent) after changing the agent's weights"
        )


# -- Transport (trainer side) ----------------------------------------------------------------------------
def ipc_payload(named_tensors: list[tuple[str, torch.Tensor]]) -> bytes:
    """CUDA IPC handles, pickled into one bytes object: the engine maps the training parameters' memory."""
    from torch.multiprocessing.reductions import reduce_tensor

    return pickle.dumps([(name, reduce_tensor(t)) for name, t in named_tensors])


def cpu_payload(named_tensors: list[tuple[str, torch.Tensor]]) -> bytes:
    """The tensors' data pickled into one bytes object (vLLM cannot forward raw tensors from its message
    decoder to the worker: their memory belongs to the message)."""
    return pickle.dumps([(name, t.detach().cpu().contiguous()) for name, t in named_tensors])


def payload_for(named_tensors: list[tuple[str, torch.Tensor]], in_process: bool):
    """What ``collective_rpc`` carries: the tensors (in-process), IPC handles (CUDA) or bytes (CPU)."""
    if in_process:
        return named_tensors
    on_cuda = any(t.is_cuda for _, t in named_tensors)
    return ipc_payload(named_tensors) if on_cuda else cpu_payload(named_tensors)


# -- Engine side: runs inside each engine's worker process -----------------------------------------------
IPC_DEVICE_ARG = 6  # rebuild_cuda_tensor(tensor_cls, size, stride, offset, storage_cls, dtype, storage_device, ...)


def _materialize(obj):
    """A tensor, or a CUDA IPC handle (rebuild function, args) opened on the engine's own device: an engine
    pinned to the rank's GPU (``vllm_ranks.engine_environment``) sees it as device 0, not the trainer's."""
    if isinstance(obj, torch.Tensor):
        return obj
    rebuild, args = obj
    if getattr(rebuild, "__name__", "") == "rebuild_cuda_tensor" and torch.cuda.is_available():
        args = list(args)
        args[IPC_DEVICE_ARG] = torch.cuda.current_device()
    return rebuild(*args)


def _unpack(payload) -> list:
    """(name, tensor-or-handle) pairs, as sent in-process or from a payload's bytes (our own process's)."""
    if isinstance(payload, memoryview):
        payload = payload.tobytes()
    return pickle.loads(payload) if isinstance(payload, (bytes, bytearray)) else list(payload)


def _engine_model(worker):
    """The worker's nn.Module, unwrapped from a CUDA-graph wrapper if any."""
    model = worker.get_model() if hasattr(worker, "get_model") else worker.model_runner.model
    unwrap = getattr(model, "unwrap", None)
    return unwrap() if callable(unwrap) else model


def refresh_packed_copies(model) -> list[str]:
    """Re-run the post-load processing of every module that still holds its weight and a CPU kernel, and
    return their names: a layerwise reload processes a tied matrix once (through the embedding), so the
    LM head's repacked copy would keep the old values."""
    refreshed = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        method = getattr(module, "quant_method", None)
        if (hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.numel() > 0
                and hasattr(method, "process_weights_after_loading")):
            method.process_weights_after_loading(module)
            refreshed.append(name)
    return refreshed


LORA_WRAPPED = ".base_layer."  # an engine with enable_lora wraps each LoRA-capable layer, its weights under this


def plain_name(name: str) -> str:
    """An engine parameter's name as its checkpoint (and ``load_weights``) names it: a LoRA wrapper's
    ``base_layer`` dropped."""
    return name.replace(LORA_WRAPPED, ".")


def engine_parameter_names(model) -> set[str]:
    """The checkpoint names of every parameter of an engine's model (``plain_name``)."""
    return {plain_name(name) for name, _ in model.named_parameters()}


class WeightSyncExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``); called by name with ``LLM.collective_rpc``."""

    def sat_load_weights(self, payload) -> list[str] | None:
        """Load (name, tensor-or-IPC-handle) pairs into the engine's model; the engine parameters NOT loaded
        (must be empty), or None when this vLLM's load_weights does not report what it loaded."""
        weights = [(name, _materialize(obj)) for name, obj in _unpack(payload)]
        model = _engine_model(self)
        expected = engine_parameter_names(model)
        loaded: list = []
        reload = getattr(self, "reload_weights", None)
        if callable(reload):
            # The layerwise reload calls model_runner.get_model().load_weights: record what it returns.
            target = self.model_runner.get_model()
            original = target.load_weights

            def recording(*args, **kwargs):
                result = original(*args, **kwargs)
                loaded.append(result)
                return result

            target.load_weights = recording
            try:
                reload(weights_iterator=iter(weights), is_checkpoint_format=True)
            finally:
                del target.load_weights
            refresh_packed_copies(model)
        else:  # an older worker without layerwise reload
            loaded.append(model.load_weights(weights=weights))
        if any(t.is_cuda for _, t in weights):
            torch.cuda.synchronize()  # the trainer may overwrite the shared memory right after we return
        del weights
        if not loaded or loaded[0] is None:
            return None
        return sorted(expected - {plain_name(n) for n in loaded[0]})

    # -- a push in groups (one decoder layer at a time) ------------------------------------------
    def sat_begin_push(self) -> bool:
        """Start a push in groups (``sat_load_group`` each, then ``sat_end_push``). With vLLM's layerwise
        reload each layer is processed as soon as its last tensor arrives, so the engine never holds a
        second copy of the model; without it the groups are loaded at the end. Returns whether layerwise."""
        self._sat_push = {"loaded": set(), "pending": [], "layerwise": None}
        api = _layerwise_api() if callable(getattr(self, "reload_weights", None)) else None
        if api is not None:
            api[0](_engine_model(self))  # every layer to meta, its kernel tensors kept for the copy back
            self._sat_push["layerwise"] = api
        return api is not None

    def sat_load_group(self, payload) -> None:
        """Load one group of (name, tensor-or-IPC-handle) pairs."""
        push = self._sat_push
        weights = [(name, _materialize(obj)) for name, obj in _unpack(payload)]
        if push["layerwise"] is None:
            push["pending"].extend(weights)
            return
        loaded = _engine_model(self).load_weights(weights)
        if loaded is None:
            push["loaded"] = None
        elif push["loaded"] is not None:
            push["loaded"] |= set(loaded)
        if any(t.is_cuda for _, t in weights):
            torch.cuda.synchronize()  # the trainer frees or overwrites this layer's memory right after we return
        del weights

    def sat_end_push(self) -> list[str] | None:
        """Finish the push; the engine parameters NOT loaded (must be empty), or None when unreported."""
        push, self._sat_push = self._sat_push, None
        if push["layerwise"] is None:
            return self.sat_load_weights(push["pending"])
        model = _engine_model(self)
        push["layerwise"][1](model, self.model_runner.model_config)  # layers left unloaded get their old tensors back
        refresh_packed_copies(model)
        if push["loaded"] is None:
            return None
        return sorted(engine_parameter_names(model) - {plain_name(n) for n in push["loaded"]})


def _layerwise_api():
    """(initialize, finalize) of vLLM's layerwise in-place reload, or None in a vLLM without it."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
    except ImportError:
        return None
    return initialize_layerwise_reload, finalize_layerwise_reload
