"""experiments/ (issue 35): each claim's script at the smallest size, its table and plot, a second invocation that
skips the finished runs, a partial run and a killed run resumed, and bad input refused in one line."""
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.run_folder import read_metrics

REPO = Path(__file__).resolve().parents[1]


def load(name: str):
    """experiments/<name>.py as a module of its own name (plug_and_play.py would otherwise meet the core module)."""
    spec = importlib.util.spec_from_file_location(f"experiments_{name}", REPO / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


common = load("common")
plug_and_play = load("plug_and_play")
sequential_vs_joint = load("sequential_vs_joint")
team_vs_single = load("team_vs_single")
step_rule = load("step_rule")

SMALL = ["--threads", "1", "--batch-size", "32", "--group-size", "4", "--eval-size", "16", "--epochs", "1",
         "--minibatch-size", "16", "--warmup-steps", "5", "--device", "cpu", "--quiet"]


def table_rows(out: Path) -> list[list[str]]:
    """The body rows of table.md's markdown table, as cells."""
    lines = [ln for ln in (out / "table.md").read_text().splitlines() if ln.startswith("|")][2:]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]


def svj_argv(out: Path, stages: int, *extra: str) -> list[str]:
    return ["--agents", "tiny x2", "--seeds", "0", "--stages", str(stages), "--protocols", "independent",
            "--n-agents", "2", "--out", str(out), *extra] + SMALL


@pytest.fixture(scope="module")
def svj(tmp_path_factory):
    out = tmp_path_factory.mktemp("svj")
    argv = svj_argv(out, 1)
    assert sequential_vs_joint.main(argv) == 0
    return out, argv


@pytest.mark.slow  # the module's sequential_vs_joint run: five tiny runs
def test_sequential_vs_joint_writes_its_table_and_plot(svj):
    out, _ = svj
    rows = table_rows(out)
    assert [(r[0], r[1], r[2]) for r in rows] == [("independent-n2", c, "1") for c in sequential_vs_joint.CONDITIONS]
    assert rows[0][6] == "-" and rows[1][6] != "-"  # the paired difference is against sat-regenerate
    assert (out / "plot.png").stat().st_size > 0
    for cond in sequential_vs_joint.CONDITIONS:  # OUT/<setting>/<condition>/seed<S>, every run from one stage 0
        rows = read_metrics(out / "independent-n2" / cond / "seed0")
        assert [r["stage"] for r in rows] == [0, 1]
        assert rows[0] == read_metrics(out / "independent-n2" / "stage0" / "seed0")[0]
    config = json.loads((out / "independent-n2" / "joint" / "seed0" / "config.json").read_text())
    assert config["update"] == "joint" and config["batch_size"] == 32 and config["seed"] == 0


@pytest.mark.slow  # the module's sequential_vs_joint run: five tiny runs
def test_a_second_invocation_skips_finished_runs(svj, capsys, monkeypatch):
    out, argv = svj
    before = {c: read_metrics(out / "independent-n2" / c / "seed0") for c in sequential_vs_joint.CONDITIONS}

    def no_run(*args, **kwargs):
        raise AssertionError("a finished run was run again")

    monkeypatch.setattr(common.harness.run, "run", no_run)  # not a wall-time bound: a busy machine passes it too
    assert sequential_vs_joint.main(argv) == 0
    said = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[experiments]")]
    assert len(said) == 4 and all(ln.endswith("skipped (finished)") for ln in said)
    assert {c: read_metrics(out / "independent-n2" / c / "seed0") for c in before} == before


@pytest.mark.slow  # the module's sequential_vs_joint run: five tiny runs
def test_partial_runs_resume_and_debris_restarts(svj, capsys):
    out, argv = svj
    folder = out / "independent-n2" / "sat-weights" / "seed0"
    stage1 = read_metrics(folder)[1]
    debris = out / "independent-n2" / "joint" / "seed0"  # killed before its first checkpoint: config.json only
    for p in list(debris.iterdir()):
        if p.name != "config.json":
            p.unlink() if p.is_file() else shutil.rmtree(p)
    assert sequential_vs_joint.main(svj_argv(out, 2, "--conditions", "sat-weights,joint")) == 0
    said = capsys.readouterr().out
    assert f"{folder}: partial" in said and f"{debris}: new" in said
    rows = read_metrics(folder)
    assert [r["stage"] for r in rows] == [0, 1, 2] and rows[1] == stage1  # continued, not redone
    assert [r["stage"] for r in read_metrics(debris)] == [0, 1, 2]


def test_a_run_trained_further_reads_as_its_first_stages(tmp_path, capsys):
    rows = [{"stage": s, "eval_accuracy": 0.1 * s} for s in range(4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert common.ensure_run(tmp_path, ["--never-parsed"], 2) == rows[:3]  # finished: nothing runs
    assert capsys.readouterr().out.strip().endswith("skipped (finished)")


@pytest.mark.slow
def test_a_killed_script_resumes_where_it_stopped(tmp_path):
    out = tmp_path / "svj"
    argv = svj_argv(out, 4, "--conditions", "sat-weights")
    run = out / "independent-n2" / "sat-weights" / "seed0"
    proc = subprocess.Popen([sys.executable, str(REPO / "experiments" / "sequential_vs_joint.py"), *argv],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 900  # a guard against a hang: a loaded machine may take minutes
        while time.time() < deadline and not (run / "latest.json").exists():  # stage 1's checkpoint
            time.sleep(0.1)
        assert (run / "latest.json").exists(), "the run never checkpointed a stage"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    kept = json.loads((run / "latest.json").read_text())["stage"]  # a later metrics row is redone on resume
    done = read_metrics(run)[: kept + 1]
    assert 1 <= kept < 4
    assert sequential_vs_joint.main(argv) == 0
    rows = read_metrics(run)
    assert [r["stage"] for r in rows] == [0, 1, 2, 3, 4] and rows[: kept + 1] == done


@pytest.mark.slow
def test_plug_and_play_branches_and_table(tmp_path, capsys):
    out = tmp_path / "pnp"
    argv = ["--agents", "tiny x2", "--seeds", "0", "--stages", "1", "--more-stages", "1", "--out", str(out),
            "--upgrade-warmup-steps", "5", "--stage0-delta", "0.05"] + SMALL
    assert plug_and_play.main(argv) == 0
    rows = table_rows(out)
    assert [r[0] for r in rows] == list(plug_and_play.BRANCHES) and all(r[1] == "1" for r in rows)
    by = {r[0]: r for r in rows}
    assert by["continue"][3] == "-" and by["strong"][3] != "-" and by["strong"][5] != "-"
    assert (out / "plot.png").stat().st_size > 0
    base = read_metrics(out / "base" / "seed0")
    for branch in plug_and_play.BRANCHES:
        rows = read_metrics(out / branch / "seed0")
        assert [r["stage"] for r in rows] == [0, 1, 2] and rows[:2] == base  # branched from the base's stage 1
    weak = read_metrics(out / "weak" / "seed0")[2]["upgrades"][0]
    raw = read_metrics(out / "strong-raw" / "seed0")[2]["upgrades"][0]
    assert weak["to"] == "tiny" and raw["to"] == "tiny-6L" and raw["stage0"]["passes"] == 0  # not projected
    assert json.loads((out / "weak" / "seed0" / "config.json").read_text())["upgrade_warmup_steps"] == 0
    capsys.readouterr()
    assert plug_and_play.main(argv) == 0
    said = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[experiments]")]
    assert len(said) == 5 and all(ln.endswith("skipped (finished)") for ln in said)


@pytest.mark.slow  # over 10 s on two busy cores: two small runs
def test_team_vs_single_equal_tokens_and_table(tmp_path, capsys):
    out = tmp_path / "tvs"
    argv = ["--agents", "tiny x2", "--seeds", "0", "--stages", "1", "--vote-groups", "2", "--out", str(out),
            "--budget", "tokens,updates"] + SMALL
    assert team_vs_single.main(argv) == 0
    rows = table_rows(out)
    assert [r[1] for r in rows] == ["vote (avg@K of the team answer)", "avg@4, mean over agents", "maj@2",
                                    "avg@2 (= avg@4)", "maj@2", "avg@2 (= avg@4)"]
    assert [r["stage"] for r in read_metrics(out / "single" / "seed0")] == [0, 1, 2]  # n x the stages
    assert [r["stage"] for r in read_metrics(out / "single-updates" / "seed0")] == [0, 1]  # one step per agent
    assert "within 10%" in (out / "table.md").read_text()
    assert (out / "plot.png").stat().st_size > 0
    summary = json.loads((out / "eval" / "single" / "seed0" / "summary.json").read_text())
    assert summary["setting"]["k"] == 4 and summary["setting"]["agents"] == ["tiny"]
    capsys.readouterr()
    assert team_vs_single.main(argv) == 0
    said = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[experiments]")]
    assert len(said) == 3 and all(ln.endswith("skipped (finished)") for ln in said)


def test_majority_at_n_uses_disjoint_groups():
    rows = [{"who": "agent_1", "problem_id": "p", "sample": s, "answer": a, "gold": "5"}
            for s, a in enumerate(["5", "5", "4", "3", "4", "4"])]
    assert team_vs_single.per_problem(rows, "agent_1", 3) == {"p": 0.5}  # (5,5,4) right, (3,4,4) wrong


def test_per_problem_scores_and_their_pairing():
    rows = [{"who": w, "problem_id": pid, "sample": s, "answer": a, "gold": "5", "correct": a == "5"}
            for w, pid, answers in [("team", "p", "5545"), ("team", "q", "4444"),
                                    ("agent_1", "p", "5455"), ("agent_1", "q", "4544")]
            for s, a in enumerate(answers)]
    vote, avg = team_vs_single.per_problem(rows, "team"), team_vs_single.per_problem(rows, "agent_1")
    assert vote == {"p": 0.75, "q": 0.0} and avg == {"p": 0.75, "q": 0.25}
    assert team_vs_single.per_problem(rows, "agent_1", 2) == {"p": 1.0, "q": 0.0}  # a tie goes to the first seen
    assert team_vs_single.accuracy(rows, "agent_1") == 0.5  # the sample mean: 4 of 8
    mean, se = team_vs_single.paired_over_problems(vote, avg)
    assert mean == pytest.approx(-0.125) and se == pytest.approx(0.125)  # d = (0, -0.25): stdev 0.177 / sqrt 2


def test_statistics_helpers():
    mean, half = common.mean_ci([0.1, 0.2, 0.3])
    assert mean == pytest.approx(0.2) and half == pytest.approx(4.302653 * 0.1 / 3 ** 0.5, rel=1e-5)
    assert common.paired_differences({0: 0.5, 1: 0.4, 2: 0.1}, {1: 0.1, 0: 0.2}) == pytest.approx([0.3, 0.3])
    assert common.fmt_ci(0.5, float("nan")) == "+0.500" and common.fmt_ci(float("nan"), 1.0) == "-"


@pytest.mark.parametrize("argv, message", [
    (["--conditions", "sat,joint"], "--conditions 'sat,joint': unknown sat"),
    (["--protocols", "ring"], "--protocols 'ring': unknown ring"),
    (["--seeds", "0,x"], "--seeds '0,x'"),
    (["--seed", "3"], "--seed is set by the script"),
    (["--batch-size", "30", "--group-size", "8"], "--batch-size 30 must be a multiple of --group-size 8"),
])
def test_bad_input_is_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        sequential_vs_joint.parse_args(argv)
    text = str(exc.value.code) if isinstance(exc.value.code, str) else capsys.readouterr().err
    assert message in text and exc.value.code != 0


def test_candidate_rows_list_every_candidate_and_the_certification():
    def bound(mean, lower):
        return {"mean_change": mean, "lower_bound": lower}

    def rows(chosen, swapped, cert):
        accept = {"chosen": chosen, "swapped": swapped, "certification": cert, "candidates": [
            {"candidate": "stage0 delta0=0.01", "selection": bound(0.01, -0.02), "stage0": {"kl_quantile": 0.0099}},
            {"candidate": "stage0 delta0=1", "error": "Stage-0 could not bring agent 2 inside delta_0=1.0"},
            {"candidate": "raw", "selection": bound(0.05, 0.03)}]}
        return [{"stage": 0}, {"stage": 1, "upgrades": [{"accept": accept}]}]

    runs = {0: rows("raw", True, bound(0.04, 0.02)), 3: rows("raw", False, bound(0.01, -0.01))}
    header, table = plug_and_play.candidate_rows("strong-certified", runs, 0)
    assert header == ["candidate", "seed 0: selection gain / lower bound", "seed 3: selection gain / lower bound"]
    assert [r[0] for r in table[:3]] == ["stage0 delta0=0.01", "stage0 delta0=1", "raw"]
    assert table[0][1] == "+0.0100 / -0.0200 (KL q 0.010)" and table[1][2] == "dropped: Stage-0 did not fit"
    assert table[3][1].endswith("**+0.0200** -> swapped") and table[3][2].endswith("**-0.0100** -> incumbent kept")


@pytest.mark.slow  # four tiny runs of 2 stages
def test_step_rule_pairs_the_rules_by_seed_and_summarises_finished_runs(tmp_path, capsys):
    argv = ["--agents", "tiny x2", "--seeds", "0,1", "--stages", "2", "--eval-every", "2", "--lr", "1e-3",
            "--rules", "fixed,adaptive", "--out", str(tmp_path), *SMALL]
    assert step_rule.main(argv) == 0
    rows = {r[0]: r for r in table_rows(tmp_path / "preset-task")}
    assert set(rows) == {"fixed", "adaptive"} and rows["fixed"][1] == rows["adaptive"][1] == "2"
    fixed = read_metrics(tmp_path / "preset-task" / "fixed" / "seed0")
    adaptive = read_metrics(tmp_path / "preset-task" / "adaptive" / "seed0")
    untimed = lambda a: {k: v for k, v in a.items() if k not in ("lr", "lr_next") and "per_s" not in k}  # noqa: E731
    assert [untimed(a) for a in fixed[1]["agents"]] == [untimed(a) for a in adaptive[1]["agents"]]  # both at --lr
    text = (tmp_path / "preset-task" / "table.md").read_text()
    assert "adaptive - fixed, last held-out evaluation, paired by row: seed 0:" in text
    assert (tmp_path / "preset-task" / "kl.png").stat().st_size > 0  # where the kept steps land in delta
    assert [p.name for p in (tmp_path / "preset-task" / "fixed" / "seed0" / "checkpoints").iterdir()] == [
        "stage_0002"]  # a finished run keeps its last checkpoint alone
    capsys.readouterr()
    assert step_rule.main(argv + ["--summary"]) == 0  # reads the finished runs, runs nothing
    assert "skipped" not in capsys.readouterr().out and (tmp_path / "preset-task" / "table.md").read_text() == text
