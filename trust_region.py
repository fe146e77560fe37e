"""The trust region: what keeps one agent's update inside its KL ball (paper, Sections 3-5).

The exact per-state KL, its quantile (the trust region's statistic), the beta controller, the backtracking line
search and ``TrustRegion``, the per-agent object that owns them and the step rule's state (``step_rules``).
Plain PyTorch on [rows, vocab] tensors; callers flatten (batch, position) into rows. The certificate is in
``bounds.py``; Stage-0's projection and the ideal tilt step in ``kl_projection.py``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Callable, NamedTuple, Sequence

import torch

from step_rules import StepSize


# -- Exact per-state KL --------------------------------------------------------------------------------------------
def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float64 for float64 input (tests, toy MDPs), else float32: bf16/fp16 logits lose too much in exp/log."""
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
    dtype = compute_dtype(new_logits)
    out = []
    for start in range(0, new_logits.shape[0], chunk_size):
        logp_new = torch.log_softmax(new_logits[start : start + chunk_size].to(dtype) / temperature, dim=-1)  # [n, V]
        logp_cur = torch.log_softmax(cur_logits[start : start + chunk_size].to(dtype) / temperature, dim=-1)  # [n, V]
        out.append(kl_from_logprobs(logp_new, logp_cur))  # [n]
    if not out:
        return torch.zeros(0, dtype=dtype, device=new_logits.device)  # [0]
    # Rounding can make an (exactly zero) KL come out as -1e-9; KL is >= 0 by Gibbs.
    return torch.cat(out).clamp_min(0.0)  # [N]


# -- Quantile of a masked tensor -----------------------------------------------------------------------------------
def kl_quantile(kl: torch.Tensor, level: float) -> float:
    """The trust region's statistic: the ``level``-quantile of the per-state KL (0.0 when there is none)."""
    return quantile(kl, level) if kl.numel() else 0.0


def beyond(kl_quantile_value: float, delta: float) -> bool:
    """A measured KL quantile outside the ball of radius delta; NaN and inf count as outside (a diverged
    step is never kept as inside)."""
    return not (math.isfinite(kl_quantile_value) and kl_quantile_value <= delta)


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
SHRINK = 0.5  # the line search's factor from one fraction tried to the next


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
                             max_backtracks: int = 5, shrink: float = SHRINK, first_try: int = 0,
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
                       scale_of: Callable[[float, float], float], max_backtracks: int = 5, shrink: float = SHRINK,
                       quantile_of: Callable[[object], float] = float,
                       stopped_at: tuple[float, float] | None = None) -> LineSearchResult:
    """Measure the whole proposal once, then try the multiple s = ``scale_of(its KL quantile, the anchor's)`` of
    it (``step_rules.StepSize.scale``: where the KL quantile reaches a target inside delta if its square root grows
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


# -- One agent's trust region --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrustRegionStep:
    """What ``TrustRegion.step`` left in place and measured there: an ``AgentStep``'s trust-region fields."""

    accepted: bool  # a step (or the in-loop anchor) stays; False: pi_j,cur restored exactly
    step_fraction: float  # the multiple of the proposal kept (0.0 when the search kept nothing of it)
    backtracks: int  # as ``LineSearchResult.backtracks``
    measurement: tuple  # what ``measure()`` returned at the weights kept: (per-state KL [M], ...)
    kl_quantile: float  # the trust-region statistic at the weights kept
    kl_quantile_dkw: float  # a DKW upper confidence bound on its population quantile
    delta: float
    beta: float  # the KL penalty weight the step trained with
    beta_next: float  # beta after the controller's update
    lr: float | None  # the lr the step trained with, where the rule moves it (None: the run's --lr)
    lr_next: float | None  # and the lr of the agent's next step

    def logged(self) -> dict:
        """The ``stage_record.AgentStep`` fields this step fills."""
        kl = self.measurement[0]  # [M]
        return {"kl_mean": float(kl.mean()), "kl_quantile": self.kl_quantile, "kl_max": float(kl.max()),
                "kl_quantile_dkw": self.kl_quantile_dkw, "delta": self.delta, "beta": self.beta,
                "beta_next": self.beta_next, "backtracks": self.backtracks, "accepted": self.accepted,
                "step_fraction": self.step_fraction, "lr": self.lr, "lr_next": self.lr_next}


@dataclass
class TrustRegion:
    """One agent's trust region (Algorithm 1, lines 8-11): the statistic (the ``level``-quantile of the exact
    per-state KL, ``kl_quantile``) and its check against ``delta``, the line search that keeps a step inside it,
    the KL penalty weight beta (``controller``) and the step rule's state (``step_size``, ``step_rules``).
    ``update.train_agents`` reads beta, the lr and the check while it trains; ``step`` then holds the proposal
    inside the ball and moves beta and the lr on from what it measured."""

    delta: float  # the run's radius (--delta)
    level: float  # the quantile level 1 - alpha (--quantile)
    max_backtracks: int  # KL checks after the first (--max-backtracks)
    controller: QuantileController
    step_size: StepSize

    def __post_init__(self) -> None:
        if not (self.delta > 0 and 0.0 < self.level <= 1.0 and self.max_backtracks >= 0):
            raise ValueError(f"need delta > 0, level in (0, 1], max_backtracks >= 0; got {self.delta}, "
                             f"{self.level}, {self.max_backtracks}")

    @classmethod
    def fresh(cls, delta: float, level: float, max_backtracks: int, beta: float, rule: str,
              lr: float) -> TrustRegion:
        """A new agent's trust region: beta at ``beta``, the step rule ``rule`` at ``lr``."""
        return cls(delta, level, max_backtracks, QuantileController(delta=delta, quantile=level, beta=beta),
                   StepSize(rule=rule, lr=lr, delta=delta))

    @property
    def beta(self) -> float:
        return self.controller.beta

    @property
    def lr(self) -> float:
        return self.step_size.lr

    def statistic(self, kl: torch.Tensor) -> float:
        """The trust region's statistic of per-state KLs [M]: their ``level``-quantile (0.0 when there is none)."""
        return kl_quantile(kl, self.level)

    def violates(self, statistic: float) -> bool:
        """Algorithm 1, line 10: the statistic lies beyond delta (NaN and inf count as beyond)."""
        return beyond(statistic, self.delta)

    def search(self, step_to: Callable[[float], None], measure: Callable[[], tuple], early_stopped: bool,
               stopped_at: tuple[float, float] | None) -> LineSearchResult:
        """The line search of the step rule: ``scaled_line_search`` where the rule stretches the step, else
        ``backtracking_line_search`` (from the proposal's first halving when the in-loop check already measured
        it outside). ``measure()`` returns a tuple whose first entry is the per-state KL [M] in place."""
        statistic_of = lambda measured: self.statistic(measured[0])  # noqa: E731
        if self.step_size.stretches:
            return scaled_line_search(step_to, measure, self.delta, self.step_size.scale, self.max_backtracks,
                                      SHRINK, quantile_of=statistic_of, stopped_at=stopped_at)
        first_try = 1 if early_stopped and self.max_backtracks else 0
        return backtracking_line_search(step_to, measure, self.delta, self.max_backtracks, SHRINK, first_try,
                                        quantile_of=statistic_of)

    def step(self, step_to: Callable[[float], None], measure: Callable[[], tuple], early_stopped: bool = False,
             stopped_at: tuple[float, float] | None = None, anchored: bool = False) -> TrustRegionStep:
        """Lines 10-11: hold the proposal inside the ball (``search``), then move beta and the lr on. ``anchored``:
        the search starts from an iterate the in-loop check measured inside, which stays if the search keeps
        nothing. A rejection counts as a violation for beta; for the lr, an anchor kept counts as one shrink and
        a rejection as a shrink past the last fraction tried."""
        search = self.search(step_to, measure, early_stopped, stopped_at)
        accepted = search.accepted or anchored
        measured = search.measurement if search.accepted else measure()  # at the weights kept
        kq, beta, lr = self.statistic(measured[0]), self.beta, self.lr
        self.controller.update(kq if accepted else math.inf)
        self.step_size.update(search.fraction, kq, SHRINK if accepted else SHRINK ** (self.max_backtracks + 1))
        moves = self.step_size.moves_lr
        return TrustRegionStep(accepted, search.fraction, search.backtracks, measured, kq,
                               dkw_upper_quantile(measured[0], self.level), self.delta, beta, self.beta,
                               lr if moves else None, self.lr if moves else None)
