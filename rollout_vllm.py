"""vLLM rollout backend: one sleeping engine per agent, weights pushed from memory.

``rollout.generate`` calls ``generate_vllm(agent, contexts, sampling)`` when
``--backend vllm``; it returns one response id list per context, cut after the
first eos exactly like ``rollout.generate_hf``. The behaviour log-probabilities
are then computed by the training model (``rollout.agent_turn``), so vLLM's
numerics never enter the importance ratios; ``logprob_health`` measures how far
vLLM's own log-probabilities are from them, as a health metric to log.

Design (one GPU, colocated training and rollout):

- One engine per distinct agent (keyed by the Agent object), created lazily,
  one after another, each with an explicit ``gpu_memory_utilization`` from
  ``engine_memory_fractions``: the memory left after what training keeps
  resident during rollouts is split among the engines.
- Each engine runs in its own process (vLLM's default). That matters: vLLM's
  sleep-mode allocator is one per process, so engines sharing a process would
  sleep and wake together.
- Sleep mode around training: ``sleep_all()`` before an agent's update
  (level 1: weights backed up to CPU, KV cache freed), ``wake_for_rollout(agent)``
  before generating (done by ``generate_vllm`` itself).
- Weights move from memory, never from disk. An engine is created from the
  agent's checkpoint (its architecture; a tiny in-memory agent is written to
  a temporary folder first) and then immediately receives the agent's
  in-memory weights. After a promotion, ``sync_weights(agent)`` pushes the new
  weights (wake the weights, load them, wake the KV cache, reset the prefix
  cache); if the engine is asleep the push happens at its next wake. A level-1
  sleep backs up whatever the engine holds, i.e. the last pushed weights, so a
  wake never brings the disk weights back.
- Versions: every agent has a weight version that moves whenever its weights'
  fingerprint (per-parameter float64 sums) changes; every engine records the
  version it holds; ``generate_vllm`` asserts they agree before sampling.
- Transport: CUDA IPC handles of the training parameters (no copy), pickled
  by us into one bytes object, go to the engine's worker through
  ``collective_rpc`` and a small worker extension (``WeightSyncExtension``)
  that calls the model's ``load_weights``. Bytes pass vLLM's own message
  encoding as they are, so no insecure-serialization switch is needed. With
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (in-process engine) tensors are passed directly.

vLLM is an optional extra: it is imported only inside the functions that
drive an engine, so ``import rollout_vllm`` and every pure helper here work
without it (and are tested without it).
"""
from __future__ import annotations

import gc
import math
import os
import pickle
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

WAKE_TAGS = ("weights", "kv_cache")
EXTENSION_CLS = "rollout_vllm.WeightSyncExtension"  # imported by name inside each engine process
SEED_MODULUS = 2 ** 31 - 1
# Wrappers that prefix parameter names without changing the model
# (torch.compile, DistributedDataParallel, FSDP1).
WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_fsdp_wrapped_module.")
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


# ---------------------------------------------------------------------------
# Memory fractions
# ---------------------------------------------------------------------------
def engine_memory_fractions(n_engines: int, train_fraction: float, reserve: float = 0.05,
                            min_fraction: float = 0.02) -> list[float]:
    """``gpu_memory_utilization`` for each engine: the GPU fraction left after
    training's resident share (``train_fraction``: the training weights and
    the scoring forward, which stay on the GPU during rollouts) and a reserve
    (CUDA contexts of the engine processes, fragmentation), split evenly, so
    all engines fit awake at once."""
    if n_engines < 1:
        raise ValueError(f"need at least one engine (got n_engines={n_engines})")
    if not 0 <= train_fraction < 1:
        raise ValueError(f"train_fraction must be in [0, 1) (got {train_fraction})")
    if not 0 <= reserve < 1:
        raise ValueError(f"reserve must be in [0, 1) (got {reserve})")
    each = (1.0 - train_fraction - reserve) / n_engines
    if each < min_fraction:
        raise ValueError(
            f"no room for {n_engines} vLLM engines: training keeps {train_fraction:.0%} of the GPU and {reserve:.0%} is "
            f"reserved, leaving {max(each, 0):.1%} per engine (< {min_fraction:.0%}); fix: fewer agents on this GPU, "
            "a smaller --token-budget or --minibatch-size, or --backend hf"
        )
    return [each] * n_engines


# ---------------------------------------------------------------------------
# Engine and sampling arguments (pure)
# ---------------------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"vLLM engines take bfloat16, float16 or float32 weights (got {dtype})")
    return DTYPE_NAMES[dtype]


def engine_kwargs(model_path: str, memory_fraction: float, dtype: torch.dtype, seed: int, max_model_len: int,
                  logprobs: bool = False) -> dict:
    """Arguments of ``vllm.LLM`` for one agent's engine.

    - skip_tokenizer_init: prompts arrive as token ids and responses leave as
      token ids; the agent's own tokenizer decodes them (as with HF).
    - generation_config="vllm": ignore the checkpoint's sampling defaults
      (Qwen3 ships top_k=20 and extra eos ids); the behaviour log-probabilities
      assume plain tempered sampling with the tokenizer's one eos.
    - enable_sleep_mode: free the GPU for training between rollouts.
    - processed log-probabilities (after temperature) when the health metric is on,
      so they are comparable with the training model's tempered log-probabilities.
    """
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1] (got {memory_fraction})")
    kwargs = dict(
        model=str(model_path),
        skip_tokenizer_init=True,
        dtype=dtype_name(dtype),
        seed=int(seed),
        gpu_memory_utilization=float(memory_fraction),
        enable_sleep_mode=True,
        enable_prefix_caching=True,
        max_model_len=int(max_model_len),
        generation_config="vllm",
        tensor_parallel_size=1,
        worker_extension_cls=EXTENSION_CLS,
    )
    if logprobs:
        kwargs["logprobs_mode"] = "processed_logprobs"
    return kwargs


def sampling_kwargs(sampling, seed: int, eos_id: int, logprobs: bool = False) -> dict:
    """Arguments of ``vllm.SamplingParams`` for one request: the same
    distribution as ``rollout.generate_hf`` (temperature, top_p, top_k
    disabled, no penalties), one sample per request (the G samples of a
    problem are G requests with their own seeds), stopping at the agent's eos."""
    return dict(
        n=1,
        temperature=float(sampling.temperature),
        top_p=float(sampling.top_p),
        top_k=-1,  # disabled (vLLM takes 0 or -1)
        min_p=0.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        max_tokens=int(sampling.max_new_tokens),
        seed=int(seed),
        stop_token_ids=[int(eos_id)],
        ignore_eos=False,
        detokenize=False,
        logprobs=0 if logprobs else None,  # 0: only the sampled token's log-probability
    )


def draw_base_seed() -> int:
    """A base seed from torch's global generator, so a run seeded with
    --seed draws the same vLLM samples every time."""
    return int(torch.randint(0, SEED_MODULUS, ()).item())


def request_seeds(base_seed: int, n: int) -> list[int]:
    """One seed per request: the sample of request i does not depend on how
    vLLM batches it, and the G copies of a prompt get different seeds."""
    return [(int(base_seed) + i) % SEED_MODULUS for i in range(n)]


def build_requests(contexts) -> list[dict]:
    """``TokensPrompt`` dicts (a TypedDict, so plain dicts are valid) from
    context id lists or 1-D tensors."""
    requests = []
    for i, ctx in enumerate(contexts):
        ids = ctx.tolist() if isinstance(ctx, torch.Tensor) else [int(t) for t in ctx]
        if not ids:
            raise ValueError(f"context {i} is empty: vLLM needs at least one prompt token")
        requests.append({"prompt_token_ids": ids})
    return requests


def check_lengths(contexts, max_new_tokens: int, max_model_len: int) -> None:
    """HF generates max_new_tokens after any prompt; vLLM would stop at
    max_model_len instead. Refuse rather than silently sample shorter."""
    longest = max((len(c) for c in contexts), default=0)
    if longest + max_new_tokens > max_model_len:
        raise ValueError(
            f"a prompt of {longest} tokens + --max-new-tokens {max_new_tokens} exceeds the vLLM engine's "
            f"max_model_len {max_model_len}; lower --max-new-tokens or configure a larger max_model_len"
        )


# ---------------------------------------------------------------------------
# Outputs (pure): RequestOutput -> response ids / log-probabilities
# ---------------------------------------------------------------------------
def response_ids_from_completion(token_ids, finish_reason, stop_reason, eos_id: int, pad_id: int) -> list[int]:
    """One completion's ids, cut after the first eos like ``generate_hf``.

    If the engine reports that it stopped on the eos but left the eos out of
    ``token_ids``, put it back: the eos is an action whose probability is part
    of the policy's likelihood (``rollout.cut_at_eos``)."""
    from rollout import cut_at_eos

    ids = [int(t) for t in token_ids]
    if finish_reason == "stop" and stop_reason == eos_id and eos_id not in ids:
        ids.append(int(eos_id))
    return cut_at_eos(ids, eos_id, pad_id)


def outputs_to_responses(outputs, eos_id: int, pad_id: int) -> list[list[int]]:
    """``LLM.generate`` outputs (one per request, in request order, each with
    ``.outputs[0]``: token_ids, finish_reason, stop_reason) -> response ids."""
    responses = []
    for out in outputs:
        c = out.outputs[0]
        responses.append(response_ids_from_completion(c.token_ids, c.finish_reason, getattr(c, "stop_reason", None),
                                                      eos_id, pad_id))
    return responses


def sampled_logprobs(token_ids, logprobs, length: int) -> list[float]:
    """The sampled tokens' log-probabilities from vLLM's per-position maps
    (token id -> Logprob or float); nan where vLLM has none (an eos put back)."""
    values = []
    for pos in range(length):
        if logprobs is None or pos >= len(token_ids) or pos >= len(logprobs):
            values.append(math.nan)
            continue
        entry = logprobs[pos][int(token_ids[pos])]
        values.append(float(getattr(entry, "logprob", entry)))
    return values


def outputs_to_logprobs(outputs, responses: list[list[int]]) -> list[list[float]]:
    """Per request, vLLM's log-probability of each token of its (cut) response."""
    return [sampled_logprobs(out.outputs[0].token_ids, out.outputs[0].logprobs, len(resp))
            for out, resp in zip(outputs, responses)]


def logprob_health(vllm_logprobs: list[list[float]], hf_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean |log pi_vllm - log pi_train| over the response tokens (mask = 1,
    nan entries skipped): how far the sampler's numerics are from the
    training model's. 0 for identical numerics; bf16 kernels give ~1e-2.
    nan when there is nothing to compare."""
    hf = hf_logprobs.detach().float().cpu()  # [N, Lr]
    v = torch.full(hf.shape, math.nan)  # [N, Lr]
    for i, row in enumerate(vllm_logprobs[: hf.shape[0]]):
        n = min(len(row), hf.shape[1])
        if n:
            v[i, :n] = torch.tensor(row[:n], dtype=torch.float32)
    valid = mask.detach().cpu().bool() & ~torch.isnan(v)  # [N, Lr]
    if not valid.any():
        return math.nan
    return float((v - hf).abs()[valid].mean())


# ---------------------------------------------------------------------------
# Weights (pure): names, tensors, fingerprints, versions
# ---------------------------------------------------------------------------
def vllm_weight_name(name: str, tie_word_embeddings: bool) -> str | None:
    """The checkpoint name vLLM's ``load_weights`` expects for one HF
    parameter name, or None for what must not be sent.

    vLLM's model classes load *checkpoint* names (``model.layers.0.self_attn.q_proj.weight``)
    and fuse q/k/v and gate/up themselves, so the HF names pass through;
    wrapper prefixes are stripped, RoPE buffers are dropped (vLLM computes
    its own), and with tied embeddings ``lm_head`` is dropped (it is the
    embedding matrix; the checkpoint has no such tensor)."""
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
    """(vLLM name, tensor) for every parameter to push; the tensors are the
    training parameters themselves (detached, no copy)."""
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    out = []
    for name, p in model.named_parameters():
        target = vllm_weight_name(name, tied)
        if target is not None:
            out.append((target, p.detach()))
    return out


@torch.no_grad()
def weights_fingerprint(model) -> tuple[float, ...]:
    """Per-parameter float64 sums: any optimizer step or line-search
    interpolation changes them, a bit-exact restore gives them back. One
    read of the weights (milliseconds on a GPU), one host sync."""
    sums = [p.detach().sum(dtype=torch.float64) for p in model.parameters()]
    return tuple(torch.stack(sums).tolist()) if sums else ()


class VersionBook:
    """Weight versions per key (agent): 0 at the first observation, +1 each
    time an observed fingerprint differs from the previous one."""

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
    """The invariant checked before every generate call."""
    if engine_version != agent_version:
        raise RuntimeError(
            f"agent {name}: its vLLM engine holds weight version {engine_version} but the agent is at version "
            f"{agent_version}; call rollout_vllm.sync_weights(agent) after promoting it"
        )


# ---------------------------------------------------------------------------
# Sleep / wake / push plans (pure): which engine calls, in which order
# ---------------------------------------------------------------------------
def plan_wake(awake: set[str], stale: bool) -> list[str]:
    """Make an engine ready to sample the agent's current weights.
    Stale weights are loaded between waking the weights and waking the KV
    cache (never with a KV cache allocated for nothing), and the prefix cache
    is reset whenever the weights changed or the KV cache was freed."""
    actions = []
    if "weights" not in awake:
        actions.append("wake:weights")
    if stale:
        actions.append("load")
    if "kv_cache" not in awake:
        actions.append("wake:kv_cache")
    if stale or "kv_cache" not in awake:
        actions.append("reset_prefix_cache")
    return actions


def plan_sync(awake: set[str], stale: bool) -> list[str]:
    """After a promotion: push now if the engine's weights are on the GPU;
    if the engine sleeps (training time) the push waits for its next wake,
    so no KV cache is allocated while another agent trains."""
    if not stale or "weights" not in awake:
        return []
    return ["load", "reset_prefix_cache"] if "kv_cache" in awake else ["load"]


def plan_sleep(awake: set[str]) -> list[str]:
    """Level-1 sleep. A half-awake engine is first woken fully: vLLM ignores
    sleep() while any of its memory is still asleep."""
    if not awake:
        return []
    return [f"wake:{tag}" for tag in WAKE_TAGS if tag not in awake] + ["sleep"]


# ---------------------------------------------------------------------------
# Worker side: runs inside each engine process (no vLLM import needed)
# ---------------------------------------------------------------------------
def _materialize(obj):
    """A tensor, or a CUDA IPC handle from ``reduce_tensor`` (rebuild function, args)."""
    if isinstance(obj, torch.Tensor):
        return obj
    rebuild, args = obj
    return rebuild(*args)


def _unpack(payload) -> list:
    """(name, tensor-or-handle) pairs: as sent in-process, or from the bytes of ``ipc_payload``
    (written by our own training process, hence safe to unpickle)."""
    return pickle.loads(payload) if isinstance(payload, (bytes, bytearray)) else list(payload)


def _engine_model(worker):
    """The worker's nn.Module, unwrapped from a CUDA-graph wrapper if any."""
    model = worker.get_model() if hasattr(worker, "get_model") else worker.model_runner.model
    unwrap = getattr(model, "unwrap", None)
    return unwrap() if callable(unwrap) else model


class WeightSyncExtension:
    """Mixed into vLLM's GPU worker via ``worker_extension_cls``; its methods
    are called by name with ``LLM.collective_rpc``."""

    def sat_load_weights(self, payload) -> list[str] | None:
        """Load (name, tensor-or-IPC-handle) pairs into the engine's model.
        Returns the engine parameters that were NOT loaded (must be empty),
        or None when this vLLM's load_weights does not report what it loaded."""
        weights = [(name, _materialize(obj)) for name, obj in _unpack(payload)]
        model = _engine_model(self)
        loaded = model.load_weights(weights=weights)
        torch.cuda.synchronize()  # the trainer may overwrite the shared memory right after we return
        del weights
        if loaded is None:
            return None
        return sorted(set(name for name, _ in model.named_parameters()) - set(loaded))


def ipc_payload(named_tensors: list[tuple[str, torch.Tensor]]) -> bytes:
    """CUDA IPC handles for the engine process, pickled into one bytes
    object: the engine maps the training parameters' memory instead of
    receiving a copy."""
    from torch.multiprocessing.reductions import reduce_tensor

    return pickle.dumps([(name, reduce_tensor(t)) for name, t in named_tensors])


def engine_in_process() -> bool:
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"


# ---------------------------------------------------------------------------
# The registry: one engine per agent
# ---------------------------------------------------------------------------
@dataclass
class Engine:
    llm: object
    path: str
    name: str
    agent_ref: weakref.ref
    max_model_len: int
    version: int = -1  # -1: weights from disk, never pushed: always stale
    awake: set = field(default_factory=lambda: set(WAKE_TAGS))  # a new engine is awake


def _prepare_environment() -> None:
    """Before the first engine starts: let the engine processes import this
    module (the worker extension) whatever their working directory."""
    here = str(Path(__file__).resolve().parent)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if here not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([here] + paths)


def engine_source(agent, tmp_root: str) -> str:
    """What an engine is created from: the agent's checkpoint folder or hub
    id; an agent built in memory (tiny) is written to a temporary folder. Only
    its architecture matters: the in-memory weights are pushed right after."""
    spec = agent.spec
    if spec.kind in ("local", "hub"):
        return spec.source
    path = Path(tmp_root) / f"agent_{id(agent):x}"
    if not (path / "config.json").exists():
        agent.model.save_pretrained(path)
        agent.tokenizer.save_pretrained(path)
    return str(path)


def default_max_model_len(agent) -> int:
    return int(getattr(agent.model.config, "max_position_embeddings", 32768))


class EngineRegistry:
    """The engines of one run, keyed by agent object."""

    def __init__(self, n_engines: int = 3, train_fraction: float = 0.5, reserve: float = 0.05, seed: int = 0,
                 max_model_len: int | None = None, health_logprobs: bool = False, **engine_overrides):
        self.fraction = engine_memory_fractions(n_engines, train_fraction, reserve)[0]
        self.n_engines = n_engines
        self.seed = seed
        self.max_model_len = max_model_len
        self.health_logprobs = health_logprobs
        self.engine_overrides = engine_overrides
        self.engines: dict[int, Engine] = {}
        self.book = VersionBook()
        self.last_logprobs: dict[int, list[list[float]]] = {}
        self._tmp = tempfile.TemporaryDirectory(prefix="sat_vllm_")

    # -- engines ----------------------------------------------------------------
    def engine(self, agent) -> Engine:
        key = id(agent)
        eng = self.engines.get(key)
        if eng is not None and eng.agent_ref() is agent:
            return eng
        if eng is not None:  # the id of a collected agent was reused: that engine is stale
            self._close(key)
        for k in [k for k, e in self.engines.items() if e.agent_ref() is None]:
            self._close(k)  # engines of agents that no longer exist (plug-and-play swap)
        if len(self.engines) >= self.n_engines:
            raise RuntimeError(f"more than {self.n_engines} vLLM engines requested: configure(n_engines=...) with the "
                               "number of distinct agents, so their memory fractions are sized for all of them")
        return self._create(agent)

    def _create(self, agent) -> Engine:
        _prepare_environment()
        from vllm import LLM  # optional GPU extra

        path = engine_source(agent, self._tmp.name)
        max_len = self.max_model_len or default_max_model_len(agent)
        dtype = next(agent.model.parameters()).dtype
        kwargs = engine_kwargs(path, self.fraction, dtype, self.seed + len(self.engines), max_len, self.health_logprobs)
        kwargs.update(self.engine_overrides)
        eng = Engine(LLM(**kwargs), path, agent.spec.name, weakref.ref(agent), max_len)
        self.engines[id(agent)] = eng
        return eng

    def _close(self, key) -> None:
        eng = self.engines.pop(key)
        llm, eng.llm = eng.llm, None
        shutdown = getattr(llm, "shutdown", None)
        if callable(shutdown):
            shutdown()
        del llm
        gc.collect()

    def shutdown(self) -> None:
        for key in list(self.engines):
            self._close(key)
        self._tmp.cleanup()

    # -- versions ---------------------------------------------------------------
    def agent_version(self, agent) -> int:
        return self.book.observe(id(agent), weights_fingerprint(agent.model))

    def assert_in_sync(self, agent) -> None:
        eng = self.engines[id(agent)]
        check_in_sync(eng.version, self.agent_version(agent), eng.name)

    # -- actions ----------------------------------------------------------------
    def _run(self, eng: Engine, agent, actions: list[str], version: int) -> None:
        for action in actions:
            if action.startswith("wake:"):
                tag = action.split(":", 1)[1]
                eng.llm.wake_up(tags=[tag])
                eng.awake.add(tag)
            elif action == "load":
                self._push(eng, agent)
                eng.version = version
            elif action == "reset_prefix_cache":
                eng.llm.reset_prefix_cache()  # cached KV was computed by other weights, or freed
            elif action == "sleep":
                eng.llm.sleep(level=1)  # weights (the last pushed ones) to CPU, KV cache freed
                eng.awake.clear()
            else:
                raise ValueError(f"unknown engine action {action!r}")

    def _push(self, eng: Engine, agent) -> None:
        named = weights_for_vllm(agent.model)
        payload = named if engine_in_process() else ipc_payload(named)
        torch.cuda.synchronize()  # IPC readers do not follow our stream order: finish the writes first
        results = eng.llm.collective_rpc("sat_load_weights", args=(payload,))
        missing = results[0] if results else None
        if missing:
            raise RuntimeError(f"agent {eng.name}: the vLLM engine did not receive {len(missing)} of its parameters "
                               f"(e.g. {missing[:3]}): the weight names do not match this model class")

    def wake_for_rollout(self, agent) -> Engine:
        eng = self.engine(agent)
        version = self.agent_version(agent)
        self._run(eng, agent, plan_wake(eng.awake, eng.version != version), version)
        return eng

    def sync_weights(self, agent) -> None:
        eng = self.engine(agent)
        version = self.agent_version(agent)
        self._run(eng, agent, plan_sync(eng.awake, eng.version != version), version)

    def sleep_all(self) -> None:
        for eng in self.engines.values():
            self._run(eng, None, plan_sleep(eng.awake), eng.version)

    # -- generation -------------------------------------------------------------
    def generate(self, agent, contexts: list[list[int]], sampling) -> list[list[int]]:
        from vllm import SamplingParams  # optional GPU extra

        eng = self.wake_for_rollout(agent)
        self.assert_in_sync(agent)
        check_lengths(contexts, sampling.max_new_tokens, eng.max_model_len)
        tok = agent.tokenizer
        params = [SamplingParams(**sampling_kwargs(sampling, s, tok.eos_token_id, self.health_logprobs))
                  for s in request_seeds(draw_base_seed(), len(contexts))]
        outputs = eng.llm.generate(build_requests(contexts), params, use_tqdm=False)
        responses = outputs_to_responses(outputs, tok.eos_token_id, tok.pad_token_id)
        if self.health_logprobs:
            self.last_logprobs[id(agent)] = outputs_to_logprobs(outputs, responses)
        return responses


# ---------------------------------------------------------------------------
# Module-level API used by rollout.py and sat.py
# ---------------------------------------------------------------------------
_REGISTRY: EngineRegistry | None = None


def configure(**kwargs) -> EngineRegistry:
    """(Re)create the run's engine registry: n_engines, train_fraction,
    reserve, seed, max_model_len, health_logprobs, and any vllm.LLM overrides.
    Closes the engines of a previous configuration."""
    global _REGISTRY
    if _REGISTRY is not None:
        _REGISTRY.shutdown()
    _REGISTRY = EngineRegistry(**kwargs)
    return _REGISTRY


def registry() -> EngineRegistry:
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = EngineRegistry()
    return _REGISTRY


def generate_vllm(agent, contexts: list[list[int]], sampling) -> list[list[int]]:
    """One sampled response per context (ids cut after the first eos)."""
    return registry().generate(agent, contexts, sampling)


def sync_weights(agent) -> None:
    """Call after promoting ``agent``: its engine gets the new weights (now, or at its next wake)."""
    if _REGISTRY is not None and id(agent) in _REGISTRY.engines:
        _REGISTRY.sync_weights(agent)


def wake_for_rollout(agent):
    return registry().wake_for_rollout(agent)


def sleep_all() -> None:
    """Call before training: every engine to level-1 sleep."""
    if _REGISTRY is not None:
        _REGISTRY.sleep_all()


def last_logprobs(agent) -> list[list[float]] | None:
    """vLLM's log-probabilities of the agent's last generate call (health_logprobs=True)."""
    return None if _REGISTRY is None else _REGISTRY.last_logprobs.get(id(agent))


def release(agent) -> None:
    """Close the agent's engine (e.g. after a plug-and-play swap replaced it)."""
    if _REGISTRY is not None and id(agent) in _REGISTRY.engines:
        _REGISTRY._close(id(agent))


def shutdown() -> None:
    global _REGISTRY
    if _REGISTRY is not None:
        _REGISTRY.shutdown()
        _REGISTRY = None
