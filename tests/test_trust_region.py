"""Unit and property tests for trust_region.py, each against a brute-force reference."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from toy_mdp import random_feasible

import bounds
import kl_projection as kp
import trust_region as tr
import update

D = torch.float64


def brute_kl(new_logits, cur_logits, temperature=1.0):
    """Double loop over rows and vocabulary in plain Python floats."""
    out = []
    for row_new, row_cur in zip(new_logits.tolist(), cur_logits.tolist()):
        zn = math.log(sum(math.exp(x / temperature) for x in row_new))
        zc = math.log(sum(math.exp(x / temperature) for x in row_cur))
        kl = 0.0
        for xn, xc in zip(row_new, row_cur):
            lpn, lpc = xn / temperature - zn, xc / temperature - zc
            kl += math.exp(lpn) * (lpn - lpc)
        out.append(kl)
    return out


def log_probs(gen, rows, cols, scale=2.0):
    return torch.log_softmax(scale * torch.randn(rows, cols, generator=gen, dtype=D), dim=-1)


# ---------------------------------------------------------------------------
# per_state_kl
# ---------------------------------------------------------------------------


@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 6), cols=st.integers(2, 7),
       temp=st.sampled_from([0.5, 0.8, 1.0, 2.0]))
def test_per_state_kl_matches_double_loop(seed, rows, cols, temp):
    gen = torch.Generator().manual_seed(seed)
    new = 3 * torch.randn(rows, cols, generator=gen, dtype=D)
    cur = 3 * torch.randn(rows, cols, generator=gen, dtype=D)
    got = tr.per_state_kl(new, cur, temperature=temp)
    assert got.dtype == D
    np.testing.assert_allclose(got.numpy(), brute_kl(new, cur, temp), rtol=1e-10, atol=1e-12)


def test_per_state_kl_matches_torch_distributions_direction():
    gen = torch.Generator().manual_seed(0)
    new = 2 * torch.randn(50, 11, generator=gen, dtype=D)
    cur = 2 * torch.randn(50, 11, generator=gen, dtype=D)
    ref = torch.distributions.kl_divergence(
        torch.distributions.Categorical(logits=new), torch.distributions.Categorical(logits=cur)
    )
    reverse = torch.distributions.kl_divergence(
        torch.distributions.Categorical(logits=cur), torch.distributions.Categorical(logits=new)
    )
    got = tr.per_state_kl(new, cur)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    assert (got - reverse).abs().max() > 1e-3  # the direction matters and is new || cur


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 10_000])
def test_per_state_kl_chunking_invariant(chunk):
    gen = torch.Generator().manual_seed(1)
    new = torch.randn(37, 29, generator=gen)
    cur = torch.randn(37, 29, generator=gen)
    full = tr.per_state_kl(new, cur, chunk_size=10_000)
    torch.testing.assert_close(tr.per_state_kl(new, cur, chunk_size=chunk), full, rtol=0, atol=0)


def test_per_state_kl_low_precision_input_computes_in_float32():
    gen = torch.Generator().manual_seed(2)
    new = torch.randn(8, 100, generator=gen).to(torch.bfloat16)
    cur = torch.randn(8, 100, generator=gen).to(torch.bfloat16)
    got = tr.per_state_kl(new, cur)
    assert got.dtype == torch.float32
    ref = tr.per_state_kl(new.double(), cur.double())  # same bf16 values, exact arithmetic
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-6)
    assert tr.per_state_kl(new.half(), cur.half()).dtype == torch.float32


def test_per_state_kl_stable_zero_and_support_edges():
    x = torch.tensor([[1e4, 0.0, -1e4], [3.0, 1.0, 2.0]], dtype=torch.float32)
    assert torch.equal(tr.per_state_kl(x, x), torch.zeros(2))  # identical: exactly 0, clamped
    shifted = x + 1e3  # logits are shift invariant per row
    assert tr.per_state_kl(shifted, x).abs().max() < 1e-6
    ninf = -math.inf
    new = torch.tensor([[0.0, ninf], [0.0, 0.0]], dtype=D)
    cur = torch.tensor([[ninf, 0.0], [0.0, ninf]], dtype=D)
    got = tr.per_state_kl(new, cur)
    assert torch.isinf(got).all()  # pi_new puts mass where pi_cur has none
    # pi_new has zero mass where pi_cur has some: finite, = -log pi_cur(support of new)
    got = tr.per_state_kl(torch.tensor([[0.0, ninf]], dtype=D), torch.tensor([[0.0, 0.0]], dtype=D))
    assert got.item() == pytest.approx(math.log(2.0), abs=1e-15)


def test_per_state_kl_rejects_bad_shapes():
    with pytest.raises(ValueError):
        tr.per_state_kl(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError):
        tr.per_state_kl(torch.zeros(3), torch.zeros(3))


# ---------------------------------------------------------------------------
# kl_penalty
# ---------------------------------------------------------------------------


def test_kl_penalty_expectations_under_behaviour_policy():
    """Exact expectation over the vocabulary with weights pi_cur (tokens are drawn from pi_cur)."""
    gen = torch.Generator().manual_seed(3)
    lp_new, lp_cur = log_probs(gen, 20, 9), log_probs(gen, 20, 9)
    p_cur = lp_cur.exp()
    kl_cur_new = tr.per_state_kl(lp_cur, lp_new)  # KL(cur || new)
    kl_new_cur = tr.per_state_kl(lp_new, lp_cur)  # KL(new || cur)
    expect = {k: (p_cur * update.kl_penalty(lp_new, lp_cur, k)).sum(-1) for k in ("k1", "k2", "k3", "k3_new")}
    torch.testing.assert_close(expect["k1"], kl_cur_new, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(expect["k3"], kl_cur_new, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(expect["k3_new"], kl_new_cur, rtol=1e-10, atol=1e-12)
    assert (expect["k2"] >= 0).all()


def test_kl_penalty_k2_is_second_order_accurate_near_cur():
    gen = torch.Generator().manual_seed(4)
    lp_cur = log_probs(gen, 10, 6)
    for eps in (1e-1, 1e-2):
        lp_new = torch.log_softmax(lp_cur + eps * torch.randn(10, 6, generator=gen, dtype=D), -1)
        k2 = (lp_cur.exp() * update.kl_penalty(lp_new, lp_cur, "k2")).sum(-1)
        kl = tr.per_state_kl(lp_cur, lp_new)
        assert (k2 - kl).abs().max() <= 10 * eps**3


@given(log_r=st.floats(-30, 30))
def test_kl_penalty_nonnegative_kinds(log_r):
    lp_new, lp_cur = torch.tensor([log_r], dtype=D), torch.tensor([0.0], dtype=D)
    for kind in ("k2", "k3", "k3_new"):
        assert update.kl_penalty(lp_new, lp_cur, kind).item() >= 0


def test_kl_penalty_zero_value_and_gradient_at_cur():
    lp_cur = torch.log_softmax(torch.randn(5, dtype=D), -1)
    for kind in ("k1", "k2", "k3", "k3_new"):
        lp_new = lp_cur.clone().requires_grad_(True)
        val = update.kl_penalty(lp_new, lp_cur, kind)
        assert torch.equal(val, torch.zeros_like(val))
        if kind != "k1":  # k1's per-sample gradient is -1; only its expectation's gradient vanishes
            val.sum().backward()
            assert torch.equal(lp_new.grad, torch.zeros_like(lp_cur))
    with pytest.raises(ValueError):
        update.kl_penalty(lp_cur, lp_cur, "k4")


# ---------------------------------------------------------------------------
# quantile
# ---------------------------------------------------------------------------


@given(
    values=st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=60),
    q=st.floats(0.0, 1.0),
    data=st.data(),
)
def test_quantile_matches_numpy_with_mask(values, q, data):
    mask = data.draw(st.lists(st.booleans(), min_size=len(values), max_size=len(values)))
    if not any(mask):
        mask[0] = True
    x = torch.tensor(values, dtype=D)
    m = torch.tensor(mask)
    ref = np.quantile(np.array(values)[np.array(mask)], q, method="linear")
    assert tr.quantile(x, q, m) == pytest.approx(ref, rel=1e-12, abs=1e-9)
    assert tr.quantile(x.reshape(1, -1), q, m.reshape(1, -1)) == pytest.approx(ref, rel=1e-12, abs=1e-9)


def test_quantile_matches_torch_quantile_2d():
    x = torch.randn(13, 17, generator=torch.Generator().manual_seed(5))
    for q in (0.0, 0.1, 0.5, 0.99, 1.0):
        assert tr.quantile(x, q) == pytest.approx(torch.quantile(x, q).item(), rel=1e-6, abs=1e-6)


def test_quantile_beyond_torch_quantile_limit():
    n = (1 << 24) + 3  # torch.quantile refuses inputs above 16M elements
    x = torch.rand(n, generator=torch.Generator().manual_seed(6))
    mask = torch.ones(n, dtype=torch.bool)
    mask[::7] = False
    ref = np.quantile(x[mask].numpy().astype(np.float64), 0.99, method="linear")
    assert tr.quantile(x, 0.99, mask) == pytest.approx(ref, rel=1e-9, abs=1e-9)


def test_quantile_errors_and_nan():
    with pytest.raises(ValueError):
        tr.quantile(torch.ones(3), 0.5, torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError):
        tr.quantile(torch.ones(3), 1.5)
    assert math.isnan(tr.quantile(torch.tensor([1.0, float("nan")]), 0.5))


# ---------------------------------------------------------------------------
# QuantileController
# ---------------------------------------------------------------------------


def test_controller_raises_from_zero_then_multiplies_then_caps():
    c = tr.QuantileController(delta=0.1, beta=0.0, beta_min=1e-3, beta_up=3.0, beta_max=0.02)
    assert c.violates(0.11) and not c.violates(0.1) and c.violates(float("nan"))
    assert c.update(0.2) == pytest.approx(1e-3)  # off -> beta_min
    assert c.update(0.2) == pytest.approx(3e-3)
    assert c.update(0.2) == pytest.approx(9e-3)
    assert c.update(0.2) == pytest.approx(0.02)  # capped
    assert c.update(float("inf")) == pytest.approx(0.02)


def test_controller_keeps_inside_and_eases_far_inside():
    c = tr.QuantileController(delta=0.1, beta=0.4, beta_down=0.5, beta_min=0.1, far_inside=0.25)
    assert c.update(0.05) == pytest.approx(0.4)  # inside, not far inside: keep
    assert c.update(0.1) == pytest.approx(0.4)  # on the boundary counts as inside
    assert c.update(0.02) == pytest.approx(0.2)  # far inside: ease
    assert c.update(0.0) == pytest.approx(0.1)
    assert c.update(0.0) == 0.0  # below beta_min: switched off


def test_controller_state_roundtrip_and_validation():
    c = tr.QuantileController(delta=0.2, beta=0.3)
    c.update(1.0)
    d = tr.QuantileController()
    d.load_state_dict(c.state_dict())
    assert d == c
    with pytest.raises(KeyError):
        d.load_state_dict({"nonsense": 1.0})
    for bad in ({"delta": 0.0}, {"beta_up": 1.0}, {"beta_down": 1.0}, {"quantile": 0.0},
                {"beta_min": 2.0, "beta_max": 1.0}):
        with pytest.raises(ValueError):
            tr.QuantileController(**bad)


# ---------------------------------------------------------------------------
# backtracking_line_search with a real model and a real KL measurement
# ---------------------------------------------------------------------------


class LinearPolicy:
    """A tiny softmax policy pi(.|x) = softmax(W x + b) over 5 actions, for 16 fixed states."""

    def __init__(self, seed, step_scale):
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(4, 5).double()
        self.states = torch.randn(16, 4, generator=gen, dtype=D)  # [16, 4]
        self.cur = [p.detach().clone() for p in self.model.parameters()]
        self.new = [c + step_scale * torch.randn(c.shape, generator=gen, dtype=D) for c in self.cur]
        with torch.no_grad():
            self.cur_logits = self.model(self.states)  # [16, 5]
        self.applied = []

    def apply_step(self, frac):
        self.applied.append(frac)
        tr.interpolate_parameters(list(self.model.parameters()), self.cur, self.new, frac)

    def measure(self, q=0.9):
        with torch.no_grad():
            return tr.quantile(tr.per_state_kl(self.model(self.states), self.cur_logits), q)

    def params(self):
        return [p.detach().clone() for p in self.model.parameters()]


@given(seed=st.integers(0, 10_000), scale=st.floats(0.01, 5.0), delta=st.floats(1e-3, 0.5), budget=st.integers(0, 6))
def test_backtracking_never_leaves_a_violating_step(seed, scale, delta, budget):
    pol = LinearPolicy(seed, scale)
    out = tr.backtracking_line_search(pol.apply_step, pol.measure, delta, max_backtracks=budget)
    kl_now = pol.measure()
    assert kl_now <= delta
    assert len(out.history) == (out.backtracks + 1 if out.accepted else budget + 1)
    if out.accepted:
        assert out.fraction == 0.5 ** out.backtracks
        assert out.kl_quantile == pytest.approx(kl_now, abs=1e-15)
        # every earlier (larger) fraction was a violation: the first feasible one is kept
        assert all(h.kl_quantile > delta for h in out.history[:-1])
        expected = [torch.lerp(c, n, out.fraction) for c, n in zip(pol.cur, pol.new)]
        for p, e in zip(pol.params(), expected):
            torch.testing.assert_close(p, e, rtol=0, atol=0)
    else:
        assert all(h.kl_quantile > delta for h in out.history)
        assert pol.applied[-1] == 0.0 and out.fraction == 0.0
        for p, c in zip(pol.params(), pol.cur):
            assert torch.equal(p, c)  # bit-exact restore of pi_cur


def test_backtracking_accepts_after_shrinking():
    pol = LinearPolicy(0, 1.0)
    pol.apply_step(1.0)
    full = pol.measure()
    pol.apply_step(0.25)
    quarter = pol.measure()
    delta = 0.5 * (full + quarter)  # full step violates, some shrink fits
    assert quarter < delta < full
    out = tr.backtracking_line_search(pol.apply_step, pol.measure, delta, max_backtracks=5)
    assert out.accepted and 1 <= out.backtracks <= 2
    assert [h.fraction for h in out.history] == [0.5**k for k in range(out.backtracks + 1)]


def test_backtracking_rejects_and_restores_on_tiny_budget():
    pol = LinearPolicy(1, 3.0)
    out = tr.backtracking_line_search(pol.apply_step, pol.measure, delta=1e-6, max_backtracks=2, shrink=0.5)
    assert not out.accepted and out.backtracks == 2 and len(out.history) == 3
    assert [h.fraction for h in out.history] == [1.0, 0.5, 0.25]
    assert pol.measure() == 0.0


def test_line_search_result_is_frozen_and_typed():
    pol = LinearPolicy(1, 3.0)
    out = tr.backtracking_line_search(pol.apply_step, pol.measure, delta=1e-6, max_backtracks=1)
    assert out.history == (tr.LineSearchTry(1.0, out.history[0].kl_quantile),
                           tr.LineSearchTry(0.5, out.history[1].kl_quantile))
    assert {f.name for f in dataclasses.fields(out)} == {"accepted", "fraction", "backtracks", "kl_quantile",
                                                          "measurement", "history"}
    with pytest.raises(TypeError):  # a typed result, not a dict read by key
        out["accepted"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.accepted = True


def test_backtracking_restores_when_measure_raises():
    pol = LinearPolicy(2, 1.0)

    def broken():
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError):
        tr.backtracking_line_search(pol.apply_step, broken, delta=0.1)
    for p, c in zip(pol.params(), pol.cur):
        assert torch.equal(p, c)
    with pytest.raises(ValueError):
        tr.backtracking_line_search(pol.apply_step, pol.measure, delta=0.1, shrink=1.0)


@given(seed=st.integers(0, 10_000), scale=st.floats(0.01, 5.0), delta=st.floats(1e-3, 0.5), budget=st.integers(1, 6))
def test_backtracking_from_the_first_halving_returns_the_kept_measurement(seed, scale, delta, budget):
    """first_try=1 (the proposal already measured outside) never puts the full step in place; the measurement
    handed back is the one of the step kept (None after a restore), and a violating step is never left."""
    pol = LinearPolicy(seed, scale)
    out = tr.backtracking_line_search(pol.apply_step, lambda: (pol.measure(), pol.params()), delta,
                                      max_backtracks=budget, first_try=1, quantile_of=lambda m: m[0])
    assert 1.0 not in pol.applied and pol.measure() <= delta
    assert [h.fraction for h in out.history] == [0.5 ** k for k in range(1, len(out.history) + 1)]
    if out.accepted:
        quantile, params = out.measurement
        assert quantile == out.kl_quantile and all(torch.equal(a, b) for a, b in zip(params, pol.params()))
    else:
        assert out.measurement is None and all(torch.equal(p, c) for p, c in zip(pol.params(), pol.cur))


def test_interpolate_parameters_matches_formula():
    gen = torch.Generator().manual_seed(7)
    cur = [torch.randn(3, 2, generator=gen, dtype=D), torch.randn(4, generator=gen, dtype=D)]
    new = [torch.randn(3, 2, generator=gen, dtype=D), torch.randn(4, generator=gen, dtype=D)]
    params = [torch.nn.Parameter(torch.zeros_like(c)) for c in cur]
    for frac in (0.0, 0.3, 1.0, 1.5):
        tr.interpolate_parameters(params, cur, new, frac)
        for p, c, n in zip(params, cur, new):
            torch.testing.assert_close(p.data, c + frac * (n - c), rtol=1e-15, atol=1e-15)
    with pytest.raises(ValueError):
        tr.interpolate_parameters(params[:1], cur, new, 0.5)


# ---------------------------------------------------------------------------
# Stage-0 geometric mixture projection
# ---------------------------------------------------------------------------


def kl(a, b):
    return tr.per_state_kl(a, b)


@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 5), cols=st.integers(2, 6), delta=st.floats(1e-3, 1.0))
def test_projection_feasible_optimal_and_a_geometric_mixture(seed, rows, cols, delta):
    gen = torch.Generator().manual_seed(seed)
    pre, cur = log_probs(gen, rows, cols, 2.5), log_probs(gen, rows, cols, 2.5)
    new, lam = kp.geometric_mixture_projection(pre, cur, delta)
    torch.testing.assert_close(new.exp().sum(-1), torch.ones(rows, dtype=D))
    assert (kl(new, cur) <= delta + 1e-12).all()
    inside = kl(pre, cur) <= delta
    assert torch.equal(lam == 0, inside)
    # Outside, the constraint is active (lam > 0 only when it binds) ...
    assert (kl(new, cur)[~inside] >= delta - 1e-9).all()
    # ... and pi_new really is pi_pre^(1/(1+lam)) pi_cur^(lam/(1+lam)).
    t = (1 / (1 + lam))[:, None]
    torch.testing.assert_close(new, torch.log_softmax(t * pre + (1 - t) * cur, -1), rtol=1e-9, atol=1e-9)
    # No feasible competitor is closer to pi_pre.
    best = kl(new, pre)
    for cand in random_feasible(gen, cur, delta, 24, anchors=[new, pre]):
        assert (kl(cand, pre) >= best - 1e-9).all()


def test_projection_identity_when_inside():
    gen = torch.Generator().manual_seed(8)
    cur = log_probs(gen, 6, 5)
    pre = torch.log_softmax(cur + 0.05 * torch.randn(6, 5, generator=gen, dtype=D), -1)
    delta = float(kl(pre, cur).max()) * 1.01
    new, lam = kp.geometric_mixture_projection(pre, cur, delta)
    torch.testing.assert_close(new, pre, rtol=0, atol=1e-14)
    assert torch.equal(lam, torch.zeros(6, dtype=D))


def test_projection_zero_radius_and_disjoint_support():
    gen = torch.Generator().manual_seed(9)
    pre, cur = log_probs(gen, 3, 4), log_probs(gen, 3, 4)
    new, lam = kp.geometric_mixture_projection(pre, cur, 0.0)
    torch.testing.assert_close(new, cur, rtol=0, atol=1e-14)
    assert torch.isinf(lam).all()
    # pi_pre puts mass where pi_cur has none: the projection stays on pi_cur's support
    cur = torch.tensor([[0.0, -math.inf, 0.0]], dtype=D)
    cur = torch.log_softmax(cur, -1)
    pre = torch.log_softmax(torch.tensor([[0.0, 3.0, 1.0]], dtype=D), -1)
    new, _ = kp.geometric_mixture_projection(pre, cur, 0.1)
    assert new[0, 1] == -math.inf and kl(new, cur).item() <= 0.1


# ---------------------------------------------------------------------------
# Exponential tilt (exact KL-constrained improvement step)
# ---------------------------------------------------------------------------


@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 5), cols=st.integers(2, 6), delta=st.floats(1e-4, 2.0))
def test_tilt_feasible_and_beats_random_feasible_policies(seed, rows, cols, delta):
    gen = torch.Generator().manual_seed(seed)
    cur = log_probs(gen, rows, cols, 2.0)
    adv = torch.randn(rows, cols, generator=gen, dtype=D)
    new = kp.exponential_tilt_step(cur, adv, delta)
    torch.testing.assert_close(new.exp().sum(-1), torch.ones(rows, dtype=D))
    kl_new = kl(new, cur)
    assert (kl_new <= delta + 1e-12).all()
    gain = (new.exp() * adv).sum(-1)
    assert (gain >= (cur.exp() * adv).sum(-1) - 1e-12).all()  # never worse than staying
    # Either the constraint binds, or the step already reaches the best action.
    assert ((kl_new >= delta - 1e-9) | (gain >= adv.max(-1).values - 1e-9)).all()
    for cand in random_feasible(gen, cur, delta, 24, anchors=[new]):
        assert ((cand.exp() * adv).sum(-1) <= gain + 1e-10).all()


def test_tilt_is_pi_cur_times_exp_eta_a():
    gen = torch.Generator().manual_seed(10)
    cur, adv = log_probs(gen, 4, 5), torch.randn(4, 5, generator=gen, dtype=D)
    new = kp.exponential_tilt_step(cur, adv, 0.05)
    eta = (new - cur)[:, :1] - (new - cur)[:, 1:2]  # log-ratio differences must be eta * dA
    eta = eta / (adv[:, :1] - adv[:, 1:2])
    torch.testing.assert_close(new - cur - (new - cur).mean(-1, keepdim=True), eta * (adv - adv.mean(-1, keepdim=True)))
    assert (eta > 0).all()


def test_tilt_constant_advantage_and_saturation():
    gen = torch.Generator().manual_seed(11)
    cur = log_probs(gen, 3, 4)
    same = kp.exponential_tilt_step(cur, torch.full((3, 4), 0.7, dtype=D), 0.3)
    torch.testing.assert_close(same, cur, rtol=0, atol=1e-14)
    # pi_cur already puts 0.9 on the best action: a radius above -log 0.9 reaches it exactly
    cur = torch.tensor([[0.9, 0.05, 0.05]], dtype=D).log()
    adv = torch.tensor([[1.0, 0.0, -1.0]], dtype=D)
    new = kp.exponential_tilt_step(cur, adv, 0.2)
    assert new.exp()[0, 0].item() == pytest.approx(1.0, abs=1e-15)
    # and radius 0 changes nothing
    torch.testing.assert_close(kp.exponential_tilt_step(cur, adv, 0.0).exp(), cur.exp(), rtol=0, atol=1e-12)


def test_tilt_row_offsets_do_not_matter():
    gen = torch.Generator().manual_seed(12)
    cur, adv = log_probs(gen, 5, 3), torch.randn(5, 3, generator=gen, dtype=D)
    a = kp.exponential_tilt_step(cur, adv, 0.1)
    b = kp.exponential_tilt_step(cur, adv + 100 * torch.randn(5, 1, generator=gen, dtype=D), 0.1)
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------------
# certificate
# ---------------------------------------------------------------------------


def test_certificate_terms_by_hand():
    c = bounds.certificate(surrogate_advantage=0.03, kl_max=0.02, adv_max=0.8, gamma=0.9, zeta=0.001, n_samples=500,
                           n_agents=3, delta_conf=0.1)
    h = 1 / (1 - 0.9)
    assert c["gain"] == pytest.approx(0.03 * h)
    assert c["occupancy_penalty"] == pytest.approx(2 * 0.9 * h * h * 0.8 * math.sqrt(0.01))
    assert c["bias_penalty"] == pytest.approx(0.001 * h)
    assert c["sample_penalty"] == pytest.approx(0.8 * h * math.sqrt(math.log(60) / 1000))
    penalties = c["occupancy_penalty"] + c["bias_penalty"] + c["sample_penalty"]
    assert c["lower_bound"] == pytest.approx(c["gain"] - penalties)
    assert c["lower_bound"] < 0
    c0 = bounds.certificate(0.5, 0.0, 1.0, 0.0)
    assert c0 == {"gain": 0.5, "occupancy_penalty": 0.0, "bias_penalty": 0.0, "sample_penalty": 0.0, "lower_bound": 0.5}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"gamma": 1.0},
        {"gamma": -0.1},
        {"kl_max": -1e-3},
        {"adv_max": -1.0},
        {"zeta": -0.1},
        {"n_samples": 0},
        {"n_samples": 2.5},
        {"n_agents": 0},
        {"delta_conf": 0.0},
        {"delta_conf": 1.0},
        {"surrogate_advantage": float("nan")},
        {"kl_max": float("inf")},
    ],
)
def test_certificate_validates_inputs(kwargs):
    args = {"surrogate_advantage": 0.1, "kl_max": 0.01, "adv_max": 1.0, "gamma": 0.5}
    args.update(kwargs)
    with pytest.raises(ValueError):
        bounds.certificate(**args)


def test_stage_certificate_sums_terms():
    steps = [bounds.certificate(0.1, 0.01, 1.0, 0.5),
             bounds.certificate(-0.05, 0.04, 2.0, 0.5, zeta=0.01, n_samples=100)]
    total = bounds.stage_certificate(steps)
    for key in bounds.CERTIFICATE_TERMS:
        assert total[key] == pytest.approx(steps[0][key] + steps[1][key])
    assert total["n_steps"] == 2
    assert bounds.stage_certificate([])["lower_bound"] == 0.0


def test_dkw_upper_quantile_covers_the_true_quantile():
    """Over many independent samples of Exp(1), the DKW upper bound at level
    q + eps(N, eta) lies above the true q-quantile in at least 1 - eta of them,
    and the plain empirical quantile does not (it is below about half the time)."""
    q, eta, n, trials = 0.9, 0.1, 200, 400
    true_q = -math.log(1 - q)  # quantile of Exp(1)
    gen = torch.Generator().manual_seed(0)
    covered = plain = 0
    for _ in range(trials):
        x = torch.empty(n, dtype=torch.float64).exponential_(generator=gen)
        covered += tr.dkw_upper_quantile(x, q, eta) >= true_q
        plain += tr.quantile(x, q) >= true_q
    assert covered / trials >= 1 - eta
    assert plain / trials < 0.75
    assert tr.dkw_slack(200, 0.1) == pytest.approx(math.sqrt(math.log(20) / 400))
    with pytest.raises(ValueError):
        tr.dkw_slack(0, 0.1)


def test_the_trust_regions_check_is_the_line_searchs_test_nan_included():
    """The in-loop check (update.py) and the line search decide alike, through the agent's ``TrustRegion``: beyond
    delta is outside, at delta inside, a NaN quantile outside (a diverged step is never kept as an inside anchor),
    no tokens inside."""
    kl = torch.linspace(0, 1, 101)  # [101]
    region, tight = (tr.TrustRegion.fresh(delta, 0.9, 0, 0.0, "fixed", 1e-5) for delta in (0.9, 0.89))
    assert region.statistic(kl) == pytest.approx(0.9)
    assert tight.violates(tight.statistic(kl)) and not region.violates(region.statistic(kl))
    assert region.violates(region.statistic(torch.tensor([0.1, float("nan")])))
    assert region.statistic(torch.zeros(0)) == 0.0 and not region.violates(0.0)
    half = tr.TrustRegion.fresh(0.5, 0.9, 0, 0.0, "fixed", 1e-5)
    for values in (kl, torch.tensor([0.1, float("nan")])):
        search = half.search(lambda f: None, lambda: (values,), early_stopped=False, stopped_at=None)
        assert search.accepted == (not half.violates(half.statistic(values)))


def test_a_trust_region_step_moves_beta_and_the_lr_from_what_it_kept():
    """``TrustRegion.step`` on a KL of curv * f^2 at fraction f in place: a rejection restores the anchor (the last
    fraction applied is 0), counts as a violation for beta and takes an adaptive lr one shrink past the last
    fraction tried; an in-loop anchor kept instead counts as one shrink; a kept fraction f moves the lr by
    f sqrt(target delta / kq); a fixed rule logs no lr; a scaled rule stretches a short proposal."""
    def run(curv: float, anchored: bool = False, rule: str = "adaptive"):
        region, applied = tr.TrustRegion.fresh(0.1, 1.0, 2, 0.0, rule, 1e-3), []
        kl_now = lambda: (torch.tensor([curv * applied[-1] ** 2], dtype=D),)  # noqa: E731  [1]
        return region, applied, region.step(applied.append, kl_now, anchored=anchored)

    region, applied, kept = run(100.0)  # even 1/4 of the proposal is at KL 6.25 > 0.1
    assert applied == [1.0, 0.5, 0.25, 0.0] and not kept.accepted and kept.step_fraction == 0.0
    assert kept.beta == 0.0 and kept.beta_next == region.controller.beta_min  # the penalty switches on
    assert kept.lr == 1e-3 and kept.lr_next == pytest.approx(1e-3 * 0.5 ** 3, rel=1e-12)
    kept = run(100.0, anchored=True)[2]
    assert kept.accepted and kept.step_fraction == 0.0 and kept.lr_next == pytest.approx(1e-3 * 0.5, rel=1e-12)
    kept = run(0.2)[2]  # the whole step at 0.2 > 0.1, half of it at 0.05
    assert kept.accepted and (kept.step_fraction, kept.backtracks) == (0.5, 1)
    assert kept.kl_quantile == pytest.approx(0.05, rel=1e-12)
    assert kept.lr_next == pytest.approx(1e-3 * 0.5 * math.sqrt(0.7 * 0.1 / 0.05), rel=1e-9)
    fixed = run(0.2, rule="fixed")[2]
    assert fixed.step_fraction == 0.5 and fixed.lr is None and fixed.lr_next is None
    scaled = run(1e-3, rule="scaled")[2]  # inside at 1: stretched to where the KL is 0.7 delta
    assert scaled.accepted and scaled.step_fraction == pytest.approx(math.sqrt(70), rel=1e-12)
    assert scaled.kl_quantile == pytest.approx(0.07, rel=1e-9) and scaled.lr is None
