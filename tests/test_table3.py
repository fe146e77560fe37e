"""experiments/table3.py: the paper's Table 3 columns of plug_and_play.py (Before, After, Gain, each benchmark's
change, Viol.%) from the composites of eval_aime.py and the runs' metrics."""
import json
import sys
from pathlib import Path

import pytest
import test_experiments

REPO = Path(__file__).resolve().parents[1]


plug_and_play = test_experiments.plug_and_play
table3 = sys.modules["table3"]  # the module plug_and_play.py imports


def composite(**team: float) -> dict:
    return {"benchmarks": team, "composite": sum(team.values()) / len(team), "k": 1}


def test_a_row_is_the_composites_their_paired_gain_and_the_share_of_violating_stages():
    before = {0: composite(aime24=0.10, aime25=0.20, dc=0.30), 1: composite(aime24=0.0, aime25=0.0, dc=0.60)}
    after = {0: composite(aime24=0.40, aime25=0.20, dc=0.30), 1: composite(aime24=0.0, aime25=0.30, dc=0.60)}
    stage = 2  # stages 0..2 are the base's; 3 and 4 follow the swap
    runs = {s: [{"stage": t, "violation": t == 4 and s == 1 or t == 1} for t in range(5)] for s in (0, 1)}
    row = table3.row("strong", before, after, runs, stage)
    assert table3.header(["aime24", "aime25", "env:dc"]) == [
        "branch", "seeds", "Before %", "After %", "Gain (pp, 95% CI)", "daime24 (pp)", "daime25 (pp)", "ddc (pp)",
        "Viol.% (stages)"]
    # Before 20 and 20 %, After 30 and 30 %: mean 20.0 ± 0 and 30.0 ± 0; gain +10 in both seeds
    assert row[:4] == ["strong", "2", "20.0 ± 0.0", "30.0 ± 0.0"] and row[4] == "+10.0 ± 0.0"
    assert row[5:8] == ["+15.0", "+15.0", "+0.0"]  # aime24 +30 and 0, aime25 0 and +30, dc unchanged
    assert row[8] == "25.0 (1/4)"  # stage 1 (a violation before the swap) is not counted


def test_a_row_with_one_seed_has_no_interval_and_gains_can_be_negative():
    before, after = {3: composite(a=0.5, b=0.25)}, {3: composite(a=0.25, b=0.0)}
    row = table3.row("weak", before, after, {3: [{"stage": 0, "violation": False}]}, 0)
    assert row == ["weak", "1", "37.5", "12.5", "-25.0", "-25.0", "-25.0", "-"]  # no stage after the swap: no Viol.%


@pytest.mark.parametrize("options, message", [
    ("--ckpt runs/x", "--table3-options --ckpt is set by the script"),
    ("--k 0", "--table3-options: --k must be >= 1 (got 0)"),
])
def test_bad_table3_options_are_one_line_before_any_run(options, message, tmp_path):
    argv = ["--agents", "tiny x2", "--seeds", "0", "--out", str(tmp_path), "--table3", "data/aime24.jsonl",
            "--table3-options", options]
    with pytest.raises(SystemExit) as exc:
        plug_and_play.parse_args(argv)
    assert message in str(exc.value.code) and "\n" not in str(exc.value.code)
    assert not any(tmp_path.iterdir())


@pytest.mark.slow  # one tiny run of 2 stages and 2 evaluations of the composite
def test_plug_and_play_reports_table3_from_the_composites_it_evaluated(tmp_path, capsys):
    out = tmp_path / "pnp"
    argv = ["--agents", "tiny x2", "--seeds", "0", "--stages", "1", "--more-stages", "1", "--branches", "continue",
            "--table3", f"{REPO / 'data' / 'aime24.jsonl'},env:detective-cases",
            "--table3-options", "--k 2 --limit 1 --max-new-tokens 3 --task-option turns=2", "--out", str(out),
            "--threads", "1", "--batch-size", "16", "--group-size", "4", "--eval-size", "8", "--epochs", "1",
            "--minibatch-size", "16", "--warmup-steps", "5", "--device", "cpu", "--quiet"]
    assert plug_and_play.main(argv) == 0
    before = json.loads((out / "table3" / "before" / "seed0" / "composite.json").read_text())
    after = json.loads((out / "table3" / "continue" / "seed0" / "composite.json").read_text())
    assert list(before["benchmarks"]) == ["aime24", "env:detective-cases"]
    run = json.loads((out / "table3" / "continue" / "seed0" / "files" / "run.json").read_text())
    assert run != json.loads((out / "table3" / "before" / "seed0" / "files" / "run.json").read_text())  # other weights
    lines = [ln for ln in (out / "table3.md").read_text().splitlines() if ln.startswith("| continue")]
    cells = [c.strip() for c in lines[0].strip("|").split("|")]
    assert cells[2] == f"{100 * before['composite']:.1f}" and cells[3] == f"{100 * after['composite']:.1f}"
    assert cells[4] == f"{100 * (after['composite'] - before['composite']):+.1f}"
    assert cells[-1].endswith("/1)")  # one stage after the branch point
    capsys.readouterr()
    assert plug_and_play.main(argv) == 0  # a second invocation: every run skipped, every evaluation read back
    assert "samples to generate" not in capsys.readouterr().out
