"""Joint-trajectory generation: the team answers B problems G times each.

Paper, Section 3 (the team as a factorized policy; Algorithm 1, line "collect
rollouts under pi_cur"): a joint trajectory is one response per agent under the
team's protocol (independent answers + majority vote, or a chain in which
agent k sees the answers of agents 1..k-1), with one team reward shared by
every agent's tokens. This module chooses the generation backend (Hugging
Face ``generate`` here, vLLM in ``rollout_vllm.py``).

``rollout(team, problems, group_size, sampling)`` returns a ``TeamBatch``:
N = B * G joint trajectories; per trajectory its group id (= problem index),
per agent turn the context ids, response ids and mask, behaviour
log-probabilities, the extracted answers, the team answer and the team reward
(shared by every agent's tokens): in the chain protocol 1 if the last agent's
answer is right, else 0; in the independent protocol the expected correctness
of the majority vote under a uniform tie-break (``grading.vote_reward``), so
no agent is a dictator on a three-way disagreement.

``regenerate(team, batch, j, sampling)`` (``--reuse regenerate``) redraws,
after agent j's promotion, only what that promotion changed: agent j's turn in
the independent protocol, agent j's turn and the turns after it in the chain
protocol, so the batch is again exactly on-policy for the intermediate policy
pi_hat^i of Eq. (1) and the later agents need no importance weights.

Batched, never one sample at a time: each agent turn is one left-padded
``generate`` call over all N contexts (chunked by a token budget), and the
behaviour log-probabilities come from one batched teacher-forced forward of
the same model at the sampling temperature. Using the training model's own
forward for the behaviour log-probabilities (rather than the sampler's) keeps
sampler numerics out of the importance ratios, and it is what the vLLM
backend must do too.

Sampling is the tempered softmax and nothing else: ``sampler_config`` sets
every logits processor of ``generate`` to its neutral value, so nothing the
checkpoint's ``generation_config`` ships (repetition_penalty, min_p,
no_repeat_ngram_size, top_k, ...) reaches the sampler, and
``check_sampler`` refuses to sample if a processor would still apply. top_p
< 1 is allowed for evaluation only: a rollout that keeps behaviour
log-probabilities refuses it, because the sampler would then draw from the
nucleus-truncated distribution while the ratios, the weights and the KL use
the untruncated one (the paper's setting is top_p = 1.0).

    python bench/rollout.py          # batched vs one-at-a-time, tokens/s
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from scale import distributed
import parallel
from grading import answers_match, vote_reward
from logprobs import (MIN_CALL_TOKENS, batched_response_logprobs, chunks_by_budget, cut_at_eos, distinct_contexts,
                      left_pad, padded_rows, right_pad, turn_forward, turn_rows)
from tasks import Problem
from team import Team

BACKENDS = ("hf", "vllm")
TOP_P_TRAINING_ERROR = ("--top-p {top_p} < 1 cannot be used for training: the sampler would draw from the nucleus while the "
                        "behaviour log-probs, ratios and KL use the full softmax (off by log Z_nucleus, tokens outside it never "
                        "pushed down); train with --top-p 1 (evaluation may use top-p < 1)")
REWARD_RANGE = (0.0, 1.0)  # (R_min, R_max) of the team reward: the certificate's A_max = R_max - R_min


@dataclass
class SamplingConfig:
    temperature: float = 0.8
    top_p: float = 1.0
    max_new_tokens: int = 32768
    token_budget: int = 65536  # max (context + response) tokens in one generate / forward chunk
    backend: str = "hf"

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"--temperature must be > 0 (got {self.temperature}): SAT needs a stochastic policy")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1] (got {self.top_p})")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1 (got {self.max_new_tokens})")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend '{self.backend}': choose one of {', '.join(BACKENDS)}")


@dataclass
class Turn:
    """One agent's turn in all N joint trajectories."""

    agent: int
    context_ids: torch.Tensor  # [N, Lc] left-padded
    context_mask: torch.Tensor  # [N, Lc]
    response_ids: torch.Tensor  # [N, Lr] right-padded, includes the eos token when one was sampled
    response_mask: torch.Tensor  # [N, Lr] 1 on generated tokens
    behaviour_logprobs: torch.Tensor  # [N, Lr] log pi_behaviour(a_t|s_t) at the sampling temperature, 0 on padding
    texts: list[str]
    answers: list[str | None]
    truncated: torch.Tensor  # [N] bool: no eos within max_new_tokens
    scoring: dict | None = None  # the behaviour forward's outputs, for pi_j,cur's KL (logprobs.adopt_scoring)

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum())


@dataclass
class TeamBatch:
    problems: list[Problem]  # [N] the problem of each joint trajectory
    group_ids: torch.Tensor  # [N] index of the problem in the rollout call
    turns: list[Turn]  # one per agent, turns[k].agent == k
    team_answers: list[str | None]
    rewards: torch.Tensor  # [N] team reward in {0, 1}
    agent_correct: torch.Tensor = field(default=None)  # [n_agents, N] each agent's own answer right?
    counterfactual: torch.Tensor | None = None  # [n_agents, N] independent protocol: see counterfactual_baselines

    def __len__(self) -> int:
        return len(self.problems)

    @property
    def num_tokens(self) -> int:
        return sum(t.num_tokens for t in self.turns)


# ---------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------
# Every GenerationConfig field that makes ``generate`` add a logits processor,
# with the test for its neutral value. transformers fills each field left at
# None from the checkpoint's generation_config, so "not set" is not neutral.
NEUTRAL_SAMPLER_FIELDS = {
    "top_k": lambda v: v in (None, 0), "min_p": lambda v: v is None, "typical_p": lambda v: v in (None, 1.0),
    "epsilon_cutoff": lambda v: v in (None, 0.0), "eta_cutoff": lambda v: v in (None, 0.0), "top_h": lambda v: v is None,
    "repetition_penalty": lambda v: v in (None, 1.0), "encoder_repetition_penalty": lambda v: v in (None, 1.0),
    "no_repeat_ngram_size": lambda v: v in (None, 0), "encoder_no_repeat_ngram_size": lambda v: v in (None, 0),
    "bad_words_ids": lambda v: v is None, "sequence_bias": lambda v: v is None, "min_length": lambda v: v in (None, 0),
    "min_new_tokens": lambda v: v in (None, 0), "forced_bos_token_id": lambda v: v is None,
    "forced_eos_token_id": lambda v: v is None, "remove_invalid_values": lambda v: v in (None, False),
    "exponential_decay_length_penalty": lambda v: v is None, "suppress_tokens": lambda v: v is None,
    "begin_suppress_tokens": lambda v: v is None, "guidance_scale": lambda v: v in (None, 1.0),
    "watermarking_config": lambda v: v is None, "renormalize_logits": lambda v: v in (None, False),
    "num_beams": lambda v: v in (None, 1), "penalty_alpha": lambda v: v is None, "dola_layers": lambda v: v is None,
    "assistant_model": lambda v: v is None, "prompt_lookup_num_tokens": lambda v: v is None,
}
# The only processors plain tempered (nucleus) sampling may use.
ALLOWED_PROCESSORS = {"TemperatureLogitsWarper", "TopPLogitsWarper"}


def sampler_config(agent, sampling: SamplingConfig):
    """The GenerationConfig of every HF rollout: the tempered softmax (and
    top-p when < 1), every other processor at its neutral value, whatever the
    checkpoint ships. Built from the global defaults, not from the
    checkpoint's generation_config, and used as the model's generation_config
    during ``generate`` (``_sampler``), so no field is filled from it."""
    from transformers import GenerationConfig

    tok = agent.tokenizer
    gen_cfg = GenerationConfig(
        do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0, min_p=None, typical_p=1.0,
        epsilon_cutoff=0.0, eta_cutoff=0.0, repetition_penalty=1.0, encoder_repetition_penalty=1.0,
        no_repeat_ngram_size=0, encoder_no_repeat_ngram_size=0, min_length=0, min_new_tokens=None, num_beams=1,
        remove_invalid_values=False, renormalize_logits=False, max_new_tokens=sampling.max_new_tokens,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )
    return gen_cfg  # fields whose neutral value is None (min_p, bad_words_ids, ...) stay None: nothing fills them


class _sampler:
    """Use ``gen_cfg`` as the model's generation_config while sampling, so
    transformers' merge of unset fields finds nothing of the checkpoint's."""

    def __init__(self, model, gen_cfg):
        self.model, self.gen_cfg = model, gen_cfg

    def __enter__(self):
        self.saved, self.model.generation_config = self.model.generation_config, self.gen_cfg
        return self.gen_cfg

    def __exit__(self, *exc):
        self.model.generation_config = self.saved


class _distinct_prefill:
    """While ``model.generate`` runs: its prefill (the one forward over the
    whole contexts) computes each distinct context once and hands generate
    the logits and key/value cache expanded to every row (a group's G rows
    share one prompt), so only the prefill's work changes (tiny default: 512
    rows of 64 prompts, generate 0.155 -> 0.085 s a call, measured). Exact on
    CPU: the call has at least MIN_CALL_TOKENS rows, like the call it
    replaces, so each row's logits and keys/values are the ones that call
    computes, bit for bit (tests/test_team_rollout.py compares every step's
    logits with generate's own); on CUDA a row may round as it does in any
    other batch size. The rest of generate (its decoding loop, sampler,
    stopping) is untouched. Only where generate prefills through
    ``_prefill`` (transformers 5) with a key/value cache and at least
    MIN_CALL_TOKENS rows; elsewhere generate runs as it is."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        plain = getattr(type(self.model), "_prefill", None)
        if plain is None:
            return self
        model = self.model

        def prefill(input_ids, generation_config, model_kwargs, *args, **kwargs):
            n, mask = input_ids.shape[0], model_kwargs.get("attention_mask")
            cache = model_kwargs.get("past_key_values")
            tensors = {k: v for k, v in model_kwargs.items() if isinstance(v, torch.Tensor) and v.dim()}
            usable = (cache is not None and cache.get_seq_length() == 0 and n >= MIN_CALL_TOKENS
                      and model_kwargs.get("inputs_embeds") is None and getattr(generation_config, "prefill_chunk_size", None) is None
                      and not generation_config.output_hidden_states and not generation_config.output_attentions
                      and all(v.shape[0] in (n, 1) for v in tensors.values()))  # per row, or broadcast over the rows
            if usable:  # (no attention mask: generate dropped an all-ones one)
                _, _, rows = distinct_contexts(input_ids, torch.ones_like(input_ids) if mask is None else mask)  # [n]
                first = torch.full((int(rows.max()) + 1,), n, device=rows.device).scatter_reduce(
                    0, rows, torch.arange(n, device=rows.device), "amin")  # [u] a row of each distinct context
                usable = max(len(first), MIN_CALL_TOKENS) < n
            if not usable:
                return plain(model, input_ids, generation_config, model_kwargs, *args, **kwargs)
            take = padded_rows(first, 1)  # [u'] and copies of row 0: a call as wide as the one it replaces
            per_row = {k: v.index_select(0, take) for k, v in tensors.items() if v.shape[0] == n}  # attention_mask, position_ids
            out = plain(model, input_ids.index_select(0, take), generation_config, {**model_kwargs, **per_row}, *args, **kwargs)
            out.past_key_values.reorder_cache(rows)  # every layer's keys/values [u', ...] -> [n, ...]
            out.logits = out.logits.index_select(0, rows)  # [n, 1, V]
            return out

        self.model._prefill = prefill  # this instance only, for this call
        return self

    def __exit__(self, *exc):
        self.model.__dict__.pop("_prefill", None)


def check_sampler(agent, sampling: SamplingConfig) -> None:
    """Refuse, in one line naming the field, a sampler that is not the plain
    tempered softmax (plus top-p): every processor field at its neutral value,
    and (where transformers exposes it) the processor list it would build
    holds nothing but temperature and top-p."""
    gen_cfg = sampler_config(agent, sampling)
    model = getattr(agent.model, "lm", agent.model)  # a sharded agent (distributed.ShardedLM): the LM inside
    merge = getattr(model, "_prepare_generation_config", None)
    if merge is not None:  # the config generate will really use: ours, merged as generate merges it
        with _sampler(model, gen_cfg):
            try:
                gen_cfg = merge(gen_cfg)[0]
            except TypeError:  # the private signature changed: check our own config
                pass
    for name, neutral in NEUTRAL_SAMPLER_FIELDS.items():
        value = getattr(gen_cfg, name, None)
        if not neutral(value):
            raise RuntimeError(f"agent '{agent.spec.name}': the sampler's {name}={value!r} would reshape the "
                               f"distribution the behaviour log-probs assume; set it to its neutral value in rollout.sampler_config")
    build = getattr(model, "_get_logits_processor", None)
    if build is None:
        return
    with _sampler(model, gen_cfg):
        from transformers import LogitsProcessorList

        try:
            procs = build(generation_config=gen_cfg, input_ids_seq_length=1, encoder_input_ids=None,
                          prefix_allowed_tokens_fn=None, logits_processor=LogitsProcessorList(), device="cpu")
        except TypeError:  # the private signature changed: the field check above still holds
            return
    extra = sorted({type(p).__name__ for p in procs} - ALLOWED_PROCESSORS)
    if extra:
        raise RuntimeError(f"agent '{agent.spec.name}': generate would apply {', '.join(extra)} on top of the tempered "
                           "softmax; neutralise its field in rollout.sampler_config")


@torch.no_grad()
def generate_hf(agent, contexts: list[list[int]], sampling: SamplingConfig) -> list[list[int]]:
    """Sample one response per context with Hugging Face ``generate``, batched,
    from the tempered softmax only (``sampler_config``; Qwen3 ships top_k=20,
    temperature=0.6, others repetition_penalty or min_p: none of it applies)."""
    tok = agent.tokenizer
    gen_cfg = sampler_config(agent, sampling)
    # Sort by length so each chunk pads little; restore the order afterwards.
    order = sorted(range(len(contexts)), key=lambda i: len(contexts[i]))
    widths = [len(contexts[i]) + sampling.max_new_tokens for i in order]
    responses: list[list[int]] = [None] * len(contexts)
    inner = getattr(agent.model, "lm", agent.model)  # a sharded agent (--shard-frozen) generates through its inner model
    chunks = chunks_by_budget(widths, sampling.token_budget)
    # a sharded agent (--shard-frozen): as many generate calls as the busiest rank, agreed before the first
    extra = distributed.extra_calls(len(chunks)) if distributed.is_sharded(agent.model) else 0
    for sl in chunks:
        idx = order[sl]
        ids, mask = left_pad([contexts[i] for i in idx], tok.pad_token_id)
        with _sampler(inner, gen_cfg), _distinct_prefill(inner):
            out = agent.model.generate(input_ids=ids.to(agent.device), attention_mask=mask.to(agent.device), generation_config=gen_cfg)
        new = out[:, ids.shape[1]:].cpu()  # [n, <=max_new]
        for row, i in enumerate(idx):
            responses[i] = cut_at_eos(new[row].tolist(), tok.eos_token_id, tok.pad_token_id)
    if extra:  # dummy calls, under their own RNG (the batch's draws stay those of one process)
        ids, mask = left_pad([contexts[order[0]]], tok.pad_token_id)
        for _ in range(extra):
            with torch.random.fork_rng(devices=distributed.rng_devices(agent.device)), _sampler(inner, gen_cfg):
                agent.model.generate(input_ids=ids.to(agent.device), attention_mask=mask.to(agent.device), generation_config=gen_cfg)
    return responses


def default_backend(device: str) -> str:
    """vLLM on CUDA when it is installed; the Hugging Face backend otherwise."""
    if not device.startswith("cuda"):
        return "hf"
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "hf"
    return "vllm"


def generate(agent, contexts: list[list[int]], sampling: SamplingConfig) -> list[list[int]]:
    if sampling.backend == "vllm":
        from scale import rollout_vllm  # lazy: an optional extra (CUDA or CPU vLLM)

        return rollout_vllm.generate_vllm(agent, contexts, sampling)
    return generate_hf(agent, contexts, sampling)


# ---------------------------------------------------------------------------
# The joint rollout
# ---------------------------------------------------------------------------
def agent_turn(team: Team, k: int, contexts: list[list[int]], sampling: SamplingConfig, score: bool = True,
               overlap: bool = False):
    """Agent k answers every context: one batched generate, one batched scoring
    (skipped with ``score=False``: evaluation needs no log-probabilities).
    ``overlap``: return (unscored turn, finish) instead, the scoring running in
    a forked child on the second core while the caller goes on
    (``parallel.fork_call``; it draws no random numbers, so the log-probs are
    the serial ones bit for bit); ``finish()`` returns the scored turn."""
    agent = team.agents[k]
    tok = agent.tokenizer
    responses = generate(agent, contexts, sampling)
    ctx, cmask = left_pad(contexts, tok.pad_token_id)  # [N, Lc]
    resp, rmask = right_pad(responses, tok.pad_token_id)  # [N, Lr]
    texts = tok.batch_decode([r for r in responses], skip_special_tokens=True)
    truncated = torch.tensor([tok.eos_token_id not in r for r in responses])
    answers = [team.extract(t) for t in texts]

    def scored() -> tuple[torch.Tensor, dict | None]:  # behaviour log-probs [N, Lr], the forward's outputs kept
        if not score:
            distributed.reshard(agent.model)  # a sharded agent keeps no gathered root between turns
            return torch.zeros(resp.shape), None
        turn_like = (ctx, cmask, resp, rmask)
        sharded = distributed.is_sharded(agent.model)
        scoring = {} if not sharded else None  # a sharded reference is a copy: it measures its own outputs
        # a sharded agent: as many forwards as the busiest rank (their all-gathers meet), agreed before the first
        extra = distributed.extra_calls(-(-len(contexts) // turn_rows(turn_like, sampling.token_budget))) if sharded else 0
        logp = batched_response_logprobs(agent.model, turn_like, sampling.temperature, sampling.token_budget, keep=scoring)
        for _ in range(extra):
            turn_forward(agent.model, turn_like, slice(0, 1), sampling.temperature)
        distributed.reshard(agent.model)
        return logp, scoring or None

    def turn(logp: torch.Tensor | None, scoring: dict | None = None) -> Turn:
        return Turn(k, ctx, cmask, resp, rmask, logp, texts, answers, truncated, scoring)

    if not overlap:
        return turn(*scored())
    pending = parallel.fork_call(scored, parallel=True)  # rollout() asks for the overlap only when it scores
    return turn(None), lambda: turn(*pending.result())


def turn_contexts(team: Team, k: int, flat: list[Problem], turns: list[Turn]) -> list[list[int]]:
    """Agent k's context in every trajectory. Independent: the problem only;
    chain: also the answers of agents 0..k-1 (``turns[:k]``) of the same trajectory."""
    if team.protocol == "chain":
        return [team.prompt_ids(k, p, [t.answers[i] for t in turns[:k]]) for i, p in enumerate(flat)]
    return [team.prompt_ids(k, p, []) for p in flat]


def counterfactual_baselines(answers: list[list[str | None]], flat: list[Problem], group_ids: torch.Tensor) -> torch.Tensor:
    """b_k(tau): agent k's counterfactual baseline in the independent protocol. [n_agents, N]

    The team reward of tau with agent k's answer swapped for each of its other
    answers to the same problem (its other G - 1 trajectories of the group),
    averaged. Agent k's answers to one prompt are i.i.d. draws of pi_k and
    independent of the other agents' answers, so b_k(tau) is an unbiased
    estimate of E[R | the others' answers in tau] that does not depend on
    agent k's own answer in tau: R - b_k is a valid (variance-reduced) advantage
    for agent k that removes the noise of the other agents' answers."""
    n_agents, cache = len(answers[0]), {}

    def reward(ans: tuple, gold: str) -> float:
        if (ans, gold) not in cache:
            cache[ans, gold] = vote_reward(list(ans), gold)
        return cache[ans, gold]

    out = torch.zeros(n_agents, len(flat))  # [n_agents, N]
    for g in torch.unique(group_ids).tolist():
        idx = (group_ids == g).nonzero().flatten().tolist()
        if len(idx) < 2:
            continue
        gold = flat[idx[0]].answer
        for k in range(n_agents):
            for t in idx:
                swaps = [tuple(answers[t][:k]) + (answers[u][k],) + tuple(answers[t][k + 1:]) for u in idx if u != t]
                out[k, t] = sum(reward(a, gold) for a in swaps) / len(swaps)
    return out


def score_team(team: Team, flat: list[Problem], turns: list[Turn], group_ids: torch.Tensor):
    """(team answers, team rewards [N], agent_correct [n_agents, N], counterfactual baselines
    [n_agents, N] or None) of the joint trajectories."""
    answers = [[t.answers[i] for t in turns] for i in range(len(flat))]
    team_answers = [team.team_answer(a) for a in answers]
    if team.protocol == "independent":  # expected correctness of the vote under a uniform tie-break
        rewards = torch.tensor([vote_reward(a, p.answer) for a, p in zip(answers, flat)])  # [N]
    else:  # chain: the last agent's answer is the team's
        rewards = torch.tensor([float(answers_match(a, p.answer)) for a, p in zip(team_answers, flat)])  # [N]
    agent_correct = torch.tensor([[float(answers_match(t.answers[i], p.answer)) for i, p in enumerate(flat)] for t in turns])
    counterfactual = counterfactual_baselines(answers, flat, group_ids) if team.protocol == "independent" else None
    return team_answers, rewards.float(), agent_correct, counterfactual


def rollout(team: Team, problems: list[Problem], group_size: int, sampling: SamplingConfig, score: bool = True) -> TeamBatch:
    """G joint trajectories for each of the B problems (paper, Section 3).
    ``score=False`` skips the behaviour log-probabilities (left as zeros)."""
    if group_size < 1:
        raise ValueError(f"--group-size must be >= 1 (got {group_size})")
    if score and sampling.top_p < 1:
        raise ValueError(TOP_P_TRAINING_ERROR.format(top_p=sampling.top_p))
    flat = [p for p in problems for _ in range(group_size)]  # [N]
    group_ids = torch.arange(len(problems)).repeat_interleave(group_size)  # [N]
    turns: list[Turn] = []
    overlap = score and sampling.backend == "hf" and parallel.idle_core()
    finish = None  # agent k-1's scoring, running in a child beside agent k's generate
    for k in range(len(team)):
        # Agent k's scoring needs only its own turn and weights (the next agent's contexts need
        # only its answers): with an idle core a child scores it while agent k+1 generates.
        if overlap and k < len(team) - 1:
            turn, finish_k = agent_turn(team, k, turn_contexts(team, k, flat, turns), sampling, score, overlap=True)
        else:
            turn, finish_k = agent_turn(team, k, turn_contexts(team, k, flat, turns), sampling, score), None
        if finish is not None:
            turns[-1] = finish()
        turns.append(turn)
        finish = finish_k
    return TeamBatch(flat, group_ids, turns, *score_team(team, flat, turns, group_ids))


def regenerate(team: Team, batch: TeamBatch, j: int, sampling: SamplingConfig) -> tuple[TeamBatch, int]:
    """After agent j is promoted (Algorithm 1, line 12), redraw what depends on it.

    Independent protocol: only agent j's turn; the other agents' responses do
    not depend on it, and given the problem the joint action is a product, so
    (kept responses of the others, fresh response of the promoted agent j) is
    an exact draw from pi_hat^i. Chain protocol: agent j's turn and every turn
    after it (their contexts contain agent j's answer); the turns before j are
    kept, being draws of agents that are the same in pi_hat^{i-1} and pi_hat^i.
    The behaviour log-probabilities of the new turns are those of the sampling
    models, so the batch needs no importance weights afterwards. Returns the
    new batch (problems and group ids unchanged) and how many responses were
    generated."""
    turns = list(batch.turns)
    redo = range(j, len(team)) if team.protocol == "chain" else [j]
    for k in redo:
        turns[k] = agent_turn(team, k, turn_contexts(team, k, batch.problems, turns), sampling)
    return TeamBatch(batch.problems, batch.group_ids, turns, *score_team(team, batch.problems, turns, batch.group_ids)), len(redo) * len(batch)


def rollout_in_blocks(team: Team, problems: list[Problem], group_size: int, sampling: SamplingConfig, seed: int,
                      n_blocks: int, score: bool = True) -> TeamBatch:
    """``rollout`` in ``n_blocks`` blocks of whole groups, block b sampled under
    the seed ``seed + b``; under torchrun rank r generates blocks r, r + N, ...
    and every rank receives the union. The batch is the same for any number of
    processes (one process generates every block itself)."""
    size = -(-len(problems) // max(1, n_blocks))  # problems per block
    starts = list(range(0, len(problems), size))
    world = distributed.STATE.world
    # sharded agents (--shard-frozen): every rank runs as many blocks; a rank past the last block redoes one, discarded
    rounds = -(-len(starts) // world) * world if any(distributed.is_sharded(a.model) for a in team.agents) else len(starts)
    mine = {}
    # sharded agents (--shard-frozen, HF backend): rank r takes r, r + N, ... up to a multiple of N
    blocks = range(distributed.STATE.rank, rounds, world) if rounds != len(starts) else blocks_of_rank(len(starts), sampling)
    for b in blocks:
        with torch.random.fork_rng(devices=distributed.rng_devices(team.agents[0].device)):
            torch.manual_seed(seed + b)
            part = rollout(team, problems[starts[b % len(starts)] : starts[b % len(starts)] + size], group_size, sampling, score)
        if b < len(starts):
            mine[b] = with_sampler_logprobs(part, team, sampling)
    parts = {b: part for gathered in distributed.gather_objects(mine) for b, part in gathered.items()}
    keep_sampler_logprobs(team, [parts[b] for b in range(len(starts))], sampling)
    return concat_batches([parts[b] for b in range(len(starts))], [a.tokenizer.pad_token_id for a in team.agents])


def with_sampler_logprobs(part: TeamBatch, team: Team, sampling: SamplingConfig) -> TeamBatch:
    """vLLM backend: attach the engines' own log-probabilities of this block
    (each agent's last generate call) to the block, so they travel with it."""
    if sampling.backend == "vllm":
        from scale import rollout_vllm

        part.sampler_logprobs = [rollout_vllm.last_logprobs(a) for a in team.agents]
    return part


def keep_sampler_logprobs(team: Team, parts: list[TeamBatch], sampling: SamplingConfig) -> None:
    """vLLM backend: the engines' log-probabilities of the whole batch, in its
    row order (every block, whichever rank generated it), as each agent's last
    ones, so the health metric (``after_rollout``) compares the same rows."""
    if sampling.backend != "vllm" or any(getattr(p, "sampler_logprobs", None) is None for p in parts):
        return
    from scale import rollout_vllm

    for k, agent in enumerate(team.agents):
        rows = [p.sampler_logprobs[k] for p in parts]
        if all(r is not None for r in rows):
            rollout_vllm.registry().last_logprobs[id(agent)] = [row for r in rows for row in r]


def blocks_of_rank(n_blocks: int, sampling: SamplingConfig) -> range:
    """The rollout blocks this rank generates: r, r + N, ... (HF backend, and
    vLLM with one engine per agent per rank); with K-rank tensor-parallel vLLM
    engines the K ranks of one engine take the same blocks
    (``vllm_ranks.engine_blocks``). The union is the same batch for any N."""
    from scale import vllm_ranks  # light: os, pathlib and torch only

    k = 1
    if sampling.backend == "vllm":
        from scale import rollout_vllm

        k = rollout_vllm.tensor_parallel()
    return vllm_ranks.engine_blocks(n_blocks, distributed.STATE.rank, distributed.STATE.world, k)


def concat_batches(parts: list[TeamBatch], pad_ids: list[int]) -> TeamBatch:
    """One TeamBatch from consecutive blocks: contexts re-padded on the left,
    responses on the right, group ids offset so groups stay distinct."""
    turns = []
    for k, pad in enumerate(pad_ids):
        ts = [p.turns[k] for p in parts]
        lc, lr = max(t.context_ids.shape[1] for t in ts), max(t.response_ids.shape[1] for t in ts)

        def pad_to(x, width, value, left):
            fill = x.new_full((x.shape[0], width - x.shape[1]), value)  # [n, width - L]
            return torch.cat([fill, x] if left else [x, fill], dim=1)  # [n, width]

        turns.append(Turn(k, torch.cat([pad_to(t.context_ids, lc, pad, True) for t in ts]),
                          torch.cat([pad_to(t.context_mask, lc, 0, True) for t in ts]),
                          torch.cat([pad_to(t.response_ids, lr, pad, False) for t in ts]),
                          torch.cat([pad_to(t.response_mask, lr, 0, False) for t in ts]),
                          torch.cat([pad_to(t.behaviour_logprobs, lr, 0.0, False) for t in ts]),
                          [x for t in ts for x in t.texts], [x for t in ts for x in t.answers],
                          torch.cat([t.truncated for t in ts])))
    offsets = torch.tensor([0] + [len(set(p.group_ids.tolist())) for p in parts]).cumsum(0)  # [n_parts + 1]
    return TeamBatch([x for p in parts for x in p.problems], torch.cat([p.group_ids + offsets[i] for i, p in enumerate(parts)]),
                     turns, [x for p in parts for x in p.team_answers], torch.cat([p.rewards for p in parts]),
                     torch.cat([p.agent_correct for p in parts], dim=1),
                     None if any(p.counterfactual is None for p in parts)  # per group, and blocks hold whole groups
                     else torch.cat([p.counterfactual for p in parts], dim=1))


# ---------------------------------------------------------------------------
# Backend hooks around training (no-ops with the HF backend)
# ---------------------------------------------------------------------------
def start_backend(backend: str, n_engines: int, seed: int, train_fraction: float | None = None,
                  tensor_parallel: int = 1) -> None:
    """Configure the vLLM engines (one per agent, per rank under torchrun, or
    per group of ``tensor_parallel`` ranks; on CUDA sized from the fraction of
    the GPU that training keeps). Nothing to do for the HF backend."""
    if backend != "vllm":
        return
    from scale import rollout_vllm

    extra = {} if train_fraction is None else {"train_fraction": train_fraction}
    rollout_vllm.configure(n_engines=n_engines, seed=seed, health_logprobs=True, tensor_parallel=tensor_parallel, **extra)


def stop_backend(backend: str) -> None:
    """Shut the vLLM engines down at the end of a run."""
    if backend == "vllm":
        from scale import rollout_vllm

        rollout_vllm.shutdown()


def after_rollout(team: Team, batch: TeamBatch, sampling: SamplingConfig):
    """Put the vLLM engines to sleep before training; return the sampler-vs-
    trainer log-prob health metric per agent (None with the HF backend)."""
    if sampling.backend != "vllm":
        return None
    from scale import rollout_vllm

    rollout_vllm.sleep_all()
    health = []
    for agent, turn in zip(team.agents, batch.turns):
        vllm_lp = rollout_vllm.last_logprobs(agent)
        health.append(None if vllm_lp is None else rollout_vllm.logprob_health(vllm_lp, turn.behaviour_logprobs, turn.response_mask))
    return health


def sync_weights(agent, sampling: SamplingConfig) -> None:
    """After a promotion: the agent's engine samples from the new weights from now on."""
    if sampling.backend == "vllm":
        from scale import rollout_vllm

        rollout_vllm.sync_weights(agent)
