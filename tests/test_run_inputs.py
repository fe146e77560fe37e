"""A run's inputs built once (harness.run.resolve), the held-out standard error, and one reading of a gold answer
whichever way the rows come in."""
from __future__ import annotations

import ast
import dataclasses
import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_sat import small_config

import harness.run
import sat
from harness.config import Config
from harness.datafiles import load_problems
from harness.loading import load_agent
from harness.math_grading import DEFAULT_REWARD, math_team_config
from harness.tasks import DatasetSpec, arithmetic_problems, load_jsonl, row_to_problem
from reward import Reward, columns_of
from rollout import SamplingConfig
from sat_config import SatConfig
from scale.rollout_hf import HF
from team import Team

ROOT = Path(__file__).resolve().parents[1]


def counted(monkeypatch, module, name: str) -> list:
    """Replace ``module.name`` by a wrapper that records each call and calls the original."""
    calls, original = [], getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def test_a_run_builds_its_inputs_once(tmp_path, monkeypatch):
    """parse_agents, team_environment, team_reward and RunState: once each for a run (its checks, its team, its
    stage-0 evaluation), the RunState with the run's own backend."""
    names = ("parse_agents", "team_environment", "team_reward", "RunState")
    calls = {name: counted(monkeypatch, harness.run, name) for name in names}
    cfg = replace(small_config(tmp_path, stages=0, warmup_steps=0, eval_size=8), device=None)
    rows = harness.run.run(cfg, log=lambda *_: None)
    assert [r["stage"] for r in rows] == [0]
    assert {name: len(c) for name, c in calls.items()} == dict.fromkeys(names, 1)
    assert calls["RunState"][0][4].name == "hf"  # the backend the run made, not a placeholder overwritten later


def test_eval_stderr_is_the_sample_standard_error_of_a_reward_in_0_10():
    """A reward in [0, 10]: eval_stderr is the rows' sample standard deviation over sqrt(n), where the binomial
    sqrt(acc (1 - acc) / n) would take the square root of a negative number."""
    spread = Reward(lambda prompts, completions, **_: [float(sum(map(ord, c[0])) % 11) for c in completions],
                    "a score in 0..10", (0.0, 10.0))
    torch.manual_seed(0)
    team = Team([load_agent("tiny", seed=0)], math_team_config(reward=spread))
    cfg = Config(agents="tiny", device="cpu", eval_samples=1).apply_preset()
    sampling = SamplingConfig(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)
    out = sat.evaluate(team, arithmetic_problems(48, seed=1, split="heldout"), sampling, cfg.core(), HF)
    rewards = out["eval_rewards"]
    assert out["eval_accuracy"] > 1 and len(set(rewards)) > 2  # a reward outside [0, 1], and spread
    assert out["eval_stderr"] == pytest.approx(statistics.stdev(rewards) / math.sqrt(len(rewards)), rel=1e-5)
    assert sat.standard_error(torch.tensor([0.0, 10.0, 10.0, 5.0])) == pytest.approx(math.sqrt(68.75 / 3 / 4))
    assert sat.standard_error(torch.tensor([3.0])) is None


@pytest.mark.parametrize("gold", [[3, 4], {"b": [1, 2], "a": "x"}, 38.0, " 7 ", 2.5])
def test_a_gold_answer_reads_and_grades_the_same_through_a_named_dataset_and_a_data_file(tmp_path, gold):
    """The named-dataset path (``row_to_problem``), --data (``datafiles.load_problems``) and ``load_jsonl`` read
    one row's answer alike, a list or dict as JSON, and the built-in reward grades an agent that says it right."""
    row = {"id": "r-1", "problem": "what?", "answer": gold}
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    named = row_to_problem(row, DatasetSpec("org/name", (None,), "train", "problem", "answer", "id"), "r-1")
    data, jsonl = load_problems(str(path))[0], load_jsonl(path)[0]
    assert named is not None and named.answer == data.answer == jsonl.answer != ""
    said = [[named.answer] * 3]  # three agents, each answering the gold as the row states it
    graded = [DEFAULT_REWARD.values([p.problem], [["..."] * 3], columns_of([p], said, "independent"))
              for p in (named, data, jsonl)]
    assert graded == [[1.0]] * 3


def test_the_core_reads_only_its_own_config():
    """``Config.core`` copies the fields of ``SatConfig`` and builds the one SamplingConfig; sat.py, update.py and
    advantage.py read no ``cfg.X`` outside SatConfig (the temperature only through ``cfg.sampling``)."""
    cfg = Config(agents="tiny x2", device="cpu", temperature=0.7).apply_preset()
    core = cfg.core()
    names = {f.name for f in dataclasses.fields(SatConfig)}
    assert all(getattr(core, n) == getattr(cfg, n) for n in names - {"sampling"})
    assert core.sampling == SamplingConfig(0.7, cfg.top_p, cfg.max_new_tokens, cfg.token_budget)
    for module in ("sat.py", "update.py", "advantage.py"):
        tree = ast.parse((ROOT / module).read_text())
        read = {n.attr for n in ast.walk(tree)
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "cfg"}
        assert read and read <= names, f"{module} reads cfg.{sorted(read - names)} outside SatConfig"
