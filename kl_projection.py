"""Exact per-state solutions of KL-constrained problems: Stage-0's projection of a plug-in model onto the
incumbent's trust region (paper, Section 5, Eqs. (6)-(7)) and the ideal trust-region step of Section 4.4.

Both solve one problem per state (row) in closed form up to a scalar, found by a batched bisection that keeps the
feasible end, so every row's KL to pi_cur stays <= delta. [N, V] normalised log-probs in and out.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from trust_region import compute_dtype, kl_from_logprobs


def _geometric_mixture(logp_pre: torch.Tensor, logp_cur: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Normalised log of pi_pre^t * pi_cur^(1-t) per row; t is [N, 1]. A zero exponent gives pi^0 = 1 even
    where pi = 0, so 0 * (-inf) is read as 0."""
    s = 1 - t  # [N, 1]
    zero = torch.zeros_like(logp_pre)  # [N, V]
    mixed = torch.where(t == 0, zero, t * logp_pre) + torch.where(s == 0, zero, s * logp_cur)  # [N, V]
    return torch.log_softmax(mixed, dim=-1)  # [N, V]


def _bisect(kl_at: Callable[[torch.Tensor], torch.Tensor], lo: torch.Tensor, hi: torch.Tensor, delta: float,
            iters: int) -> torch.Tensor:
    """Per-row bisection for the largest x in [lo, hi] [N, 1] with kl_at(x) <= delta (kl_at increasing, lo
    feasible): returns the feasible end."""
    for _ in range(iters):
        mid = 0.5 * (lo + hi)  # [N, 1]
        ok = (kl_at(mid) <= delta)[:, None]  # [N, 1]
        lo = torch.where(ok, mid, lo)  # [N, 1]
        hi = torch.where(ok, hi, mid)  # [N, 1]
    return lo


def geometric_mixture_projection(logp_pre: torch.Tensor, logp_cur: torch.Tensor, delta: float,
                                 iters: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage-0 projection of a plug-in model onto the incumbent's trust region (paper, Section 5, Eqs. (6)-(7)).

    Per state s solves  min_pi KL(pi || pi_pre)  s.t.  KL(pi || pi_cur) <= delta.  Stationarity of
    KL(pi || pi_pre) + lam * KL(pi || pi_cur) gives the geometric mixture

        pi_new ∝ pi_pre^(1/(1+lam)) * pi_cur^(lam/(1+lam)),   lam >= 0,

    lam = 0 when pi_pre is already inside, else the lam that makes the constraint tight. With t = 1/(1+lam),
    pi_t is an exponential family in t and d/dt KL(pi_t || pi_cur) = t * Var_{pi_t}(log pi_pre - log pi_cur)
    >= 0, so a batched bisection finds the largest feasible t; returning the bracket's feasible end keeps
    KL(pi_new || pi_cur) <= delta for every row.
    [N, V] normalised log-probs -> (logp_new [N, V], lam [N]; inf where only t = 0, i.e. pi_cur, fits)."""
    if logp_pre.shape != logp_cur.shape or logp_pre.dim() != 2:
        raise ValueError(f"expected two [N, V] tensors of equal shape, got {tuple(logp_pre.shape)}, "
                         f"{tuple(logp_cur.shape)}")
    if not delta >= 0:
        raise ValueError(f"delta must be >= 0, got {delta}")
    dtype = compute_dtype(logp_pre)
    pre, cur = (torch.log_softmax(x.to(dtype), dim=-1) for x in (logp_pre, logp_cur))  # [N, V] renormalised
    n = pre.shape[0]
    if delta == 0:
        # Only pi_cur fits; bisection would creep to t ~ 1e-8, where the KL rounds to 0: answer exactly.
        return cur, torch.full((n,), math.inf, dtype=dtype, device=pre.device)

    def kl_at(t: torch.Tensor) -> torch.Tensor:  # t [N, 1] -> [N]
        return kl_from_logprobs(_geometric_mixture(pre, cur, t), cur).clamp_min(0.0)

    hi = torch.ones(n, 1, dtype=dtype, device=pre.device)  # [N, 1]
    inside = kl_at(hi) <= delta  # [N] pi_pre already in the ball: lam = 0
    lo = torch.where(inside[:, None], hi, torch.zeros_like(hi))  # [N, 1] t = 0 (pi_cur) is always feasible
    t = _bisect(kl_at, lo, hi, delta, iters).squeeze(-1)  # [N]
    lam = torch.where(t > 0, (1 - t) / t, torch.full_like(t, math.inf))  # [N]
    return _geometric_mixture(pre, cur, t[:, None]), lam


def geometric_mixture_at(logp_pre: torch.Tensor, logp_cur: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The Stage-0 target of Eq. (7) for given exponents t = 1/(1+lambda(s)) in [0, 1] ([N]; 0 is pi_cur,
    1 is pi_pre): Stage-0 solves t once per state and reuses it for fixed targets. [N, V]"""
    if t.dim() != 1 or t.shape[0] != logp_pre.shape[0]:
        raise ValueError(f"t must be [N] with N = {logp_pre.shape[0]} rows, got {tuple(t.shape)}")
    dtype = compute_dtype(logp_pre)
    pre, cur = (torch.log_softmax(x.to(dtype), dim=-1) for x in (logp_pre, logp_cur))  # [N, V]
    return _geometric_mixture(pre, cur, t.to(dtype)[:, None])


def exponential_tilt_step(logp_cur: torch.Tensor, advantages: torch.Tensor, delta: float,
                          iters: int = 60) -> torch.Tensor:
    """Exact KL-constrained policy improvement per state (the ideal step of the paper's Section 4.4).

    Per state s solves  max_pi E_{a~pi}[A(s, a)]  s.t.  KL(pi || pi_cur(.|s)) <= delta.  The Lagrangian
    solution is the exponential tilt pi_eta ∝ pi_cur * exp(eta_s * A(s, .)), eta_s >= 0, and
    d/deta KL(pi_eta || pi_cur) = eta * Var_{pi_eta}(A) >= 0, so a batched bisection finds the eta_s
    with KL = delta (the feasible end). As eta -> inf the tilt tends to pi_cur restricted to
    argmax_a A(s, a), with KL -log pi_cur(argmax set); when that is <= delta this limit is returned
    exactly (constant advantages: no change). [S, A] log-probs and advantages -> [S, A] log-probs."""
    if logp_cur.shape != advantages.shape or logp_cur.dim() != 2:
        raise ValueError(f"expected two [S, A] tensors of equal shape, got {tuple(logp_cur.shape)}, "
                         f"{tuple(advantages.shape)}")
    if not delta >= 0:
        raise ValueError(f"delta must be >= 0, got {delta}")
    dtype = compute_dtype(logp_cur)
    cur = torch.log_softmax(logp_cur.to(dtype), dim=-1)  # [S, A]
    if delta == 0:
        return cur  # [S, A] only pi_cur fits (bisection would drift by float rounding)
    support = torch.isfinite(cur)  # [S, A] actions pi_cur can take; others stay at zero
    adv = torch.where(support, advantages.to(dtype), torch.zeros_like(cur))  # [S, A]
    neg_inf = torch.full_like(cur, -math.inf)  # [S, A]

    # The eta -> inf limit: pi_cur restricted to its best supported actions.
    top = torch.where(support, adv, neg_inf).amax(dim=-1, keepdim=True)  # [S, 1]
    limit = torch.log_softmax(torch.where(support & (adv == top), cur, neg_inf), dim=-1)  # [S, A]
    saturated = kl_from_logprobs(limit, cur) <= delta  # [S] the constraint never binds

    # Centre and scale so eta brackets start at a sensible size for every row.
    centred = adv - adv.mean(dim=-1, keepdim=True)  # [S, A]
    spread = top - torch.where(support, adv, -neg_inf).amin(dim=-1, keepdim=True)  # [S, 1]
    spread = torch.where(spread > 0, spread, torch.ones_like(spread))  # [S, 1]

    def tilt(eta: torch.Tensor) -> torch.Tensor:  # eta [S, 1] -> [S, A]
        return torch.log_softmax(cur + eta * centred / spread, dim=-1)

    def kl_at(eta: torch.Tensor) -> torch.Tensor:  # [S, 1] -> [S]
        return kl_from_logprobs(tilt(eta), cur).clamp_min(0.0)

    # Bracket: double hi until it violates (finite for every non-saturated row: the KL tends to the limit's > delta).
    lo = torch.zeros_like(spread)  # [S, 1]
    hi = torch.ones_like(spread)  # [S, 1]
    for _ in range(80):
        grow = (~saturated & (kl_at(hi) <= delta))[:, None]  # [S, 1]
        if not grow.any():
            break
        lo = torch.where(grow, hi, lo)  # [S, 1] a feasible eta is a valid lower end
        hi = torch.where(grow, 2 * hi, hi)  # [S, 1]
    return torch.where(saturated[:, None], limit, tilt(_bisect(kl_at, lo, hi, delta, iters)))  # [S, A]
