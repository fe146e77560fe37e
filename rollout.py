"""Joint-trajectory generation: the team answers B problems G times each.

``rollout(team, problems, group_size, sampling)`` returns a ``TeamBatch``:
N = B * G joint trajectories; per trajectory its group id (= problem index),
per agent turn the context ids, response ids and mask, behaviour
log-probabilities, the extracted answers, the team answer and the team reward
(1 if the team answer is right, else 0, shared by every agent's tokens).

Batched, never one sample at a time: each agent turn is one left-padded
``generate`` call over all N contexts (chunked by a token budget), and the
behaviour log-probabilities come from one batched teacher-forced forward of
the same model at the sampling temperature. Using the training model's own
forward for the behaviour log-probabilities (rather than the sampler's) keeps
sampler numerics out of the importance ratios, and it is what the vLLM
backend must do too.

Sampling is plain temperature (top_k disabled) with optional top_p. Note:
with top_p < 1 the sampler draws from a truncated distribution while the
log-probabilities are those of the untruncated tempered softmax (as in most
RL-for-LLM libraries); the paper's setting is top_p = 1.0, where they agree.

    python bench/rollout.py          # batched vs one-at-a-time, tokens/s
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tasks import Problem, answers_match
from team import Team

BACKENDS = ("hf", "vllm")


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

    def __len__(self) -> int:
        return len(self.problems)

    @property
    def num_tokens(self) -> int:
        return sum(t.num_tokens for t in self.turns)


# ---------------------------------------------------------------------------
# Padding helpers
# ---------------------------------------------------------------------------
def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # [N, L]
    mask = torch.zeros((len(seqs), width), dtype=torch.long)  # [N, L]
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s)
            mask[i, width - len(s):] = 1
    return ids, mask


def right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # [N, L]
    mask = torch.zeros((len(seqs), width), dtype=torch.long)  # [N, L]
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, exactly as ``generate`` computes them."""
    pos = mask.long().cumsum(-1) - 1  # [N, L]
    return pos.clamp(min=0)


def chunks_by_budget(lengths: list[int], budget: int) -> list[slice]:
    """Consecutive slices whose padded size (rows x longest row) fits the budget."""
    out, start, longest = [], 0, 0
    for i, n in enumerate(lengths):
        new_longest = max(longest, n)
        if i > start and (i - start + 1) * new_longest > budget:
            out.append(slice(start, i))
            start, new_longest = i, n
        longest = new_longest
    out.append(slice(start, len(lengths)))
    return out


# ---------------------------------------------------------------------------
# Teacher-forced log-probabilities (used by rollout and by training)
# ---------------------------------------------------------------------------
def response_hidden_states(model, context_ids, context_mask, response_ids, response_mask) -> torch.Tensor:
    """Final hidden states at the positions that predict each response token.

    Position Lc - 1 + t predicts response token t, so we return
    hidden[:, Lc-1 : Lc-1+Lr]. Only hidden states are returned: the caller
    applies the LM head in chunks, so [N, Lr, V] logits never exist at once.
    """
    input_ids = torch.cat([context_ids, response_ids], dim=1)  # [N, Lc+Lr]
    attention_mask = torch.cat([context_mask, response_mask], dim=1)  # [N, Lc+Lr]
    position_ids = position_ids_from_mask(attention_mask)  # [N, Lc+Lr]
    out = model.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    lc, lr = context_ids.shape[1], response_ids.shape[1]
    return out.last_hidden_state[:, lc - 1 : lc - 1 + lr]  # [N, Lr, H]


def token_logprobs_from_hidden(model, hidden, targets, temperature: float, chunk_tokens: int = 4096) -> torch.Tensor:
    """log softmax(lm_head(h)/T)[target], the LM head applied to about
    ``chunk_tokens`` positions (rows x columns) at a time, so a [n, c, V]
    logits block stays small (4096 x 151936 x 4 B = 2.5 GB for Qwen3). With
    gradients on, each chunk is recomputed in the backward pass
    (checkpointing), so only the hidden states are kept."""
    head = model.get_output_embeddings()
    n, length, _ = hidden.shape
    chunk = max(1, chunk_tokens // max(n, 1))  # positions per chunk

    def piece(h, y):
        logits = head(h).float() / temperature  # [n, c, V]
        return torch.gather(F.log_softmax(logits, dim=-1), -1, y.unsqueeze(-1)).squeeze(-1)  # [n, c]

    parts = []
    for s in range(0, length, chunk):
        h, y = hidden[:, s : s + chunk], targets[:, s : s + chunk]
        if torch.is_grad_enabled() and h.requires_grad:
            parts.append(torch.utils.checkpoint.checkpoint(piece, h, y, use_reentrant=False))
        else:
            parts.append(piece(h, y))
    return torch.cat(parts, dim=1)  # [n, Lr]


def response_logprobs(model, context_ids, context_mask, response_ids, response_mask, temperature: float) -> torch.Tensor:
    """log pi(response_t | context, response_<t) at ``temperature``, 0 on padding. [N, Lr]"""
    device = next(model.parameters()).device
    args = [t.to(device) for t in (context_ids, context_mask, response_ids, response_mask)]
    hidden = response_hidden_states(model, *args)  # [N, Lr, H]
    logp = token_logprobs_from_hidden(model, hidden, args[2], temperature)  # [N, Lr]
    return logp * args[3]


@torch.no_grad()
def batched_response_logprobs(model, turn_like, temperature: float, token_budget: int) -> torch.Tensor:
    """``response_logprobs`` over all rows, in chunks that fit the token budget."""
    ctx, cmask, resp, rmask = turn_like
    width = ctx.shape[1] + resp.shape[1]
    rows = max(1, token_budget // width)
    out = torch.zeros(resp.shape, dtype=torch.float32)  # [N, Lr]
    for s in range(0, resp.shape[0], rows):
        sl = slice(s, s + rows)
        # trim padding columns shared by the whole chunk: cheaper and exact
        c_keep = cmask[sl].any(0).nonzero()
        r_len = int(rmask[sl].sum(1).max())
        c0 = int(c_keep[0]) if len(c_keep) else ctx.shape[1] - 1
        lp = response_logprobs(model, ctx[sl, c0:], cmask[sl, c0:], resp[sl, : max(r_len, 1)], rmask[sl, : max(r_len, 1)], temperature)
        out[sl, : lp.shape[1]] = lp.float().cpu()
    return out


# ---------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------
@torch.no_grad()
def generate_hf(agent, contexts: list[list[int]], sampling: SamplingConfig) -> list[list[int]]:
    """Sample one response per context with Hugging Face ``generate``, batched.

    An explicit GenerationConfig replaces the checkpoint's own defaults
    (Qwen3 ships top_k=20, temperature=0.6): the behaviour log-probabilities
    assume plain tempered sampling, so nothing else may shape the distribution.
    """
    from transformers import GenerationConfig

    tok = agent.tokenizer
    gen_cfg = GenerationConfig(
        do_sample=True,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=0,
        max_new_tokens=sampling.max_new_tokens,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    # Sort by length so each chunk pads little; restore the order afterwards.
    order = sorted(range(len(contexts)), key=lambda i: len(contexts[i]))
    widths = [len(contexts[i]) + sampling.max_new_tokens for i in order]
    responses: list[list[int]] = [None] * len(contexts)
    for sl in chunks_by_budget(widths, sampling.token_budget):
        idx = order[sl]
        ids, mask = left_pad([contexts[i] for i in idx], tok.pad_token_id)
        out = agent.model.generate(input_ids=ids.to(agent.device), attention_mask=mask.to(agent.device), generation_config=gen_cfg)
        new = out[:, ids.shape[1]:].cpu()  # [n, <=max_new]
        for row, i in enumerate(idx):
            responses[i] = cut_at_eos(new[row].tolist(), tok.eos_token_id, tok.pad_token_id)
    return responses


def cut_at_eos(tokens: list[int], eos_id: int, pad_id: int) -> list[int]:
    """Keep tokens up to and including the first eos (the eos is an action
    too: its probability is part of the policy's likelihood)."""
    if eos_id in tokens:
        return tokens[: tokens.index(eos_id) + 1]
    # no eos: truncated by max_new_tokens; strip trailing pads only if pad != eos
    while tokens and tokens[-1] == pad_id and pad_id != eos_id:
        tokens = tokens[:-1]
    return tokens


def generate(agent, contexts: list[list[int]], sampling: SamplingConfig) -> list[list[int]]:
    if sampling.backend == "vllm":
        import rollout_vllm  # lazy: an optional GPU extra

        return rollout_vllm.generate_vllm(agent, contexts, sampling)
    return generate_hf(agent, contexts, sampling)


# ---------------------------------------------------------------------------
# The joint rollout
# ---------------------------------------------------------------------------
def agent_turn(team: Team, k: int, contexts: list[list[int]], sampling: SamplingConfig, score: bool = True) -> Turn:
    """Agent k answers every context: one batched generate, one batched scoring
    (skipped with ``score=False``: evaluation needs no log-probabilities)."""
    agent = team.agents[k]
    tok = agent.tokenizer
    responses = generate(agent, contexts, sampling)
    ctx, cmask = left_pad(contexts, tok.pad_token_id)  # [N, Lc]
    resp, rmask = right_pad(responses, tok.pad_token_id)  # [N, Lr]
    if score:
        logp = batched_response_logprobs(agent.model, (ctx, cmask, resp, rmask), sampling.temperature, sampling.token_budget)
    else:
        logp = torch.zeros(resp.shape)  # [N, Lr]
    texts = tok.batch_decode([r for r in responses], skip_special_tokens=True)
    truncated = torch.tensor([tok.eos_token_id not in r for r in responses])
    return Turn(k, ctx, cmask, resp, rmask, logp, texts, [team.extract(t) for t in texts], truncated)


def rollout(team: Team, problems: list[Problem], group_size: int, sampling: SamplingConfig, score: bool = True) -> TeamBatch:
    """G joint trajectories for each of the B problems (SAT.md section 2).
    ``score=False`` skips the behaviour log-probabilities (left as zeros)."""
    if group_size < 1:
        raise ValueError(f"--group-size must be >= 1 (got {group_size})")
    flat = [p for p in problems for _ in range(group_size)]  # [N]
    group_ids = torch.arange(len(problems)).repeat_interleave(group_size)  # [N]
    turns: list[Turn] = []
    for k in range(len(team)):
        # independent: every agent sees only the problem; chain: also the earlier answers
        previous = [[t.answers[i] for t in turns] for i in range(len(flat))] if team.protocol == "chain" else [[] for _ in flat]
        contexts = [team.prompt_ids(k, p, prev) for p, prev in zip(flat, previous)]
        turns.append(agent_turn(team, k, contexts, sampling, score))
    team_answers = [team.team_answer([t.answers[i] for t in turns]) for i in range(len(flat))]
    rewards = torch.tensor([float(answers_match(a, p.answer)) for a, p in zip(team_answers, flat)])  # [N]
    agent_correct = torch.tensor([[float(answers_match(t.answers[i], p.answer)) for i, p in enumerate(flat)] for t in turns])
    return TeamBatch(flat, group_ids, turns, team_answers, rewards, agent_correct)
