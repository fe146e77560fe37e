"""Step rules beyond the paper (``--step-size``): how long a step the line search starts from.

The paper trains every step at a fixed lr and backtracks from the whole proposal (``fixed``). ``adaptive`` and
``scaled`` are this project's: they use the exact KL quantile the trust region measures to size the next lr or
this step. Neither touches the check itself: every step kept is still measured inside delta by
``trust_region.TrustRegion``, which holds each agent's ``StepSize`` and calls it.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

STEP_RULES = ("fixed", "adaptive", "scaled")  # --step-size


@dataclass
class StepSize:
    """Agent j's learning rate and where its line search starts (``--step-size``). ``fixed`` keeps ``lr`` (the
    paper's setting) and starts at the proposal.
    ``scaled`` keeps ``lr`` too, and moves along each proposal to the multiple ``scale(kq)`` of it that the
    quadratic model of a small step puts at target * delta, kq the proposal's own KL quantile
    (``trust_region.scaled_line_search``): the step adapts within the step, to the batch it was trained on.
    ``adaptive`` rescales the lr after every step from what the exact KL check measured, ``update(f, kq)``:

        lr <- lr * min(growth, f * sqrt(target * delta / kq))

    where f is the fraction of the step the line search kept and kq its KL quantile. Under the quadratic model
    of a small step, KL quantile ~ c * (f * lr)^2, this is the lr whose whole proposal lands at target * delta:
    it grows while steps sit well inside delta and shrinks by about the backtracked fraction when a step
    backtracks. A rejected step (even shrink^max_backtracks was outside) multiplies lr by ``rejected_scale``.
    lr stays within [lr_start / span, lr_start * span]. Backtracking and the certificates are unchanged: the rule
    only moves the proposal the line search starts from."""

    rule: str = "fixed"
    lr: float = 1e-5
    delta: float = 0.05
    target: float = 0.7  # aim the next proposal's KL quantile at this share of delta
    growth: float = 4.0  # adaptive: the most lr grows in one step (x 16 on the quadratic model's KL)
    stretch: float = 16.0  # scaled: the longest step, a multiple of the proposal (lr 1e-6 -> about 1.6e-5)
    span: float = 100.0
    lr_start: float = 0.0  # the run's --lr; 0: take lr

    def __post_init__(self) -> None:
        if self.rule not in STEP_RULES:
            raise ValueError(f"step rule must be one of {STEP_RULES}, got {self.rule!r}")
        if not (self.lr > 0 and self.delta > 0 and 0 < self.target <= 1 and min(self.growth, self.stretch,
                                                                                  self.span) >= 1):
            raise ValueError(f"need lr, delta > 0, 0 < target <= 1, growth, stretch, span >= 1; got {self}")
        self.lr_start = self.lr_start or self.lr

    @property
    def moves_lr(self) -> bool:
        """Whether the lr changes from step to step (``adaptive``): then each step logs the lr it used."""
        return self.rule == "adaptive"

    @property
    def stretches(self) -> bool:
        """Whether the line search moves along the proposal to ``scale`` of it (``scaled``)."""
        return self.rule == "scaled"

    def scale(self, kl_quantile: float, anchor_kl_quantile: float = 0.0) -> float:
        """``scaled``: the multiple f of a step from an anchor (pi_cur: KL quantile 0) to a proposal (at
        ``kl_quantile``) where the KL quantile is target * delta, if its square root grows in proportion to the
        distance from pi_cur along the step (the quadratic model of a small step: f = sqrt(target delta / kq)
        from pi_cur); at most ``stretch``, 0 when the anchor is already past the target, and 1 when the step did
        not move the policy (a zero proposal, stretched, moves nothing: no check is spent on it). For a small step,
        Adam's proposal at lr stretched by f should be close to the proposal at lr * f, its gradients having barely
        moved (an argument, not measured here)."""
        root, at = math.sqrt(self.target * self.delta), math.sqrt(anchor_kl_quantile)
        if not kl_quantile > anchor_kl_quantile:
            return 1.0
        return min(self.stretch, max(0.0, (root - at) / (math.sqrt(kl_quantile) - at)))

    def update(self, fraction: float, kl_quantile: float, rejected_scale: float) -> float:
        """The lr after a step that kept ``fraction`` of its proposal at KL quantile ``kl_quantile``
        (fraction 0: rejected); returns it. Only ``adaptive`` moves it."""
        if not self.moves_lr:
            return self.lr
        if fraction == 0.0:
            scale = rejected_scale
        elif not kl_quantile > 0:  # the step did not move the policy: no evidence of curvature, grow
            scale = self.growth
        else:
            scale = min(self.growth, fraction * math.sqrt(self.target * self.delta / kl_quantile))
        self.lr = min(self.lr_start * self.span, max(self.lr_start / self.span, self.lr * scale))
        return self.lr

    def state_dict(self) -> dict:
        return asdict(self)
