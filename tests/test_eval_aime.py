"""eval_aime.py (the metrics) and harness/evaluation.py (its loop): metrics against brute force, AIME grading,
end-to-end runs of tiny teams on AIME24 problems (both protocols, a checkpoint), resume after an interruption,
and one-line CLI errors."""
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eval_aime import bootstrap_ci, majority_correct, pass_at_k, problem_metrics
from harness import evaluation
from harness.eval_folder import read_predictions
from harness.eval_setting import team_identity
from harness.evaluation import chunk_seed, plan_chunks, summarize
from harness.loading import load_agent, save_team
from harness.math_grading import answers_match, extract_answer, math_team_config
from team import Problem, Team

REPO = Path(__file__).resolve().parents[1]
AIME24 = Path(__file__).resolve().parents[1] / "data" / "aime24.jsonl"
needs_aime = pytest.mark.skipif(not AIME24.exists(), reason=f"{AIME24} not found (the offline AIME24 copy)")


# -- metrics -------------------------------------------------------------------------
@given(st.integers(1, 8).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_equals_brute_force_over_all_k_subsets(nck):
    n, c, k = nck
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(outcomes, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_pass_at_k_edges_and_large_n():
    assert pass_at_k(64, 0, 64) == 0.0 and pass_at_k(64, 1, 64) == 1.0
    assert pass_at_k(64, 16, 1) == pytest.approx(16 / 64)  # pass@1 is the plain accuracy
    assert 0 < pass_at_k(64, 1, 8) < 1  # a product, no overflowing binomials
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


@given(st.lists(st.booleans(), min_size=1, max_size=12))
def test_avg_at_k_is_the_mean_and_pass_at_1(correct):
    m = problem_metrics(correct, ["1"] * len(correct), "1", len(correct))
    k = len(correct)
    assert m[f"avg@{k}"] == pytest.approx(sum(correct) / k) == pytest.approx(m["pass@1"])
    assert m[f"pass@{k}"] == float(any(correct))


def test_majority_ties_abstentions_and_normalisation():
    assert majority_correct(["1", "2", "2", "1"], "1")  # tie: the answer seen first wins
    assert not majority_correct(["2", "1", "1", "2"], "1")
    assert majority_correct([None, None, "7", None], "7")  # None abstains
    assert not majority_correct([None, None], "7")  # nobody answered
    assert majority_correct(["033", "33", "5"], "33")  # "033" and "33" are one answer with two votes
    assert not majority_correct(["5", "5", "33"], "33")


def test_bootstrap_interval_is_deterministic_and_brackets_the_mean():
    scores = [0, 1, 1, 0.5, 0, 1, 0.25]
    lo, hi = bootstrap_ci(scores)
    assert lo <= sum(scores) / len(scores) <= hi and (lo, hi) == bootstrap_ci(scores)
    assert bootstrap_ci([0.0] * 5) == (0.0, 0.0)


def test_aime_answers_graded_right():
    assert answers_match(extract_answer("so the walk takes \\boxed{204} minutes"), "204")
    assert answers_match(extract_answer("The final answer is \\boxed{033}."), "33")
    assert answers_match("33", "033") and not answers_match("34", "033")


def test_summary_from_rows_by_hand():
    problems = [Problem("p0", "?", "5"), Problem("p1", "?", "033")]
    answers = {"p0": ["5", "4", "4", "5"], "p1": ["33", None, "033", "1"]}  # p0: tie -> "5" (first) is right
    rows = [{"bench": "b", "problem_id": pid, "sample": s, "who": "team", "answer": a, "correct": answers_match(a, g),
             "tokens": 10 * (s + 1), "truncated": s == 3}
            for pid, g in (("p0", "5"), ("p1", "033")) for s, a in enumerate(answers[pid])]
    m = summarize(rows, {"b": problems}, 4)["b"]
    assert m["metrics"]["team"]["avg@4"]["value"] == pytest.approx((2 / 4 + 2 / 4) / 2)
    assert m["metrics"]["team"]["pass@4"]["value"] == 1.0 and m["metrics"]["team"]["maj@4"]["value"] == 1.0
    assert m["lengths"]["team"] == {"mean_tokens": 25.0, "median_tokens": 25.0, "max_tokens": 40, "truncated": 0.25}
    with pytest.raises(RuntimeError, match="rerun the same command"):
        summarize(rows[:-1], {"b": problems}, 4)


def test_chunk_plan_and_seeds():
    plan = plan_chunks(n_problems=3, k=5, batch_problems=2, sample_chunk=2)
    first = [([0, 1], [0, 1], 0), ([0, 1], [2, 3], 1), ([0, 1], [4], 2)]
    assert [(list(p), list(s), c) for p, s, c in plan][:3] == first
    assert sum(len(p) * len(s) for p, s, _ in plan) == 15
    assert chunk_seed(0, "aime24", 0, 0) == chunk_seed(0, "aime24", 0, 0) != chunk_seed(0, "aime24", 0, 1)


def test_torn_last_line_is_cut(tmp_path):
    path = tmp_path / "predictions.jsonl"
    row = {"bench": "b", "problem_id": "p", "sample": 0, "who": "team", "text": "x"}
    path.write_text(json.dumps(row) + "\n" + json.dumps({**row, "sample": 1})[:20])
    assert read_predictions(path) == [{k: v for k, v in row.items() if k != "text"}]
    assert path.read_text() == json.dumps(row) + "\n"  # the next append starts on a fresh line


# -- end to end on tiny teams -------------------------------------------------------------
def run_cli(tmp_path, name, *extra):
    out = tmp_path / name
    argv = ["--agents", "tiny x3", "--data", str(AIME24), "--limit", "5", "--k", "2", "--max-new-tokens", "8",
            "--device", "cpu", "--out", str(out), *extra]
    assert evaluation.main(argv) == 0
    return out, json.loads((out / "summary.json").read_text())


@needs_aime
@pytest.mark.parametrize("protocol", ["independent", "chain"])
def test_end_to_end_tiny_team(tmp_path, protocol, capsys):
    out, summary = run_cli(tmp_path, protocol, "--protocol", protocol)
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 5 * 2 * 4  # problems x samples x (3 agents + team)
    assert {r["who"] for r in rows} == {"team", "agent_1", "agent_2", "agent_3"}
    assert all(0 < r["tokens"] <= (24 if r["who"] == "team" else 8) for r in rows)
    b = summary["benchmarks"]["aime24"]
    assert b["n_problems"] == 5 and set(b["metrics"]) == {"team", "agent_1", "agent_2", "agent_3"}
    assert set(b["metrics"]["team"]) == {"avg@2", "pass@1", "pass@2", "maj@2"}
    assert summary["setting"]["protocol"] == protocol
    printed = capsys.readouterr().out
    assert "| aime24 | team |" in printed and "hit --max-new-tokens 8" in printed  # 8 tokens truncate: warned
    # A second run with the same flags finds everything written and generates nothing.
    assert evaluation.main(["--agents", "tiny x3", "--data", str(AIME24), "--limit", "5", "--k", "2",
                           "--max-new-tokens", "8", "--device", "cpu", "--out", str(out), "--protocol", protocol]) == 0
    assert "to generate" not in capsys.readouterr().out


@pytest.mark.slow  # two evaluations of sampled chunks
@needs_aime
def test_resume_after_interruption_gives_the_same_summary(tmp_path):
    full, expected = run_cli(tmp_path, "full", "--sample-chunk", "1")
    lines = (full / "predictions.jsonl").read_text().splitlines(keepends=True)
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "run.json").write_text((full / "run.json").read_text())
    # interrupted mid-chunk, with half a row written
    (cut / "predictions.jsonl").write_text("".join(lines[:13]) + lines[13][: len(lines[13]) // 2])
    _, resumed = run_cli(tmp_path, "cut", "--sample-chunk", "1")
    assert resumed == expected
    def read(d):
        rows = (json.loads(x) for x in (d / "predictions.jsonl").read_text().splitlines())
        return sorted(rows, key=lambda r: (r["problem_id"], r["sample"], r["who"]))

    assert read(cut) == read(full)  # the very same samples, not just the same numbers


@needs_aime
def test_checkpoint_team_keeps_its_protocol(tmp_path):
    team = Team([load_agent("tiny", seed=k) for k in range(2)], math_team_config(protocol="chain", instruction=" Sum?"))
    stage = tmp_path / "run" / "checkpoints" / "stage_0003"
    save_team(team, stage / "team")
    (tmp_path / "run" / "latest.json").write_text(json.dumps({"stage": 3, "path": "stage_0003"}))
    out = tmp_path / "ev"
    argv = ["--ckpt", str(tmp_path / "run"), "--data", str(AIME24), "--limit", "2", "--k", "2", "--max-new-tokens", "4",
            "--device", "cpu", "--out", str(out)]
    assert evaluation.main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["setting"]["protocol"] == "chain" and summary["setting"]["ckpt"] == str((stage / "team").resolve())
    assert summary["setting"]["instruction"] == " Sum?"  # the prompts it was trained on, not the boxed default
    assert set(summary["benchmarks"]["aime24"]["metrics"]) == {"team", "agent_1", "agent_2"}
    identity = team_identity(evaluation.parse_args(argv + ["--instruction", ""]))
    assert identity["instruction"] == ""  # an explicit --instruction still replaces it


@needs_aime
def test_checkpoint_team_samples_with_its_runs_own_settings_unless_told(tmp_path, capsys):
    """A --ckpt run's config.json gives the sampling the command line leaves out: without it, a tiny team (2048
    positions) would be refused at the default 32768 new tokens. The identity holds the effective values, so
    giving the same values explicitly reuses the folder."""
    run = tmp_path / "run"
    save_team(Team([load_agent("tiny", seed=k) for k in range(2)], math_team_config(instruction="")),
              run / "checkpoints" / "stage_0001" / "team")
    (run / "latest.json").write_text(json.dumps({"stage": 1, "path": "stage_0001"}))
    (run / "config.json").write_text(json.dumps({"max_new_tokens": 4, "temperature": 0.5, "top_p": 0.9,
                                                 "agents": "tiny x2"}))
    out = tmp_path / "ev"
    argv = ["--ckpt", str(run), "--data", str(AIME24), "--limit", "1", "--k", "2", "--device", "cpu", "--out", str(out)]
    assert evaluation.main(argv) == 0
    printed = capsys.readouterr().out
    assert f"from {run / 'config.json'}: temperature 0.5, top_p 0.9, max_new_tokens 4 (the run's own; " in printed
    setting = json.loads((out / "summary.json").read_text())["setting"]
    assert (setting["max_new_tokens"], setting["temperature"], setting["top_p"]) == (4, 0.5, 0.9)
    explicit = ["--max-new-tokens", "4", "--temperature", "0.5", "--top-p", "0.9"]
    assert evaluation.main(argv + explicit) == 0  # the same effective setting: the same run.json, nothing to draw
    assert "to generate" not in capsys.readouterr().out
    (run / "checkpoints" / "stage_0001" / "state.pt").write_bytes(b"")  # what marks a stage folder
    for stage in (run / "checkpoints" / "stage_0001", run / "checkpoints" / "stage_0001" / "team"):
        identity = team_identity(evaluation.parse_args(["--ckpt", str(stage), "--temperature", "0.8"]))
        assert (identity["max_new_tokens"], identity["temperature"], identity["top_p"]) == (4, 0.8, 0.9)
    (run / "config.json").unlink()  # a team without its run's config: the paper's evaluation sampling
    identity = team_identity(evaluation.parse_args(["--ckpt", str(run)]))
    assert (identity["max_new_tokens"], identity["temperature"], identity["top_p"]) == (32768, 0.8, 1.0)


# -- clear errors ------------------------------------------------------------------------------
def test_unknown_bench_is_one_line(tmp_path, capsys):
    assert evaluation.main(["--agents", "tiny x3", "--bench", "aime26", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "unknown dataset 'aime26'" in err and "aime24" in err


@pytest.mark.slow  # a process importing torch, transformers and datasets
def test_offline_bench_says_how_to_pass_a_local_file(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "eval_aime.py", "--agents", "tiny x3", "--bench", "aime24", "--out", str(tmp_path / "o")]
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    err = proc.stderr.strip()
    assert proc.returncode != 0 and "\n" not in err, err
    assert err.startswith("eval_aime.py: error:") and "--data data/aime24.jsonl" in err


@pytest.mark.slow
def test_a_composite_of_datasets_and_an_environment_is_their_mean(tmp_path):
    """--bench data files plus env:NAME: each setting in its own subfolder (its summary.json as it would be alone),
    and the composite the mean of the team's avg@K over every benchmark (the paper's Table 3 composite)."""
    data = Path(__file__).resolve().parents[1] / "data"
    out = tmp_path / "t3"
    cfg = evaluation.parse_args(["--agents", "tiny x2", "--bench",
                                f"{data / 'aime24.jsonl'},{data / 'aime25.jsonl'},env:detective-cases",
                                "--k", "2", "--limit", "1", "--max-new-tokens", "3", "--task-option", "turns=2",
                                "--out", str(out)])
    composite = evaluation.evaluate(cfg, log=lambda *_: None)
    subs = {name: json.loads((out / folder / "summary.json").read_text())["benchmarks"][name]
            for folder, names in (("files", ["aime24", "aime25"]), ("env_detective-cases", ["env:detective-cases"]))
            for name in names}
    team = {name: b["metrics"]["team"]["avg@2"]["value"] for name, b in subs.items()}
    assert composite["benchmarks"] == team and list(team) == ["aime24", "aime25", "env:detective-cases"]
    assert composite["composite"] == pytest.approx(sum(team.values()) / 3)
    assert json.loads((out / "composite.json").read_text()) == composite
    assert subs["env:detective-cases"]["rounds"]["max"] == 2  # the environment's episodes, over its rounds
    seconds = subs["env:detective-cases"]["round_seconds"]  # one rollout call of 2 rounds: its time, split
    assert seconds["rounds"] == 2 and 0 <= seconds["responder_seconds"] < seconds["agents_seconds"]  # rules: no model
    assert "round_seconds" not in subs["aime24"]  # single-turn benchmarks have no rounds


def test_round_seconds_count_the_last_call_of_each_planned_chunk_and_cut_a_torn_line(tmp_path):
    def row(chunk, rnd, agents, first=0):
        return json.dumps({"bench": "env:x", "first_problem": first, "chunk": chunk, "round": rnd, "episodes": 2,
                           "agents_seconds": agents, "responder_seconds": 0.5, "step_seconds": 0.25}) + "\n"
    path = tmp_path / evaluation.ROUNDS_FILE
    first_call = row(0, 1, 1.0) + row(0, 2, 2.0) + row(0, 3, 8.0)  # its chunk generated again below, in 2 rounds
    path.write_text(first_call + row(0, 1, 4.0) + row(0, 2, 16.0) + row(1, 1, 32.0) + row(0, 1, 64.0, first=4)
                    + row(1, 2, 128.0)[:-9])  # chunk 1's second round torn by a crash
    rows = evaluation.read_rounds(path)
    assert path.read_text().endswith(row(0, 1, 64.0, first=4))  # the torn line is cut off the file
    planned = {("env:x", 0, 0), ("env:x", 0, 1)}  # (env:x, 4, 0) is outside this plan (e.g. a smaller --limit)
    assert evaluation.round_seconds(rows, planned) == {
        "env:x": {"rounds": 3, "agents_seconds": 52.0, "responder_seconds": 1.5, "step_seconds": 0.75}}
