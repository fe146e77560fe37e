"""--lora on the vLLM backend: one engine per base, serving every agent of that base through its own LoRA adapter.

Paper, Algorithm 1 (ROLLOUT under pi_cur; after line 12's promotion the promoted agent samples its new policy). With
``--lora`` an agent is a shared base plus its own adapter (``adapter.py``), so one engine holds the base once and each
agent's requests carry the agent's ``LoRARequest``:

- Engines: one per base (keyed by the base Agent object that ``lora.with_adapter`` shares), started with
  ``enable_lora``, ``max_lora_rank`` (vLLM's next allowed rank at or above the adapters') and ``max_loras`` = the
  adapters it may serve at once (the run's agents). The base's weights are pushed once, at the engine's first wake
  (``rollout_vllm.VLLMBackend``'s push: a base the warm start trained exists only in memory).
- Adapters: after a promotion (``sync``) the agent's adapter is written in PEFT's layout to a temporary folder and
  loaded under a new adapter id; the previous id is removed from the engine. No base weights move. A new id (and name)
  per version also keeps vLLM's prefix cache, whose keys include the adapter, from reusing another version's KV.
- Versions: every generate checks the base (a fingerprint, as for whole agents) and the adapter (a fingerprint of
  the agent's own parameters only: cheap) and refuses a stale one.
- Log-probabilities: those of the sampled tokens (``health``) come back as for whole agents. ``score`` (prompt
  log-probabilities of given responses) is refused: vLLM 0.32's LoRA logits processor fails on prompt log-probs
  (an einsum over the sampled rows meets every prompt row; seen on the CPU build).
- Seeds: per request, exactly as for whole agents (``rollout_vllm.request_seeds``).
- The environment's responder (``--env-model``): a responder of a base's model is that base itself
  (``harness.responder``), so the base's engine serves it, its requests with no ``LoRARequest``: no second engine,
  no second copy of the weights, and its replies never change as the adapters train. A responder of another model
  gets an engine of its own, without LoRA (``lora_engines`` counts it).

vLLM is imported only inside the functions that drive an engine: the pure helpers run without it.
"""
from __future__ import annotations

import shutil
import weakref
from dataclasses import dataclass
from pathlib import Path

from adapter import own_parameters
from scale import distributed
from scale.rollout_vllm import Engine, VLLMBackend, make_backend, plan_sync, plan_wake, team_engines
from scale.vllm_weights import check_in_sync, weights_fingerprint

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's LoRAConfig.max_lora_rank choices


# -- Engine arguments and checks (pure) ------------------------------------------------------------------
def engine_lora_rank(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for adapters of rank ``rank``: the smallest value it allows that holds them."""
    if rank < 1:
        raise ValueError(f"an adapter's rank must be >= 1 (got {rank})")
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(lora_rank_error(rank))
    return fits[0]


def lora_rank_error(rank: int) -> str:
    """The line refusing an adapter rank no vLLM engine serves."""
    return (f"--lora {rank} with --backend vllm: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}; "
            f"use --lora {VLLM_LORA_RANKS[-1]} or less, or --backend hf")


def lora_engine_kwargs(max_adapters: int, rank: int) -> dict:
    """``vllm.LLM`` arguments that make an engine serve up to ``max_adapters`` adapters of rank <= ``rank`` at once
    (as many kept loaded on the host: one per agent, so a promotion never evicts another agent's adapter)."""
    if max_adapters < 1:
        raise ValueError(f"an adapter engine serves at least one adapter (got max_adapters={max_adapters})")
    return dict(enable_lora=True, max_lora_rank=engine_lora_rank(rank), max_loras=int(max_adapters),
                max_cpu_loras=int(max_adapters))


def lora_bases(team) -> int | None:
    """The number of distinct bases of a team of adapter agents (one engine each), None for a team of whole
    models (one engine per agent)."""
    if not any(agent.adapter is not None for agent in team.agents):
        return None
    if not all(agent.adapter is not None and agent.base is not None for agent in team.agents):
        raise ValueError("a team mixes adapter agents and whole models: the vLLM backend serves one or the other; "
                         "train every agent with --lora, or none")
    return len({id(agent.base) for agent in team.agents})


def lora_engines(team) -> int:
    """The engines of a team of adapters: one per base, the responder served by its base's engine where it is that
    base (``harness.responder.responder_base``), else (a responder of another model) one engine of its own."""
    from harness.responder import responder_base

    own = team.config.responder is not None and responder_base(team) is None
    return lora_bases(team) + own


def make_team_backend(name: str, team, seed: int, train_fraction: float | None = None, tensor_parallel: int = 1,
                      health: bool = True, max_model_len: int | None = None):
    """The sampler of ``team`` (``rollout_vllm.make_backend``'s arguments): for a team of adapters on vLLM one engine
    per base (``VLLMLoraBackend``), each serving up to len(team) adapters and the base itself (a responder of that
    model), plus an engine for a responder of another model; their memory shares sized for all of them."""
    bases = lora_bases(team) if name == "vllm" else None
    if bases is None:
        return make_backend(name, team_engines(team), seed, train_fraction, tensor_parallel, health, max_model_len)
    if tensor_parallel > 1:
        raise ValueError("--lora with --backend vllm serves a team from one process; drop --vllm-tensor-parallel")
    extra = {} if train_fraction is None else {"train_fraction": train_fraction}
    backend = VLLMLoraBackend(n_engines=lora_engines(team), max_adapters=len(team),
                              rank=max(a.adapter.settings.rank for a in team.agents), seed=seed,
                              health_logprobs=health, max_model_len=max_model_len, **extra)
    backend.serve_bases(agent.base for agent in team.agents)
    return backend


def base_of(agent):
    """The base Agent whose weights ``agent``'s model shares (``lora.with_adapter``); one line for a whole agent."""
    if agent.adapter is None or agent.base is None:
        raise ValueError(f"agent {agent.spec.name} is a whole model, not a base plus an adapter: serve it with "
                         "rollout_vllm.make_backend")
    return agent.base


def adapter_fingerprint(agent) -> tuple[float, ...]:
    """The fingerprint of the agent's adapter alone (its own parameters): what a promotion changes."""
    return weights_fingerprint(own_parameters(agent.model))


def check_adapter_in_sync(served_version: int | None, agent_version: int, name: str) -> None:
    """Before every generate: an engine never samples from an adapter other than the agent's current one."""
    if served_version != agent_version:
        held = "no adapter of it" if served_version is None else f"its adapter version {served_version}"
        raise RuntimeError(f"agent {name}: its base's vLLM engine holds {held} but the agent is at adapter version "
                           f"{agent_version}: refusing to sample from a stale adapter; call backend.sync(agent) after "
                           "changing the agent's adapter")


# -- The backend: one engine per base, one adapter per agent ---------------------------------------------
@dataclass
class Served:
    """The adapter an engine serves for one agent: the engine, its vLLM request, the agent's adapter version it
    holds, and its folder."""

    eng: Engine
    request: object  # vllm.lora.request.LoRARequest
    version: int
    path: Path
    agent_ref: weakref.ref
    pending: bool = False  # a promotion came while the engine slept: the new adapter loads at its wake


class VLLMLoraBackend(VLLMBackend):
    """``VLLMBackend`` for a team of adapter agents: engines keyed by base, requests carrying the agent's adapter. A
    whole agent whose model is a served base (the responder on the agents' base, ``harness.responder``) is served
    by that base's engine with no adapter; any other whole agent (a responder of another model) by an engine of its
    own, without LoRA, as ``VLLMBackend`` serves it."""

    def __init__(self, n_engines: int = 1, max_adapters: int = 3, rank: int | None = None, **kwargs):
        super().__init__(n_engines=n_engines, **kwargs)
        self.max_adapters, self.rank = max_adapters, rank  # rank: the adapters' (None: the first agent's)
        self.served: dict[int, Served] = {}  # id(agent) -> its adapter on its base's engine
        self.bases: dict[int, weakref.ref] = {}  # id(base model) -> its base Agent (``serve_bases``)
        self.next_lora_id = 1  # vLLM's adapter ids: unique for the backend's life, never reused

    # -- engines ----------------------------------------------------------------
    def serve_bases(self, bases) -> None:
        """Know these bases (the team's), so that a whole agent on one of their models finds its engine even before
        an adapter agent of that base first generates."""
        for base in bases:
            self.bases[id(base.model)] = weakref.ref(base)

    def base_for(self, agent):
        """The base whose engine serves ``agent``: an adapter agent's base; for a whole agent, the known base whose
        model it is (the responder on the agents' base); None for a whole model of its own."""
        if agent.adapter is not None:
            return base_of(agent)
        ref = self.bases.get(id(agent.model))
        base = ref() if ref is not None else None
        return base if base is not None and base.model is agent.model else None

    def engine(self, agent) -> Engine:
        base = self.base_for(agent)
        if base is None:
            return super().engine(agent)  # a model of its own: an engine without adapters
        self.bases[id(base.model)] = weakref.ref(base)
        eng = self.engines.get(id(base))
        if eng is not None and eng.agent_ref() is base:
            return eng
        if eng is not None:  # the id of a collected base was reused: that engine is stale
            self._close(id(base))
        for k in [k for k, e in self.engines.items() if e.agent_ref() is None]:
            self._close(k)  # engines of bases no agent holds any more
        if len(self.engines) >= self.n_engines:
            raise RuntimeError(f"more than {self.n_engines} vLLM engines requested: create the backend with "
                               "n_engines = the number of distinct bases (+ 1 for a responder of another model), so "
                               "their memory is sized for all of them")
        if distributed.is_sharded(base.model):
            raise ValueError("--lora with --backend vllm serves whole bases on one process; drop --shard-frozen")
        rank = self.rank if self.rank is not None else (agent.adapter and agent.adapter.settings.rank)
        if not rank:
            raise ValueError(f"{agent.spec.name}: the engine of its base serves adapters of a rank not known yet; "
                             "create the backend with rank = the adapters' (vllm_lora.make_team_backend)")
        return self._create(base, lora_engine_kwargs(self.max_adapters, rank))

    def _close(self, key) -> None:
        closing = self.engines[key]
        for agent_key, served in list(self.served.items()):
            if served.eng is closing:
                self._forget(agent_key)  # goes with its engine
            elif served.agent_ref() is None:
                self._forget(agent_key, unload=True)  # a collected agent's adapter on another engine
        super()._close(key)

    def _forget(self, agent_key: int, unload: bool = False) -> None:
        """Drop an agent's adapter entry and folder; ``unload``: remove it from its engine too (the engine stays)."""
        served = self.served.pop(agent_key)
        if unload and served.eng.llm is not None:
            served.eng.llm.llm_engine.remove_lora(served.request.lora_int_id)
        shutil.rmtree(served.path, ignore_errors=True)

    def served_for(self, agent) -> Served | None:
        """What the engine serves for this very agent (an entry left by a collected agent whose id was reused is
        dropped)."""
        served = self.served.get(id(agent))
        if served is not None and served.agent_ref() is not agent:
            self._forget(id(agent), unload=True)
            return None
        return served

    def release(self, agent) -> None:
        """Drop the agent's adapter from its base's engine (a plug-and-play swap replaced the agent); the engine
        stays for the base's other agents. A whole model of its own: its engine closes."""
        if self.base_for(agent) is None:
            return super().release(agent)
        if self.served_for(agent) is not None:
            self._forget(id(agent), unload=True)
        self.logprobs.pop(id(agent), None)

    # -- versions ---------------------------------------------------------------
    def base_version(self, agent) -> int:
        base = self.base_for(agent)
        return self.book.observe(id(base), weights_fingerprint(base.model.parameters()))

    def adapter_version(self, agent) -> int:
        return self.book.observe(("adapter", id(agent)), adapter_fingerprint(agent))

    def assert_in_sync(self, agent) -> None:
        if self.base_for(agent) is None:
            return super().assert_in_sync(agent)
        eng = self.engine(agent)
        check_in_sync(eng.version, self.base_version(agent), eng.name)
        if agent.adapter is None:
            return  # the base itself: no adapter to check
        served = self.served_for(agent)
        check_adapter_in_sync(None if served is None else served.version, self.adapter_version(agent),
                              agent.spec.name)

    # -- adapters ---------------------------------------------------------------
    def load_adapter(self, eng: Engine, agent, version: int) -> None:
        """The agent's current adapter into its base's engine under a new id, the previous one removed first (so
        an engine never holds more adapters than it has room for)."""
        from vllm.lora.request import LoRARequest  # optional extra

        from harness.lora import write_peft_folder

        if self.served_for(agent) is not None:
            self._forget(id(agent), unload=True)
        lora_id, self.next_lora_id = self.next_lora_id, self.next_lora_id + 1
        path = Path(self._tmp.name) / f"adapter_{lora_id}"
        write_peft_folder(agent, path)
        request = LoRARequest(lora_name=f"{agent.spec.name}#{id(agent):x}@v{version}", lora_int_id=lora_id,
                              lora_path=str(path))
        if not eng.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"agent {agent.spec.name}: its base's vLLM engine refused its adapter ({path})")
        self.served[id(agent)] = Served(eng, request, version, path, weakref.ref(agent))

    # -- actions ----------------------------------------------------------------
    def wake_for_rollout(self, agent) -> Engine:
        """Wake the base's engine (pushing the base if the engine is new or a push was deferred) and load the
        agent's adapter if the engine has never served it or its load was deferred (the base itself: none)."""
        base = self.base_for(agent)
        if base is None:
            return super().wake_for_rollout(agent)
        eng = self.engine(agent)
        load = eng.version < 0 or eng.pending
        self._run(eng, base, plan_wake(eng.awake, load), self.base_version(agent) if load else eng.version)
        if agent.adapter is None:
            return eng
        served = self.served_for(agent)
        if served is None or served.pending:
            self.load_adapter(eng, agent, self.adapter_version(agent))
        return eng

    def sync(self, agent) -> None:
        """After changing the agent's adapter (a promotion): the engine serves the new adapter from now on, or
        from its next wake if it sleeps (no base weights move); a changed base (never, once training starts) is
        pushed as for whole agents. A whole model of its own: as ``VLLMBackend``."""
        base = self.base_for(agent)
        if base is None:
            return super().sync(agent)
        if id(base) not in self.engines:
            return  # no engine yet: the base and the adapter load when it starts
        eng = self.engine(agent)
        version = self.base_version(agent)
        self._run(eng, base, plan_sync(eng.awake, eng.version != version), version)
        if agent.adapter is None:
            return
        served, adapter = self.served_for(agent), self.adapter_version(agent)
        if served is not None and served.version != adapter:
            if "weights" in eng.awake:
                self.load_adapter(eng, agent, adapter)
            else:
                served.pending = True

    def score(self, agent, contexts, responses, check: bool = True):
        if self.base_for(agent) is None:
            return super().score(agent, contexts, responses, check)
        raise NotImplementedError(f"agent {agent.spec.name}: an adapter engine cannot score given responses (vLLM "
                                  "0.32's LoRA logits processor fails on prompt log-probabilities); compare the "
                                  "sampled tokens' log-probabilities instead (health_logprobs, backend.health)")

    def request_kwargs(self, agent) -> dict:
        """What every request of the agent carries: its adapter (a whole agent: nothing, the base or its own
        engine)."""
        return {} if agent.adapter is None else {"lora_request": self.served[id(agent)].request}
