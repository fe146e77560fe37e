"""Claims 1 and 2 checked exactly on enumerable teams (experiments/exact_team.py, role_selection.py,
stale_rollouts_exact.py): SAT, arXiv 2605.05216, Algorithm 1 and Theorem 4.2; TeamTR, arXiv 2605.15207.

Every expectation is a finite sum in float64, so the properties hold to rounding: a sequential step on fresh
advantages never lowers J and claims exactly its change, every step stays inside its KL ball, joint steps from a
symmetric start stay symmetric and below (1 - 1/n)^(n-1), and the tensor code agrees with plain loops."""
import importlib.util
import itertools
import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]


def load(name: str):
    """experiments/<name>.py as a module of its own name, registered so that the drivers' own
    `import exact_team` finds this same module (dataclasses also need it in sys.modules)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


et = load("exact_team")
rs = load("role_selection")
sr = load("stale_rollouts_exact")

TOL = 1e-12


@st.composite
def games(draw, protocols=et.PROTOCOLS, agents=(1, 4)):
    """A random game (either protocol, random reward in [0, 1]) and a random full-support team on it."""
    protocol = draw(st.sampled_from(protocols))
    n = draw(st.integers(*agents))
    k = draw(st.integers(2, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    game = et.Game(protocol, torch.rand([k] * n, generator=gen, dtype=et.DTYPE))
    return game, et.random_team(game, seed + 1, scale=1.5)


# -- The tensor code against plain loops -----------------------------------------------------------------------------
def context_of(game, k, a):
    """Agent k's row for joint action a: 0 (independent) or ravel(a_0..a_{k-1}) (chain)."""
    if game.protocol == "independent":
        return 0
    return sum(x * game.n_actions ** (k - 1 - m) for m, x in enumerate(a[:k]))


def loop_prob(game, team, a):
    return math.prod(float(team[k][context_of(game, k, a), a[k]].exp()) for k in range(game.n_agents))


def loop_advantage(game, team, k, w, b):
    """E[w (R - b) | context_k = c, a_k = a] by conditioning a list of all joint actions (full-support team)."""
    num = torch.zeros(game.n_contexts(k), game.n_actions, dtype=et.DTYPE)
    den = torch.zeros_like(num)
    for a in itertools.product(range(game.n_actions), repeat=game.n_agents):
        p, c = loop_prob(game, team, a), context_of(game, k, a)
        num[c, a[k]] += p * float(w[a]) * (float(game.reward[a]) - b)
        den[c, a[k]] += p
    return num / den


@given(case=games(), data=st.data())
def test_enumeration_matches_plain_loops(case, data):
    game, team = case
    joint = sum(loop_prob(game, team, a) * float(game.reward[a])
                for a in itertools.product(range(game.n_actions), repeat=game.n_agents))
    assert et.value(game, team) == pytest.approx(joint, abs=TOL)
    k = data.draw(st.integers(0, game.n_agents - 1))
    adv, b = et.advantage(game, team, k)
    assert b == pytest.approx(joint, abs=TOL)
    torch.testing.assert_close(adv, loop_advantage(game, team, k, torch.ones_like(game.reward), b), rtol=0, atol=1e-12)
    # the truncated weights of some promoted agents, and the weighted baseline, against loops
    promoted = {m: et.random_team(game, data.draw(st.integers(0, 99)))[m] for m in range(game.n_agents) if m != k}
    w = et.truncated_weight(game, team, promoted)
    for a in itertools.product(range(game.n_actions), repeat=game.n_agents):
        want = math.prod(min(1.0, float((promoted[m][context_of(game, m, a), a[m]]
                                         - team[m][context_of(game, m, a), a[m]]).exp())) for m in promoted)
        assert float(w[a]) == pytest.approx(want, abs=TOL)
    adv_w, b_w = et.advantage(game, team, k, w)
    p = et.joint_probs(game, team)
    assert b_w == pytest.approx(float((p * w * game.reward).sum() / (p * w).sum()), abs=TOL)
    torch.testing.assert_close(adv_w, loop_advantage(game, team, k, w, b_w), rtol=0, atol=1e-12)


# -- Sequential steps, every condition's KL --------------------------------------------------------------------------
@given(case=games(agents=(2, 4)), delta=st.floats(1e-3, 2.0), data=st.data())
def test_sequential_fresh_steps_never_lower_j_and_claim_the_true_change(case, delta, data):
    """Theorem 4.2 with exact advantages: only agent k moves and its contexts' law is fixed, so the surrogate is
    the change of J, and the tilt's surrogate is >= 0 (pi_old is feasible)."""
    game, team = case
    order = data.draw(st.permutations(range(game.n_agents)))
    for stage in et.run(game, team, delta, 2, "regenerate", order):
        for step in stage.steps:
            assert step.j_after >= step.j_before - TOL
            assert abs(step.gap) <= 1e-10
            assert step.kl_max <= delta + 1e-12


@given(case=games(agents=(2, 4)), delta=st.floats(1e-3, 2.0), condition=st.sampled_from(et.CONDITIONS))
def test_every_step_stays_inside_its_trust_region(case, delta, condition):
    game, team = case
    prev = team
    for stage in et.run(game, team, delta, 2, condition):
        assert all(s.kl_max <= delta + 1e-12 for s in stage.steps)
        for old, new in zip(prev, stage.team):  # a stage moves each agent once: its own KL is the step's
            assert float(et.tr.per_state_kl(new, old).max()) <= delta + 1e-12
        prev = stage.team


@given(n=st.integers(2, 4), seed=st.integers(0, 2**31 - 1), delta=st.floats(1e-3, 2.0))
def test_chain_order_weights_step_like_regenerate_and_never_over_claim(n, seed, delta):
    """Prediction Q2: in chain order the truncated weights depend only on the stepping agent's context, so they do
    not move its per-context maximiser; the gain they claim counts contexts at prod min(pi, pi') <= prod pi'."""
    game = sr.chain_game(n)
    team = et.random_team(game, seed)
    regen = et.run(game, team, delta, 2, "regenerate")
    weights = et.run(game, team, delta, 2, "weights")
    for a, b in zip(regen, weights):
        assert b.j_after == pytest.approx(a.j_after, abs=1e-9)
        assert all(s.gap <= TOL for s in b.steps)
    assert weights[0].steps[0].gap == pytest.approx(0.0, abs=TOL)  # the first agent has no promoted agent before it


def test_truncated_weights_under_claim_a_chain_stage():
    """The stale contexts' cost is visible: after the first agent, weights claims strictly less than it gains."""
    game = sr.chain_game(3)
    stage = et.run(game, et.random_team(game, 0), 0.2, 1, "weights")[0]
    assert all(s.gap < -1e-6 for s in stage.steps[1:])


# -- The role-selection game -----------------------------------------------------------------------------------------
def symmetric_team(game, p_pass, p_right):
    return et.uniform_team(game, [p_pass, p_right, max(0.0, 1 - p_pass - p_right)])


@given(n=st.integers(1, 5), p_pass=st.floats(0.0, 1.0), share=st.floats(0.0, 1.0))
def test_symmetric_bound_is_the_max_over_symmetric_policies(n, p_pass, share):
    """J of a symmetric (PASS p, RIGHT r, WRONG w) team is n r p^(n-1) <= (1 - 1/n)^(n-1), attained at
    r = 1/n, w = 0."""
    game = rs.role_game(n)
    p_right = (1 - p_pass) * share
    j = et.value(game, symmetric_team(game, p_pass, p_right))
    assert j == pytest.approx(n * p_right * p_pass ** (n - 1), abs=TOL)
    assert j <= rs.symmetric_bound(n) + TOL
    best = et.value(game, et.uniform_team(game, [1 - 1 / n, 1 / n, 0.0]))
    assert best == pytest.approx(rs.symmetric_bound(n), abs=TOL)


def test_role_game_rewards_exactly_one_right_answerer():
    for n in (1, 2, 4):
        game = rs.role_game(n)
        winners = [a for a in itertools.product(range(3), repeat=n) if game.reward[a] == 1]
        assert sorted(winners) == sorted(tuple(rs.RIGHT if i == j else rs.PASS for i in range(n)) for j in range(n))
        assert float(game.reward.sum()) == n


@given(n=st.integers(2, 5), p_answer=st.floats(0.05, 0.95), p_correct=st.floats(0.05, 1.0),
       delta=st.floats(1e-3, 2.0))
def test_joint_from_a_symmetric_start_keeps_symmetry_and_the_bound(n, p_answer, p_correct, delta):
    """Prediction P2: equal tables get equal advantages and equal tilts, so joint never leaves the symmetric
    policies, whose J is at most (1 - 1/n)^(n-1)."""
    game = rs.role_game(n)
    team = et.uniform_team(game, rs.start_policy(p_answer, p_correct))
    for stage in et.run(game, team, delta, 4, "joint"):
        assert rs.asymmetry(stage.team) <= 1e-9
        assert stage.j_after <= rs.symmetric_bound(n) + TOL


@given(n=st.integers(2, 5), delta=st.floats(0.01, 1.0))
def test_sequential_breaks_the_symmetry_in_its_first_stage(n, delta):
    """The second agent's fresh advantage sees the first agent already moved, so their steps differ: the
    sequential team leaves the symmetric set (where joint stays) in one stage, and does not lose."""
    game = rs.role_game(n)
    team = et.uniform_team(game, rs.start_policy(0.5, 0.7))
    stage = et.run(game, team, delta, 1, "regenerate")[0]
    assert rs.asymmetry(stage.team) > 1e-3
    assert stage.j_after > stage.j_before


def test_exact_table_predictions_at_one_cell():
    """The driver's criterion on one cell of its table (n = 3, delta = 0.2), small enough for CI."""
    cell = rs.exact_cell(3, 0.2, 10, rs.start_policy(0.5, 0.7))
    assert rs.predictions(cell) == {"P1": True, "P2": True, "P3": True, "P4": True}
    assert cell["runs"]["regenerate"][-1].j_after == pytest.approx(1.0, abs=1e-9)
    assert rs.one_answerer(cell["runs"]["regenerate"][-1].team) == pytest.approx(1.0, abs=1e-9)


# -- The fit and the command lines -----------------------------------------------------------------------------------
def test_fit_tells_quadratic_from_linear_growth():
    ns = [2, 3, 4, 5]
    quad = sr.fit(ns, [0.3 * n * (n - 1) / 2 for n in ns])
    assert quad["quadratic"][0] == pytest.approx(0.3) and quad["quadratic"][1] == pytest.approx(0.0, abs=1e-20)
    assert quad["linear"][1] > 0
    lin = sr.fit(ns, [0.3 * (n - 1) for n in ns])
    assert lin["linear"][1] == pytest.approx(0.0, abs=1e-20) and lin["quadratic"][1] > 0
    assert sr.fit(ns, [n ** 2 for n in ns])["slope"] == pytest.approx(2.0)


@pytest.mark.parametrize("argv, message", [
    (["exact", "--n", "two"], "comma-separated numbers"),
    (["exact", "--p-answer", "1.5"], "p_answer"),
    (["exact", "--stages", "0"], "--stages"),
])
def test_role_selection_refuses_bad_input_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit):
        rs.parse_args(argv)
    assert message in capsys.readouterr().err


def test_engine_refuses_bad_input():
    game = sr.chain_game(2)
    team = et.random_team(game, 0)
    with pytest.raises(ValueError, match="permutation"):
        et.sequential_stage(game, team, 0.1, [0, 0], "regenerate")
    with pytest.raises(ValueError, match="condition"):
        et.run(game, team, 0.1, 1, "stale")
    with pytest.raises(ValueError, match="delta"):
        et.run(game, team, 0.0, 1, "joint")
    with pytest.raises(ValueError, match="protocol"):
        et.Game("vote", game.reward)


@given(case=games(agents=(2, 4)), delta=st.floats(1e-3, 2.0), data=st.data())
def test_untruncated_weights_recover_the_fresh_step(case, delta, data):
    """With the full ratio prod pi_new / pi_cur of the promoted agents in place of its truncation, the stage
    start's rollouts give the fresh advantage (up to a per-context scale and shift) and the fresh step: whatever
    ``weights`` does differently (role game: steps that lower J) comes from the truncation min(1, rho) alone."""
    game, start = case
    order = data.draw(st.permutations(range(game.n_agents)))
    cur, promoted = list(start), {}
    for k in order:
        full = et.joint_probs(game, cur, list(promoted)) / et.joint_probs(game, start, list(promoted))  # [K]*n
        fresh, _ = et.tilt(cur[k], et.advantage(game, cur, k)[0], delta)
        via_start, _ = et.tilt(cur[k], et.advantage(game, start, k, full)[0], delta)
        # a context the promoted agents no longer reach has no data in either estimator; only reached ones compare
        reached = reach(game, cur, k) > 0  # [C_k]
        torch.testing.assert_close(via_start.exp()[reached], fresh.exp()[reached], rtol=0, atol=1e-7)
        cur[k] = promoted[k] = fresh


def reach(game, team, k):
    """P(context_k = c) under team, [C_k]."""
    if game.protocol == "independent":
        return torch.ones(1, dtype=et.DTYPE)
    grid = et.joint_probs(game, team, list(range(k)))  # [K]*n, constant along the axes from k on
    return grid[(slice(None),) * k + (0,) * (game.n_agents - k)].reshape(-1)  # [K^k]
