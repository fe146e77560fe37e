"""tools/compare_runs.py: the start, end and change of each run, and the mean over runs, from metrics.jsonl."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from compare_runs import summary  # noqa: E402


def write_run(folder: Path, accs: list[float], n: int = 64) -> Path:
    folder.mkdir()
    rows = [{"stage": s, "seconds": 0.0 if s == 0 else 60.0, "eval_accuracy": a,
             "eval_stderr": math.sqrt(a * (1 - a) / n), "eval_agent_reward": [a / 2, a / 3]}
            for s, a in enumerate(accs)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_summary_reads_the_first_and_last_evaluation(tmp_path):
    s = summary(write_run(tmp_path / "a", [0.25, 0.5, 0.375]))
    assert (s["stages"], s["start"], s["end"], s["change"], s["seconds"]) == (2, 0.25, 0.375, 0.125, 120.0)
    assert s["change_se"] == pytest.approx(math.sqrt((0.25 * 0.75 + 0.375 * 0.625) / 64))
    assert s["agents_end"] == [0.1875, 0.125] and s["certified"] is None  # a run without paired evaluations


def test_a_run_certificate_gives_the_paired_error_and_the_certified_gain(tmp_path):
    folder = write_run(tmp_path / "a", [0.25, 0.5])
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    rows[-1]["run_certificate"] = {"lower_bound": 0.11, "stderr": 0.02, "mean_change": 0.25}
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = summary(folder)
    assert (s["certified"], s["change_se"]) == (0.11, 0.02)


def test_cli_prints_every_run_and_the_mean_change_and_plots(tmp_path):
    runs = [write_run(tmp_path / "a", [0.25, 0.5]), write_run(tmp_path / "b", [0.5, 0.25, 0.75])]
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "compare_runs.py"), *map(str, runs), "--plot",
                          str(tmp_path / "p.png")], capture_output=True, text=True, check=True).stdout
    assert "mean change over 2 runs: +0.250 (se between runs 0.000)" in out  # both changed by +0.25
    assert (tmp_path / "p.png").stat().st_size > 0


def test_a_folder_without_metrics_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="no metrics.jsonl with a stage-0 row"):
        summary(tmp_path)


def test_stage_table_puts_each_paired_bound_beside_its_unpaired_figure(tmp_path):
    from compare_runs import stage_table

    folder = write_run(tmp_path / "a", [0.25, 0.5, 0.375])
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    for r, (low, unpaired) in zip(rows[1:], [(0.031, -0.12), (-0.25, -0.33)]):
        cert = {"mean_change": 0.1, "stderr": 0.02, "nonzero": 0.25, "lower_bound": low,
                "unpaired_lower_bound": unpaired}
        r.update(certificate=cert, run_certificate={**cert, "lower_bound": low + 0.5}, violation=low < 0,
                 certified_fall=False, eval_seconds=7.0)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = stage_table(summary(folder))
    assert len(lines) == 3  # the header and the two trained stages; stage 0 has nothing to certify
    assert lines[1].split()[:10] == ["1", "0.500", "+0.100+-0.020", "25%", "+0.031", "-0.120", "+0.531", "-0.120",
                                     "no", "no"]
    assert lines[2].split()[8] == "yes" and lines[2].split()[-1] == "7"


def test_an_evaluation_of_one_value_prints_no_standard_error(tmp_path):
    """sat.py logs ``eval_stderr`` None when one held-out value gives no sample standard deviation."""
    folder = write_run(tmp_path / "a", [0.0, 1.0])
    rows = [dict(json.loads(line), eval_stderr=None) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert summary(folder)["change_se"] is None
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "compare_runs.py"), str(folder), "--plot",
                          str(tmp_path / "p.png")], capture_output=True, text=True, check=True).stdout
    assert " 0.000+--   1.000+--   +1.000+--" in out
