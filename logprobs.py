"""Teacher-forced log-probabilities: the one forward every ratio uses.

Paper, Section 5 (Algorithm 1): the importance ratio r_j of the surrogate L_i (Section 3) in its practical
form, Eq. (5) of Section 5, the truncated weights c_t = min(1, rho_t) and the trust region's exact per-state
KL(pi_j(.|s) || pi_j,cur(.|s)) (Section 3) are all computed from the same teacher-forced forward of a
Hugging Face causal LM:

- masked sums and means over response positions, and the cap on a log-ratio before ``exp``;
- padding helpers (left-padded contexts, right-padded responses) and the position ids that skip
  left padding, exactly as ``generate`` computes them;
- ``response_hidden_states`` + ``token_logprobs_from_hidden``: log pi(a_t|s_t) of the sampled tokens
  at the sampling temperature, the LM head and the log-softmax in fp32 (``head_logits``), applied
  in chunks so [N, L, V] logits never exist at once;
- ``TurnTensors``: a turn's context and response ids and masks, what every forward of a turn reads;
- ``turn_forward``: the forward of rows of a turn at the turn's full width (behaviour, training,
  KL and log rho all call it);
- ``measure_kl``: the exact per-state KL over the whole vocabulary at every position of an agent's
  responses, the new log-probabilities and log rho, from one forward of each model.
"""
from __future__ import annotations

from itertools import chain
from typing import NamedTuple

import torch
import torch.nn.functional as F

from trust_region import per_state_kl

# Positions (rows x columns) through the LM head at once: a [n, c, V] fp32 logits block of
# 4096 x 151936 x 4 B = 2.5 GB for Qwen3 (scale/memory.py sizes the peak from the same numbers).
LOGITS_CHUNK_TOKENS = 4096
# A chunk's fp32 logits above this are recomputed in the backward pass instead of kept (Qwen3: 2.5 GB
# a chunk); a tiny agent's (0.2 MB) are kept: recomputing them costs time and saves no memory that matters
# (docs/results.md, "LM-head checkpointing").
HEAD_CHECKPOINT_BYTES = 64 << 20
KL_CHUNK_POSITIONS = 1024  # positions of two [c, V] fp32 logits blocks in one exact-KL call
# The cap on a log-ratio log r_j of agent j (a token's, or its response's) before exp: e^20 ~ 4.9e8, far beyond
# any ratio the clip keeps (1 + eps), and far below float32's overflow at e^88.7.
LOG_RATIO_CAP = 20.0


# -- Masked reductions over response positions ---------------------------------------------------------------------
def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of x over entries where mask is true (padding may hold nan/inf: it is never read)."""
    kept = torch.where(mask.bool(), x, torch.zeros_like(x))  # [...]
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over entries where mask is true; 0 where nothing is selected (not nan),
    so an empty row (e.g. an agent that produced no tokens) drops out of a loss quietly."""
    total = masked_sum(x, mask, dim)
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    return total / count.clamp_min(1).to(total.dtype)


# -- Padding helpers -----------------------------------------------------------------------------------------------
def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.long)  # [N]
    width = int(lens.max())
    mask = (torch.arange(width) >= (width - lens)[:, None]).long()  # [N, L]
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # [N, L]
    ids[mask.bool()] = torch.tensor(list(chain.from_iterable(seqs)), dtype=torch.long)  # row-major
    return ids, mask


def right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.long)  # [N]
    width = max(1, int(lens.max()))
    mask = (torch.arange(width) < lens[:, None]).long()  # [N, L]
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # [N, L]
    ids[mask.bool()] = torch.tensor(list(chain.from_iterable(seqs)), dtype=torch.long)  # row-major
    return ids, mask


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, exactly as ``generate`` computes them."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)  # [N, L]


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


def cut_at_eos(tokens: list[int], eos_id: int) -> list[int]:
    """Keep tokens up to and including the first eos (the eos is an action too: its probability is
    part of the policy's likelihood); what a sampler writes after it is padding. A response without eos
    (truncated by max_new_tokens) keeps every id: each was sampled, a pad id too where pad != eos (the tiny
    tokenizer's pad; Qwen's <|endoftext|> beside its eos <|im_end|>), and each is a factor of the ratio and
    the KL."""
    return tokens[: tokens.index(eos_id) + 1] if eos_id in tokens else list(tokens)


# -- Teacher-forced log-probabilities ------------------------------------------------------------------------------
def response_hidden_states(model, context_ids, context_mask, response_ids, response_mask) -> torch.Tensor:
    """Final hidden states at the positions that predict each response token: position Lc - 1 + t
    predicts response token t. Hidden states only, so the caller applies the LM head in chunks.
    ``response_mask`` marks the agent's own tokens; every response token up to the row's last one is attended
    to (an episode's response holds what the environment and the other agents wrote, at mask 0, between the
    agent's turns; without rounds the two masks are the same prefix)."""
    present = response_mask.flip(-1).cummax(-1).values.flip(-1)  # [N, Lr] 1 up to the last own token
    input_ids = torch.cat([context_ids, response_ids], dim=1)  # [N, Lc+Lr]
    attention_mask = torch.cat([context_mask, present], dim=1)  # [N, Lc+Lr]
    out = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids_from_mask(attention_mask))
    lc, lr = context_ids.shape[1], response_ids.shape[1]
    return out.last_hidden_state[:, lc - 1 : lc - 1 + lr]  # [N, Lr, H]


def head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logits of the LM head (hidden states and head weight cast to fp32 first): a bf16 matmul
    would round every logit to 8 significant bits (~0.03 on a logit of 10, i.e. on the log-prob
    itself), and the ratios, weights and KL are differences of log-probs. [..., H] -> [..., V]

    One 2-D matmul over the positions, whatever the layout: on a strided [n, c, H] slice F.linear
    falls back to matmul, which picks its kernel by whether the weight requires grad (even under
    no_grad), so the agent being trained would round its logits unlike the frozen agent that scored
    the rollout (4.8e-7 in a log-prob, measured)."""
    head = model.get_output_embeddings()
    bias = head.bias.float() if getattr(head, "bias", None) is not None else None
    flat = hidden.float().reshape(-1, hidden.shape[-1])  # [n * c, H]
    return F.linear(flat, head.weight.float(), bias).reshape(*hidden.shape[:-1], head.weight.shape[0])  # [..., V]


def head_chunk_positions(rows: int, chunk_tokens: int = LOGITS_CHUNK_TOKENS) -> int:
    """Positions of every row in one LM-head chunk: at least one."""
    return max(1, chunk_tokens // max(rows, 1))


def _head_chunks(hidden, chunk_tokens: int) -> list[slice]:
    """Position slices covering about ``chunk_tokens`` (rows x columns) each."""
    n, length, _ = hidden.shape
    chunk = head_chunk_positions(n, chunk_tokens)
    return [slice(s, s + chunk) for s in range(0, length, chunk)]


def token_logprobs_from_hidden(model, hidden, targets, temperature: float,
                               chunk_tokens: int = LOGITS_CHUNK_TOKENS) -> torch.Tensor:
    """log softmax(lm_head(h) / T)[target] in fp32, about ``chunk_tokens`` positions at a time. With
    gradients, a chunk whose logits exceed HEAD_CHECKPOINT_BYTES is recomputed in the backward pass
    (checkpointing): the same gradients bit for bit, only the hidden states kept. [n, Lr]"""

    def piece(h, y):
        logits = head_logits(model, h) / temperature  # [n, c, V] fp32
        return torch.gather(F.log_softmax(logits, dim=-1), -1, y.unsqueeze(-1)).squeeze(-1)  # [n, c]

    vocab = model.get_output_embeddings().weight.shape[0]
    parts = []
    for sl in _head_chunks(hidden, chunk_tokens):
        h, y = hidden[:, sl], targets[:, sl]
        big = h.shape[0] * h.shape[1] * vocab * 4 > HEAD_CHECKPOINT_BYTES
        if big and torch.is_grad_enabled() and h.requires_grad:
            parts.append(torch.utils.checkpoint.checkpoint(piece, h, y, use_reentrant=False))
        else:
            parts.append(piece(h, y))
    return torch.cat(parts, dim=1)  # [n, Lr]


# -- The forward of a turn's rows at the turn's full width ---------------------------------------------------------
# Behaviour log-probs, the training forward and the KL measurement all run rows of the SAME
# [N, Lc] + [N, Lr] tensors stored in the Turn, never re-padded or trimmed per chunk: in bf16 a row's
# result depends on how much padding shares its batch (5e-3 in a log-prob after 5 extra padding
# columns, measured on CPU), while different rows at the same width give bit-identical results. So
# the ratio is exactly 1 before the first step, and log rho of an agent that did not move is exactly 0.
class TurnTensors(NamedTuple):
    """The tensors of one agent's turn in N joint trajectories that a teacher-forced forward reads. A
    tuple, so ``ctx, cmask, resp, rmask = tensors`` unpacks it; the functions below take any
    (ctx, cmask, resp, rmask) sequence and read it through this class."""

    context_ids: torch.Tensor  # [N, Lc] left-padded
    context_mask: torch.Tensor  # [N, Lc] 1 on context tokens
    response_ids: torch.Tensor  # [N, Lr] right-padded
    response_mask: torch.Tensor  # [N, Lr] 1 on response tokens

    def rows(self, idx, device=None) -> TurnTensors:
        """Rows ``idx`` (a slice or an index tensor) of every tensor, on ``device`` when given. [b, ...]"""
        return TurnTensors(*(t[idx] if device is None else t[idx].to(device) for t in self))


def turn_rows(tensors: TurnTensors, token_budget: int) -> int:
    """Rows per forward chunk so that rows x (Lc + Lr) fits the token budget."""
    tensors = TurnTensors(*tensors)
    return max(1, token_budget // (tensors.context_ids.shape[1] + tensors.response_ids.shape[1]))


def turn_forward(model, tensors: TurnTensors, idx, temperature: float):
    """(log pi(a_t|s_t) [b, Lr] fp32 at ``temperature``, 0 on padding; final hidden states
    [b, Lr, H]) of rows ``idx`` of a turn (``TurnTensors``). What every ratio reads: the behaviour
    log-probs of Algorithm 1, the sequence log-ratio of Eqs. (3)-(5) (Section 5) and the per-state KL
    (Section 3)."""
    part = TurnTensors(*tensors).rows(idx, next(model.parameters()).device)  # [b, Lc] and [b, Lr] tensors
    hidden = response_hidden_states(model, *part)  # [b, Lr, H]
    logp = token_logprobs_from_hidden(model, hidden, part.response_ids, temperature)  # [b, Lr]
    return logp * part.response_mask, hidden  # [b, Lr], [b, Lr, H]


@torch.no_grad()
def batched_response_logprobs(model, tensors: TurnTensors, temperature: float, token_budget: int) -> torch.Tensor:
    """``turn_forward`` over all rows of a turn (``TurnTensors``) in chunks that fit the token budget
    (the behaviour log-probs of a rollout). [N, Lr] fp32 on the host."""
    tensors = TurnTensors(*tensors)
    rows = turn_rows(tensors, token_budget)
    out = torch.zeros(tensors.response_ids.shape, dtype=torch.float32)  # [N, Lr]
    for s in range(0, out.shape[0], rows):
        out[s : s + rows] = turn_forward(model, tensors, slice(s, s + rows), temperature)[0].cpu()
    return out


@torch.no_grad()
def measure_kl(agent, reference, turn, temperature: float, token_budget: int):
    """(per-state KL [M], new log-probs [N, Lr], log rho [N, Lr]) of agent j against its reference
    pi_j,cur on the turn, from one forward of each model. The KL is exact over the whole vocabulary
    at every position of the agent's responses (Section 3, not a sampled proxy); log rho =
    log pi_new - log pi_cur of the sampled tokens, exactly 0 where the agent did not move, is what
    the later agents' truncated weights are built from (``advantage.truncated_log_weights``). Each process
    (``agent.procs``) measures its rows and the results are gathered."""
    model = agent.model
    tensors = turn.tensors
    rows = turn_rows(tensors, token_budget)
    kls = []
    new_logp, cur_logp = torch.zeros(turn.response_ids.shape), torch.zeros(turn.response_ids.shape)  # [N, Lr]
    lo, hi = agent.procs.rows(len(turn.texts))  # this process's rows (all of them on one process); gathered below
    for s in range(lo, hi, rows):
        sl = slice(s, min(s + rows, hi))
        lp_new, h_new = turn_forward(model, tensors, sl, temperature)  # [b, Lr], [b, Lr, H]
        lp_cur, h_cur = turn_forward(reference, tensors, sl, temperature)  # [b, Lr], [b, Lr, H]
        new_logp[sl], cur_logp[sl] = lp_new.cpu(), lp_cur.cpu()
        mask = turn.response_mask[sl].bool()  # [b, Lr]
        h_new, h_cur = h_new[mask.to(h_new.device)], h_cur[mask.to(h_cur.device)]  # [M_b, H] valid positions
        for c in range(0, h_new.shape[0], KL_CHUNK_POSITIONS):
            new_logits = head_logits(model, h_new[c : c + KL_CHUNK_POSITIONS])  # [<=1024, V] fp32
            cur_logits = head_logits(reference, h_cur[c : c + KL_CHUNK_POSITIONS])  # [<=1024, V] fp32
            kls.append(per_state_kl(new_logits, cur_logits, temperature=temperature).cpu())
    kl = torch.cat(agent.procs.gather(torch.cat(kls) if kls else torch.zeros(0)))  # [M] rows contiguous per process
    new_logp, cur_logp = agent.procs.sum(new_logp), agent.procs.sum(cur_logp)  # [N, Lr] zeros off this one's rows
    return kl, new_logp, (new_logp - cur_logp) * turn.response_mask
