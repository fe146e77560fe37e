"""Joint-trajectory generation: the team answers B problems G times each (paper, Section 3; Algorithm 1, ROLLOUT).

A joint trajectory is one response per agent under the team's protocol (independent answers + majority
vote, or a chain in which agent k sees the answers of agents 1..k-1), with one team reward shared by every
agent's tokens: the team's reward (``reward.Reward``: a user's function of every agent's response, or the
built-in one: chain, 1 if the last answer is right; independent, the expected correctness of the vote under a
uniform tie-break, so that no agent is a dictator).

The behaviour log-probabilities come from the training model's teacher-forced forward at the sampling
temperature, so the sampler's numerics never enter the importance ratios. The sampler is a backend object
the entry point chooses once per run (``scale.rollout_vllm.make_backend``): ``HFBackend`` here, or
``scale.rollout_vllm.VLLMBackend``. Sampling is the tempered softmax and nothing else; top_p < 1 is for
evaluation only (the ratios and the KL use the full softmax).

Common random numbers: every response is sampled under a seed of its own (``response_seeds``: a function of
the call's base seed, the row and the agent), and its randomness is a function of that seed alone, whatever
else is in the batch. Two policies sampled under the same seeds give the same response wherever they agree
closely enough, while each draw keeps exactly its own distribution: the paired certificates (``bounds``) use
that to pair the held-out evaluations of consecutive stages and a step's before/after redraws.
"""
from __future__ import annotations

import hashlib
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from harness.config import TOP_P_TRAINING_ERROR
from logprobs import (
    TurnTensors,
    batched_response_logprobs,
    chunks_by_budget,
    cut_at_eos,
    left_pad,
    right_pad,
    turn_forward,
    turn_rows,
)
from reward import agent_scores, counterfactual_baselines, score
from team import Problem, Team


@dataclass
class SamplingConfig:
    temperature: float = 0.8
    top_p: float = 1.0
    max_new_tokens: int = 32768
    token_budget: int = 65536  # max (context + response) tokens in one generate / forward chunk

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"--temperature must be > 0 (got {self.temperature}): SAT needs a stochastic policy")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1] (got {self.top_p})")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1 (got {self.max_new_tokens})")


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
    sampler_logprobs: list[list[float]] | None = None  # [N][len] the engine's own (vLLM), for the health metric

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum())

    @property
    def tensors(self) -> TurnTensors:
        """Its context and response ids and masks, as every teacher-forced forward of the turn reads them."""
        return TurnTensors(self.context_ids, self.context_mask, self.response_ids, self.response_mask)


@dataclass
class TeamBatch:
    problems: list[Problem]  # [N] the problem of each joint trajectory
    group_ids: torch.Tensor  # [N] index of the problem in the rollout call
    turns: list[Turn]  # one per agent, turns[k].agent == k
    team_answers: list[str | None]
    rewards: torch.Tensor  # [N] team reward R, in the reward's own range
    agent_correct: torch.Tensor = None  # [n_agents, N] each agent's own score (reward.agent_scores): its answer right?
    counterfactual: torch.Tensor | None = None  # [n_agents, N] independent protocol: counterfactual_baselines
    transcripts: list[str] | None = None  # [N] with an environment: each episode, every round, as text
    rounds: list[int] | None = None  # [N] with an environment: the rounds each episode ran

    def __len__(self) -> int:
        return len(self.problems)

    @property
    def responses(self) -> int:
        """Responses generated for the batch: one per agent and round of every trajectory."""
        return len(self.turns) * (sum(self.rounds) if self.rounds is not None else len(self))

    @property
    def num_tokens(self) -> int:
        return sum(t.num_tokens for t in self.turns)


# -- Common random numbers ------------------------------------------------------------------------------
SEED_BITS = 62  # seeds and base seeds lie in [0, 2**62)
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's constants


def _int64(x: int) -> int:
    """x modulo 2**64 as a signed int64 (torch's int64 arithmetic wraps the same way)."""
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


def rng_devices(device) -> list[int]:
    """The CUDA devices ``torch.random.fork_rng`` must save: the current one for a CUDA device, none otherwise
    (asking a CPU run for ``torch.cuda.current_device()`` would initialise CUDA)."""
    return [torch.cuda.current_device()] if str(device).startswith("cuda") and torch.cuda.is_available() else []


def draw_seed() -> int:
    """A base seed from torch's global generator: a run seeded with --seed draws the same samples."""
    return int(torch.randint(0, 1 << SEED_BITS, ()))


def response_seeds(base: int, rows: int, agent: int, round_: int = 0) -> list[int]:
    """One seed per response of agent ``agent`` in rows 0..rows-1 of a call with base seed ``base``: a hash
    of (base, agent, row) and, after an episode's first round, the round, so the agents of one row (the rows,
    the rounds) draw independent randomness, and a call with the same base, rows and agent draws the same
    randomness whatever the batch around it."""
    tag = "" if round_ == 0 else f":{round_}"
    return [int.from_bytes(hashlib.blake2b(f"{base}:{agent}:{row}{tag}".encode(), digest_size=8).digest(),
                           "little") >> (64 - SEED_BITS) for row in range(rows)]


def _shift_right(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x >> k) & ((1 << (64 - k)) - 1)  # logical shift of an int64


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 words (multiplication wraps): a bijection whose outputs on
    distinct inputs behave as independent uniform 64-bit words."""
    x = (x ^ _shift_right(x, 30)) * _int64(_MIX1)
    x = (x ^ _shift_right(x, 27)) * _int64(_MIX2)
    return x ^ _shift_right(x, 31)


def position_uniforms(seeds: torch.Tensor, position: int) -> torch.Tensor:
    """[n] float64 uniforms in (0, 1), one per row, a function of (the row's seed, the position) alone."""
    z = _splitmix64(_splitmix64(seeds) + _int64((position + 1) * _GOLDEN))  # [n]
    return (_shift_right(z, 11).double() + 0.5) * 2.0 ** -53  # 53 random bits, never 0 or 1


def tempered_weights(scores: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """[n, V] the tempered softmax's unnormalised weights exp(scores / T - max), in the scores' precision (the
    logits' own), restricted to the top-p nucleus: the smallest set of most likely tokens whose mass reaches
    top_p, as transformers' TopPLogitsWarper keeps it."""
    weights = scores / temperature  # [n, V]
    weights = weights.sub_(weights.max(-1, keepdim=True).values).exp_()  # [n, V] in (0, 1], the top token at 1
    if top_p >= 1:
        return weights
    sorted_w, order = weights.sort(-1, descending=True)  # [n, V]
    mass = sorted_w.double().cumsum(-1) / sorted_w.double().sum(-1, keepdim=True)  # [n, V]
    outside = (mass - sorted_w / sorted_w.sum(-1, keepdim=True)) >= top_p  # the mass before it reaches top_p
    return weights.scatter(-1, order, sorted_w.masked_fill(outside, 0.0))  # [n, V]


def tempered_probs(scores: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """[n, V] float64: the distribution ``SeededSampler`` draws from (``tempered_weights`` normalised)."""
    weights = tempered_weights(scores, temperature, top_p).double()  # [n, V]
    return weights / weights.sum(-1, keepdim=True)


class SeededSampler:
    """A logits processor for ``generate`` run greedily: at each position it picks, for every row, the
    token of the tempered (nucleus) softmax that the row's uniform u falls on in the cumulative
    distribution (inverse-CDF sampling), and leaves that token the only one with a finite score.

    Exact: P(token v) = F(v) - F(v - 1) = p(v) for u uniform, so the draw is the tempered softmax's (each
    weight and block sum rounded in the logits' precision, the cumulative sums in float64).
    Coupled: u depends only on the row's seed and the position (``position_uniforms``), so two policies
    sampled under one seed emit the same token wherever u falls in the same token's interval of both
    cumulative distributions (probability at least 1 - sum_v |F_1(v) - F_2(v)|), and identical policies
    give identical responses. One uniform per position, where Gumbel-max needs one per vocabulary entry:
    for 256 rows x SmolLM2's 49,152 tokens that noise took 0.9-3.5 s a step on a loaded 2-core CPU, this
    sampler 0.7 s (HF's multinomial sampling 3.3 s) on the same machine at the same time. The search runs
    in two levels (blocks of ``BLOCK`` tokens, then within the block), so the cumulative sums in float64
    touch one block per row rather than the whole vocabulary."""

    BLOCK = 256

    def __init__(self, seeds: list[int], temperature: float, top_p: float = 1.0):
        self.seeds = torch.tensor(seeds, dtype=torch.int64)  # [n]
        self.temperature, self.top_p, self.position = temperature, top_p, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # scores [n, V]
        """As a logits processor: 0 on each row's drawn token, -inf elsewhere (greedy then takes it)."""
        token = self.draw(scores)  # [n]
        return torch.full_like(scores, -torch.inf).scatter_(-1, token[:, None], 0.0)  # [n, V]

    def keep(self, rows: torch.Tensor) -> None:
        """Go on drawing for ``rows`` only (the rows of a batch still unfinished)."""
        self.seeds = self.seeds[rows.cpu()]  # [m]

    def draw(self, scores: torch.Tensor) -> torch.Tensor:  # scores [n, V] -> [n]
        """Each row's token at the next position."""
        n, vocab = scores.shape
        weights = tempered_weights(scores, self.temperature, self.top_p)  # [n, V]
        if vocab % self.BLOCK:
            weights = torch.nn.functional.pad(weights, (0, -vocab % self.BLOCK))  # [n, K * B]
        weights = weights.view(n, -1, self.BLOCK)  # [n, K, B]
        block_cdf = weights.sum(-1).double().cumsum(-1)  # [n, K] (blocks summed pairwise, then in float64)
        u = position_uniforms(self.seeds, self.position).to(scores.device) * block_cdf[:, -1]  # [n]
        block = torch.searchsorted(block_cdf, u[:, None].contiguous()).clamp_max(block_cdf.shape[1] - 1)  # [n, 1]
        below = torch.where(block > 0, block_cdf.gather(-1, (block - 1).clamp_min(0)), 0.0)  # [n, 1] mass before
        inner_cdf = below + weights[torch.arange(n), block[:, 0]].double().cumsum(-1)  # [n, B]
        offset = torch.searchsorted(inner_cdf, u[:, None].contiguous()).clamp_max(self.BLOCK - 1)  # [n, 1]
        token = (block * self.BLOCK + offset).clamp_max(vocab - 1)  # [n, 1]
        self.position += 1
        return token[:, 0]  # [n]


# -- The HF sampler: the tempered softmax only -----------------------------------------------------------
# Every GenerationConfig field that makes ``generate`` add a logits processor, with its neutral values.
# ``do_sample`` False is the neutral value of the sampling warpers (temperature, top_k, top_p, min_p, typical_p,
# epsilon_cutoff, eta_cutoff, top_h): transformers builds them only when it samples, whatever their values.
# transformers fills each field left at None from the checkpoint's generation_config.
NEUTRAL_SAMPLER_FIELDS = {
    "do_sample": (None, False), "repetition_penalty": (None, 1.0),
    "encoder_repetition_penalty": (None, 1.0), "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,), "sequence_bias": (None,),
    "min_length": (None, 0), "min_new_tokens": (None, 0), "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,), "remove_invalid_values": (None, False), "exponential_decay_length_penalty": (None,),
    "suppress_tokens": (None,), "begin_suppress_tokens": (None,), "guidance_scale": (None, 1.0),
    "watermarking_config": (None,), "renormalize_logits": (None, False), "num_beams": (None, 1),
    "penalty_alpha": (None,), "dola_layers": (None,), "assistant_model": (None,), "prompt_lookup_num_tokens": (None,),
}
ALLOWED_PROCESSORS = {"SeededSampler"}  # generate runs greedily on the SeededSampler's one finite score


def sampler_config(agent, sampling: SamplingConfig):
    """The GenerationConfig of an HF rollout through ``generate`` (``generate_hf``): greedy on
    ``SeededSampler``'s output (which applies the temperature and top-p), every other processor at its
    neutral value whatever the checkpoint ships (Qwen3: top_k=20, temperature=0.6). The sampling warpers'
    fields are left unset: greedy decoding never builds them, and a value set beside ``do_sample=False`` is
    what transformers warns about. Built from the global defaults and installed as the model's
    generation_config while sampling (``_sampler``)."""
    from transformers import GenerationConfig

    tok = agent.tokenizer
    return GenerationConfig(
        do_sample=False, repetition_penalty=1.0, encoder_repetition_penalty=1.0,
        no_repeat_ngram_size=0, encoder_no_repeat_ngram_size=0, min_length=0, min_new_tokens=None, num_beams=1,
        remove_invalid_values=False, renormalize_logits=False, max_new_tokens=sampling.max_new_tokens,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )


@contextmanager
def _sampler(model, gen_cfg):
    """``gen_cfg`` as the model's generation_config while sampling, so transformers' merge of unset
    fields finds nothing of the checkpoint's."""
    saved, model.generation_config = model.generation_config, gen_cfg
    try:
        yield gen_cfg
    finally:
        model.generation_config = saved


def check_sampler(agent, sampling: SamplingConfig) -> None:
    """Refuse, in one line naming the field, a sampler that is not the plain tempered softmax (plus
    top-p): every processor field neutral, and (where transformers exposes it) the processor list that
    generate would build holds nothing but ``SeededSampler``."""
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
        if value not in neutral:
            raise RuntimeError(f"agent '{agent.spec.name}': the sampler's {name}={value!r} would reshape the "
                               "distribution the behaviour log-probs assume; set it to its neutral value in "
                               "rollout.sampler_config")
    build = getattr(model, "_get_logits_processor", None)
    if build is None:
        return
    with _sampler(model, gen_cfg):
        from transformers import LogitsProcessorList

        try:
            procs = build(generation_config=gen_cfg, input_ids_seq_length=1, encoder_input_ids=None,
                          prefix_allowed_tokens_fn=None, logits_processor=LogitsProcessorList(
                              [SeededSampler([0], sampling.temperature, sampling.top_p)]), device="cpu")
        except TypeError:  # the private signature changed: the field check above still holds
            return
    extra = sorted({type(p).__name__ for p in procs} - ALLOWED_PROCESSORS)
    if extra:
        raise RuntimeError(f"agent '{agent.spec.name}': generate would apply {', '.join(extra)} on top of the "
                           "tempered softmax; neutralise its field in rollout.sampler_config")


@torch.no_grad()
def decode(model, ids: torch.Tensor, mask: torch.Tensor, sampler: SeededSampler, max_new_tokens: int,
           eos_id: int, pad_id: int) -> torch.Tensor:  # ids, mask [n, Lc] left-padded -> [n, <= max_new_tokens]
    """Sampling with a KV cache, each step forwarding only the rows not yet ended, where HF ``generate``
    forwards every row until the batch's last ends (in a SmolLM2 stage 68% of its row-steps were on ended
    rows; ``bench/backends.py --backends hf-generate,hf`` times the two). A row's draws are its own
    (``SeededSampler``: the row's seed and the position), so dropping ended rows changes what is computed,
    not the distribution sampled (the tokens too, up to float rounding that depends on the batch's shape).
    For models whose cache is attention alone (``drops_rows``)."""
    new = torch.full((ids.shape[0], max_new_tokens), pad_id, dtype=torch.long)  # [n, T] pads after an eos
    live = torch.arange(ids.shape[0])  # [m] the rows still sampling
    positions = (mask.cumsum(-1) - 1).clamp_min(0)  # [m, Lc] left padding leaves positions unchanged
    cache, step_ids = new_cache(model), ids
    for t in range(max_new_tokens):
        logits = model(input_ids=step_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                       use_cache=True, logits_to_keep=1).logits[:, -1].float()  # [m, V]
        token = sampler.draw(logits).cpu()  # [m]
        new[live, t] = token
        going = token != eos_id  # [m]
        if not going.all():
            if not going.any():
                break
            rows = going.nonzero()[:, 0]  # [m'] the rows that go on
            live, token, mask, positions = live[rows], token[rows], mask[rows], positions[rows]
            cache.batch_select_indices(rows.to(mask.device))
            sampler.keep(rows)
        step_ids = token[:, None].to(mask.device)  # [m, 1]
        mask = torch.cat([mask, mask.new_ones(len(live), 1)], 1)  # [m, Lc + t + 1]
        positions = positions[:, -1:] + 1  # [m, 1]
    return new[:, :t + 1]


def new_cache(model):
    """The empty KV cache HF ``generate`` would start ``model`` with: one layer cache per decoder layer, of
    the kind its config names (full or sliding-window attention, linear attention, state space)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config.get_text_config(decoder=True))


def drops_rows(model) -> bool:
    """Whether ``decode`` can cut rows out of ``model``'s cache: every layer's cache is attention keys and
    values. A linear-attention or state-space layer keeps a recurrent state that ``batch_select_indices``
    does not cut (Qwen3.5, Qwen3-Next, FalconH1); such a model samples through HF ``generate``."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    return all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in new_cache(model).layers)


@torch.no_grad()
def generate_hf(agent, contexts: list[list[int]], sampling: SamplingConfig, seeds: list[int]) -> list[list[int]]:
    """One sampled response per context (ids cut after the first eos), response i under ``seeds[i]``
    (``SeededSampler``): one left-padded ``decode`` per token-budget chunk, contexts sorted by length so a
    chunk pads little. A model whose forwards are collectives (``procs.synced_forwards``: FSDP2 shards)
    samples through HF ``generate``, whose ``synced_gpus`` keeps every rank forwarding until all are done, and
    so does a model whose cache cannot drop rows (``drops_rows``)."""
    from transformers import LogitsProcessorList

    tok = agent.tokenizer
    gen_cfg = sampler_config(agent, sampling)
    order = sorted(range(len(contexts)), key=lambda i: len(contexts[i]))
    chunks = chunks_by_budget([len(contexts[i]) + sampling.max_new_tokens for i in order], sampling.token_budget)
    inner = getattr(agent.model, "lm", agent.model)  # a sharded agent (--shard-frozen) generates through its LM
    through_generate = agent.procs.synced_forwards(agent.model) or not drops_rows(inner)

    def gen(ids: torch.Tensor, mask: torch.Tensor, row_seeds: list[int]) -> torch.Tensor:  # [n, <= new]
        ids, mask = ids.to(agent.device), mask.to(agent.device)  # [n, Lc]
        sampler = SeededSampler(row_seeds, sampling.temperature, sampling.top_p)
        if not through_generate:
            return decode(inner, ids, mask, sampler, sampling.max_new_tokens, tok.eos_token_id, tok.pad_token_id)
        with _sampler(inner, gen_cfg):
            out = agent.model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg,
                                       logits_processor=LogitsProcessorList([sampler]))  # [n, Lc + <= new]
        return out[:, ids.shape[1]:].cpu()

    responses: list[list[int]] = [None] * len(contexts)
    dummy = lambda: gen(*left_pad([contexts[order[0]]], tok.pad_token_id), [0])  # noqa: E731  (discarded)
    with agent.procs.lockstep(agent.model, len(chunks), dummy):
        for sl in chunks:
            idx = order[sl]
            ids, mask = left_pad([contexts[i] for i in idx], tok.pad_token_id)  # [n, Lc]
            new = gen(ids, mask, [seeds[i] for i in idx])  # [n, <= max_new_tokens]
            for row, i in enumerate(idx):
                responses[i] = cut_at_eos(new[row].tolist(), tok.eos_token_id, tok.pad_token_id)
    return responses


# -- The backend seam ------------------------------------------------------------------------------------
class HFBackend:
    """Hugging Face sampling in the training process (``generate_hf``): sampling reads the training
    weights, so a promotion needs no sync and nothing sleeps. Stateless."""

    name = "hf"
    tensor_parallel = 1

    def generate(self, agent, contexts: list[list[int]], sampling: SamplingConfig, seeds: list[int]) -> list[list[int]]:
        return generate_hf(agent, contexts, sampling, seeds)

    def last_logprobs(self, agent) -> None: return None  # the sampler is the training model: nothing to compare
    def health(self, team: Team, batch: TeamBatch) -> None: return None
    def sync(self, agent) -> None: pass
    def release(self, agent) -> None: pass
    def sleep(self) -> None: pass
    def close(self) -> None: pass


HF = HFBackend()


# -- The joint rollout -----------------------------------------------------------------------------------
@torch.no_grad()
def behaviour_logprobs(agent, tensors: TurnTensors, sampling: SamplingConfig) -> torch.Tensor:
    """log pi(a_t | s_t) at the sampling temperature of one turn [N, Lr], 0 on padding: the training
    model's teacher-forced forward, one call per token-budget chunk. ``tensors``: the turn's
    ``TurnTensors`` or the same four tensors as a plain tuple."""
    tensors = TurnTensors(*tensors)
    calls = -(-len(tensors.context_ids) // turn_rows(tensors, sampling.token_budget))
    dummy = lambda: turn_forward(agent.model, tensors, slice(0, 1), sampling.temperature)  # noqa: E731
    with agent.procs.lockstep(agent.model, calls, dummy):
        return batched_response_logprobs(agent.model, tensors, sampling.temperature, sampling.token_budget)


def agent_turn(team: Team, k: int, contexts: list[list[int]], sampling: SamplingConfig, backend, score: bool,
               seed: int) -> Turn:
    """Agent k answers every context: one batched generate, row i under ``response_seeds(seed, .., k)[i]``,
    then (unless ``score=False``: evaluation needs no log-probabilities) the behaviour log-probabilities."""
    agent = team.agents[k]
    tok = agent.tokenizer
    responses = backend.generate(agent, contexts, sampling, response_seeds(seed, len(contexts), k))
    ctx, cmask = left_pad(contexts, tok.pad_token_id)  # [N, Lc]
    resp, rmask = right_pad(responses, tok.pad_token_id)  # [N, Lr]
    texts = tok.batch_decode(responses, skip_special_tokens=True)
    truncated = torch.tensor([tok.eos_token_id not in r for r in responses])  # [N]
    tensors = TurnTensors(ctx, cmask, resp, rmask)
    logp = behaviour_logprobs(agent, tensors, sampling) if score else torch.zeros(resp.shape)  # [N, Lr]
    agent.procs.release(agent.model)  # nothing kept gathered between turns
    return Turn(k, ctx, cmask, resp, rmask, logp, texts, [team.extract(t) for t in texts], truncated,
                backend.last_logprobs(agent))


def turn_contexts(team: Team, k: int, flat: list[Problem], turns: list[Turn]) -> list[list[int]]:
    """Agent k's context in every trajectory: the problem, and in the chain protocol the answers of
    agents 0..k-1 (``turns[:k]``) of the same trajectory."""
    if team.protocol == "chain":
        return [team.prompt_ids(k, p, [t.answers[i] for t in turns[:k]], [t.texts[i] for t in turns[:k]])
                for i, p in enumerate(flat)]
    return [team.prompt_ids(k, p, []) for p in flat]


def score_team(team: Team, flat: list[Problem], turns: list[Turn], group_ids: torch.Tensor):
    """(team answers, team rewards [N], each agent's own score [n_agents, N], counterfactual baselines
    [n_agents, N] or None) of the joint trajectories, all from the team's reward (``reward.score``)."""
    reward, protocol = team.config.reward, team.protocol
    answers = [[t.answers[i] for t in turns] for i in range(len(flat))]
    texts = [[t.texts[i] for t in turns] for i in range(len(flat))]
    rewards = torch.tensor(score(reward, flat, texts, answers, protocol))  # [N]
    own = agent_scores(reward, flat, texts, answers, protocol)  # [n_agents, N]
    counterfactual = (counterfactual_baselines(reward, flat, texts, answers, protocol, group_ids)
                      if protocol == "independent" else None)  # [n_agents, N]
    return [team.team_answer(a) for a in answers], rewards.float(), own, counterfactual


def rollout(team: Team, problems: list[Problem], group_size: int, sampling: SamplingConfig, backend=HF,
            score: bool = True, seed: int | None = None) -> TeamBatch:
    """G joint trajectories for each of the B problems (paper, Section 3); row b * G + g is sample g of
    problem b, agent k's response in it drawn under ``response_seeds(seed, N, k)`` (None: a seed drawn
    from torch's global generator). ``score=False`` leaves the behaviour log-probabilities at zero
    (evaluation)."""
    if group_size < 1:
        raise ValueError(f"--group-size must be >= 1 (got {group_size})")
    if score and sampling.top_p < 1:
        raise ValueError(TOP_P_TRAINING_ERROR.format(top_p=sampling.top_p))
    flat = [p for p in problems for _ in range(group_size)]  # [N]
    group_ids = torch.arange(len(problems)).repeat_interleave(group_size)  # [N]
    seed = draw_seed() if seed is None else seed
    if team.config.environment is not None:
        return episode_rollout(team, flat, group_ids, sampling, backend, score, seed)
    turns: list[Turn] = []
    for k in range(len(team)):
        turns.append(agent_turn(team, k, turn_contexts(team, k, flat, turns), sampling, backend, score, seed))
    return TeamBatch(flat, group_ids, turns, *score_team(team, flat, turns, group_ids))


def regenerate(team: Team, batch: TeamBatch, j: int, sampling: SamplingConfig, backend=HF,
               seed: int | None = None) -> tuple[TeamBatch, int]:
    """After agent j's promotion (Algorithm 1, line 12), redraw what depends on it, so the batch is
    exactly on-policy for pi_hat^i of Eq. (1) and needs no importance weights. Independent: agent j's
    turn only (the joint action is a product given the problem). Chain: agent j's turn and every turn
    after it (their contexts hold agent j's answer); earlier turns are draws of unchanged agents. With an
    environment, the whole episode (every later round reacts to agent j's turns); the unchanged agents'
    draws under the same seed repeat wherever their contexts do. Two
    calls with one ``seed`` (a step's before and after draws) share their random numbers row by row.
    Returns the new batch and how many responses were generated."""
    seed = draw_seed() if seed is None else seed
    if team.config.environment is not None:  # every later round reacts to agent j's turns: the whole episode
        new = episode_rollout(team, batch.problems, batch.group_ids, sampling, backend, True, seed)
        return new, new.responses
    turns = list(batch.turns)
    redo = range(j, len(team)) if team.protocol == "chain" else [j]
    for k in redo:
        turns[k] = agent_turn(team, k, turn_contexts(team, k, batch.problems, turns), sampling, backend, True, seed)
    new = TeamBatch(batch.problems, batch.group_ids, turns, *score_team(team, batch.problems, turns, batch.group_ids))
    return new, len(redo) * len(batch)


def concat_batches(parts: list[TeamBatch], pad_ids: list[int]) -> TeamBatch:
    """One TeamBatch from consecutive blocks: contexts re-padded on the left, responses on the right,
    group ids offset so groups stay distinct."""
    def pad_to(x, width, value, left):
        fill = x.new_full((x.shape[0], width - x.shape[1]), value)  # [n, width - L]
        return torch.cat([fill, x] if left else [x, fill], dim=1)  # [n, width]

    turns = []
    for k, pad in enumerate(pad_ids):
        ts = [p.turns[k] for p in parts]
        lc, lr = max(t.context_ids.shape[1] for t in ts), max(t.response_ids.shape[1] for t in ts)
        sampler = None if any(t.sampler_logprobs is None for t in ts) else [r for t in ts for r in t.sampler_logprobs]
        turns.append(Turn(k, torch.cat([pad_to(t.context_ids, lc, pad, True) for t in ts]),
                          torch.cat([pad_to(t.context_mask, lc, 0, True) for t in ts]),
                          torch.cat([pad_to(t.response_ids, lr, pad, False) for t in ts]),
                          torch.cat([pad_to(t.response_mask, lr, 0, False) for t in ts]),
                          torch.cat([pad_to(t.behaviour_logprobs, lr, 0.0, False) for t in ts]),
                          [x for t in ts for x in t.texts], [x for t in ts for x in t.answers],
                          torch.cat([t.truncated for t in ts]), sampler))
    offsets = torch.tensor([0] + [len(set(p.group_ids.tolist())) for p in parts]).cumsum(0)  # [n_parts + 1]
    counterfactual = (None if any(p.counterfactual is None for p in parts)  # per group; blocks hold whole groups
                      else torch.cat([p.counterfactual for p in parts], dim=1))
    return TeamBatch([x for p in parts for x in p.problems],
                     torch.cat([p.group_ids + offsets[i] for i, p in enumerate(parts)]), turns,
                     [x for p in parts for x in p.team_answers], torch.cat([p.rewards for p in parts]),
                     torch.cat([p.agent_correct for p in parts], dim=1), counterfactual)


# -- Episodes: agents that act, observe and act again (an environment's rounds) ----------------------------------
ENVIRONMENT = -1  # the speaker of an environment's observation in ``Episode.said``


@dataclass
class Episode:
    """One joint trajectory over rounds. The state at any token is the transcript so far (the brief's section
    12): each agent's view is its own chat, its turns as the assistant's, everything else (the opening
    observation, the other agents' turns, the environment's answers) as user turns, with token ids kept as
    they were sampled (never re-templated), so the rollout's contexts and the training forward read the same
    sequence."""

    problem: Problem  # the data row, as the environment's reset received it
    opening: Problem  # the same row with the opening observation as its problem text
    state: object  # the environment's object for this trajectory
    ids: list[list[int]]  # per agent: its first prompt, then every token of its view after it
    own: list[list[int]]  # per agent, after the prompt: 1 on its own sampled tokens, 0 on what others wrote
    prompt_len: list[int]  # per agent
    said: list[tuple[int, str]]  # (speaker, text) in order: an agent's index, or ENVIRONMENT
    seen: list[int]  # per agent: the entries of ``said`` already in its view
    ended_with_eos: list[bool]  # per agent: its last turn sampled the eos (else the template's close is added)
    truncated: list[bool]  # per agent: some turn hit --max-new-tokens
    rounds: int = 0
    done: bool = False


def start_episode(team: Team, problem: Problem) -> Episode:
    state, opening = team.config.environment.start(problem)
    n = len(team)
    return Episode(problem, Problem(problem.id, opening, problem.answer, problem.system, problem.columns), state,
                   [[] for _ in range(n)], [[] for _ in range(n)], [0] * n, [(ENVIRONMENT, opening)], [1] * n,
                   [True] * n, [False] * n)


def episode_context(team: Team, e: Episode, k: int) -> list[int]:
    """Agent k's context for its next turn. The first round: its prompt for the opening observation (chain: with
    the earlier agents' turns, as without an environment). Later rounds: its view so far, then one user turn with
    what it has not yet seen (chain: everything said since its last turn; independent: up to the environment's
    last observation, so agents of one round answer independently), rendered by its own chat template."""
    if e.rounds == 0:
        earlier = [text for speaker, text in e.said[1:]]  # chain: agents 0..k-1 of this round
        e.ids[k] = team.prompt_ids(k, e.opening, [team.extract(t) for t in earlier], earlier)
        e.prompt_len[k] = len(e.ids[k])
        e.seen[k] = len(e.said) if team.protocol == "chain" else 1  # independent: the opening only
        return e.ids[k]
    last_env = max(i for i, (speaker, _) in enumerate(e.said) if speaker == ENVIRONMENT)
    upto = len(e.said) if team.protocol == "chain" else last_env + 1
    entries = [(speaker, text) for speaker, text in e.said[e.seen[k]:upto] if speaker != k]
    delta = team.agents[k].continuation_ids(team.round_text(entries), e.ended_with_eos[k],
                                            team.config.enable_thinking)
    e.ids[k] += delta
    e.own[k] += [0] * len(delta)
    e.seen[k] = upto
    return e.ids[k]


def episode_rollout(team: Team, flat: list[Problem], group_ids: torch.Tensor, sampling: SamplingConfig, backend,
                    score: bool, seed: int) -> TeamBatch:
    """ROLLOUT over rounds: in each round every live episode's agents speak (in order; chain: each seeing the
    round so far), then the environment answers each episode or ends it; an episode still going after
    ``max_rounds`` ends there. Agent k's response in row i and round r is drawn under
    ``response_seeds(seed, N, k, r)[i]``. Then one teacher-forced forward per agent over its whole view gives
    the behaviour log-probabilities of its tokens in every round; the environment's and the other agents'
    tokens are context, masked out of the loss, the ratios, the KL and the value targets (``Turn.response_mask``
    is 1 on the agent's own tokens only)."""
    env, n = team.config.environment, len(team)
    episodes = [start_episode(team, p) for p in flat]
    for r in range(env.max_rounds):
        live = [i for i, e in enumerate(episodes) if not e.done]
        if not live:
            break
        for k in range(n):
            agent = team.agents[k]
            contexts = [episode_context(team, episodes[i], k) for i in live]
            seeds = response_seeds(seed, len(flat), k, r)
            for i, response in zip(live, backend.generate(agent, contexts, sampling, [seeds[i] for i in live])):
                speak(episodes[i], k, response, agent.tokenizer)
        for i in live:
            e = episodes[i]
            observation, done = env.step(e.state, e.problem, [text for _, text in e.said[-n:]])
            e.said.append((ENVIRONMENT, observation))
            e.rounds += 1
            e.done = done or e.rounds == env.max_rounds
    turns = [episode_turn(team, k, episodes, sampling, backend, score) for k in range(n)]
    return TeamBatch([e.problem for e in episodes], group_ids, turns,
                     *score_episodes(team, episodes, turns, group_ids),
                     transcripts=[transcript(e) for e in episodes], rounds=[e.rounds for e in episodes])


def speak(e: Episode, k: int, response: list[int], tokenizer) -> None:
    """Agent k's sampled turn: its tokens into its view (its own: mask 1), its text into the transcript."""
    e.ids[k] += response
    e.own[k] += [1] * len(response)
    e.ended_with_eos[k] = tokenizer.eos_token_id in response
    e.truncated[k] = e.truncated[k] or not e.ended_with_eos[k]
    e.said.append((k, tokenizer.decode(response, skip_special_tokens=True)))


def episode_turn(team: Team, k: int, episodes: list[Episode], sampling: SamplingConfig, backend, score: bool) -> Turn:
    """Agent k's tokens in every episode as one Turn: the first prompt as context, the rest of its view as the
    response, its mask 1 on the agent's own tokens only; texts and answers from its last turn."""
    agent = team.agents[k]
    pad = agent.tokenizer.pad_token_id
    ctx, cmask = left_pad([e.ids[k][: e.prompt_len[k]] for e in episodes], pad)  # [N, Lc]
    resp, _ = right_pad([e.ids[k][e.prompt_len[k]:] for e in episodes], pad)  # [N, Lr]
    own, _ = right_pad([e.own[k] for e in episodes], 0)  # [N, Lr] 1 on the agent's tokens
    tensors = TurnTensors(ctx, cmask, resp, own)
    logp = behaviour_logprobs(agent, tensors, sampling) if score else torch.zeros(resp.shape)  # [N, Lr]
    agent.procs.release(agent.model)
    texts = [next(text for speaker, text in reversed(e.said) if speaker == k) for e in episodes]
    return Turn(k, ctx, cmask, resp, own, logp, texts, [team.extract(t) for t in texts],
                torch.tensor([e.truncated[k] for e in episodes]), None)


def score_episodes(team: Team, episodes: list[Episode], turns: list[Turn], group_ids: torch.Tensor):
    """``score_team`` for episodes: the team reward R through ``reward.score`` with the environment's reward
    (``env_reward``) and the whole ``transcript`` among the columns. No agent's share of an episode can be
    swapped out of it, so each agent's own score is the team's and there is no counterfactual baseline."""
    env, reward, protocol = team.config.environment, team.config.reward, team.protocol
    extra = {"env_reward": [env.reward(e.state, e.problem) for e in episodes],
             "transcript": [transcript(e) for e in episodes]}
    answers = [[t.answers[i] for t in turns] for i in range(len(episodes))]
    texts = [[t.texts[i] for t in turns] for i in range(len(episodes))]
    rewards = torch.tensor(score(reward, [e.opening for e in episodes], texts, answers, protocol, extra)).float()
    return [team.team_answer(a) for a in answers], rewards, rewards.expand(len(turns), -1).clone(), None


def transcript(e: Episode) -> str:
    """The episode as text: the opening observation, then every turn, named."""
    return "\n\n".join(f"{'Environment' if s == ENVIRONMENT else f'Agent {s + 1}'}: {text}" for s, text in e.said)
