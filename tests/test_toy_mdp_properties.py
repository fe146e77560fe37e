"""SAT's guarantees, checked exactly on random finite cooperative MDPs (paper, Sections 3-5).

Every quantity (J, V, Q, A, occupancy d, per-state KL) is exact (float64 linear algebra,
see toy_mdp.py), so the certificate of bounds.certificate must hold to rounding
error, for every step, every stage and every update order.
"""

import itertools
import math

import pytest
import torch
import toy_mdp as tm
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st
from scipy.optimize import brentq

import bounds
import kl_projection as kp
import trust_region as tr

TOL = 1e-9  # bound slack for float64 rounding (J is at most 1 / (1 - gamma) = 10)


@st.composite
def cases(draw, gamma=(0.5, 0.9), delta=(1e-3, 0.5), agents=(2, 4), coordination=(0.0, 0.5, 0.9)):
    """A random MDP, a random team on it and per-step radii."""
    n_agents = draw(st.integers(*agents))
    n_states = draw(st.integers(2, 5))
    n_actions = draw(st.lists(st.integers(2, 3), min_size=n_agents, max_size=n_agents))
    g = draw(st.floats(*gamma))
    coordination = draw(st.sampled_from(coordination))
    seed = draw(st.integers(0, 2**31 - 1))
    deltas = draw(st.lists(st.floats(*delta), min_size=n_agents, max_size=n_agents))
    mdp = tm.random_mdp(seed, n_agents, n_states, n_actions, g, coordination)
    team = tm.random_team(seed + 1, mdp)
    return mdp, team, deltas


def check_step_bounds(stage):
    for i, cert in enumerate(stage["certificates"]):
        realised = stage["J"][i + 1] - stage["J"][i]
        assert realised >= cert["lower_bound"] - TOL, (i, realised, cert)


def check_stage_bound(stage):
    realised = stage["J"][-1] - stage["J"][0]
    assert realised >= stage["stage"]["lower_bound"] - TOL, (realised, stage["stage"])


# A third of the profile's examples (ci 10, dev 100) for the properties also checked elsewhere: exactly, on fixed
# cases, or with random cases of their own (each use below names where).
FEWER = settings(max_examples=max(1, settings.default.max_examples // 3))

# ---------------------------------------------------------------------------
# 1-3: the certificate
# ---------------------------------------------------------------------------


@given(case=cases(), data=st.data())
def test_per_step_bound_holds(case, data):
    mdp, team, deltas = case
    order = data.draw(st.permutations(range(mdp.n_agents)))
    stage = tm.sat_stage(mdp, team, order, deltas)
    check_step_bounds(stage)
    # the certificate's gain is the exact surrogate L_i, and PDL says the realised change
    # is that same expectation under the *new* occupancy: sanity-check the bookkeeping
    for step in stage["steps"]:
        assert step["certificate"]["gain"] == pytest.approx(step["surrogate"] / (1 - mdp.gamma), rel=1e-12)


@FEWER  # every order of 24 at most: test_bounds_fixed_examples does all orders exactly, test_per_step_bound_holds
@given(case=cases())  # draws an order for each of the profile's cases
def test_stage_bound_holds_for_every_order(case):
    mdp, team, deltas = case
    for order in itertools.permutations(range(mdp.n_agents)):
        stage = tm.sat_stage(mdp, team, order, deltas)
        check_stage_bound(stage)
        check_step_bounds(stage)


@pytest.mark.parametrize(
    "seed, n_agents, n_states, n_actions, gamma, delta",
    [(0, 2, 2, 2, 0.5, 0.1), (3, 3, 4, 3, 0.9, 0.05), (11, 4, 5, 2, 0.7, 0.3), (5, 3, 3, (2, 3, 2), 0.8, 0.01)],
)
def test_bounds_fixed_examples(seed, n_agents, n_states, n_actions, gamma, delta):
    mdp = tm.random_mdp(seed, n_agents, n_states, n_actions, gamma)
    team = tm.random_team(seed + 1, mdp)
    for order in itertools.permutations(range(n_agents)):
        stage = tm.sat_stage(mdp, team, order, delta)
        check_step_bounds(stage)
        check_stage_bound(stage)
        assert stage["J"][-1] > stage["J"][0]  # exact steps never lose (and here they gain)


# With gamma >= 1/2 the occupancy penalty always beats the gain (a positive certificate
# needs std_pi(A_j) > gamma/(1-gamma) * max|A|), so the implication is exercised on
# short horizons, where it is often non-vacuous.
@given(case=cases(gamma=(0.05, 0.4), delta=(1e-3, 0.1)))
def test_positive_certificate_implies_no_drop(case):
    mdp, team, deltas = case
    stage = tm.sat_stage(mdp, team, range(mdp.n_agents), deltas)
    for i, cert in enumerate(stage["certificates"]):
        if cert["lower_bound"] > 0:
            event("a step had a positive certificate")
            assert stage["J"][i + 1] >= stage["J"][i]
    if stage["stage"]["lower_bound"] > 0:
        event("the stage had a positive certificate")
        assert stage["J"][-1] >= stage["J"][0]


def test_positive_certificate_fixed_example():
    mdp = tm.random_mdp(0, 2, 3, 2, 0.1)
    stage = tm.sat_stage(mdp, tm.random_team(1, mdp), [0, 1], 0.05)
    lb = stage["stage"]["lower_bound"]
    assert lb > 0.05  # non-vacuous: the certificate promises a real gain ...
    assert stage["J"][-1] - stage["J"][0] >= lb  # ... and the team delivers it


# ---------------------------------------------------------------------------
# 4: the KL step
# ---------------------------------------------------------------------------


@FEWER  # the tilt's feasibility and optimality: test_trust_region's tilt tests (random cases, and exact ones)
@given(case=cases(), data=st.data())
def test_kl_step_feasible_and_optimal(case, data):
    mdp, team, deltas = case
    j = data.draw(st.integers(0, mdp.n_agents - 1))
    _, step = tm.sat_step(mdp, team, j, deltas[j])
    assert (step["kl"] <= deltas[j] + 1e-12).all()
    new_j = kp.exponential_tilt_step(team[j], step["adv_j"], deltas[j])
    best = step["surrogate"]
    assert best >= -1e-12  # pi_cur itself scores E_pi[A^pi] = 0
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    for cand in tm.random_feasible(gen, team[j], deltas[j], 20, anchors=[new_j]):
        assert (tr.per_state_kl(cand, team[j]) <= deltas[j] + 1e-12).all()
        assert tm.surrogate(step["d"], cand, step["adv_j"]) <= best + 1e-10


# ---------------------------------------------------------------------------
# 5: Stage-0 projection
# ---------------------------------------------------------------------------


@FEWER  # the projection's feasibility and optimality: test_trust_region's projection tests (random and exact)
@given(case=cases(), data=st.data(), delta0=st.floats(1e-3, 0.5))
def test_stage0_projection(case, data, delta0):
    mdp, team, _ = case
    j = data.draw(st.integers(0, mdp.n_agents - 1))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    cur = team[j]
    pre = tm.random_policy(gen, mdp.n_states, cur.shape[1], scale=2.0)
    new, lam = kp.geometric_mixture_projection(pre, cur, delta0)
    assert (tr.per_state_kl(new, cur) <= delta0 + 1e-12).all()
    best = tr.per_state_kl(new, pre)
    for cand in tm.random_feasible(gen, cur, delta0, 20, anchors=[new, pre]):
        assert (tr.per_state_kl(cand, pre) >= best - 1e-9).all()
    # a plug-in already inside the ball is taken as it is
    near = torch.log_softmax(cur + 0.02 * torch.randn(cur.shape, generator=gen, dtype=tm.DTYPE), -1)
    radius = float(tr.per_state_kl(near, cur).max()) + 1e-6
    same, lam0 = kp.geometric_mixture_projection(near, cur, radius)
    torch.testing.assert_close(same, near, rtol=0, atol=1e-13)
    assert (lam0 == 0).all()


# ---------------------------------------------------------------------------
# 6: plug-and-play
# ---------------------------------------------------------------------------


def swap(mdp, team, j, logp_new):
    """Certificate of replacing agent j by logp_new, as one step of agent j."""
    old = tm.solve_policy(mdp, team)
    adv_j = tm.marginal_advantage(old["A"], team, j)
    new_team = list(team)
    new_team[j] = logp_new
    cert = bounds.certificate(
        surrogate_advantage=tm.surrogate(old["d"], logp_new, adv_j),
        kl_max=float(tr.per_state_kl(logp_new, team[j]).max()),
        adv_max=float(old["A"].abs().max()),
        gamma=mdp.gamma,
    )
    return new_team, cert, old, adv_j


@given(case=cases(), data=st.data(), delta0=st.floats(1e-3, 0.5))
def test_plug_and_play_swap_keeps_the_guarantee(case, data, delta0):
    """Projected plug-in + a SAT stage: the swap is itself a certified step of agent j, and
    the following stage keeps its bound, so the chain swap + stage is certified end to end."""
    mdp, team, deltas = case
    j = data.draw(st.integers(0, mdp.n_agents - 1))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    pre = tm.random_policy(gen, mdp.n_states, team[j].shape[1], scale=2.0)
    projected, _ = kp.geometric_mixture_projection(pre, team[j], delta0)
    swapped, cert, old, _ = swap(mdp, team, j, projected)
    J_swapped = tm.solve_policy(mdp, swapped)["J"]
    assert J_swapped - old["J"] >= cert["lower_bound"] - TOL
    stage = tm.sat_stage(mdp, swapped, data.draw(st.permutations(range(mdp.n_agents))), deltas)
    check_step_bounds(stage)
    check_stage_bound(stage)
    total = bounds.stage_certificate([cert] + stage["certificates"])
    assert stage["J"][-1] - old["J"] >= total["lower_bound"] - TOL


@given(case=cases(), data=st.data(), delta0=st.floats(1e-3, 0.3), factor=st.floats(1.0, 4.0))
def test_plug_in_that_improves_keeps_its_improvement_after_projection(case, data, delta0, factor):
    """If the plug-in is an advantage tilt of the incumbent, pi_pre ∝ pi_cur exp(eta A_j),
    with radius delta_big >= delta_0, then its Stage-0 projection is exactly the best
    delta_0 step, tilt(pi_cur, A_j, delta_0): the geometric mixture pi_pre^t pi_cur^(1-t) is
    again a tilt, and the KL-tight tilt is unique. Hence the surrogate gain after the swap,
    E_d E_{proj}[A_j] >= 0 = the incumbent's own gain E_d E_{pi_cur}[A_j], and it is at most
    the unprojected plug-in's gain (a smaller ball)."""
    mdp, team, _ = case
    j = data.draw(st.integers(0, mdp.n_agents - 1))
    old = tm.solve_policy(mdp, team)
    adv_j = tm.marginal_advantage(old["A"], team, j)
    pre = kp.exponential_tilt_step(team[j], adv_j, factor * delta0)
    assume(torch.isfinite(pre).all())  # a saturated tilt (pi_cur restricted to argmax) has no interior mixtures
    projected, _ = kp.geometric_mixture_projection(pre, team[j], delta0)
    best_step = kp.exponential_tilt_step(team[j], adv_j, delta0)
    torch.testing.assert_close(projected.exp(), best_step.exp(), rtol=0, atol=1e-7)
    gain_before = tm.surrogate(old["d"], team[j], adv_j)
    gain_after = tm.surrogate(old["d"], projected, adv_j)
    assert abs(gain_before) < 1e-12
    assert gain_after >= gain_before - 1e-12
    assert gain_after <= tm.surrogate(old["d"], pre, adv_j) + 1e-10
    swapped, _, _, _ = swap(mdp, team, j, projected)
    assert tm.solve_policy(mdp, swapped)["J"] >= old["J"] - 1e-12  # a state-wise improvement never loses


# ---------------------------------------------------------------------------
# 7: why sequential
# ---------------------------------------------------------------------------


def coordination_game(p0, p1, gamma=0.5):
    """2 agents, 1 state, 2 actions each; team reward 1 iff both pick the same action."""
    D = tm.DTYPE
    mdp = tm.ToyMDP(P=torch.ones(1, 2, 2, 1, dtype=D), R=torch.eye(2, dtype=D)[None], mu=torch.ones(1, dtype=D),
                    gamma=gamma)
    return mdp, [torch.tensor([p0], dtype=D).log(), torch.tensor([p1], dtype=D).log()]


def bernoulli_tilt(p, delta, toward_zero):
    """The q with KL(Bern(q) || Bern(p)) = delta on the given side of p (closed form check)."""
    def kl(q):
        return q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p)) - delta

    return brentq(kl, 1e-15, p, xtol=1e-15) if toward_zero else brentq(kl, p, 1 - 1e-15, xtol=1e-15)


def test_coordination_game_joint_update_falls_sequential_rises():
    # Agent 0 leans to action 0 (0.6), agent 1 to action 1 (0.7). Each agent's stale
    # advantage says "do what the other does", so a joint update swaps their leanings and
    # they miscoordinate; SAT moves agent 0 first and agent 1 then follows it.
    gamma, delta = 0.5, 0.5
    mdp, team = coordination_game([0.6, 0.4], [0.3, 0.7], gamma)
    J0 = (0.6 * 0.3 + 0.4 * 0.7) / (1 - gamma)

    joint = tm.joint_update(mdp, team, delta)
    q0 = bernoulli_tilt(0.6, delta, toward_zero=True)  # agent 0's new P(action 0)
    q1 = bernoulli_tilt(0.3, delta, toward_zero=False)  # agent 1's new P(action 0)
    assert joint["J_before"] == pytest.approx(J0, abs=1e-12) == pytest.approx(0.92, abs=1e-12)
    assert joint["J_after"] == pytest.approx((q0 * q1 + (1 - q0) * (1 - q1)) / (1 - gamma), abs=1e-9)
    assert joint["J_after"] == pytest.approx(0.568058, abs=1e-6)  # fell by 0.352

    stage = tm.sat_stage(mdp, team, [0, 1], delta)
    # step 1 = agent 0's move; step 2: agent 1 now sees agent 0 leaning to action 1, and
    # since -log 0.7 = 0.357 <= delta its best step is to play action 1 outright.
    assert stage["J"][1] == pytest.approx((q0 * 0.3 + (1 - q0) * 0.7) / (1 - gamma), abs=1e-9)
    assert stage["J"][2] == pytest.approx((1 - q0) / (1 - gamma), abs=1e-9)
    assert stage["J"] == pytest.approx([0.92, 1.303763, 1.759408], abs=1e-6)
    assert torch.exp(stage["logps"][1]).tolist() == [[0.0, 1.0]]
    # the other order coordinates too (on action 0)
    other = tm.sat_stage(mdp, team, [1, 0], delta)
    assert other["J"][0] < other["J"][1] < other["J"][2]
    for s in (stage, other):
        check_step_bounds(s)
        check_stage_bound(s)


def test_joint_updates_can_fall_sat_never_does():
    counts = {"examples": 0, "joint_fell": 0, "sat_fell": 0}

    # large radii and agreement-heavy rewards: where simultaneous steps can overshoot
    @given(case=cases(delta=(0.3, 2.0), agents=(2, 3), coordination=(0.5, 0.9, 1.0)))
    def run(case):
        mdp, team, deltas = case
        counts["examples"] += 1
        joint = tm.joint_update(mdp, team, deltas)
        joint_fell = joint["J_after"] < joint["J_before"] - 1e-12
        counts["joint_fell"] += joint_fell
        event(f"joint update fell: {joint_fell}")
        stage = tm.sat_stage(mdp, team, range(mdp.n_agents), deltas)
        sat_fell = sum(b < a - 1e-12 for a, b in zip(stage["J"], stage["J"][1:]))
        counts["sat_fell"] += sat_fell
        assert sat_fell == 0, stage["J"]

    run()
    print(f"\nmonotonicity violations over {counts['examples']} random MDPs: joint {counts['joint_fell']}, "
          f"SAT {counts['sat_fell']}")
    assert counts["sat_fell"] == 0
