"""A researcher's own task (issue 46): the reward contract and its one-line errors, data files in four formats
with key mapping, roles per agent, trackers (TensorBoard read back by its own reader), reasoning-gym splits."""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grading import answers_match, vote_reward  # noqa: E402
from harness import datafiles  # noqa: E402
from harness.reward import (  # noqa: E402
    DEFAULT_REWARD,
    Reward,
    RewardError,
    call_reward,
    counterfactual_baselines,
    load_reward,
    probe,
    score_problems,
    vote_score,
)
from rollout import Turn, score_team  # noqa: E402
from rollout import counterfactual_baselines as rollout_counterfactual  # noqa: E402
from tasks import Problem  # noqa: E402
from team import Team, TeamConfig  # noqa: E402


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


# -- The reward contract ----------------------------------------------------------------------------------
PROMPTS = ["1+1", "2+2", "3+3"]
COMPLETIONS = [["2", "2"], ["4", "5"], ["7", "6"]]
COLUMNS = {"answer": ["2", "4", "6"], "agent_answers": COMPLETIONS, "protocol": "independent"}
IDS = ["a", "b", "c"]


def reward_file(tmp_path: Path, body: str, name: str = "rw.py") -> Path:
    return write(tmp_path / name, "import math\n\n" + textwrap.dedent(body))


def called(tmp_path: Path, body: str) -> pytest.ExceptionInfo:
    fn = load_reward(f"{reward_file(tmp_path, body)}:reward")
    with pytest.raises(RewardError) as err:
        call_reward(fn, PROMPTS, COMPLETIONS, COLUMNS, IDS)
    return err


def test_load_errors_are_one_line(tmp_path):
    cases = {
        f"{tmp_path}/missing.py:reward": "no such file",
        "no_such_package.mod:reward": "no module 'no_such_package.mod'",
        "rewardfile": "write FILE.py:NAME or package.module:NAME",
    }
    for spec, expected in cases.items():
        with pytest.raises(RewardError) as err:
            load_reward(spec)
        assert expected in one_line(err) and spec in str(err.value)
    path = reward_file(tmp_path, "def reward(prompts, completions, **c):\n    return []\n"
                                 "def helper(x):\n    return x\n")
    with pytest.raises(RewardError) as err:
        load_reward(f"{path}:rewrd")
    assert f"{path} has no 'rewrd'; it defines: reward, helper" in one_line(err)
    broken = reward_file(tmp_path, "x = 1\nraise ImportError('needs numpy 3')\n", "broken.py")
    with pytest.raises(RewardError) as err:
        load_reward(f"{broken}:reward")
    assert "importing" in one_line(err) and "ImportError: needs numpy 3 (broken.py:4)" in str(err.value)
    bad_syntax = write(tmp_path / "syntax.py", "def reward(:\n")
    with pytest.raises(RewardError) as err:
        load_reward(f"{bad_syntax}:reward")
    assert "SyntaxError" in one_line(err) and "syntax.py:1" in str(err.value)


@pytest.mark.parametrize("signature", ["completions", "prompts, completions", "prompts, completions, answer"])
def test_wrong_arguments_are_refused_at_load(tmp_path, signature):
    path = reward_file(tmp_path, f"def reward({signature}):\n    return [0.0]\n")
    with pytest.raises(RewardError) as err:
        load_reward(f"{path}:reward")
    assert "wrong arguments" in one_line(err) and "def NAME(prompts, completions, **columns)" in str(err.value)


def test_a_column_the_data_lacks_is_wrong_arguments_at_the_first_call(tmp_path):
    err = called(tmp_path, "def reward(prompts, completions, *, solution, **c):\n    return [0.0] * len(prompts)\n")
    assert "wrong arguments (missing a required argument: 'solution')" in one_line(err)
    assert "answer, agent_answers, protocol" in str(err.value)


def test_a_reward_that_raises_names_the_row_and_the_line(tmp_path):
    err = called(tmp_path, """\
        def reward(prompts, completions, answer, **c):
            return [1.0 / (int(a) - 4) for a in answer]
        """)
    assert one_line(err).startswith("reward ")
    assert ":reward raised on row 1 (id 'b'): ZeroDivisionError" in str(err.value)
    assert "rw.py:4)" in str(err.value)


@pytest.mark.parametrize("body, expected", [
    ("return [0.5, 0.5]", "returned 2 values for 3 rows"),
    ("return 0.5", "returned float 0.5, not a list of 3 numbers"),
    ("return {'a': 1}", "returned dict {'a': 1}, not a list of 3 numbers"),
    ("return [0.0, math.nan, 0.0]", "row 1 (id 'b'): value nan is not finite"),
    ("return [0.0, 0.0, math.inf]", "row 2 (id 'c'): value inf is not finite"),
    ("return [0.0, 1.5, 0.0]", "row 1 (id 'b'): value 1.5 is outside its range [0.0, 1.0]"),
    ("return [0.0, -0.1, 0.0]", "row 1 (id 'b'): value -0.1 is outside its range [0.0, 1.0]"),
    ("return [0.0, None, 0.0]", "row 1 (id 'b'): value None is not a number"),
    ("return [0.0, '1', 0.0]", "row 1 (id 'b'): value '1' is not a number"),
])
def test_bad_values_give_one_line_naming_function_row_and_value(tmp_path, body, expected):
    err = called(tmp_path, f"def reward(prompts, completions, **c):\n    {body}\n")
    assert expected in one_line(err) and f"{tmp_path}/rw.py:reward" in str(err.value)


def test_reward_range_attribute_sets_the_range(tmp_path):
    path = reward_file(tmp_path, """\
        def reward(prompts, completions, **c):
            return [-1.0, 2.0, 0.5]
        reward.reward_range = (-1, 2)
        """)
    fn = load_reward(f"{path}:reward")
    assert fn.range == (-1.0, 2.0)
    assert call_reward(fn, PROMPTS, COMPLETIONS, COLUMNS, IDS) == [-1.0, 2.0, 0.5]
    for bad in ("(1, 1)", "(0, math.inf)", "'0-1'", "(2, 1)"):
        path = reward_file(tmp_path, f"def reward(p, c, **k):\n    return []\nreward.reward_range = {bad}\n", "r2.py")
        with pytest.raises(RewardError) as err:
            load_reward(f"{path}:reward")
        assert "reward_range must be (lo, hi) with finite lo < hi" in one_line(err)


def test_numpy_and_tensor_values_are_accepted_and_inputs_are_copies(tmp_path):
    path = reward_file(tmp_path, """\
        import torch
        def reward(prompts, completions, answer, **c):
            completions[0][0] = "edited"
            answer.clear()
            return torch.tensor([1.0, 0.0, 0.5])
        """)
    prompts, completions, columns = list(PROMPTS), [list(c) for c in COMPLETIONS], json.loads(json.dumps(COLUMNS))
    assert call_reward(load_reward(f"{path}:reward"), prompts, completions, columns, IDS) == [1.0, 0.0, 0.5]
    assert completions == COMPLETIONS and columns == COLUMNS  # the caller's batch is untouched


def test_probe_refuses_a_random_or_batch_dependent_reward(tmp_path):
    path = reward_file(tmp_path, """\
        import random
        def noisy(prompts, completions, **c):
            return [random.random() for _ in prompts]
        def ranked(prompts, completions, answer, **c):
            return [i / len(prompts) for i in range(len(prompts))]
        def fine(prompts, completions, answer, **c):
            return [float(texts[0] == a) for texts, a in zip(completions, answer)]
        """)
    with pytest.raises(RewardError) as err:
        probe(load_reward(f"{path}:noisy"), PROMPTS, COMPLETIONS, COLUMNS, IDS)
    assert "is not deterministic: row 0 (id 'a') got" in one_line(err) and "on the same input" in str(err.value)
    with pytest.raises(RewardError) as err:
        probe(load_reward(f"{path}:ranked"), PROMPTS, COMPLETIONS, COLUMNS, IDS)
    assert "with the rows in reverse order" in one_line(err)
    assert probe(load_reward(f"{path}:fine"), PROMPTS, COMPLETIONS, COLUMNS, IDS) == [1.0, 1.0, 0.0]


def test_a_package_module_reward_loads(tmp_path, monkeypatch):
    pkg = tmp_path / "myrewards"
    pkg.mkdir()
    write(pkg / "__init__.py", "")
    write(pkg / "team.py", "def reward(prompts, completions, **c):\n    return [1.0] * len(prompts)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward("myrewards.team:reward")
    assert call_reward(fn, PROMPTS, COMPLETIONS, COLUMNS) == [1.0, 1.0, 1.0]


# -- The built-in reward through the same path: equal to the rollout's --------------------------------------
ANSWERS = st.sampled_from([None, "", "2", "02", "2.0", "3", "1/2", "0.5", "\\frac{1}{2}", "x", "-2", "4"])
GOLDS = st.sampled_from(["2", "3", "1/2", "4", "x"])


def turns_of(answers: list[list]) -> list[Turn]:
    """Rollout turns holding only what score_team reads: each agent's extracted answers."""
    n, empty = len(answers), torch.zeros(len(answers), 1)
    return [Turn(k, empty, empty, empty, empty, empty, [""] * n, [a[k] for a in answers], torch.zeros(n, dtype=bool))
            for k in range(len(answers[0]))]


@given(st.integers(1, 4).flatmap(lambda k: st.lists(st.tuples(st.lists(ANSWERS, min_size=k, max_size=k), GOLDS),
                                                    min_size=1, max_size=6)),
       st.sampled_from(["independent", "chain"]))
def test_default_reward_equals_the_rollouts_team_reward(rows, protocol):
    answers = [a for a, _ in rows]
    problems = [Problem(f"p{i}", "q", gold) for i, (_, gold) in enumerate(rows)]
    team = Team([object()] * len(answers[0]), TeamConfig(protocol=protocol))
    group_ids = torch.arange(len(rows))
    expected = score_team(team, problems, turns_of(answers), group_ids)[1]
    completions = [[str(a) for a in row] for row in answers]
    got = score_problems(DEFAULT_REWARD, problems, completions, answers, protocol, check_determinism=True)
    assert torch.equal(torch.tensor(got).float(), expected)  # the rollout keeps float32 rewards


@given(st.lists(ANSWERS, min_size=1, max_size=5), GOLDS)
def test_vote_score_with_correctness_is_vote_reward(answers, gold):
    assert vote_score(answers, lambda a: float(answers_match(a, gold))) == vote_reward(answers, gold)


@given(st.lists(st.lists(ANSWERS, min_size=3, max_size=3), min_size=2, max_size=6), st.integers(1, 3), GOLDS)
def test_counterfactual_baselines_equal_the_rollouts_for_the_default_reward(answers, groups, gold):
    group_ids = torch.arange(len(answers)) % groups
    problems = [Problem(f"g{g}", "q", gold) for g in group_ids.tolist()]
    expected = rollout_counterfactual(answers, problems, group_ids)
    texts = [[str(a) for a in row] for row in answers]
    got = counterfactual_baselines(DEFAULT_REWARD, problems, texts, answers, "independent", group_ids)
    assert torch.allclose(got, expected, atol=1e-12)


def test_counterfactual_baselines_with_a_user_reward_and_its_own_range():
    """b_k by its definition (the mean of R over agent k's other responses in the group) for a reward in
    [-1, 2] that reads the texts: the swap carries agent k's text, not only its answer."""
    def margin(prompts, completions, **columns):  # longest minus shortest response, scaled into [-1, 2]
        return [min(2.0, -1.0 + (max(map(len, c)) - min(map(len, c))) / 4) for c in completions]
    margin.reward_range = (-1.0, 2.0)
    texts = [["a", "bbb", "cc"], ["dddd", "e", "ff"], ["g", "h", "iiiiiii"], ["jj", "k", "l"]]
    group_ids = torch.tensor([0, 0, 0, 1])
    problems = [Problem("p", "q", "0")] * 4
    reward = Reward(margin, "margin", margin.reward_range)
    got = counterfactual_baselines(reward, problems, texts, [[None] * 3] * 4, "independent", group_ids)
    for k in range(3):
        for t in range(3):
            swaps = [texts[t][:k] + [texts[u][k]] + texts[t][k + 1:] for u in range(3) if u != t]
            assert got[k, t].item() == pytest.approx(sum(margin([], swaps)) / 2)
    assert got[:, 3].tolist() == [0.0, 0.0, 0.0]  # a group of one: no swap, b = 0 as in the rollout


def test_the_example_reward_through_the_checked_path():
    fn = load_reward(str(ROOT / "examples" / "addition_reward.py") + ":reward")
    problems = datafiles.load_problems(str(ROOT / "examples" / "addition.jsonl"))
    assert len(problems) == 200 and isinstance(problems[0].columns["answer"], int)
    gold = problems[0].columns["answer"]
    completions = [[str(gold), f" {gold}\n", str(gold + 1)], ["", "x", "-1"]]
    values = score_problems(fn, problems[:2], completions, [[None] * 3] * 2, "independent", check_determinism=True)
    assert values == [pytest.approx(2 / 3), 0.0]
    heldout = {p.problem for p in datafiles.load_problems(str(ROOT / "examples" / "addition_heldout.jsonl"))}
    assert not heldout & {p.problem for p in problems}
