"""--step-size: the per-agent rules (step_rules.StepSize), checked against the quadratic model of a small step they
are built on, through the real line searches, and in runs (one that checkpoints and resumes)."""
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import harness.cli
import harness.run
from step_rules import StepSize
from trust_region import QuantileController, TrustRegion, scaled_line_search

pos = st.floats(1e-3, 1e3)


def one_step(size: StepSize, curvature: float, max_backtracks: int = 6) -> tuple:
    """One trust-region step (``TrustRegion.step``: the real line search, then the rule's update) when the KL
    quantile of the policy at fraction f of a proposal trained at lr is exactly curvature * (f * lr)^2.
    -> (what the step kept, lr used)"""
    lr, at = size.lr, {}
    region = TrustRegion(size.delta, 1.0, max_backtracks, QuantileController(delta=size.delta), size)
    kl_at = lambda: (torch.tensor([curvature * (at["f"] * lr) ** 2], dtype=torch.float64),)  # noqa: E731  [1]
    return region.step(lambda f: at.update(f=f), kl_at), lr


@settings(max_examples=200, deadline=None)
@given(curvature=pos, lr=pos, delta=st.floats(1e-3, 1.0))
def test_one_adaptive_step_puts_the_next_proposal_at_the_target(curvature, lr, delta):
    size = StepSize(rule="adaptive", lr=lr, delta=delta, span=1e12)
    search, lr_used = one_step(size, curvature)
    if not search.accepted:  # even 1/64 of the proposal was outside: the lr falls past the last fraction tried
        assert size.lr == pytest.approx(lr_used * 0.5 ** 7, rel=1e-12)
        return
    wanted = math.sqrt(size.target * delta / curvature)  # the lr whose whole proposal lands at target * delta
    assert size.lr == pytest.approx(min(wanted, lr_used * size.growth), rel=1e-9)
    next_search, _ = one_step(size, curvature)
    assert next_search.kl_quantile <= delta  # at the target, or short of it when growth capped the lr
    if wanted <= lr_used * size.growth:
        assert next_search.backtracks == 0 and next_search.kl_quantile == pytest.approx(size.target * delta, rel=1e-9)


@settings(max_examples=100, deadline=None)
@given(curvature=pos, lr=pos, delta=st.floats(1e-3, 1.0))
def test_the_adaptive_rule_reaches_the_target_within_its_growth_limit(curvature, lr, delta):
    size = StepSize(rule="adaptive", lr=lr, delta=delta, span=1e12)
    kept = [one_step(size, curvature)[0] for _ in range(12)]
    assert kept[-1].backtracks == 0 and kept[-1].kl_quantile == pytest.approx(size.target * delta, rel=1e-9)
    assert all(s.kl_quantile <= delta for s in kept if s.accepted)


@settings(max_examples=100, deadline=None)
@given(curvature=pos, lr=pos, delta=st.floats(1e-3, 1.0))
def test_a_fixed_rule_keeps_its_lr(curvature, lr, delta):
    size = StepSize(rule="fixed", lr=lr, delta=delta)
    for _ in range(3):
        one_step(size, curvature)
    assert size.lr == lr


def scaled_step(size: StepSize, kl_at, max_backtracks: int = 6) -> tuple:
    """One ``scaled`` trust-region step when the KL quantile at multiple f of the proposal is ``kl_at(f)``.
    -> (search, the multiples applied in order)"""
    applied = []
    search = scaled_line_search(applied.append, lambda: kl_at(applied[-1]), size.delta, size.scale, max_backtracks)
    return search, applied


@settings(max_examples=200, deadline=None)
@given(curvature=st.floats(1e-6, 1e3), delta=st.floats(1e-3, 1.0))
def test_a_scaled_step_lands_at_the_target_in_two_checks(curvature, delta):
    size = StepSize(rule="scaled", lr=1e-6, delta=delta)
    search, applied = scaled_step(size, lambda f: curvature * f ** 2)
    target = size.target * delta
    assert search.accepted and len(search.history) <= 2 and applied[-1] == search.fraction
    if curvature * size.stretch ** 2 <= target:  # far inside: stretched by stretch, the most it moves
        assert search.fraction == size.stretch and search.kl_quantile == pytest.approx(curvature * size.stretch ** 2)
    elif target < curvature <= delta:  # the proposal is already between the target and delta: it stays
        assert (search.fraction, search.backtracks) == (1.0, 0)
    else:  # stretched or shrunk onto the target, one check after the proposal's
        assert search.backtracks == 1 and search.kl_quantile == pytest.approx(target, rel=1e-9)
    size.update(search.fraction, search.kl_quantile, 0.5)
    assert size.lr == 1e-6  # the lr never moves under this rule


@settings(max_examples=200, deadline=None)
@given(a=st.floats(1e-6, 1e3), power=st.floats(0.5, 6.0), delta=st.floats(1e-3, 1.0), budget=st.integers(0, 6))
def test_a_scaled_step_keeps_only_what_it_measured_inside_delta(a, power, delta, budget):
    """Off the quadratic model the stretched step can overshoot: the proposal, or a halving, stays instead."""
    size = StepSize(rule="scaled", lr=1e-6, delta=delta)
    search, applied = scaled_step(size, lambda f: a * f ** power, budget)
    assert len(search.history) <= budget + 1  # no more KL checks than the plain line search may make
    if search.accepted:
        assert applied[-1] == search.fraction and search.kl_quantile == a * search.fraction ** power <= delta
        assert search.fraction >= 1.0 or a > delta  # a proposal inside delta is never shrunk
    else:
        assert applied[-1] == 0.0 and all(kq > delta for _, kq in search.history)


@settings(max_examples=200, deadline=None)
@given(at=st.floats(0.0, 1.0), past=st.floats(1.0001, 30.0), delta=st.floats(1e-3, 1.0))
def test_a_scaled_step_after_an_early_stop_lands_at_the_target_from_its_anchor(at, past, delta):
    """The in-loop check stopped training with the proposal outside delta and an anchor inside it: on a straight
    path, where the KL quantile's square root grows in proportion to the distance from pi_cur, one check lands at
    the target; an anchor already past it stays, with no check."""
    size = StepSize(rule="scaled", lr=1e-6, delta=delta)
    a, b = math.sqrt(at * delta), math.sqrt(past * delta)  # sqrt of the anchor's and the proposal's KL quantiles
    applied = []
    search = scaled_line_search(applied.append, lambda: (a + applied[-1] * (b - a)) ** 2, delta, size.scale, 6,
                                stopped_at=(a * a, b * b))
    if at < size.target:
        assert search.accepted and search.backtracks == 1 and len(applied) == 1
        assert search.kl_quantile == pytest.approx(size.target * delta, rel=1e-9) and 0 < search.fraction < 1
    else:  # the caller keeps the anchor (trust_region_step: accepted = search.accepted or an anchor)
        assert not search.accepted and applied == [0.0]


def test_a_scaled_step_spends_no_check_stretching_a_proposal_that_did_not_move_the_policy():
    applied = []
    search = scaled_line_search(applied.append, lambda: 0.0, 0.05, StepSize(rule="scaled", delta=0.05).scale)
    assert applied == [1.0] and (search.accepted, search.fraction, search.backtracks) == (True, 1.0, 0)


def test_a_scaled_step_restores_pi_cur_when_measuring_fails():
    applied = []

    def measure():
        if len(applied) > 1:
            raise RuntimeError("out of memory")
        return 1e-4

    with pytest.raises(RuntimeError):
        scaled_line_search(applied.append, measure, 0.05, StepSize(rule="scaled", delta=0.05).scale)
    assert applied == [1.0, 16.0, 0.0]


def test_the_lr_stays_within_its_span_and_grows_at_most_growth_a_step():
    size = StepSize(rule="adaptive", lr=1e-6, delta=0.05, span=10.0)
    assert size.update(1.0, 0.0, 0.5) == pytest.approx(4e-6)  # a step that did not move: grows by growth
    assert size.update(1.0, 1e-12, 0.5) == pytest.approx(1e-5)  # capped at lr_start * span
    for _ in range(5):
        size.update(0.0, 0.0, 0.5 ** 7)  # rejected steps
    assert size.lr == pytest.approx(1e-7)  # floored at lr_start / span


@pytest.mark.parametrize("kw,needle", [(dict(rule="trpo"), "step rule must be one of"),
                                       (dict(lr=0.0), "need lr, delta > 0"), (dict(target=1.5), "0 < target <= 1"),
                                       (dict(stretch=0.5), "stretch")])
def test_a_bad_step_size_is_one_clear_error(kw, needle):
    with pytest.raises(ValueError, match=needle):
        StepSize(**kw)


@pytest.mark.slow  # about a minute: a straight adaptive run and its resumed twin
def test_an_adaptive_run_logs_each_agents_lr_and_resumes_it(tmp_path):
    def config(out, stages, *extra):
        return harness.cli.parse_args(["--agents", "tiny x2", "--stages", str(stages), "--batch-size", "32",
                                       "--group-size", "4", "--epochs", "1", "--minibatch-size", "16",
                                       "--warmup-steps", "30", "--eval-size", "16", "--device", "cpu",
                                       "--step-size", "adaptive", "--lr", "1e-3", "--out", str(out), *extra])

    lines = []
    quiet = lambda *_: None  # noqa: E731
    straight = harness.run.run(config(tmp_path / "a", 3), log=lines.append)
    harness.run.run(config(tmp_path / "b", 1), log=quiet)
    resumed = harness.run.run(harness.cli.parse_args(["--resume", str(tmp_path / "b"), "--stages", "3"]), log=quiet)
    steps = [{a["agent"]: a for a in row["agents"]} for row in straight[1:]]
    assert steps[0][1]["lr"] == steps[0][2]["lr"] == 1e-3
    for before, after in zip(steps, steps[1:]):  # each agent's next step trains at the lr its last step set
        assert all(after[k]["lr"] == before[k]["lr_next"] for k in (1, 2))
    assert any(s[k]["lr_next"] != s[k]["lr"] for s in steps for k in (1, 2))  # the rule moved some lr
    last = [line for line in lines if line.lstrip().startswith("3 ")][0]  # stage 3's console line ends with the lrs
    assert last.endswith(f" lr {steps[2][1]['lr_next']:.2g}/{steps[2][2]['lr_next']:.2g}")
    timing = ("seconds", "per_s")
    strip = lambda rows: json.loads(json.dumps(rows, default=str), object_hook=lambda d: {  # noqa: E731
        k: v for k, v in d.items() if not any(t in k for t in timing)})
    assert strip(resumed) == strip(straight)
