"""A researcher's own task (issue 46): the reward contract and its one-line errors, data files in four formats
with key mapping, roles per agent, reasoning-gym splits (the trackers: tests/test_trackers.py)."""
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

from harness import datafiles, reasoning_gym_task, roles  # noqa: E402
from harness.math_grading import (  # noqa: E402
    DEFAULT_REWARD,
    answers_match,
    math_team_config,
    vote_reward,
    vote_score,
)
from harness.user_reward import CheckedReward, RewardError, call_reward, load_reward, probe  # noqa: E402
from reward import Reward, columns_of, counterfactual_baselines, score  # noqa: E402
from rollout import Turn, score_team  # noqa: E402
from team import (  # noqa: E402
    Problem,  # noqa: E402
    Team,
)


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def score_problems(reward, problems, completions, answers, protocol, check_determinism=False) -> list[float]:
    """``reward.score``, or with ``check_determinism`` the probe's three calls on the same rows."""
    if not check_determinism:
        return score(reward, problems, completions, answers, protocol)
    return probe(reward, [p.problem for p in problems], completions, columns_of(problems, answers, protocol),
                 [p.id for p in problems])


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
    write(pkg / "needs.py", "import not_installed_dep\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward("myrewards.team:reward")
    assert call_reward(fn, PROMPTS, COMPLETIONS, COLUMNS) == [1.0, 1.0, 1.0]
    with pytest.raises(RewardError) as err:
        load_reward("myrewards.needs:reward")
    assert ("importing myrewards.needs raised ModuleNotFoundError: No module named 'not_installed_dep' (needs.py:1)"
            in one_line(err))


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
    team = Team([object()] * len(answers[0]), math_team_config(protocol=protocol))
    group_ids = torch.arange(len(rows))
    expected = score_team(team, problems, turns_of(answers), group_ids)[1]
    completions = [[str(a) for a in row] for row in answers]
    got = score_problems(DEFAULT_REWARD, problems, completions, answers, protocol, check_determinism=True)
    assert torch.equal(torch.tensor(got).float(), expected)  # the rollout keeps float32 rewards


@given(st.lists(ANSWERS, min_size=1, max_size=5), GOLDS)
def test_vote_score_with_correctness_is_vote_reward(answers, gold):
    assert vote_score(answers, lambda a: float(answers_match(a, gold))) == vote_reward(answers, gold)


@given(st.lists(st.lists(ANSWERS, min_size=3, max_size=3), min_size=2, max_size=6), st.integers(1, 3), GOLDS)
def test_counterfactual_baselines_of_the_default_reward_by_their_definition(answers, groups, gold):
    """b_k(t): the vote's correctness with agent k's answer swapped for each of its others in t's group, averaged."""
    group_ids = torch.arange(len(answers)) % groups
    problems = [Problem(f"g{g}", "q", gold) for g in group_ids.tolist()]
    texts = [[str(a) for a in row] for row in answers]
    got = counterfactual_baselines(DEFAULT_REWARD, problems, texts, answers, "independent", group_ids)
    for k in range(3):
        for t in range(len(answers)):
            mates = [u for u in range(len(answers)) if group_ids[u] == group_ids[t] and u != t]
            swaps = [vote_reward(answers[t][:k] + [answers[u][k]] + answers[t][k + 1:], gold) for u in mates]
            assert got[k, t].item() == pytest.approx(sum(swaps) / len(swaps) if swaps else 0.0, abs=1e-6)


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


# -- Data files -------------------------------------------------------------------------------------------
ROWS = [
    {"id": "r1", "question": "23+15", "reward_model": {"ground_truth": 38, "style": "rule"}, "source": "mine"},
    {"id": "r2", "question": "10+11", "reward_model": {"ground_truth": 21, "style": "rule"}, "source": "mine"},
]


def write_all_formats(tmp_path: Path, rows: list[dict]) -> dict[str, Path]:
    """The same rows as .jsonl, .json, .csv (nested fields flattened to dotted columns) and .parquet."""
    import pandas as pd

    paths = {ext: tmp_path / f"data{ext}" for ext in (".jsonl", ".json", ".csv", ".parquet")}
    paths[".jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths[".json"].write_text(json.dumps(rows))
    pd.json_normalize(rows).to_csv(paths[".csv"], index=False)
    pd.DataFrame(rows).to_parquet(paths[".parquet"])
    return paths


def test_four_formats_give_the_same_problems_with_key_mapping(tmp_path):
    for ext, path in write_all_formats(tmp_path, ROWS).items():
        problems = datafiles.load_problems(str(path), problem_key="question", answer_key="reward_model.ground_truth")
        assert [(p.id, p.problem, p.answer) for p in problems] == [("r1", "23+15", "38"), ("r2", "10+11", "21")], ext
        assert [p.columns["answer"] for p in problems] == [38, 21], ext  # the raw gold reaches the reward
        assert all(p.columns["source"] == "mine" and "question" not in p.columns for p in problems), ext
        assert isinstance(problems[0], Problem) and problems[0].system is None


def test_a_chat_prompt_keeps_its_system_turn_and_ids_default_to_row_numbers(tmp_path):
    chat = [{"prompt": [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "2+2"}],
             "answer": "4"},
            {"prompt": [{"role": "user", "content": "3+3"}], "answer": 6}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in chat))
    problems = datafiles.load_problems(str(path))  # no "problem" column: "prompt" is taken, as load_jsonl does
    assert [(p.id, p.problem, p.answer, p.system) for p in problems] == [
        ("chat-1", "2+2", "4", "Answer with a number."), ("chat-2", "3+3", "6", None)]


def test_data_errors_are_one_line_naming_what_the_file_has(tmp_path):
    paths = write_all_formats(tmp_path, ROWS)
    with pytest.raises(ValueError) as err:
        datafiles.load_problems(str(paths[".parquet"]), problem_key="question", answer_key="reward_model.truth")
    assert ("no column 'reward_model.truth' (--answer-key); it has: id, question, reward_model, "
            "reward_model.ground_truth, reward_model.style, source") in one_line(err)
    with pytest.raises(ValueError) as err:
        datafiles.load_problems(str(paths[".jsonl"]), answer_key="reward_model.ground_truth")
    assert "no column 'problem' (--problem-key)" in one_line(err)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "1+1", "answer": 2}) + "\n" + json.dumps({"problem": "2+2", "answer": ""}))
    with pytest.raises(ValueError) as err:
        datafiles.load_problems(str(bad))
    assert "bad.jsonl: row 2: 'answer' is empty" in one_line(err)
    twice = tmp_path / "twice.jsonl"
    twice.write_text("".join(json.dumps({"id": 7, "problem": f"{i}+1", "answer": i + 1}) + "\n" for i in range(2)))
    with pytest.raises(ValueError) as err:
        datafiles.load_problems(str(twice))
    assert "rows 1 and 2 share the id '7'" in one_line(err)
    clash = tmp_path / "clash.jsonl"
    clash.write_text(json.dumps({"problem": "1+1", "answer": "two", "final": 2}) + "\n")
    with pytest.raises(ValueError) as err:
        datafiles.load_problems(str(clash), answer_key="final")
    assert "column 'answer' would hide the reward's own argument" in one_line(err)
    with pytest.raises(FileNotFoundError) as err:
        datafiles.load_problems(str(tmp_path / "none.csv"))
    assert "none.csv: no such file" in one_line(err)


def test_the_repositorys_jsonl_files_read_as_load_jsonl_reads_them():
    from harness.tasks import load_jsonl

    problem_files = [p for p in sorted((ROOT / "data").glob("*.jsonl"))  # PlanBench's instances are no problems
                     if {"problem", "prompt"} & set(json.loads(p.open().readline()))]
    assert len(problem_files) >= 3
    for path in problem_files:
        expected = [(p.id, p.problem, p.answer) for p in load_jsonl(path)]
        assert [(p.id, p.problem, p.answer) for p in datafiles.load_problems(str(path))] == expected, path.name


def test_hub_specs_parse_and_files_are_told_apart():
    assert datafiles.parse_hub_spec("org/name") == ("org/name", None, "train")
    assert datafiles.parse_hub_spec("org/name:main:test") == ("org/name", "main", "test")
    assert datafiles.parse_hub_spec("org/name:default:train[:100]") == ("org/name", "default", "train[:100]")
    assert datafiles.is_data_file("x/y.parquet") and not datafiles.is_data_file("org/name")
    with pytest.raises(ValueError) as err:
        datafiles.parse_hub_spec("not a dataset")
    assert "neither a data file" in one_line(err)


# -- Roles -------------------------------------------------------------------------------------------------
CHAIN_ROLES = """\
previous: answers
agents:
  - system: You solve.
    user: "Solve {problem}"
  - system: You check.
    user: "{problem}\\nEarlier:\\n{previous}"
  - user: "{problem} | {previous} | final?"
"""


def test_roles_render_per_agent_with_previous_in_the_chain(tmp_path):
    path = write(tmp_path / "roles.yaml", CHAIN_ROLES)
    r = roles.load_roles(path, 3, "chain")
    problem = Problem("p", "2+2", "4", "Row system.", {})
    assert r.messages(0, problem, [], []) == [{"role": "system", "content": "You solve."},
                                              {"role": "user", "content": "Solve 2+2"}]
    assert r.messages(1, problem, ["I think 4"], ["4"])[1]["content"] == "2+2\nEarlier:\nAgent 1: 4"
    third = r.messages(2, problem, ["I think 4", "no"], ["4", None])
    assert third == [{"role": "system", "content": "Row system."},  # no system in the role: the row's own
                     {"role": "user", "content": "2+2 | Agent 1: 4\nAgent 2: ? | final?"}]
    full = roles.parse_roles({**json.loads(json.dumps(roles.load_roles(path, 3, "chain").to_dict())),
                              "previous": "full"}, "x", 3, "chain")
    assert full.messages(1, Problem("p", "2+2", "4"), ["I think 4"], ["4"])[1]["content"] == \
        "2+2\nEarlier:\nAgent 1:\nI think 4"
    saved = roles.save_roles(r, tmp_path)
    assert roles.load_roles(saved, 3, "chain") == r  # the run folder's copy rebuilds the same prompts


def test_one_role_for_all_agents_in_json_through_a_chat_template(tmp_path):
    from harness.loading import build_char_tokenizer

    path = write(tmp_path / "roles.json", json.dumps([{"system": "Be brief.", "user": "Q: {problem}"}]))
    r = roles.load_roles(path, 3, "independent")
    messages = [r.messages(k, Problem("p", "1+2", "3"), [], []) for k in range(3)]
    assert messages[0] == messages[2] == [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Q: 1+2"}]
    rendered = build_char_tokenizer().apply_chat_template(messages[1], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|system|>Be brief.<|user|>Q: 1+2<|assistant|>"  # the tiny agent's own chat template


@pytest.mark.parametrize("content, n, protocol, expected", [
    ([{"user": "{problem}"}] * 2, 3, "independent", "has 2 entries for a team of 3 agents"),
    ([{"user": "{question}"}], 2, "independent", "unknown placeholder {question}"),
    ([{"user": "{problem} {"}], 2, "independent", "not a valid template"),
    ([{"user": "{problem} {previous}"}], 2, "independent", "{previous} needs --protocol chain"),
    ([{"user": "{problem}"}, {"user": "{problem}"}], 2, "chain", "agent 2: the chain protocol shows"),
    ([{"user": "Answer briefly."}], 2, "independent", "has no {problem}"),
    ([{"sytem": "x", "user": "{problem}"}], 2, "independent", "unknown key 'sytem'"),
    ({"agents": [{"user": "{problem}"}], "previous": "some"}, 2, "independent", "previous: 'some'"),
])
def test_bad_roles_are_one_line(tmp_path, content, n, protocol, expected):
    path = write(tmp_path / "roles.json", json.dumps(content))
    with pytest.raises(ValueError) as err:
        roles.load_roles(path, n, protocol)
    assert expected in one_line(err) and "roles.json" in str(err.value)


# -- reasoning-gym ------------------------------------------------------------------------------------------
def test_reasoning_gym_splits_never_overlap_whatever_the_seed():
    train = {p.problem for seed in (0, 1) for p in reasoning_gym_task.reasoning_gym_problems(
        "knights_knaves", {}, 40, seed, "train")}
    heldout = [p for seed in (0, 1, 2) for p in reasoning_gym_task.reasoning_gym_problems(
        "knights_knaves", {}, 15, seed, "heldout")]
    assert len(train) >= 60 and len(heldout) == 45 and not train & {p.problem for p in heldout}
    assert all(reasoning_gym_task.is_heldout_question(p.problem) for p in heldout)
    once = reasoning_gym_task.reasoning_gym_problems("knights_knaves", {}, 15, 0, "heldout")
    assert len({p.id for p in once}) == 15 and once == reasoning_gym_task.reasoning_gym_problems(
        "knights_knaves", {}, 15, 0, "heldout")  # deterministic in the seed


def test_a_small_question_space_gives_what_it_has():
    hanoi = reasoning_gym_task.reasoning_gym_problems("tower_of_hanoi", {"min_disks": 1, "max_disks": 2, "max_pegs": 3},
                                                     50, 0, "train")
    assert 1 <= len(hanoi) < 12 and len({p.problem for p in hanoi}) == len(hanoi)


def test_reasoning_gym_reward_is_the_datasets_own_score_with_the_vote():
    problems = reasoning_gym_task.reasoning_gym_problems("knights_knaves", {}, 2, 0, "train")
    fn = reasoning_gym_task.ReasoningGymReward("knights_knaves", {})
    reward = CheckedReward(fn, fn.__name__, fn.reward_range)
    gold = problems[0].columns["answer"]
    names = [part.split(" is ")[0].strip(" ,.") for part in gold.replace(", and", ",").split(",")]
    half = f"{names[0]} is a {'villain' if 'hero' in gold.split(',')[0] else 'hero'}, and {gold.split(', and ')[1]}"
    texts = [[f"<answer>{gold}</answer>", "no tags", f"Thinking.\n<answer>{gold}</answer>"],
             [f"<answer>{half}</answer>", "<answer>nonsense</answer>", "<answer>x</answer>"]]
    rows = [problems[0], problems[0]]
    answers = [[reasoning_gym_task.tagged_answer(t) for t in row] for row in texts]
    values = score_problems(reward, rows, texts, answers, "independent", check_determinism=True)
    score = fn.dataset.score_answer(half, {"answer": gold, "metadata": problems[0].columns["metadata"]})
    assert values[0] == 1.0 and 0 < score < 1 and values[1] == pytest.approx(score / 3)  # a three-way tie
    assert score_problems(reward, rows, texts, answers, "chain") == [1.0, 0.0]
    untagged = score_problems(reward, rows[:1], [[f"So: {gold}"]], [[None]], "chain")[0]
    assert untagged == fn.dataset.score_answer(f"So: {gold}", {"answer": gold, "metadata": {}}) > 0  # as written
    assert reasoning_gym_task.response_answer("  ") is None


def test_reasoning_gym_bad_names_and_options_are_one_line():
    for name, options, expected in (("knights_knave", {}, "no such reasoning-gym dataset; did you mean knights_knaves"),
                                    ("tower_of_hanoi", {"disks": 3}, "not a valid HanoiConfig"),
                                    ("tower_of_hanoi", {"min_disks": 5, "max_disks": 2}, "not a valid HanoiConfig")):
        with pytest.raises(ValueError) as err:
            reasoning_gym_task.reasoning_gym_problems(name, options, 4, 0)
        assert expected in one_line(err)
    assert reasoning_gym_task.parse_options(["max_disks=3", "name=abc", "flag=True"]) == {
        "max_disks": 3, "name": "abc", "flag": True}
    with pytest.raises(ValueError) as err:
        reasoning_gym_task.parse_options(["max_disks"])
    assert "write key=value" in one_line(err)


def test_a_reasoning_gym_task_brings_its_prompt_and_budget_unless_the_user_sets_them():
    """Real models on a CPU get the task's measured prompt and response budget (config.REASONING_GYM_CPU, else the
    fallback); the tiny team and CUDA keep their presets' budgets with reasoning-gym's default prompt; a user's
    --max-new-tokens and --task-prompt win; other tasks are untouched."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    from harness.config import REAL_CPU_PRESET, REASONING_GYM_CPU, REASONING_GYM_CPU_FALLBACK, Config, task_preset
    from harness.run import team_roles

    smol = dict(agents="SmolLM2-135M x2", device="cpu")
    for name in (*REASONING_GYM_CPU, "propositional_logic"):
        setting = REASONING_GYM_CPU.get(name, REASONING_GYM_CPU_FALLBACK)
        cfg = Config(task=f"reasoning-gym:{name}", **smol).apply_preset()
        assert (cfg.task_prompt, cfg.max_new_tokens) == (setting.prompt, setting.max_new_tokens)
        assert team_roles(cfg, 2).role(1).system == SYSTEM_PROMPTS[setting.prompt]
    mine = Config(task="reasoning-gym:knights_knaves", max_new_tokens=48, task_prompt="default", **smol).apply_preset()
    assert (mine.task_prompt, mine.max_new_tokens) == ("default", 48)
    plain = Config(task="arithmetic-chat", **smol).apply_preset()
    assert (plain.task_prompt, plain.max_new_tokens) == (None, REAL_CPU_PRESET["max_new_tokens"])
    tiny = Config(agents="tiny x2", task="reasoning-gym:knights_knaves").apply_preset()
    assert (tiny.task_prompt, tiny.max_new_tokens) == ("default", 4)
    assert task_preset("reasoning-gym:knights_knaves", "Qwen3-4B x3", "cuda") == {"task_prompt": "default"}
    assert task_preset("dapo-math-17k", "SmolLM2-135M", "cpu") == {}
    with pytest.raises(ValueError, match="not one of reasoning-gym's system prompts"):
        reasoning_gym_task.task_roles(2, "chain", "terse")


# -- Whole runs: a user's reward, data, roles and tracker; reasoning-gym; resume ----------------------------
def sat_main(argv: list[str], capsys) -> tuple[int, str]:
    from harness.cli import main

    rc = main(argv)
    return rc, capsys.readouterr().err


TINY_RUN = ["--agents", "tiny x2", "--batch-size", "16", "--group-size", "4", "--epochs", "1", "--minibatch-size", "16",
            "--eval-size", "8", "--warmup-steps", "20"]


def readme_example(out: Path) -> list[str]:
    """The README's own-task command, its options (run from the repository root), --out replaced."""
    import shlex

    line = next(line for line in (ROOT / "README.md").read_text().splitlines()
                if line.strip().startswith("python sat.py --data examples/"))
    argv = shlex.split(line)[2:]
    argv = [str(ROOT / a) if a.startswith("examples/") else a for a in argv]  # a FILE.py:NAME keeps its :NAME
    at = argv.index("--out")
    return argv[:at] + argv[at + 2:] + ["--out", str(out)]


@pytest.mark.slow  # whole runs: sat.py and its resume
def test_a_run_keeps_its_reward_and_roles_on_resume_and_reports_to_tensorboard(tmp_path, capsys):
    """The README's example at a tiny size, with roles, then resumed for a second stage."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from harness.loading import read_team
    from harness.run_folder import latest_checkpoint

    roles_file = tmp_path / "roles.json"
    roles_file.write_text(json.dumps({"agents": [{"system": "Add.", "user": "{problem}="}]}))
    out = tmp_path / "run"
    first = readme_example(out) + TINY_RUN + ["--roles", str(roles_file), "--stages", "1"]
    assert sat_main(first, capsys)[0] == 0
    roles_file.unlink()  # the run keeps its own copy: --resume never reads the user's file again
    assert sat_main(["--resume", str(out), "--stages", "2"], capsys)[0] == 0
    config = json.loads((out / "config.json").read_text())
    assert config["reward"].endswith("addition_reward.py:reward") and config["report_to"] == "tensorboard"
    _, team_cfg = read_team(latest_checkpoint(out) / "team")
    assert team_cfg.roles.role(1).system == "Add." and team_cfg.roles.role(0).user == "{problem}="
    assert json.loads((out / "roles.json").read_text())["agents"][0]["system"] == "Add."
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in rows] == [0, 1, 2]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    for s in samples:  # the example's reward, the share of agents with the right sum, on every stage's samples
        right = sum(a["response"].strip() == s["gold"] for a in s["agents"])
        assert s["reward"] == pytest.approx(right / 2), s
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    held_out = events.Scalars("eval_accuracy")
    assert [e.step for e in held_out] == [0, 1, 2]  # the resumed run appends stage 2 to the same log
    assert [e.value for e in held_out] == pytest.approx([r["eval_accuracy"] for r in rows])


def test_a_reward_that_fails_is_refused_before_any_model_loads(tmp_path, capsys):
    bad = reward_file(tmp_path, "def reward(prompts, completions, answer, **columns):\n"
                                "    return [float('nan') if int(a) > 10 else 1.0 for a in answer]\n")
    out = tmp_path / "run"
    rc, err = sat_main(TINY_RUN + ["--data", str(ROOT / "examples" / "addition.jsonl"), "--reward", f"{bad}:reward",
                                   "--out", str(out)], capsys)
    line = err.strip().splitlines()[-1]
    assert rc != 0 and len(err.strip().splitlines()) == 1 and "is not finite" in line and "row " in line, err
    assert not out.exists()  # nothing written, no model loaded


@pytest.mark.slow  # a whole run and an evaluation
def test_a_reasoning_gym_task_trains_and_evaluates_at_tiny_size(tmp_path, capsys):
    from harness import evaluation
    from harness.config import Config
    from harness.tasks import load_task

    out = tmp_path / "run"
    task = ["--task", "reasoning-gym:knights_knaves", "--task-option", "n_people=2"]
    argv = ["--agents", "tiny x2", "--batch-size", "8", "--group-size", "2", "--epochs", "1", "--minibatch-size", "8",
            "--eval-size", "4", "--warmup-steps", "0", "--max-new-tokens", "8", "--stages", "1", "--out", str(out)]
    assert sat_main(argv + task, capsys)[0] == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in rows] == [0, 1] and all(0 <= r["eval_accuracy"] <= 1 for r in rows)
    cfg = Config(task="reasoning-gym:knights_knaves", task_option=["n_people=2"], eval_size=4, stages=1,
                 batch_size=8, group_size=2)
    train, heldout, _ = load_task(cfg)
    assert not {p.problem for p in train} & {p.problem for p in heldout}
    summary = evaluation.evaluate_benchmarks(evaluation.parse_args(
        ["--ckpt", str(out), "--bench", "reasoning-gym:knights_knaves", "--task-option", "n_people=2", "--k", "2",
         "--limit", "2", "--max-new-tokens", "8", "--out", str(tmp_path / "eval")]), log=lambda *_: None)
    team = summary["benchmarks"]["reasoning-gym:knights_knaves"]["metrics"]["team"]
    assert 0 <= team["avg@2"]["value"] <= 1 and summary["setting"]["reward"] == "reasoning-gym:knights_knaves"
    assert summary["setting"]["roles"]["agents"][0]["system"]  # reasoning-gym's system prompt, from the checkpoint


# -- Warnings a new user needs: a held-out split too small to measure, responses cut at the token limit -------
@pytest.mark.parametrize("delta_conf", [0.01, 0.05, 0.1, 0.5])
def test_fewest_certifying_rows_is_where_the_best_case_certificate_turns_positive(delta_conf):
    from bounds import fewest_certifying_rows, paired_lower_bound

    need = fewest_certifying_rows(delta_conf)
    best = lambda n, width: paired_lower_bound([width] * n, width, delta_conf)["lower_bound"]  # noqa: E731
    assert best(need, 1.0) > 0 and (need == 1 or best(need - 1, 1.0) <= 0)
    assert best(need, 3.0) > 0 and (need == 1 or best(need - 1, 3.0) <= 0)  # the reward's range scales out
    assert fewest_certifying_rows(0.05) == 8


def test_held_out_and_truncation_warnings_are_one_line_or_none():
    from harness.records import heldout_warning, truncation_warning

    line = heldout_warning(1, 1, 0.05)
    assert "\n" not in line and "--eval-data" in line and "1 paired row" in line and "fewer than 8" in line
    assert heldout_warning(2, 4, 0.05) is None and heldout_warning(7, 1, 0.05) is not None
    line = truncation_warning({"stage": 3, "truncated_fraction": 0.969}, 48)
    assert line == ("warning: stage 3 cut 97% of its responses at --max-new-tokens 48: raise --max-new-tokens (or "
                    "ask for shorter answers) so that an answer fits")
    assert truncation_warning({"stage": 3, "truncated_fraction": 0.5}, 48) is None
    assert truncation_warning({"stage": 0, "eval_accuracy": 0.0}, 48) is None  # stage 0 trains nothing


def test_a_surrogate_estimate_on_a_thin_effective_sample_warns_in_one_line():
    from harness.records import surrogate_ess_warning

    row = {"stage": 2, "agents": [{"agent": 1, "surrogate_ess": 12.0, "N": 16},
                                  {"agent": 2, "surrogate_ess": 1.4, "N": 16}]}
    line = surrogate_ess_warning(row)
    assert "\n" not in line and line.startswith("warning: stage 2:") and "agent(s) 2 (1.4 of 16)" in line
    row["agents"][1]["surrogate_ess"] = 1.6  # a tenth of 16: not under it
    assert surrogate_ess_warning(row) is None
    assert surrogate_ess_warning({"stage": 0, "eval_accuracy": 0.0}) is None  # stage 0 trains nothing


def test_a_one_row_held_out_split_and_cut_responses_each_warn_once(tmp_path):
    """The issue's new-user run at tiny size: a 6-row file holds out 1 row, and 1 new token cuts every response."""
    from harness.cli import parse_args
    from harness.run import run

    data = tmp_path / "six.jsonl"
    data.write_text("".join((ROOT / "examples" / "addition.jsonl").read_text().splitlines(True)[:6]))
    said = []
    rows = run(parse_args(TINY_RUN + ["--data", str(data), "--stages", "1", "--max-new-tokens", "1",
                                      "--warmup-steps", "0", "--out", str(tmp_path / "run")]), log=said.append)
    warnings = [line for line in said if line.startswith("warning:")]
    assert len(warnings) == 2, said
    assert "1 problem(s) x 1 sample(s) = 1 paired row(s)" in warnings[0] and "--eval-data" in warnings[0]
    assert warnings[1].startswith("warning: stage 1 cut 100% of its responses at --max-new-tokens 1")
    assert rows[0]["eval_n"] == 1 and rows[1]["truncated_fraction"] == 1.0
