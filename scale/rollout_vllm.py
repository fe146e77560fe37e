"""The vLLM rollout backend: one engine per agent, weights pushed from memory, on CUDA or CPU.

Paper, Algorithm 1 (ROLLOUT under pi_cur; after the promotion of line 12 the promoted agent samples
its new weights). ``VLLMBackend`` has the methods of ``scale.rollout_hf.HFBackend`` (generate, sync, sleep,
health, close) and holds the run's engines; ``make_backend("vllm", ...)`` (below) creates it. The
behaviour log-probabilities still come from the training model (``rollout.agent_turn``), so vLLM's
numerics never enter the importance ratios; ``health`` measures how far vLLM's own are from them.

- One engine per agent (keyed by the Agent object), created at its first generate, in its own
  processes (a script that drives engines guards its entry point, ``if __name__ == "__main__":``).
- Memory: on CUDA ``gpu_memory_utilization`` from ``engine_memory_fractions``; on CPU that would be a
  share of host memory, so the KV cache is sized in bytes (``memory.cpu_kv_cache_bytes``) and the
  engine runs eagerly.
- Sleep mode around training where the platform has it (CUDA): ``sleep()`` before an update (level 1:
  weights to CPU, KV cache freed), woken before generating. CPU engines stay resident.
- Weights move from memory, never from disk (``vllm_weights``, ``vllm_ranks.push_layers``). After a
  promotion ``sync(agent)`` pushes them, at once or at the engine's next wake if it sleeps (a sharded
  agent's push is a collective and happens at once: ``plan_shard_push``).
- Versions: every generate checks that the engine holds the agent's current weights (a fingerprint)
  and refuses to sample from stale ones.

vLLM is imported only inside the functions that drive an engine: the pure helpers run without it.
"""
from __future__ import annotations

import gc
import logging
import math
import tempfile
import weakref
from dataclasses import dataclass, field

import torch

from harness.config import BACKENDS
from logprobs import cut_at_eos
from scale import distributed
from scale.memory import cpu_kv_cache_bytes
from scale.rollout_hf import HF
from scale.vllm_ranks import (
    TENSOR_PARALLEL_CPU_ERROR,
    engine_platform,
    engine_source,
    prepare_environment,
    push_layers,
    sharded_engine_kwargs,
    start_llm,
)
from scale.vllm_weights import EXTENSION_CLS, VersionBook, check_in_sync, weights_fingerprint

WAKE_TAGS = ("weights", "kv_cache")
SEED_MODULUS = 2 ** 31 - 1
CPU_STEP_TOKENS = 4096  # tokens a CPU engine schedules per step (vLLM's own CPU default)
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
log = logging.getLogger(__name__)


# -- Engine and sampling arguments (pure) ----------------------------------------------------------------
def engine_memory_fractions(n_engines: int, train_fraction: float, reserve: float = 0.05,
                            min_fraction: float = 0.02) -> list[float]:
    """``gpu_memory_utilization`` per engine: what is left after training's resident share (weights and
    the scoring forward stay on the GPU during rollouts) and a reserve (CUDA contexts, fragmentation),
    split evenly so that all engines fit awake at once."""
    if n_engines < 1:
        raise ValueError(f"need at least one engine (got n_engines={n_engines})")
    if not 0 <= train_fraction < 1:
        raise ValueError(f"train_fraction must be in [0, 1) (got {train_fraction})")
    if not 0 <= reserve < 1:
        raise ValueError(f"reserve must be in [0, 1) (got {reserve})")
    each = (1.0 - train_fraction - reserve) / n_engines
    if each < min_fraction:
        raise ValueError(
            f"no room for {n_engines} vLLM engines: training keeps {train_fraction:.0%} of the GPU and {reserve:.0%} "
            f"is reserved, leaving {max(each, 0):.1%} per engine (< {min_fraction:.0%}); fix: fewer agents on this "
            "GPU, a smaller --token-budget or --minibatch-size, or --backend hf")
    return [each] * n_engines


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"vLLM engines take bfloat16, float16 or float32 weights (got {dtype})")
    return DTYPE_NAMES[dtype]


def engine_kwargs(model_path: str, memory_fraction: float, dtype: torch.dtype, seed: int, max_model_len: int,
                  logprobs: bool = False, device: str = "cuda", sleep_mode: bool = True,
                  kv_cache_bytes: int | None = None, tensor_parallel: int = 1) -> dict:
    """Arguments of ``vllm.LLM`` for one agent's engine: token ids in and out (the agent's tokenizer
    decodes); ``generation_config="vllm"`` ignores the checkpoint's sampling defaults (the behaviour
    log-probs assume plain tempered sampling); CUDA: a memory fraction and sleep mode; CPU: a KV cache in
    bytes, eager, no sleep mode (vLLM refuses it there), no chunked prefill; processed (tempered) log-probs
    for the health metric; K > 1 tensor-parallel ranks through vLLM's ``external_launcher`` (CUDA under torchrun)."""
    kwargs = dict(model=str(model_path), skip_tokenizer_init=True, dtype=dtype_name(dtype), seed=int(seed),
                  enable_prefix_caching=True, max_model_len=int(max_model_len), generation_config="vllm",
                  tensor_parallel_size=int(tensor_parallel), worker_extension_cls=EXTENSION_CLS)
    if tensor_parallel > 1:
        if device == "cpu":
            raise ValueError(TENSOR_PARALLEL_CPU_ERROR)
        kwargs["distributed_executor_backend"] = "external_launcher"
    if device == "cpu":
        if not kv_cache_bytes or kv_cache_bytes <= 0:
            raise ValueError(f"a CPU engine needs a KV cache size in bytes (got kv_cache_bytes={kv_cache_bytes})")
        # Whole prompts only: a prompt split over two engine steps makes vLLM rewind the request's seeded
        # generator, which a CPU generator cannot do (the engine dies: "CPU Generator does not use offset").
        kwargs.update(kv_cache_memory_bytes=int(kv_cache_bytes), enforce_eager=True, enable_chunked_prefill=False,
                      max_num_batched_tokens=max(int(max_model_len), CPU_STEP_TOKENS))
    else:
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1] (got {memory_fraction})")
        kwargs["gpu_memory_utilization"] = float(memory_fraction)
    if sleep_mode:
        kwargs["enable_sleep_mode"] = True
    if logprobs:
        kwargs["logprobs_mode"] = "processed_logprobs"
    return kwargs


def sampling_kwargs(sampling, seed: int, eos_id: int, logprobs: bool = False) -> dict:
    """Arguments of ``vllm.SamplingParams`` for one request: the distribution of ``scale.rollout_hf.generate_hf``
    (temperature, top_p, no top-k, no penalties), one sample per request (the G samples of a problem are
    G requests with their own seeds), stopping at the agent's eos."""
    return dict(n=1, temperature=float(sampling.temperature), top_p=float(sampling.top_p), top_k=-1, min_p=0.0,
                presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                max_tokens=int(sampling.max_new_tokens), seed=int(seed), stop_token_ids=[int(eos_id)],
                ignore_eos=False, detokenize=False,
                logprobs=0 if logprobs else None)  # 0: only the sampled token's log-probability


def request_seeds(seeds: list[int]) -> list[int]:
    """The engine's seed of each request: the response's own seed (``rollout.response_seeds``) reduced to
    the range vLLM takes. A request's draws depend on its seed alone, not on how vLLM batches it: vLLM
    samples a seeded request by an exponential race (Gumbel-max) on noise from that seed, position by
    position, so two engines given one seed share their random numbers."""
    return [int(s) % SEED_MODULUS for s in seeds]


def build_requests(contexts) -> list[dict]:
    """``TokensPrompt`` dicts from context id lists or 1-D tensors."""
    requests = []
    for i, ctx in enumerate(contexts):
        ids = ctx.tolist() if isinstance(ctx, torch.Tensor) else [int(t) for t in ctx]
        if not ids:
            raise ValueError(f"context {i} is empty: vLLM needs at least one prompt token")
        requests.append({"prompt_token_ids": ids})
    return requests


def check_lengths(contexts, max_new_tokens: int, max_model_len: int) -> None:
    """HF generates max_new_tokens after any prompt, vLLM would stop at max_model_len: refuse instead."""
    longest = max((len(c) for c in contexts), default=0)
    if longest + max_new_tokens > max_model_len:
        raise ValueError(f"a prompt of {longest} tokens + --max-new-tokens {max_new_tokens} exceeds the vLLM "
                         f"engine's max_model_len {max_model_len} (a run's engines hold memory.run_max_len tokens: a "
                         "1024-token prompt allowance + the responses); lower --max-new-tokens or use --backend hf")


# -- Outputs (pure): RequestOutput -> response ids / log-probabilities -----------------------------------
def response_ids_from_completion(token_ids, finish_reason, stop_reason, eos_id: int) -> list[int]:
    """One completion's ids, cut after the first eos like ``generate_hf``; an eos the engine stopped on
    but left out is put back (its probability is part of the policy's likelihood)."""
    ids = [int(t) for t in token_ids]
    if finish_reason == "stop" and stop_reason == eos_id and eos_id not in ids:
        ids.append(int(eos_id))
    return cut_at_eos(ids, eos_id)


def outputs_to_responses(outputs, eos_id: int) -> list[list[int]]:
    """``LLM.generate`` outputs (in request order) -> response ids."""
    return [response_ids_from_completion(o.outputs[0].token_ids, o.outputs[0].finish_reason,
                                         getattr(o.outputs[0], "stop_reason", None), eos_id)
            for o in outputs]


def sampled_logprobs(token_ids, logprobs, length: int) -> list[float]:
    """The sampled tokens' log-probabilities from vLLM's per-position maps (token id -> Logprob or
    float); nan where vLLM has none (an eos put back)."""
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
    """Mean |log pi_vllm - log pi_train| over the response tokens (nan entries skipped): 0 for identical
    numerics, ~1e-2 for bf16 kernels; nan when there is nothing to compare."""
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


def scored_logprobs(prompt_logprobs, prompt_ids, start: int) -> list[float]:
    """vLLM's log-probabilities of ``prompt_ids[start:]`` as part of a prompt (``prompt_logprobs``: None
    for the first token, then one map token id -> Logprob per position)."""
    values = []
    for pos in range(start, len(prompt_ids)):
        entry = prompt_logprobs[pos][int(prompt_ids[pos])]
        values.append(float(getattr(entry, "logprob", entry)))
    return values


# -- Sleep / wake / push plans (pure): which engine calls, in which order --------------------------------
def plan_wake(awake: set[str], load: bool) -> list[str]:
    """Make an engine ready to sample; ``load``: push the agent's weights (a new engine, or a push
    deferred while it slept), between waking the weights and the KV cache. The prefix cache is reset
    whenever the weights changed or the KV cache was freed."""
    actions = ["wake:weights"] if "weights" not in awake else []
    if load:
        actions.append("load")
    if "kv_cache" not in awake:
        actions.append("wake:kv_cache")
    if load or "kv_cache" not in awake:
        actions.append("reset_prefix_cache")
    return actions


def plan_sync(awake: set[str], stale: bool) -> list[str]:
    """After a promotion: push now if the weights are resident, else defer to the next wake, so no KV
    cache is allocated while another agent trains."""
    if not stale:
        return []
    if "weights" not in awake:
        return ["defer"]
    return ["load", "reset_prefix_cache"] if "kv_cache" in awake else ["load"]


def plan_sleep(awake: set[str], sleep_mode: bool = True) -> list[str]:
    """Level-1 sleep (nothing without sleep mode). A half-awake engine is first woken fully: some vLLM
    versions ignore sleep() while anything sleeps."""
    if not awake or not sleep_mode:
        return []
    return [f"wake:{tag}" for tag in WAKE_TAGS if tag not in awake] + ["sleep"]


def plan_shard_push(awake: set[str], sleep_mode: bool = True) -> list[str]:
    """A sharded agent's push after a promotion: a collective (every rank gathers the layers), so it
    cannot wait for a wake that not every rank may reach. An engine asleep wakes its weights, takes the
    new ones, and goes back to sleep (``plan_sleep``)."""
    asleep = "weights" not in awake
    after = awake | {"weights"}
    actions = (["wake:weights"] if asleep else []) + ["load"]
    if "kv_cache" in after:
        actions.append("reset_prefix_cache")
    return actions + (plan_sleep(after, sleep_mode) if asleep else [])


# -- The backend: one engine per agent -------------------------------------------------------------------
@dataclass
class Engine:
    llm: object
    path: str
    name: str
    agent_ref: weakref.ref
    max_model_len: int
    version: int = -1  # -1: weights from disk, never pushed: always stale
    pending: bool = False  # a push was requested while the engine slept
    awake: set = field(default_factory=lambda: set(WAKE_TAGS))  # a new engine is awake


def default_max_model_len(agent) -> int:
    return int(getattr(agent.model.config, "max_position_embeddings", 32768))


class VLLMBackend:
    """The engines of one run, keyed by agent object (``scale.rollout_hf.HFBackend``'s methods, plus ``score``)."""

    name = "vllm"

    def __init__(self, n_engines: int = 3, train_fraction: float = 0.5, reserve: float = 0.05, seed: int = 0,
                 max_model_len: int | None = None, health_logprobs: bool = False, kv_cache_bytes: int | None = None,
                 tensor_parallel: int = 1, **engine_overrides):
        self.fraction = engine_memory_fractions(n_engines, train_fraction, reserve)[0]
        self.n_engines, self.seed, self.max_model_len = n_engines, seed, max_model_len
        self.health_logprobs = health_logprobs
        self.kv_cache_bytes = kv_cache_bytes  # CPU engines; None: memory.cpu_kv_cache_bytes
        self.tensor_parallel = tensor_parallel  # K > 1: engines spanning K ranks (external launcher, CUDA)
        self.engine_overrides = engine_overrides
        self.engines: dict[int, Engine] = {}
        self.book = VersionBook()
        self.logprobs: dict[int, list[list[float]]] = {}  # the last generate call's, per agent
        self.prompt_reads: dict[int, tuple[int, int]] = {}  # per agent: (prompt tokens, of them from the prefix cache)
        self.device: str | None = None
        self.sleep_mode = True
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
            raise RuntimeError(f"more than {self.n_engines} vLLM engines requested: create the backend with "
                               "n_engines = the number of distinct agents, so their memory is sized for all of them")
        return self._create(agent)

    def _create(self, agent, overrides: dict | None = None) -> Engine:
        """Start the engine of ``agent``'s weights (``overrides``: more ``vllm.LLM`` arguments for this one)."""
        if agent.adapter is not None and type(self) is VLLMBackend:
            raise ValueError(f"agent {agent.spec.name} is a LoRA adapter on a shared base: serve its team with "
                             "vllm_lora.make_team_backend, one engine per base")
        prepare_environment()
        if self.device is None:
            self.device, self.sleep_mode = engine_platform()
            if not self.sleep_mode:
                log.warning("vLLM has no sleep mode on %s: engines stay resident and sleep() does nothing", self.device)
        path = engine_source(agent, self._tmp.name)
        max_len = min(self.max_model_len or default_max_model_len(agent), default_max_model_len(agent))
        dtype = next(agent.model.parameters()).dtype
        kv_bytes = self.kv_cache_bytes or cpu_kv_cache_bytes(agent.model.config, dtype.itemsize, max_len)
        kwargs = engine_kwargs(path, self.fraction, dtype, self.seed + len(self.engines), max_len,
                               self.health_logprobs, self.device, self.sleep_mode, kv_bytes, self.tensor_parallel)
        kwargs.update(sharded_engine_kwargs(agent.model), **{**self.engine_overrides, **(overrides or {})})
        eng = Engine(start_llm(kwargs, self.device, self.tensor_parallel), path, agent.spec.name, weakref.ref(agent),
                     max_len)
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

    def release(self, agent) -> None:
        """Close the agent's engine (a plug-and-play swap replaced the agent)."""
        if id(agent) in self.engines:
            self._close(id(agent))
        self.logprobs.pop(id(agent), None)

    def close(self) -> None:
        for key in list(self.engines):
            self._close(key)
        self._tmp.cleanup()

    # -- versions ---------------------------------------------------------------
    def agent_version(self, agent) -> int:
        return self.book.observe(id(agent), weights_fingerprint(distributed.local_parameters(agent.model)))

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
                push_layers(eng.llm, agent.model, eng.name)
                eng.version, eng.pending = version, False
            elif action == "defer":
                eng.pending = True
            elif action == "reset_prefix_cache":
                eng.llm.reset_prefix_cache()  # cached KV was computed by other weights, or freed
            elif action == "sleep":
                eng.llm.sleep(level=1)  # weights (the last pushed ones) to CPU, KV cache freed
                eng.awake.clear()
            else:
                raise ValueError(f"unknown engine action {action!r}")

    def wake_for_rollout(self, agent) -> Engine:
        """Wake the agent's engine, pushing its weights if it is new or a push was deferred."""
        eng = self.engine(agent)
        load = eng.version < 0 or eng.pending
        if load and distributed.is_sharded(agent.model):  # a push from shards is a collective: never lazily here
            raise RuntimeError(f"agent {eng.name}: its engine has not received the agent's shards; call "
                               "backend.sync(agent) on every rank before generating")
        self._run(eng, agent, plan_wake(eng.awake, load), self.agent_version(agent) if load else eng.version)
        return eng

    def sync(self, agent) -> None:
        """After changing the agent's weights (a promotion): its engine gets them now, or at its next wake
        if it sleeps. A sharded agent (--shard-frozen): on every rank at once, its engine created if need be
        and fed from the shards layer by layer (a collective; the ranks agree whether it is stale)."""
        sharded = distributed.is_sharded(agent.model)
        if id(agent) not in self.engines and not sharded:
            return  # no engine yet: it receives the weights when it starts
        eng = self.engine(agent)
        version = self.agent_version(agent)
        if sharded:  # every rank pushes, or none: stale somewhere is stale everywhere
            if distributed.any_rank(eng.version != version):
                self._run(eng, agent, plan_shard_push(eng.awake, self.sleep_mode), version)
            return
        self._run(eng, agent, plan_sync(eng.awake, eng.version != version), version)

    def sleep(self) -> None:
        """Before training: every engine to level-1 sleep (a no-op without sleep mode, on CPU)."""
        for eng in self.engines.values():
            self._run(eng, None, plan_sleep(eng.awake, self.sleep_mode), eng.version)

    # -- generation -------------------------------------------------------------
    def generate(self, agent, contexts: list[list[int]], sampling, seeds: list[int]) -> list[list[int]]:
        """One sampled response per context (ids cut after the first eos), from the agent's current weights,
        response i under ``seeds[i]``."""
        from vllm import SamplingParams  # optional extra

        eng = self.wake_for_rollout(agent)
        self.assert_in_sync(agent)
        check_lengths(contexts, sampling.max_new_tokens, eng.max_model_len)
        tok = agent.tokenizer
        params = [SamplingParams(**sampling_kwargs(sampling, s, tok.eos_token_id, self.health_logprobs))
                  for s in request_seeds(seeds)]
        outputs = eng.llm.generate(build_requests(contexts), params, use_tqdm=False, **self.request_kwargs(agent))
        read, cached = self.prompt_reads.get(id(agent), (0, 0))
        self.prompt_reads[id(agent)] = (read + sum(map(len, contexts)),
                                        cached + sum(o.num_cached_tokens or 0 for o in outputs))
        responses = outputs_to_responses(outputs, tok.eos_token_id)
        if self.health_logprobs:
            self.logprobs[id(agent)] = outputs_to_logprobs(outputs, responses)
        return responses

    def request_kwargs(self, agent) -> dict:
        """Extra arguments of every ``LLM.generate`` call for the agent (none: the engine is the agent's own)."""
        return {}

    def prefix_cache_share(self, agent) -> float:
        """The share of the prompt tokens of the agent's generate calls so far that its engine read from its prefix
        cache (vLLM's ``num_cached_tokens``): an episode's later rounds re-read the earlier ones from there."""
        read, cached = self.prompt_reads.get(id(agent), (0, 0))
        return cached / read if read else 0.0

    def last_logprobs(self, agent) -> list[list[float]] | None:
        """The engine's log-probabilities of the agent's last generate call (``health_logprobs``)."""
        return self.logprobs.get(id(agent))

    def health(self, team, batch) -> list[float | None]:
        """Per agent, mean |log pi_vllm - log pi_train| over the batch's response tokens (every block's
        rows, whichever rank generated them); None where the engine returned no log-probabilities."""
        return [None if t.sampler_logprobs is None
                else logprob_health(t.sampler_logprobs, t.behaviour_logprobs, t.response_mask) for t in batch.turns]

    def score(self, agent, contexts: list[list[int]], responses: list[list[int]],
              check: bool = True) -> list[list[float]]:
        """The engine's log-probabilities (temperature 1) of given responses after their contexts, as
        prompt log-probabilities. ``check=False`` skips the version check, to look at a stale engine."""
        from vllm import SamplingParams  # optional extra

        eng = self.wake_for_rollout(agent)
        if check:
            self.assert_in_sync(agent)
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        prompts = build_requests([list(c) + list(r) for c, r in zip(contexts, responses)])
        outputs = eng.llm.generate(prompts, params, use_tqdm=False, **self.request_kwargs(agent))
        return [scored_logprobs(o.prompt_logprobs, p["prompt_token_ids"], len(c))
                for o, p, c in zip(outputs, prompts, contexts)]


def team_engines(team) -> int:
    """The engines a team of whole models needs: one per agent, and one for the environment's frozen responder model
    (``TeamConfig.responder``), which answers every question of a round in one generate on its own engine (a team of
    adapters: ``vllm_lora.lora_engines``)."""
    return len(team) + (team.config.responder is not None)


def make_backend(name: str, n_engines: int, seed: int, train_fraction: float | None = None,
                 tensor_parallel: int = 1, health: bool = True, max_model_len: int | None = None):
    """The run's sampler: ``HF``, or vLLM engines (one per agent, per rank under torchrun, or per group of
    ``tensor_parallel`` ranks; on CUDA sized from the GPU fraction training keeps). ``health``: the engines
    also return their log-probabilities of the sampled tokens (``VLLMBackend.health``). ``max_model_len``: the
    longest sequence the run reaches (``memory.run_max_len``; the model's own limit where that is shorter); a
    CPU engine's KV cache is sized to it. A team of adapters (--lora): ``vllm_lora.make_team_backend``."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend '{name}': choose one of {', '.join(BACKENDS)}")
    if name == "hf":
        return HF
    extra = {} if train_fraction is None else {"train_fraction": train_fraction}
    return VLLMBackend(n_engines=n_engines, seed=seed, health_logprobs=health, tensor_parallel=tensor_parallel,
                       max_model_len=max_model_len, **extra)
