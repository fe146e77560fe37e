"""The LLM role-selection game (experiments/role_selection.py llm): its team reward is the exact game's reward
on text, its statistics and criterion do what the docstring says, and the driver runs through sat.py end to end."""
import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_claims_exact import rs
from test_experiments import table_rows

TEXT = {rs.PASS: "PASS", rs.RIGHT: "{gold}", rs.WRONG: "{wrong}"}


@pytest.mark.parametrize("n", [1, 2, 3])
def test_game_reward_is_the_exact_games_reward_on_text(n):
    """Every joint action of PASS/RIGHT/WRONG, written as text (with stray whitespace), earns what the enumerated
    game's reward tensor says; one_answer_reward counts the rows with exactly one non-PASS response."""
    exact = rs.role_game(n).reward
    for gold in (0, 7, 58):
        for a in itertools.product(range(3), repeat=n):
            texts = [" " + TEXT[x].format(gold=gold, wrong=gold + 1) + "\n" for x in a]
            assert rs.game_reward(["p"], [texts], total=[gold]) == [float(exact[a])]
            assert rs.one_answer_reward(["p"], [texts]) == [float(sum(x != rs.PASS for x in a) == 1)]
            assert rs.answered_reward(["p"], [texts]) == [sum(x != rs.PASS for x in a) / n]
            assert rs.right_reward(["p"], [texts], total=[gold]) == [sum(x == rs.RIGHT for x in a) / n]


@given(sd=st.floats(0.001, 0.2), target=st.floats(0.005, 0.1))
def test_seeds_for_is_the_fewest_seeds_reaching_the_mde(sd, target):
    k = rs.seeds_for(sd, target)
    power = lambda k: (rs.common.t_quantile(k - 1) + rs.common.t_quantile(k - 1, 0.6)) * sd / math.sqrt(k)  # noqa: E731
    if k < 1000:
        assert power(k) <= target
    if k > 2:
        assert power(k - 1) > target
    half = rs.common.t_quantile(k - 1) * sd / math.sqrt(k)  # the 95% half-width k seeds would give
    assert rs.mde(half, k) == pytest.approx(power(k))


def cell(diff, mde, falls, backtracked=0.9):
    return {"diff": diff, "mde": mde, "falls": falls, "backtracked": backtracked}


@pytest.mark.parametrize("joint, regen_falls, verdict", [
    (cell((-0.05, 0.02), 0.03, 0.2), 0.0, "holds"),
    (cell((-0.05, 0.02), 0.03, 0.0), 0.0, "inconclusive"),  # a loss, but joint falls no more often
    (cell((0.01, 0.015), 0.02, 0.0), 0.0, "refuted"),  # lower end -0.005 > -MDE
    (cell((-0.01, 0.015), 0.02, 0.0), 0.0, "inconclusive"),  # lower end -0.025 < -MDE, upper end > 0
    (cell((-0.05, 0.02), 0.03, 0.2, backtracked=0.4), 0.0, "not judged"),
    # the run (2 seeds): lower end -0.124 is above -MDE, but an MDE of 0.133 against the named 0.03 could
    # not have seen the effect
    (cell((-0.004, 0.120), 0.133, 0.0), 0.0, "underpowered"),
    (cell((0.01, 0.015), 0.031, 0.0), 0.0, "underpowered"),  # just past the named effect
    (cell((-0.01, 0.015), 0.02, 0.0), 0.0, "inconclusive"),
    (cell((0.0, 0.0), math.nan, 0.0), 0.0, "underpowered"),  # one seed: no interval, no power
    (cell((-0.2, 0.15), 0.17, 0.2), 0.0, "holds"),  # an effect seen needs no power argument
])
def test_llm_verdict_applies_the_criterion(joint, regen_falls, verdict):
    other = {"diff": (math.nan, math.nan), "mde": math.nan, "backtracked": 0.9}
    cells = {(2, 0.5, "joint"): joint, (2, 0.5, "sat-regenerate"): dict(other, falls=regen_falls),
             (2, 0.5, "sat-weights"): dict(other, falls=0.0)}
    lines = rs.llm_verdict(cells, [2], [0.5])
    assert lines[0].endswith(verdict)
    assert lines[-1].endswith(verdict if verdict in ("holds", "refuted", "underpowered") else "not established")


def test_llm_verdict_overall_mixes_to_not_established():
    """Refuted in one cell and underpowered in another: neither refuted nor underpowered overall."""
    other = {"diff": (math.nan, math.nan), "mde": math.nan, "backtracked": 0.9, "falls": 0.0}
    cells = {}
    for delta, joint in ((0.05, cell((0.01, 0.015), 0.02, 0.0)), (0.5, cell((-0.004, 0.12), 0.133, 0.0))):
        cells.update({(2, delta, "joint"): joint, (2, delta, "sat-regenerate"): other,
                      (2, delta, "sat-weights"): other})
    lines = rs.llm_verdict(cells, [2], [0.05, 0.5])
    assert [ln.rsplit(": ", 1)[1] for ln in lines] == ["refuted", "underpowered", "not established"]


def test_llm_refuses_a_team_of_one(capsys):
    with pytest.raises(SystemExit):
        rs.parse_args(["llm", "--n", "1,2"])
    assert "at least 2 agents" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        rs.parse_args(["exact", "--batch-size", "8"])
    assert "unrecognized arguments: --batch-size 8" in capsys.readouterr().err


@pytest.mark.slow  # about a minute on two busy cores: a warm agent, a stage-0 team and three one-stage runs
def test_llm_game_runs_through_sat_and_resumes(tmp_path, capsys):
    out = tmp_path / "rs"
    argv = ["llm", "--seeds", "0", "--n", "2", "--deltas", "0.5", "--stages", "1", "--warmup-steps", "5",
            "--out", str(out), "--quiet", "--batch-size", "32", "--group-size", "4", "--epochs", "1",
            "--minibatch-size", "16", "--eval-size", "16"]
    assert rs.main(argv) == 0
    rows = table_rows(out)
    assert [r[2] for r in rows] == ["joint", "sat-regenerate", "sat-weights"]
    assert all(0 <= float(r[4]) <= 1 for r in rows)  # the backtrack share
    assert "claim 1 in the LLM role-selection game:" in (out / "table.md").read_text()
    assert (out / "plot.png").stat().st_size > 0
    capsys.readouterr()
    assert rs.main(argv) == 0
    said = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[experiments]")]
    assert len(said) == 5 and all(ln.endswith("skipped (finished)") for ln in said)

