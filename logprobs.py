"""Teacher-forced log-probabilities: the one forward path every ratio uses.

Paper, Section 4 (Algorithm 1): the importance ratio r_j of Eq. (objective)
and the truncated weights c_t = min(1, rho_t) are ratios of per-token
probabilities of the same sampled tokens, and the trust region bounds the
exact per-state KL(pi_j(.|s) || pi_j,cur(.|s)). This module holds the forward
that computes those quantities from a Hugging Face causal LM, below both
rollout backends (``rollout.py`` and ``rollout_vllm.py``) and the update
(``update.py``):

- padding helpers (left-padded contexts, right-padded responses) and the
  position ids that skip left padding, exactly as ``generate`` computes them;
- ``response_hidden_states`` + ``token_logprobs_from_hidden``: log pi(a_t|s_t)
  of the sampled tokens at the sampling temperature, the LM head applied in
  chunks so [N, L, V] logits never exist at once;
- ``measure_kl``: the exact per-state KL over the whole vocabulary at every
  position of an agent's responses, plus the new log-probabilities of the
  sampled tokens, from one forward of each model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import distributed
from trust_region import per_state_kl


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


def cut_at_eos(tokens: list[int], eos_id: int, pad_id: int) -> list[int]:
    """Keep tokens up to and including the first eos (the eos is an action
    too: its probability is part of the policy's likelihood)."""
    if eos_id in tokens:
        return tokens[: tokens.index(eos_id) + 1]
    # no eos: truncated by max_new_tokens; strip trailing pads only if pad != eos
    while tokens and tokens[-1] == pad_id and pad_id != eos_id:
        tokens = tokens[:-1]
    return tokens


# ---------------------------------------------------------------------------
# Teacher-forced log-probabilities (behaviour, training and KL all use these)
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


@torch.no_grad()
def measure_kl(agent, reference, turn, temperature: float, token_budget: int):
    """Exact per-state KL(pi_j(.|s) || pi_j,cur(.|s)) at every position of agent
    j's responses, and the new log-probabilities of the sampled tokens, from
    one forward of each model (paper, Section 3: the per-state KL; exact, not a sampled proxy).
    Returns (per_state_kl [M], new_logprobs [N, Lr])."""
    model, device = agent.model, agent.device
    width = turn.context_ids.shape[1] + turn.response_ids.shape[1]
    rows = max(1, token_budget // width)
    kls, new_logp = [], torch.zeros_like(turn.behaviour_logprobs)  # [N, Lr]
    lo, hi = distributed.row_range(len(turn.texts))  # under torchrun: this rank's rows; gathered below
    for s in range(lo, hi, rows):
        sl = slice(s, min(s + rows, hi))
        args = [t[sl].to(device) for t in (turn.context_ids, turn.context_mask, turn.response_ids, turn.response_mask)]
        mask = args[3].bool()  # [b, Lr]
        h_new = response_hidden_states(model, *args)[mask]  # [M_b, H] valid positions only
        h_cur = response_hidden_states(reference, *args)[mask]  # [M_b, H]
        head_new, head_cur = model.get_output_embeddings(), reference.get_output_embeddings()
        targets = args[2][mask]  # [M_b]
        lp_rows = []
        for c in range(0, h_new.shape[0], 1024):  # chunk rows: [1024, V] logits at a time
            logits_new = head_new(h_new[c : c + 1024]).float()  # [c, V]
            kls.append(per_state_kl(logits_new, head_cur(h_cur[c : c + 1024]).float(), temperature=temperature).cpu())
            lp = F.log_softmax(logits_new / temperature, -1).gather(-1, targets[c : c + 1024, None]).squeeze(-1)
            lp_rows.append(lp.cpu())
        block = torch.zeros(mask.shape)  # [b, Lr]
        block[mask.cpu()] = torch.cat(lp_rows) if lp_rows else torch.zeros(0)
        new_logp[sl] = block
    kl = torch.cat(kls) if kls else torch.zeros(0)
    if distributed.active():  # rows are contiguous per rank: rank order is row order
        kl, new_logp = torch.cat(distributed.gather_objects(kl)), distributed.sum_ranks(new_logp)
    return kl, new_logp
