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
  of the sampled tokens at the sampling temperature, the LM head and the
  log-softmax in fp32 (``head_logits``), applied in chunks so [N, L, V]
  logits never exist at once;
- ``turn_forward``: the one forward of a turn's rows at the turn's full width
  that behaviour, training, KL and log rho all use (see the note above it),
  by default with each distinct context of its rows computed once
  (``shared_prefix_hidden_states``: a group's G rows share one prompt) in
  the turns where that computes fewer tokens (``prefix_sharing_pays``);
- ``measure_kl``: the exact per-state KL over the whole vocabulary at every
  position of an agent's responses, plus the new log-probabilities of the
  sampled tokens, from one forward of each model.
"""
from __future__ import annotations

import weakref
from itertools import chain

import torch
import torch.nn.functional as F

from scale import distributed
from scale.memory import LOGITS_CHUNK_TOKENS, head_chunk_positions
from trust_region import per_state_kl


# ---------------------------------------------------------------------------
# Padding helpers
# ---------------------------------------------------------------------------
def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.long)  # [N]
    width = int(lens.max())
    mask = (torch.arange(width) >= (width - lens)[:, None]).long()  # [N, L]
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # [N, L]
    ids[mask.bool()] = torch.tensor(list(chain.from_iterable(seqs)), dtype=torch.long)  # row-major: each row's tokens in order
    return ids, mask


def right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.long)  # [N]
    width = max(1, int(lens.max()))
    mask = (torch.arange(width) < lens[:, None]).long()  # [N, L]
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # [N, L]
    ids[mask.bool()] = torch.tensor(list(chain.from_iterable(seqs)), dtype=torch.long)  # row-major: each row's tokens in order
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


def distinct_rows(*tensors: torch.Tensor) -> tuple:
    """(the distinct rows of ``tensors`` taken together, split back into
    their widths [u, ...] each, row -> distinct index [N]): rows equal in
    every one of the tensors are one."""
    rows, inverse = torch.unique(torch.cat(tensors, dim=1), dim=0, return_inverse=True)  # [u, sum of widths], [N]
    return (*torch.split(rows, [t.shape[1] for t in tensors], dim=1), inverse)


def distinct_contexts(context_ids, context_mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(distinct context rows [u, Lc], their masks [u, Lc], row -> distinct index [N]):
    rows with the same tokens AND mask are one context (in the independent
    protocol a group's G rows share one prompt, Eq. (2)'s group)."""
    return distinct_rows(context_ids, context_mask)


# CPU matmul kernels round a row differently when a call has few tokens (rows x
# positions; measured with torch 2.13: an [M, K] x [K, O] matmul for M <= 15 in
# fp32, M <= 127 in bf16, K up to 2048): each shared-prefix call is padded with
# copies of its first row to at least MIN_CALL_TOKENS, so a row never depends
# on how few rows (or distinct contexts) share its call.
MIN_CALL_TOKENS = 128


def min_call_rows(width: int) -> int:
    """Rows of ``width`` tokens that make a call of at least MIN_CALL_TOKENS."""
    return -(-MIN_CALL_TOKENS // max(width, 1))


def padded_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` [n, ...] with copies of its row 0 appended up to MIN_CALL_TOKENS / width rows."""
    extra = max(0, min_call_rows(width) - t.shape[0])
    return torch.cat([t, t[:1].expand(extra, *t.shape[1:])]) if extra else t  # [max(n, ...), ...]


def shared_prefix_hidden_states(model, context_ids, context_mask, response_ids, response_mask) -> torch.Tensor:
    """``response_hidden_states`` with each distinct context computed once.

    The base model runs over the distinct contexts [u, Lc] (their keys and
    values kept in HF's cache), the cache is expanded to the rows
    (index_select), and the responses [N, Lr] run against it with positions
    continuing each context's and the mask [context mask, response mask]. The
    state that predicts response token 0 is the context's last position
    (contexts are left-padded), then response positions 0..Lr-2. Gradients
    reach the shared context through the expansion (summed over its rows).
    Always two calls of the base model, whatever the rows (the number of
    model calls never depends on the data). [N, Lr, H], the same as the plain forward
    up to summation order (fp32 tiny agents: within 1e-5, tests/test_shared_prefix.py)."""
    (n, lc), lr = context_ids.shape, response_ids.shape[1]
    ctx_u, cmask_u, inverse = distinct_contexts(context_ids, context_mask)  # [u, Lc], [u, Lc], [N]
    ctx_u, cmask_u = padded_rows(ctx_u, lc), padded_rows(cmask_u, lc)  # [u', Lc]
    out = model.base_model(input_ids=ctx_u, attention_mask=cmask_u, position_ids=position_ids_from_mask(cmask_u),
                           use_cache=True)
    cache = out.past_key_values
    if cache is None:
        raise RuntimeError("shared-prefix forward got no key/value cache (gradient checkpointing on?): use --no-share-prefix")
    rows = padded_rows(inverse.to(ctx_u.device), lr)  # [N'] distinct context of each (padded) row
    cache.reorder_cache(rows)  # every layer's keys/values [u', ...] -> [N', ...]
    attention_mask = padded_rows(torch.cat([context_mask, response_mask], dim=1), lr)  # [N', Lc+Lr]
    position_ids = position_ids_from_mask(attention_mask)[:, lc:]  # [N', Lr] as in the plain forward
    resp = model.base_model(input_ids=padded_rows(response_ids, lr), attention_mask=attention_mask,
                            position_ids=position_ids, past_key_values=cache, use_cache=True).last_hidden_state  # [N', Lr, H]
    first = out.last_hidden_state[:, -1].index_select(0, rows[:n])  # [N, H] predicts response token 0
    return torch.cat([first[:, None], resp[:n, :-1]], dim=1)  # [N, Lr, H]


def head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logits of the LM head: the hidden states and the head weight are
    cast to fp32 before the matmul. A bf16 matmul would round every logit to 8
    significant bits (an error of ~0.03 on a logit of 10, i.e. on the
    log-probability itself), and it is the log-probabilities whose
    differences are the ratios, the weights and the KL. [..., H] -> [..., V]"""
    head = model.get_output_embeddings()
    bias = head.bias.float() if getattr(head, "bias", None) is not None else None
    # One 2-D matmul over the positions, whatever the layout: on a strided [n, c, H] slice (the plain
    # forward's positions) F.linear falls back to matmul, which picks a batched kernel or a folded one
    # by whether the weight requires grad (even under no_grad), so the training forward would round
    # its logits unlike the behaviour forward of the frozen agent (4.8e-7 in a log-prob, measured).
    flat = hidden.float().reshape(-1, hidden.shape[-1])  # [n * c, H]
    return F.linear(flat, head.weight.float(), bias).reshape(*hidden.shape[:-1], head.weight.shape[0])  # [..., V]


def _head_chunks(hidden, chunk_tokens: int):
    """Position slices covering about ``chunk_tokens`` (rows x columns) each."""
    n, length, _ = hidden.shape
    chunk = head_chunk_positions(n, chunk_tokens)  # positions per chunk
    return [slice(s, s + chunk) for s in range(0, length, chunk)]


# A chunk's fp32 logits block above this is recomputed in the backward pass
# instead of kept (Qwen3: 2.5 GB a chunk); a tiny agent's (16 x 32 x 102 x 4 B
# = 0.2 MB) is kept: recomputing it cost 3-8 % of a training step, measured.
HEAD_CHECKPOINT_BYTES = 64 << 20


def token_logprobs_from_hidden(model, hidden, targets, temperature: float,
                               chunk_tokens: int = LOGITS_CHUNK_TOKENS) -> torch.Tensor:
    """log softmax(lm_head(h)/T)[target] in fp32 (``head_logits``), the LM head
    applied to about ``chunk_tokens`` positions (rows x columns) at a time, so
    a [n, c, V] logits block stays small (4096 x 151936 x 4 B = 2.5 GB for
    Qwen3). With gradients on, a chunk whose logits exceed
    HEAD_CHECKPOINT_BYTES is recomputed in the backward pass (checkpointing),
    so only the hidden states are kept; the same gradients either way, bit
    for bit (the recomputation runs the same kernels)."""

    def piece(h, y):
        logits = head_logits(model, h) / temperature  # [n, c, V] fp32
        return torch.gather(F.log_softmax(logits, dim=-1), -1, y.unsqueeze(-1)).squeeze(-1)  # [n, c]

    parts = []
    for sl in _head_chunks(hidden, chunk_tokens):
        h, y = hidden[:, sl], targets[:, sl]
        big = h.shape[0] * h.shape[1] * model.get_output_embeddings().weight.shape[0] * 4 > HEAD_CHECKPOINT_BYTES
        if big and torch.is_grad_enabled() and h.requires_grad:
            parts.append(torch.utils.checkpoint.checkpoint(piece, h, y, use_reentrant=False))
        else:
            parts.append(piece(h, y))
    return torch.cat(parts, dim=1)  # [n, Lr]


# ---------------------------------------------------------------------------
# The one log-prob path of a turn: full turn width, any grouping of rows
# ---------------------------------------------------------------------------
# Behaviour ("old") log-probs, the training forward and the KL measurement all
# call ``turn_forward`` on rows of the SAME [N, Lc] + [N, Lr] tensors stored in
# the Turn, never re-padded or trimmed per chunk: in bf16 the result of a row
# depends on how much padding shares its batch (measured on CPU: 5e-3 in a
# log-prob after adding 5 padding columns), while grouping different rows at
# the same width gave bit-identical results. So the ratio is exactly 1 before
# the first step, and log rho of an agent that did not move is exactly 0. The
# cost is padding: every row runs at the turn's longest context + response.
def turn_rows(turn_like, token_budget: int) -> int:
    """Rows per forward chunk so that rows x (Lc + Lr) fits the token budget."""
    ctx, _cmask, resp, _rmask = turn_like
    return max(1, token_budget // (ctx.shape[1] + resp.shape[1]))


# With SHARE_PREFIX (``Config.share_prefix``, set per run by ``set_share_prefix``)
# the forward computes each distinct context of its rows once
# (``shared_prefix_hidden_states``) in the turns where that computes fewer
# tokens (``prefix_sharing_pays``). The property above holds for it too
# (tests/test_shared_prefix.py): a distinct context's rows are computed in a
# batch of distinct contexts at the turn's full context width, and the
# responses at the full response width (each call at least MIN_CALL_TOKENS),
# so a row does not depend on which other rows share its call. Under torchrun
# ``sat.run`` turns it off: the agent being trained is FSDP2-sharded and its
# wrapper returns no cache (a sharded model always takes the plain forward here).
SHARE_PREFIX = False
# (minibatch rows, token budget) of the run's update, for ``prefix_sharing_pays``; None: share in every turn
TRAINING_CALL: tuple[int, int] | None = None


def set_share_prefix(on: bool, minibatch_size: int | None = None, token_budget: int | None = None) -> None:
    """Whether ``turn_forward`` shares each distinct context (Config.share_prefix),
    and, given the update's minibatch size and token budget, only in the turns
    where that pays (``prefix_sharing_pays``; without them: in every turn)."""
    global SHARE_PREFIX, TRAINING_CALL
    SHARE_PREFIX = bool(on)
    TRAINING_CALL = (minibatch_size, token_budget) if minibatch_size and token_budget else None


def expected_distinct(counts: torch.Tensor, n: int, m: int) -> float:
    """E[number of distinct contexts among m rows drawn without replacement
    from n rows], where distinct context c has counts[c] rows:
    sum over c of 1 - C(n - counts[c], m) / C(n, m) (the chance of missing c
    is the product over its rows of (n - m - i) / (n - i), i < counts[c])."""
    sizes, how_many = torch.unique(counts, return_counts=True)  # a handful of distinct sizes (G, 1, ...)
    total = 0.0
    for size, k in zip(sizes.tolist(), how_many.tolist()):
        missed = 1.0
        for i in range(size):
            missed *= max(0, n - m - i) / (n - i)
            if missed == 0.0:
                break
        total += k * (1.0 - missed)
    return total


def prefix_sharing_pays(turn_like) -> bool:
    """Whether a training micro-batch of this turn (m rows drawn at random
    from the turn's N, ``update._gradient_step``) computes fewer tokens through
    ``shared_prefix_hidden_states``, about E[distinct contexts] x Lc plus
    m x Lr (each call padded to MIN_CALL_TOKENS), than through the plain
    forward, m x (Lc + Lr). An estimate (the padding is applied to the
    expectation, the cache's expansion is not counted); ties take the plain
    forward. Short contexts with long responses in small minibatches (16
    rows, 7-token prompts, 32-token responses: 645 tokens against 624, in two
    calls), contexts that are all distinct (the chain protocol's later turns
    can be) and one-row calls take the plain forward; a group's prompt shared
    by several rows of a call and longer than a few response tokens is
    shared. A function of the whole turn only (never of the rows of one
    call), so every forward of a turn (behaviour, training, KL, log rho)
    takes the same path, and the first step's ratio is exactly 1."""
    if TRAINING_CALL is None:
        return True
    # once per turn, not per call (a 4096-row turn's distinct contexts take ~70 ms on a CPU): kept
    # while the turn's very tensors live, unchanged in place (their version counters), for this run's sizes
    key, stamp = id(turn_like[0]), (TRAINING_CALL, tuple(t._version for t in turn_like))
    kept = _SHARING.get(key)
    if kept is not None and kept[1] == stamp and all(ref() is t for ref, t in zip(kept[0], turn_like)):
        return kept[2]
    pays = _sharing_saves_tokens(turn_like)
    refs = (weakref.ref(turn_like[0], lambda _, k=key: _SHARING.pop(k, None)), *map(weakref.ref, turn_like[1:]))
    _SHARING[key] = (refs, stamp, pays)
    return pays


_SHARING: dict[int, tuple] = {}  # id(a turn's context tensor) -> (weak refs to its 4 tensors, sizes and versions, decision)


def _sharing_saves_tokens(turn_like) -> bool:
    """``prefix_sharing_pays``' comparison, uncached: the expected tokens of
    one training forward of m rows (``update._gradient_step``'s micro-batch),
    shared against plain."""
    ctx, cmask, resp, _rmask = turn_like
    (n, lc), lr = ctx.shape, resp.shape[1]
    m = min(n, TRAINING_CALL[0], turn_rows(turn_like, TRAINING_CALL[1]))  # rows of one training forward
    counts = torch.bincount(distinct_contexts(ctx, cmask)[2])  # [u] rows of each distinct context
    shared = max(expected_distinct(counts, n, m), min_call_rows(lc)) * lc + max(m, min_call_rows(lr)) * lr
    return shared < m * (lc + lr)


def turn_forward(model, turn_like, idx, temperature: float):
    """(log pi(a_t|s_t) [b, Lr] at ``temperature``, 0 on padding; final hidden
    states [b, Lr, H]) for rows ``idx`` of a turn, at the turn's full width.
    The canonical forward of every ratio (behaviour, training, KL, log rho):
    Algorithm 1's behaviour log-probs, the sequence log-ratio of Eqs. (3)-(4)
    in Eq. (5)'s objective, the per-state KL of Sec. 3."""
    device = next(model.parameters()).device
    ctx, cmask, resp, rmask = [t[idx].to(device) for t in turn_like]
    once = SHARE_PREFIX and not distributed.is_sharded(model)  # shared work computed once (Config.share_prefix)
    shared = once and prefix_sharing_pays(turn_like)
    rows = None
    if once and not torch.is_grad_enabled():
        # A measurement (no gradient): each distinct row once, then copied to its duplicates (a
        # group's G samples often agree), on either forward. Exact: a row's result does not depend
        # on which rows share its call, the LM head's included, once the call has MIN_CALL_TOKENS
        # (padded with copies of row 0). Not with gradients: the duplicates' gradients would be
        # summed before the backward's matmuls instead of inside them (another summation order).
        *distinct, rows = distinct_rows(ctx, cmask, resp, rmask)  # [u, ...] x4, [b]
        width = resp.shape[1] if shared else ctx.shape[1] + resp.shape[1]  # tokens per row of the largest call
        ctx, cmask, resp, rmask = [padded_rows(t, width) for t in distinct]  # [u', ...]
    forward = shared_prefix_hidden_states if shared else response_hidden_states
    hidden = forward(model, ctx, cmask, resp, rmask)  # [b or u, Lr, H]
    logp = token_logprobs_from_hidden(model, hidden, resp, temperature) * rmask  # [b or u, Lr] fp32
    if rows is not None:
        return logp[rows], hidden[rows]  # [b, Lr], [b, Lr, H]
    return logp, hidden


def response_logprobs(model, context_ids, context_mask, response_ids, response_mask, temperature: float) -> torch.Tensor:
    """log pi(response_t | context, response_<t) at ``temperature``, 0 on padding. [N, Lr]"""
    turn_like = (context_ids, context_mask, response_ids, response_mask)
    return turn_forward(model, turn_like, slice(None), temperature)[0]


@torch.no_grad()
def batched_response_logprobs(model, turn_like, temperature: float, token_budget: int, keep: dict | None = None) -> torch.Tensor:
    """``turn_forward`` over all rows, in chunks of rows that fit the token
    budget (the behaviour log-probs of a rollout). [N, Lr] fp32 on the host.
    With ``keep`` (a dict), the forward's outputs are also kept there when
    they fit the reference cache: the agent's pi_j,cur is these weights, so
    its first KL measurement need not run this forward again (``adopt_scoring``)."""
    resp, rmask = turn_like[2], turn_like[3]
    rows = turn_rows(turn_like, token_budget)
    kind = cache_kind(model, rmask) if keep is not None else "none"
    kept = {}
    out = torch.zeros(resp.shape, dtype=torch.float32)  # [N, Lr]
    for s in range(0, resp.shape[0], rows):
        lp, hidden = turn_forward(model, turn_like, slice(s, s + rows), temperature)  # [b, Lr], [b, Lr, H]
        out[s : s + rows] = lp.cpu()
        if kind != "none":
            mask = rmask[s : s + rows].bool().to(hidden.device)  # [b, Lr]
            kept[(s, min(s + rows, resp.shape[0]))] = (lp.cpu(), _pieces(model, hidden[mask], kind))
    if kind != "none":
        keep.update(kind=kind, version=weights_version(model), temperature=temperature, outputs=kept)
    return out


def weights_version(model) -> tuple:
    """Which weights a model holds now: every in-place change (optimizer step,
    copy_, load_state_dict) bumps a tensor's version counter."""
    return tuple((id(p), p._version) for p in model.parameters())


# The reference pi_j,cur is frozen for the whole of agent j's turn, while the KL
# is measured up to ~10 times in it (in-loop checks, backtracking): its outputs
# on the turn are computed once and kept (``frozen_reference=True``) when they
# fit REFERENCE_CACHE_BYTES: its fp32 logits at the response positions if those
# fit, else its final hidden states, else nothing (recomputed, as before).
# Same rows, same chunks, same kernels: the cached values are the ones a fresh
# forward returns, bit for bit.
REFERENCE_CACHE_BYTES = 256 << 20
_REFERENCE_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # reference model -> {key: outputs}


def _pieces(model, hidden: torch.Tensor, kind: str) -> list[torch.Tensor]:
    """[M, H] hidden states at valid positions -> 1024-position pieces: hidden, or fp32 logits [<=1024, V]."""
    pieces = [hidden[c : c + 1024] for c in range(0, hidden.shape[0], 1024)]
    return [head_logits(model, h) for h in pieces] if kind == "logits" else pieces


def _reference_outputs(reference, turn_like, sl, mask, temperature: float, keep: str):
    """(log pi_cur [b, Lr], list of per-1024-position pieces: fp32 logits or
    hidden states) of rows ``sl``, from the cache or from one forward."""
    cache = _REFERENCE_CACHE.setdefault(reference, {})
    key = (id(turn_like[2]), sl.start, sl.stop, temperature, keep)
    if key in cache and cache[key][2] is turn_like[2]:  # the same turn, not a new tensor at a recycled id
        return cache[key][:2]
    lp_cur, h_cur = turn_forward(reference, turn_like, sl, temperature)  # [b, Lr], [b, Lr, H]
    out = (lp_cur.cpu(), _pieces(reference, h_cur[mask], keep if keep != "none" else "hidden"))
    if keep != "none":
        cache[key] = (*out, turn_like[2])
    return out


def adopt_scoring(reference, model, turn) -> None:
    """Give the reference pi_j,cur (a fresh copy of ``model``) the outputs of
    the rollout's behaviour forward of ``turn``, when ``model`` still holds
    the weights that ran it (Section 5: pi_j,cur is the behaviour policy of
    agent j's tokens). Same weights, rows, chunks and kernels: the outputs a
    forward of the reference would give, bit for bit."""
    kept = getattr(turn, "scoring", None)
    if not kept or kept["version"] != weights_version(model):
        return
    cache = _REFERENCE_CACHE.setdefault(reference, {})
    for (start, stop), out in kept["outputs"].items():
        cache[(id(turn.response_ids), start, stop, kept["temperature"], kept["kind"])] = (*out, turn.response_ids)


def reference_cache_kind(reference, turn, frozen_reference: bool) -> str:
    """What of the reference's outputs fits the cache budget: logits, hidden or none."""
    return cache_kind(reference, turn.response_mask) if frozen_reference else "none"


def cache_kind(model, response_mask: torch.Tensor) -> str:
    """What to keep of a forward over these response positions: "logits" if
    their fp32 logits fit REFERENCE_CACHE_BYTES, else "hidden" if their final
    hidden states do, else "none"."""
    positions = int(response_mask.sum())
    head = model.get_output_embeddings().weight
    if positions * head.shape[0] * 4 <= REFERENCE_CACHE_BYTES:
        return "logits"
    if positions * head.shape[1] * head.element_size() <= REFERENCE_CACHE_BYTES:
        return "hidden"
    return "none"


@torch.no_grad()
def measure_kl(agent, reference, turn, temperature: float, token_budget: int, return_log_rho: bool = False,
               frozen_reference: bool = False):
    """Exact per-state KL(pi_j(.|s) || pi_j,cur(.|s)) at every position of agent
    j's responses, and the new log-probabilities of the sampled tokens, from
    one forward of each model (paper, Section 3: the per-state KL; exact, not a
    sampled proxy). Returns (per_state_kl [M], new_logprobs [N, Lr]) and, with
    ``return_log_rho``, log rho = log pi_new - log pi_cur on the sampled tokens
    [N, Lr] from the same two forwards (exactly 0 where the agent did not move):
    what the later agents' truncated weights are built from (Section 5).
    ``frozen_reference``: the caller promises ``reference`` does not change
    while it may be passed again with this turn; its outputs are then cached."""
    model = agent.model
    if distributed.is_sharded(reference):  # its head may be used below without a forward (cached hidden states)
        reference.unshard()
    keep = reference_cache_kind(reference, turn, frozen_reference)
    turn_like = (turn.context_ids, turn.context_mask, turn.response_ids, turn.response_mask)
    rows = turn_rows(turn_like, token_budget)
    kls, new_logp = [], torch.zeros(turn.response_ids.shape)  # [N, Lr]
    cur_logp = torch.zeros(turn.response_ids.shape)  # [N, Lr]
    lo, hi = distributed.row_range(len(turn.texts))  # under torchrun: this rank's rows; gathered below
    for s in range(lo, hi, rows):
        sl = slice(s, min(s + rows, hi))
        lp_new, h_new = turn_forward(model, turn_like, sl, temperature)  # [b, Lr], [b, Lr, H]
        mask = turn.response_mask[sl].bool().to(h_new.device)  # [b, Lr]
        lp_cur, ref_pieces = _reference_outputs(reference, turn_like, sl, mask, temperature, keep)
        new_logp[sl], cur_logp[sl] = lp_new.cpu(), lp_cur
        h_new = h_new[mask]  # [M_b, H] valid positions only
        for c, ref in zip(range(0, h_new.shape[0], 1024), ref_pieces):  # [1024, V] fp32 logits at a time
            ref_logits = ref if keep == "logits" else head_logits(reference, ref)  # [<=1024, V]
            kls.append(per_state_kl(head_logits(model, h_new[c : c + 1024]), ref_logits, temperature=temperature).cpu())
    kl = torch.cat(kls) if kls else torch.zeros(0)
    if distributed.active():  # rows are contiguous per rank: rank order is row order
        kl, new_logp = torch.cat(distributed.gather_objects(kl)), distributed.sum_ranks(new_logp)
        cur_logp = distributed.sum_ranks(cur_logp)
    if return_log_rho:
        return kl, new_logp, (new_logp - cur_logp) * turn.response_mask
    return kl, new_logp
