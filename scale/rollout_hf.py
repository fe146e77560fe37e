"""The Hugging Face rollout backend: ROLLOUT's sampler in the training process, the tempered softmax only.

``rollout.agent_turn`` asks a backend for one response per context, each under a seed of its own
(``rollout.response_seeds``). ``HFBackend`` answers with the training model itself: ``SeededSampler`` draws every
token by inverse-CDF sampling on a uniform that depends on the response's seed and the position alone (common
random numbers, exact draws), ``decode`` forwards only the rows not yet ended through a KV cache of its own, and
``generate_hf`` falls back on HF ``generate`` where a model's forwards are collectives or its cache cannot drop
rows. ``sampler_config`` and ``check_sampler`` keep every logits processor a checkpoint ships neutral, so the
distribution sampled is the one the behaviour log-probabilities assume.
``scale.rollout_vllm.make_backend`` picks this backend (``HF``) or the vLLM engines once per run; the entry point
hands it to ``sat`` and ``rollout``, which never import it.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from logprobs import chunks_by_budget, cut_at_eos, left_pad
from rollout import SamplingConfig, TeamBatch
from team import Team

# -- The seeded sampler: one uniform per (seed, position) ------------------------------------------------
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's constants


def _int64(x: int) -> int:
    """x modulo 2**64 as a signed int64 (torch's int64 arithmetic wraps the same way)."""
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


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
    that noise, drawn over the whole vocabulary at every step, costs more than this whole draw
    (docs/results.md, "The HF sampler's costs"). The search runs in two levels (blocks of ``BLOCK`` tokens,
    then within the block), so the cumulative sums in float64 touch one block per row rather than the
    whole vocabulary."""

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
                               "scale.rollout_hf.sampler_config")
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
                           "tempered softmax; neutralise its field in scale.rollout_hf.sampler_config")


@torch.no_grad()
def decode(model, ids: torch.Tensor, mask: torch.Tensor, sampler: SeededSampler, max_new_tokens: int,
           eos_id: int, pad_id: int) -> torch.Tensor:  # ids, mask [n, Lc] left-padded -> [n, <= max_new_tokens]
    """Sampling with a KV cache, each step forwarding only the rows not yet ended, where HF ``generate``
    forwards every row until the batch's last ends, so most of its late row-steps are spent on ended rows
    (docs/results.md, "The HF sampler's costs"; ``bench/backends.py --backends hf-generate,hf`` times the
    two). A row's draws are its own
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
                responses[i] = cut_at_eos(new[row].tolist(), tok.eos_token_id)
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
