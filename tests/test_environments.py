"""The environment contract (harness/environments.py): loading, probing, the built-in games' rows, every fault as one
line, and whole runs at tiny size (the games themselves: tests/test_env_games.py)."""
import json
import re
from pathlib import Path

import pytest

from harness import env_games as games
from harness.environments import (
    EnvironmentFault,
    game_problems,
    load_environment,
    play,
    probe_environment,
    row_of,
)
from team import Problem


# -- The built-in games' rows (the games themselves: tests/test_env_games.py) ----------------------------------
def test_game_rows_split_train_and_heldout_apart_whatever_the_seed():
    for name in games.GAMES:
        train = {p.columns["seed"] for s in range(3) for p in game_problems(name, {}, 50, s, "train")}
        held = {p.columns["seed"] for s in range(3) for p in game_problems(name, {}, 50, s, "heldout")}
        assert not train & held


# -- The contract's faults, one line each ------------------------------------------------------------------------
def env_file(tmp_path, body: str) -> str:
    path = tmp_path / "myenv.py"
    path.write_text(body)
    return f"{path}:Env"


GOOD = ("class Env:\n    max_rounds = 2\n    def reset(self, **row): return 'go'\n"
        "    def step(self, responses): return ('ok', False)\n    def get_reward(self): return {reward}\n")


@pytest.mark.parametrize("body, expected", [
    (GOOD.replace("return 'go'", "return 1 / 0"), "reset raised ZeroDivisionError: division by zero (myenv.py:3)"),
    (GOOD.replace("return 'go'", "return 7"), "reset returned int 7; return the opening observation as a str"),
    (GOOD.replace("('ok', False)", "'ok'"), "step returned 'ok'; return (observation: str, done: bool)"),
    (GOOD.format(reward="1.5"), "get_reward returned 1.5, outside its range [0.0, 1.0]; return values in the "
                                "range, or give the class reward_range = (lo, hi)"),
    (GOOD.format(reward="'high'"), "get_reward returned 'high'; return a finite number in [0.0, 1.0]"),
])
def test_each_fault_is_one_line_naming_the_environment_and_the_row(tmp_path, body, expected):
    spec = env_file(tmp_path, body.format(reward="0.5"))
    env = load_environment(spec)
    problem = Problem("row-7", "1+1", "2")
    with pytest.raises(EnvironmentFault) as err:
        play(env, problem, [["a"]] * 2)
    assert str(err.value) == f"environment {spec}, row 'row-7': {expected}"


@pytest.mark.parametrize("step, expected", [
    # randomness drawn while playing: caught by playing again in this process
    ("import random; return (str(random.random()), False)", r"observation 1 was '0\.\d+', then '0\.\d+'"),
    # randomness only when the agents disagree (the probe's replies vary across agents and rounds)
    ("import random; return (str(random.random()) if len(set(responses)) > 1 else 'same', False)",
     r"observation 1 was '0\.\d+', then '0\.\d+'"),
    # hash() of a str: the same in one process, another under another PYTHONHASHSEED
    ("return (str(hash(' '.join(responses)) % 1000), False)",
     r"observation 1 was '\d+', then in a second process \(PYTHONHASHSEED=[01]\) '\d+'"),
])
def test_a_nondeterministic_environment_is_refused_before_training(tmp_path, step, expected):
    body = GOOD.format(reward="0.5").replace("return ('ok', False)", step)
    env = load_environment(env_file(tmp_path, body))
    with pytest.raises(EnvironmentFault) as err:
        probe_environment(env, [Problem("r", "1+1", "2")], n_agents=2)
    assert re.fullmatch(rf"environment {re.escape(env.name)} is not deterministic: row 'r': {expected} for the same "
                        r"replies; seed any randomness from the row, and never from hash\(\) of a str, which "
                        r"differs between processes \(the paired certificates replay episodes\)", str(err.value))


def test_the_probe_names_the_row_whose_episode_differs(tmp_path):
    """Three rows probed; only the third draws from hash(), so the line names that row."""
    body = GOOD.format(reward="0.5").replace("return 'go'", "self.n = row['n']; return 'go'").replace(
        "return ('ok', False)", "return (str(hash(str(responses)) % 97) if self.n == 2 else 'ok', False)")
    env = load_environment(env_file(tmp_path, body))
    with pytest.raises(EnvironmentFault, match=r"not deterministic: row 'third': observation 1 was '\d+', then in a "
                                               r"second process"):
        probe_environment(env, [Problem(name, "", "", None, {"n": n})
                                for n, name in enumerate(["first", "second", "third"])], n_agents=3)


def test_the_probe_replays_a_class_that_cannot_load_elsewhere_as_one_line(tmp_path):
    """An environment whose file the second process cannot import (here: it was deleted after loading) is named."""
    spec = env_file(tmp_path, GOOD.format(reward="0.5"))
    env = load_environment(spec)
    Path(spec.rpartition(":")[0]).unlink()
    with pytest.raises(EnvironmentFault, match=r"its determinism probe could not replay it in a second process "
                                               r"\(python -m harness.env_replay\): FileNotFoundError: .*; make the "
                                               r"class importable from its spec, and deterministic$"):
        probe_environment(env, [Problem("r", "1+1", "2")], n_agents=2)


def test_the_probe_replays_a_module_spec_in_its_second_process(tmp_path, monkeypatch):
    """package.module:NAME, importable here through sys.path only, is importable in the second process too; a
    deterministic class passes, the same class drawing on hash() does not."""
    package = tmp_path / "mygames"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "fixed.py").write_text(GOOD.format(reward="0.5"))
    (package / "hashed.py").write_text(GOOD.format(reward="0.5").replace(
        "return ('ok', False)", "return (str(hash(str(responses)) % 1000), False)"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(ROOT)  # not the package's folder: only sys.path reaches it
    probe_environment(load_environment("mygames.fixed:Env"), [Problem("r", "1+1", "2")], n_agents=2)
    with pytest.raises(EnvironmentFault, match=r"^environment mygames.hashed:Env is not deterministic: row 'r': "
                                               r"observation 1 was '\d+', then in a second process"):
        probe_environment(load_environment("mygames.hashed:Env"), [Problem("r", "1+1", "2")], n_agents=2)


@pytest.mark.parametrize("name", list(games.GAMES))
def test_the_built_in_games_pass_the_probe(name):
    env = load_environment(f"env:{name}")
    probe_environment(env, game_problems(name, {}, 3, seed=0, split="train", rounds=env.max_rounds), n_agents=3)


@pytest.mark.parametrize("body, expected", [
    ("x = 1\n", "has no class 'Env'"),
    ("class Env:\n    def reset(self, **row): return ''\n", "Env has no step, get_reward"),
    (GOOD.replace("max_rounds = 2", "pass"), "no round limit; pass --max-rounds T or give the class max_rounds = T"),
    (GOOD.replace("max_rounds = 2", "max_rounds = 2\n    def __init__(self, size): pass"), r"Env\(\) needs arguments"),
])
def test_a_malformed_class_is_refused_when_loaded(tmp_path, body, expected):
    with pytest.raises(EnvironmentFault, match=expected):
        load_environment(env_file(tmp_path, body.replace("{reward}", "0.5")))


def test_max_rounds_from_the_option_overrides_the_class():
    assert load_environment("env:guess-numbers", max_rounds=3).max_rounds == 3
    assert load_environment("env:guess-numbers").max_rounds == games.GuessNumbers.max_rounds


# -- Whole runs: the example environment trained at tiny size, resumed, evaluated --------------------------------
ROOT = Path(__file__).resolve().parents[1]
TINY = ["--agents", "tiny x2", "--batch-size", "8", "--group-size", "4", "--epochs", "1", "--minibatch-size", "8",
        "--eval-size", "6", "--warmup-steps", "20", "--max-new-tokens", "4"]


@pytest.mark.slow  # whole runs: sat.py, its resume and eval_aime.py
def test_the_example_environment_trains_resumes_and_evaluates_at_tiny_size(tmp_path, capsys):
    from harness import evaluation
    from harness.cli import main

    out, env = tmp_path / "run", f"{ROOT / 'examples' / 'addition_env.py'}:AdditionGame"
    data = ["--data", str(ROOT / "examples" / "addition.jsonl"), "--env", env, "--max-rounds", "2"]
    assert main(TINY + data + ["--stages", "1", "--protocol", "chain", "--out", str(out)]) == 0
    assert main(["--resume", str(out), "--stages", "2"]) == 0  # the environment's spec comes back from the run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in rows] == [0, 1, 2]
    assert all(1 <= r["episode_rounds"] <= 2 and 0 <= r["success"] <= 1 for r in rows[1:])
    assert all(0 <= r["eval_success"] <= 1 and 1 <= r["eval_rounds"] <= 2 for r in rows)
    sample = json.loads((out / "samples.jsonl").read_text().splitlines()[-1])
    assert sample["transcript"].startswith("Environment: ") and "Agent 2: " in sample["transcript"]
    summary = evaluation.evaluate_benchmarks(evaluation.parse_args(
        ["--ckpt", str(out), "--data", str(ROOT / "examples" / "addition_heldout.jsonl"), "--k", "2", "--limit", "3",
         "--max-new-tokens", "4", "--out", str(tmp_path / "eval")]), log=lambda *_: None)
    bench = summary["benchmarks"]["addition_heldout"]
    assert 1 <= bench["rounds"]["mean"] <= 2 and summary["setting"]["environment"] == env
    assert 0 <= bench["metrics"]["team"]["avg@2"]["value"] <= 1


@pytest.mark.slow  # whole runs: sat.py and eval_aime.py on two games
def test_the_built_in_games_train_and_evaluate(tmp_path):
    """Each built-in game through sat.py (one stage; guess-numbers with two digits) and eval_aime.py, tiny and short:
    their openings are long for a character tokenizer, so no warm start and few rows."""
    from harness import evaluation
    from harness.cli import main

    small = ["--agents", "tiny x2", "--batch-size", "4", "--group-size", "2", "--epochs", "1", "--minibatch-size", "4",
             "--eval-size", "2", "--warmup-steps", "0", "--max-new-tokens", "3", "--max-rounds", "2"]
    out = tmp_path / "run"
    assert main(small + ["--task", "env:guess-numbers", "--task-option", "digits=2", "--stages", "1",
                         "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["generations"] >= 4 * 2 and 1 <= rows[1]["episode_rounds"] <= 2
    summary = evaluation.evaluate_benchmarks(evaluation.parse_args(
        ["--agents", "tiny", "--bench", "env:blocksworld", "--max-rounds", "1", "--k", "1", "--limit", "1",
         "--max-new-tokens", "3", "--out", str(tmp_path / "eval")]), log=lambda *_: None)
    assert summary["benchmarks"]["env:blocksworld"]["rounds"] == {"mean": 1.0, "max": 1}


def test_a_roles_next_template_addresses_the_later_rounds():
    from harness.episodes import episode_context, speak, start_episode
    from harness.loading import load_agent
    from harness.math_grading import math_team_config
    from harness.roles import parse_roles
    from team import Team

    roles = parse_roles({"agents": [{"user": "{problem}", "next": "Round {round}. {turns}"}]}, "roles", 2,
                        "independent")
    env = load_environment(f"{ROOT / 'examples' / 'addition_env.py'}:AdditionGame")
    agents = [load_agent("tiny", seed=k) for k in range(2)]
    team = Team(agents, math_team_config(roles=roles, environment=env))
    e = start_episode(team, Problem("p", "2+3", "5"))
    for k, text in enumerate(["4", "6"]):
        episode_context(team, e, k)
        speak(e, k, agents[k].encode_text(text) + [agents[k].tokenizer.eos_token_id], agents[k].tokenizer)
    observation, _ = env.step(e.state, e.problem, ["4", "6"])
    e.said.append((-1, observation))
    e.rounds = 1
    view = agents[0].tokenizer.decode(episode_context(team, e, 0))
    assert view.endswith("<|user|>Round 2. Agent 2: 6\n\nAgent 1: 4 is too low\nAgent 2: 6 is too high<|assistant|>")
    with pytest.raises(ValueError, match="the next template takes"):
        parse_roles({"agents": [{"user": "{problem}", "next": "{problem}"}]}, "roles", 2, "independent")


def test_a_built_in_opening_states_the_rounds_the_run_gives():
    env = load_environment("env:blocksworld", max_rounds=3)
    p = game_problems("blocksworld", {}, 1, seed=0, split="heldout", rounds=env.max_rounds)[0]
    assert "We act over 3 rounds" in env.start(p)[1]
    env = load_environment("env:guess-numbers", max_rounds=3)
    p = game_problems("guess-numbers", {}, 1, seed=0, split="heldout", rounds=env.max_rounds)[0]
    assert "You have 3 rounds" in env.start(p)[1] and "The last guess of round 3 is your final answer" in \
        env.start(p)[1]


def test_the_trackers_table_carries_an_episodes_whole_transcript():
    from harness.trackers import sample_table

    transcript = "Environment: go\n\n" + "\n\n".join(f"Agent 1: guess {i}\n\nEnvironment: no" for i in range(50))
    sample = {"stage": 1, "problem": "", "gold": "", "agents": [{"response": "guess 49", "answer": None}],
              "team_answer": None, "reward": 0.5, "rounds": 50, "transcript": transcript}
    columns, rows = sample_table([sample])
    assert columns[-2:] == ["rounds", "transcript"] and rows[0][-2:] == [50, transcript]


# -- An environment owns its rows: no problem or answer column ---------------------------------------------------
NUMBER_GAME = f"{ROOT / 'examples' / 'number_game_env.py'}:NumberGuess"
NUMBER_ROWS = ROOT / "examples" / "number_game.jsonl"
NUMBER_HELDOUT = ROOT / "examples" / "number_game_heldout.jsonl"


def test_an_environments_rows_need_no_problem_or_answer_column():
    """Rows {"id", "secret"}: read for an environment they load as they are (the id kept, reset's keywords exactly
    the row), pass the probe and play; read as a math task they are refused as before."""
    from harness.datafiles import load_problems

    rows = load_problems(str(NUMBER_ROWS), environment=True)
    assert [p.id for p in rows[:2]] == ["secret-0", "secret-1"] and rows[0].problem == rows[0].answer == ""
    assert row_of(rows[0]) == json.loads(NUMBER_ROWS.read_text().splitlines()[0])
    env = load_environment(NUMBER_GAME)
    probe_environment(env, rows, n_agents=2)
    secret = str(rows[0].columns["secret"])
    seen, reward = play(env, rows[0], [["I do not know", "0"], ["maybe", secret]])
    assert seen[0].startswith("I am thinking of a whole number from 1 to 20")
    assert seen[1] == "Agent 1: Say a number.\nAgent 2: 0 is too low." and reward == 1.0 and len(seen) == 3
    with pytest.raises(ValueError, match=r"no column 'problem' \(--problem-key\); it has: id, secret"):
        load_problems(str(NUMBER_ROWS))


@pytest.mark.slow  # a whole run and an evaluation: 27 s on two busy cores
def test_a_run_on_rows_without_problem_or_answer_says_what_the_agents_see(tmp_path, capsys):
    """sat.py with --env on rows {"id", "secret"} trains a tiny team one stage: the warm start, with no gold answer
    to train on, is skipped in one line; the first row's opening and what the per-agent figures mean are said once;
    a sample's transcript holds the environment's words; the baseline is the group's, no credit_correlation; and
    eval_aime.py evaluates the trained team on such rows."""
    from harness import evaluation
    from harness.cli import main

    out = tmp_path / "run"
    argv = TINY + ["--env", NUMBER_GAME, "--data", str(NUMBER_ROWS), "--eval-data", str(NUMBER_HELDOUT),
                   "--max-rounds", "2", "--stages", "1", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.count(f"warm start skipped: environment {NUMBER_GAME}'s rows have no gold answer") == 1
    assert "supervised steps" not in printed
    assert printed.count(f"environment {NUMBER_GAME}: row 'secret-0' opens with (each row's reset gives its own):\n"
                         "I am thinking of a whole number from 1 to 20.") == 1
    assert printed.count(f"environment {NUMBER_GAME}: each agent's own score is the team reward") == 1
    assert json.loads((out / "config.json").read_text())["baseline"] == "group"
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[1])
    assert [a["credit_correlation"] for a in row["agents"]] == [None, None]
    sample = json.loads((out / "samples.jsonl").read_text().splitlines()[0])
    assert sample["transcript"].startswith("Environment: I am thinking of a whole number from 1 to 20.")
    assert re.search(r"\n\nEnvironment: Agent 1: (Say a number\.|-?\d+ is (right|too high|too low)\.)\nAgent 2: ",
                     sample["transcript"]), sample["transcript"]
    summary = evaluation.evaluate_benchmarks(evaluation.parse_args(  # the same rows evaluate a --ckpt team
        ["--ckpt", str(out), "--data", str(NUMBER_HELDOUT), "--k", "1", "--limit", "2", "--max-new-tokens", "4",
         "--out", str(tmp_path / "eval")]), log=lambda *_: None)
    assert 1 <= summary["benchmarks"]["number_game_heldout"]["rounds"]["mean"] <= 2


def test_options_an_environment_cannot_honour_are_refused_and_the_baseline_becomes_group():
    from harness.config import Config, check_episode_options

    assert Config(agents="tiny x2", env=NUMBER_GAME).apply_preset().baseline == "group"
    assert Config(agents="tiny x2", task="env:blocksworld").apply_preset().baseline == "group"
    assert Config(agents="tiny x2").apply_preset().baseline == "counterfactual"  # the default run: unchanged
    assert Config(agents="tiny x2", task="env:blocksworld", data="x.jsonl").apply_preset().baseline == \
        "counterfactual"  # --data replaces the task: no environment
    check_episode_options(Config(order="greedy", baseline="counterfactual"))  # without an environment: fine
    check_episode_options(Config(env=NUMBER_GAME, order="random", baseline="group"))
    for option, value in (("baseline", "counterfactual"), ("order", "greedy")):
        with pytest.raises(ValueError, match=rf"^--{option} {value} does not apply with an environment \(env:"):
            check_episode_options(Config(task="env:guess-numbers", **{option: value}))
