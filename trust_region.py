"""Trust-region machinery: what keeps one agent's update inside its KL ball (paper, Sections 3-5).

Plain PyTorch on [rows, vocab] tensors; callers flatten (batch, position) into rows. The certificate is in
`bounds.py`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Callable, NamedTuple, Sequence

import torch


# -- Exact per-state KL --------------------------------------------------------------------------------------------
def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    # bf16/fp16 logits lose too much in exp/log; float64 callers (tests, toy MDPs) keep float64.
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def kl_from_logprobs(logp_new: torch.Tensor, logp_cur: torch.Tensor) -> torch.Tensor:
    """Exact KL(p_new || p_cur) = sum_v p_new (log p_new - log p_cur) per row, for normalised log-probs [N, V]
    (``per_state_kl`` from logits; Stage-0's KLs, whose log-probs are already tempered). -> [N]"""
    p_new = logp_new.exp()  # [N, V]
    # 0 * log 0 = 0: a token the new policy never emits contributes nothing (not -inf - -inf = nan).
    terms = torch.where(p_new > 0, p_new * (logp_new - logp_cur), torch.zeros_like(p_new))  # [N, V]
    return terms.sum(dim=-1)  # [N]


def per_state_kl(new_logits: torch.Tensor, cur_logits: torch.Tensor, temperature: float = 1.0,
                 chunk_size: int = 1024) -> torch.Tensor:
    """Exact KL(pi_new(.|s) || pi_cur(.|s)) per state (row): the per-state KL constraint of the trust region
    (paper, Section 3), in the direction the certificates of ``bounds`` use:

        KL_s = sum_v p_new(v) * (log p_new(v) - log p_cur(v)),  p = softmax(logits / temperature).

    Both distributions are known in full at every position, so the sum runs over the vocabulary, not a
    sampled proxy, ``chunk_size`` rows at a time (V ~ 150k for Qwen). [N, V] logits or log-probs, any float
    dtype -> [N] KL >= 0; +inf where pi_new puts mass on a token pi_cur cannot emit."""
    if new_logits.shape != cur_logits.shape or new_logits.dim() != 2:
        raise ValueError(f"per_state_kl expects two [N, V] tensors of equal shape, got {tuple(new_logits.shape)} "
                         f"and {tuple(cur_logits.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    dtype = _compute_dtype(new_logits)
    out = []
    for start in range(0, new_logits.shape[0], chunk_size):
        logp_new = torch.log_softmax(new_logits[start : start + chunk_size].to(dtype) / temperature, dim=-1)  # [n, V]
        logp_cur = torch.log_softmax(cur_logits[start : start + chunk_size].to(dtype) / temperature, dim=-1)  # [n, V]
        out.append(kl_from_logprobs(logp_new, logp_cur))  # [n]
    if not out:
        return torch.zeros(0, dtype=dtype, device=new_logits.device)  # [0]
    # Rounding can make an (exactly zero) KL come out as -1e-9; KL is >= 0 by Gibbs.
    return torch.cat(out).clamp_min(0.0)  # [N]


# -- Sampled per-token KL estimators (for the loss penalty) --------------------------------------------------------
def kl_penalty(logp_new: torch.Tensor, logp_cur: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token sampled KL estimators for tokens a ~ pi_cur (the behaviour policy), r = pi_new(a) / pi_cur(a)
    (J. Schulman, "Approximating KL Divergence", 2020):

        k1 = -log r                  E_cur[k1] = KL(cur || new)   unbiased, can be < 0
        k2 = (log r)^2 / 2           E_cur[k2] = KL(cur || new) + O(|new - cur|^3)   biased, >= 0, low variance
        k3 = (r - 1) - log r         E_cur[k3] = KL(cur || new)   unbiased, >= 0
        k3_new = r log r - (r - 1)   E_cur[.]  = KL(new || cur)   unbiased, >= 0, importance-weighted (more variance)

    The reverse KL(cur || new) agrees with the trust region's KL(new || cur) to second order near
    pi_new = pi_cur, and accept/reject uses the exact ``per_state_kl``, so the penalty only has to pull the
    right way. Every kind is zero with zero gradient at pi_new = pi_cur, so it enters the loss directly.
    logp_new [...] carries the gradient; logp_cur [...] none. -> [...]"""
    log_r = logp_new - logp_cur  # [...]  log(pi_new / pi_cur)
    if kind == "k1":
        return -log_r  # [...]
    if kind == "k2":
        return 0.5 * log_r.pow(2)  # [...]
    if kind == "k3":
        # expm1 keeps (r - 1) accurate when r is close to 1, i.e. for every early step.
        return torch.expm1(log_r) - log_r  # [...]
    if kind == "k3_new":
        r = log_r.exp()  # [...]
        r_log_r = torch.where(r > 0, r * log_r, torch.zeros_like(r))  # [...] 0 * log 0 = 0
        return r_log_r - torch.expm1(log_r)  # [...]
    raise ValueError(f"unknown KL estimator kind {kind!r}; expected 'k1', 'k2', 'k3' or 'k3_new'")


# -- Quantile of a masked tensor -----------------------------------------------------------------------------------
def kl_quantile(kl: torch.Tensor, level: float) -> float:
    """The trust region's statistic: the ``level``-quantile of the per-state KL (0.0 when there is none)."""
    return quantile(kl, level) if kl.numel() else 0.0


def beyond(kl_quantile_value: float, delta: float) -> bool:
    """A measured KL quantile outside the ball of radius delta; NaN and inf count as outside (a diverged
    step is never kept as inside)."""
    return not (math.isfinite(kl_quantile_value) and kl_quantile_value <= delta)


def outside_trust_region(kl: torch.Tensor, level: float, delta: float) -> bool:
    """Algorithm 1, line 10: the ``level``-quantile of the per-state KL lies beyond delta."""
    return beyond(kl_quantile(kl, level), delta)


def quantile(x: torch.Tensor, q: float, mask: torch.Tensor | None = None) -> float:
    """The q-quantile of the (masked) entries of x, linear interpolation as torch.quantile (nan if a
    selected entry is nan). One batch can hold far more than 16M tokens, torch.quantile's input limit,
    so the two order statistics around q * (n - 1) come from kthvalue (linear time, no size limit)."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile level must be in [0, 1], got {q}")
    values = x.reshape(-1)  # [M]
    if mask is not None:
        if mask.shape != x.shape:
            raise ValueError(f"mask shape {tuple(mask.shape)} != x shape {tuple(x.shape)}")
        values = values[mask.reshape(-1).bool()]  # [n]
    n = values.numel()
    if n == 0:
        raise ValueError("quantile of an empty selection is undefined")
    if torch.isnan(values).any():
        return float("nan")
    pos = q * (n - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    # kthvalue is 1-indexed; float64 so the interpolation does not lose bf16/fp32 precision.
    v_lo = values.kthvalue(lo + 1).values.double().item()
    v_hi = values.kthvalue(hi + 1).values.double().item() if hi != lo else v_lo
    frac = pos - lo
    # The same lerp torch.quantile uses; at frac == 0 it returns v_lo exactly, even for inf.
    return v_lo if frac == 0 else v_lo + frac * (v_hi - v_lo)


def dkw_slack(n: int, eta: float) -> float:
    """eps(N, eta) = sqrt(log(2 / eta) / (2 N)): the Dvoretzky-Kiefer-Wolfowitz band (paper, Section 4.3).
    With probability >= 1 - eta the empirical CDF of N i.i.d. draws is within eps of the true CDF
    everywhere, so the empirical quantile at level q + eps bounds the true q-quantile from above."""
    if n < 1 or not 0 < eta < 1:
        raise ValueError(f"dkw_slack needs n >= 1 and eta in (0, 1) (got n={n}, eta={eta})")
    return math.sqrt(math.log(2.0 / eta) / (2.0 * n))


def dkw_upper_quantile(x: torch.Tensor, q: float, eta: float = 0.05) -> float:
    """Upper bound on the true q-quantile w.p. 1 - eta: the empirical quantile at min(1, q + dkw_slack(N, eta)).
    Per-state KLs along one response are not independent: on LLM batches a relaxation, not a guarantee."""
    return quantile(x, min(1.0, q + dkw_slack(x.numel(), eta)))


# -- Adaptive penalty from the KL quantile -------------------------------------------------------------------------
@dataclass
class QuantileController:
    """Adapts the KL penalty weight beta from the measured KL quantile kq (paper, Section 5), ``update(kq)``:

    - kq > delta (or non-finite): beta <- min(beta_max, max(beta_min, beta * beta_up)); a beta of 0
      (penalty off) jumps to beta_min, since 0 * beta_up would never switch it on.
    - kq < far_inside * delta: beta <- beta * beta_down, 0 below beta_min (an over-cautious penalty turns off).
    - otherwise beta is kept.
    The hard guarantee comes from the line search; beta only makes proposals land inside more often."""

    delta: float = 0.05
    quantile: float = 0.99
    beta: float = 0.0
    beta_up: float = 2.0
    beta_down: float = 0.5
    beta_min: float = 1e-4
    beta_max: float = 10.0
    far_inside: float = 0.25

    def __post_init__(self) -> None:
        if not self.delta > 0:
            raise ValueError(f"delta must be > 0, got {self.delta}")
        if not 0.0 < self.quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {self.quantile}")
        if not self.beta_up > 1.0:
            raise ValueError(f"beta_up must be > 1, got {self.beta_up}")
        if not 0.0 < self.beta_down < 1.0:
            raise ValueError(f"beta_down must be in (0, 1), got {self.beta_down}")
        if not 0.0 <= self.beta_min <= self.beta_max:
            raise ValueError(f"need 0 <= beta_min <= beta_max, got {self.beta_min}, {self.beta_max}")
        if not 0.0 <= self.beta <= self.beta_max:
            raise ValueError(f"beta must be in [0, beta_max], got {self.beta}")
        if not 0.0 <= self.far_inside < 1.0:
            raise ValueError(f"far_inside must be in [0, 1), got {self.far_inside}")

    def violates(self, kl_quantile: float) -> bool:
        """True when the measured KL quantile lies outside the ball (nan/inf count as outside)."""
        return beyond(kl_quantile, self.delta)

    def update(self, kl_quantile: float) -> float:
        """Adjust beta from one measurement (rules in the class docstring); returns the new beta."""
        if self.violates(kl_quantile):
            self.beta = min(self.beta_max, max(self.beta_min, self.beta * self.beta_up))
        elif kl_quantile < self.far_inside * self.delta:
            eased = self.beta * self.beta_down
            self.beta = eased if eased >= self.beta_min else 0.0
        return self.beta

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        unknown = set(state) - {f.name for f in fields(self)}
        if unknown:
            raise KeyError(f"unknown QuantileController keys: {sorted(unknown)}")
        for name, value in state.items():
            setattr(self, name, float(value))
        self.__post_init__()


# -- Backtracking line search --------------------------------------------------------------------------------------
@torch.no_grad()
def interpolate_parameters(model_params: Sequence[torch.Tensor], cur_params: Sequence[torch.Tensor],
                           new_params: Sequence[torch.Tensor], frac: float) -> None:
    """Write cur + frac * (new - cur) into model_params, in place. frac = 0 and 1 copy cur / new
    exactly, so restoring pi_cur is bit-exact (cur + 0 * (new - cur) could differ in the last bit)."""
    if not (len(model_params) == len(cur_params) == len(new_params)):
        raise ValueError(f"parameter lists differ in length: {len(model_params)}, {len(cur_params)}, "
                         f"{len(new_params)}")
    for p, c, n in zip(model_params, cur_params, new_params):
        if not (p.shape == c.shape == n.shape):
            raise ValueError(f"parameter shapes differ: {tuple(p.shape)}, {tuple(c.shape)}, {tuple(n.shape)}")
        if frac == 0.0:
            p.copy_(c)
        elif frac == 1.0:
            p.copy_(n)
        else:
            p.copy_(torch.lerp(c.to(p.dtype), n.to(p.dtype), frac))


class LineSearchTry(NamedTuple):
    """One fraction the line search tried and the KL quantile measured there."""

    fraction: float  # start * shrink ** k
    kl_quantile: float  # the (1 - alpha) quantile of the per-state KL of the policy at that fraction


@dataclass(frozen=True)
class LineSearchResult:
    """What ``backtracking_line_search`` left in place, and every fraction it tried."""

    accepted: bool  # a fraction inside delta was found and stays in place; False: apply_step(0.0) restored pi_cur
    fraction: float  # the multiple of the proposal left in place (1: the proposal itself); 0.0 when rejected
    backtracks: int  # k of the last fraction tried (max_backtracks when rejected); scaled: KL checks after the first
    kl_quantile: float  # of the policy left in place; 0.0 when rejected
    measurement: object  # what ``measure`` returned for the step kept; None when rejected
    history: tuple[LineSearchTry, ...]  # every fraction tried, in order


def backtracking_line_search(apply_step: Callable[[float], None], measure: Callable[[], object], delta: float,
                             max_backtracks: int = 5, shrink: float = 0.5, first_try: int = 0,
                             quantile_of: Callable[[object], float] = float, start: float = 1.0) -> LineSearchResult:
    """Shrink a proposed step until its KL quantile is inside delta, else restore pi_cur (paper, Section 5).

    Tries fractions start * shrink^k for k = first_try, ..., max_backtracks (k = 0 is the proposal itself; a caller
    that already measured it outside starts at 1): ``apply_step(frac)`` puts cur + frac * (new - cur) in
    place, ``measure()`` measures it and ``quantile_of`` reads its KL quantile; the first fraction inside
    delta stays. Otherwise, or when measuring raises, apply_step(0.0) restores pi_cur: the per-step
    guarantee needs that a violating step is never left in place."""
    if not delta >= 0:
        raise ValueError(f"delta must be >= 0, got {delta}")
    if not 0 <= first_try <= max_backtracks:
        raise ValueError(f"need 0 <= first_try <= max_backtracks, got {first_try} and {max_backtracks}")
    if not (0.0 < shrink < 1.0 and start > 0):
        raise ValueError(f"need shrink in (0, 1) and start > 0, got {shrink} and {start}")
    history = []
    try:
        for attempt in range(first_try, max_backtracks + 1):
            frac = start * shrink ** attempt
            apply_step(frac)
            measured = measure()
            kl = float(quantile_of(measured))
            history.append(LineSearchTry(frac, kl))
            if not beyond(kl, delta):
                return LineSearchResult(accepted=True, fraction=frac, backtracks=attempt, kl_quantile=kl,
                                        measurement=measured, history=tuple(history))
    except BaseException:
        apply_step(0.0)
        raise
    apply_step(0.0)
    return LineSearchResult(accepted=False, fraction=0.0, backtracks=max_backtracks, kl_quantile=0.0,
                            measurement=None, history=tuple(history))


def scaled_line_search(apply_step: Callable[[float], None], measure: Callable[[], object], delta: float,
                       scale_of: Callable[[float, float], float], max_backtracks: int = 5, shrink: float = 0.5,
                       quantile_of: Callable[[object], float] = float,
                       stopped_at: tuple[float, float] | None = None) -> LineSearchResult:
    """Measure the whole proposal once, then try the multiple s = ``scale_of(its KL quantile, the anchor's)`` of
    it (``update.StepSize.scale``: where the KL quantile reaches a target inside delta if its square root grows
    in proportion to the step), so that the step length, not the lr, meets the trust region.

    - Inside delta and s > 1: the extrapolated step anchor + s (new - anchor) stays if it is inside delta too,
      else the proposal does (it was measured inside).
    - Inside delta and s <= 1: the proposal stays.
    - Outside delta: ``backtracking_line_search`` from s, halving on; s <= 0 (an anchor already past the
      target) restores the anchor with no check.
    ``stopped_at``: (the anchor's, the proposal's) KL quantiles when the in-loop check already measured the
    proposal outside delta; the first check is then skipped. At most max_backtracks + 1 KL checks, as the
    plain search; every step kept was measured inside delta; ``backtracks`` counts the checks after the first."""
    try:
        if stopped_at is None:
            apply_step(1.0)
            first = measure()
            kq_anchor, kq = 0.0, float(quantile_of(first))
        else:
            (kq_anchor, kq), first = stopped_at, None
        tried = (LineSearchTry(1.0, kq),)
        s = scale_of(kq, kq_anchor)
        if beyond(kq, delta):
            if max_backtracks == 0 or s <= 0:
                apply_step(0.0)
                return LineSearchResult(False, 0.0, 0, 0.0, None, tried)
            rest = backtracking_line_search(apply_step, measure, delta, max_backtracks - 1, shrink,
                                            quantile_of=quantile_of, start=min(s, 1.0))
            return replace(rest, backtracks=rest.backtracks + 1, history=tried + rest.history)
        if s <= 1.0 or max_backtracks == 0:  # no check left to spend on a longer step
            return LineSearchResult(True, 1.0, 0, kq, first, tried)
        apply_step(s)
        further = measure()
        kq_s = float(quantile_of(further))
        tried += (LineSearchTry(s, kq_s),)
        if not beyond(kq_s, delta):
            return LineSearchResult(True, s, 1, kq_s, further, tried)
        apply_step(1.0)
        return LineSearchResult(True, 1.0, 1, kq, first, tried)
    except BaseException:
        apply_step(0.0)
        raise


# -- Stage-0 projection (plug-and-play) and the exact tilt step ----------------------------------------------------
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
    dtype = _compute_dtype(logp_pre)
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
    dtype = _compute_dtype(logp_pre)
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
    dtype = _compute_dtype(logp_cur)
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
