"""The import graph is a DAG whose arrows point from the product (harness/, scale/) to the paper's modules, lazy imports
included (tools/check_imports.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_graph_has_no_cycle_and_entry_points_on_top():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "check_imports.py"), "--tests"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "import graph: OK" in done.stdout and "[0] " in done.stdout  # the graph, level by level


def test_quiet_prints_the_verdict_alone_when_the_graph_holds():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "check_imports.py"), "--tests", "--quiet"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.splitlines() == [
        "import graph: OK (a DAG; the paper's modules import from harness/ only the processes seam, and eval_aime "
        "the answer grader; never scale/)"]


def test_checker_finds_a_lazy_cycle(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    (tmp_path / "sat.py").write_text("import a\n")
    (tmp_path / "c.py").write_text("import sat\n")
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "check_imports.py"), "--root", str(tmp_path),
                           "--quiet"], capture_output=True, text=True, timeout=60)  # quiet still shows a failure whole
    assert done.returncode == 1
    assert "CYCLE: a <-> b" in done.stdout
    assert "lazy imports (1): b -> a" in done.stdout
    assert "TOP MODULE IMPORTED: c imports sat" in done.stdout


def test_checker_finds_scale_out_in_the_paper(tmp_path):
    """The paper reaches scale/ only through the seam the harness hands in: a paper module importing scale/ fails,
    lazily too; harness/ and scale/ itself may."""
    for package in ("scale", "harness"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "scale" / "distributed.py").write_text("import update\n")  # scale/ above the paper: allowed
    (tmp_path / "update.py").write_text("def f():\n    from scale import distributed\n")  # lazy, still refused
    (tmp_path / "harness" / "cli.py").write_text("from scale import distributed\n")  # the product picks it: allowed
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "check_imports.py"), "--root", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "SCALE-OUT IN THE PAPER: update imports scale.distributed (lazy)" in done.stdout
    assert "harness.cli imports" not in done.stdout and "SCALE-OUT IN THE PAPER: scale" not in done.stdout


def test_checker_keeps_the_product_out_of_the_paper(tmp_path):
    """A paper module may take the processes seam it is handed but not the product's configuration (its own is
    sat_config.SatConfig) nor the loading code; eval_aime.py's metrics may also take the answer grading; the
    ``__main__`` blocks of sat.py and eval_aime.py (their command lines) are exempt."""
    (tmp_path / "harness").mkdir()
    for name in ("__init__", "config", "loading", "cli", "processes", "math_grading"):
        (tmp_path / "harness" / f"{name}.py").write_text("")
    (tmp_path / "harness" / "cli.py").write_text("import sat\n")
    (tmp_path / "harness" / "evaluation.py").write_text("import eval_aime\nfrom harness import loading\n")
    (tmp_path / "rollout.py").write_text("from harness.processes import ONE_PROCESS\n"
                                         "from harness.config import Config\nfrom harness.loading import x\n")
    (tmp_path / "sat.py").write_text("import rollout\nif __name__ == '__main__':\n    from harness.cli import main\n")
    (tmp_path / "eval_aime.py").write_text("from harness import math_grading\nfrom harness import loading\n"
                                           "if __name__ == '__main__':\n    from harness.evaluation import main\n")
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "check_imports.py"), "--root", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stdout
    assert "PRODUCT IN THE PAPER: rollout imports harness.loading (top)" in done.stdout
    assert "PRODUCT IN THE PAPER: rollout imports harness.config (top)" in done.stdout
    assert "rollout imports harness.processes" not in done.stdout
    assert "PRODUCT IN THE PAPER: eval_aime imports harness.loading (top)" in done.stdout
    assert "eval_aime imports harness.math_grading" not in done.stdout
    assert "CYCLE" not in done.stdout and "sat imports" not in done.stdout and "harness.evaluation imports" not in \
        done.stdout
    assert "| __main__: harness.cli" in done.stdout
