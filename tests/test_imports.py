"""The import graph is a DAG with sat.py and eval_aime.py on top, lazy imports included (tools/check_imports.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_graph_has_no_cycle_and_entry_points_on_top():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "check_imports.py"), "--tests"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "import graph: OK" in done.stdout


def test_checker_finds_a_lazy_cycle(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    (tmp_path / "sat.py").write_text("import a\n")
    (tmp_path / "c.py").write_text("import sat\n")
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "check_imports.py"), "--root", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "CYCLE: a <-> b" in done.stdout
    assert "lazy imports (1): b -> a" in done.stdout
    assert "TOP MODULE IMPORTED: c imports sat" in done.stdout


def test_checker_finds_scale_out_in_the_core(tmp_path):
    """The core reaches scale/ only through the seam: a core module importing scale/ fails; the entry point
    and scale/ itself may."""
    (tmp_path / "scale").mkdir()
    (tmp_path / "scale" / "__init__.py").write_text("")
    (tmp_path / "scale" / "distributed.py").write_text("import update\n")  # scale/ above the core: allowed
    (tmp_path / "update.py").write_text("def f():\n    from scale import distributed\n")  # lazy, still refused
    (tmp_path / "sat.py").write_text("from scale import distributed\n")  # the entry point picks it: allowed
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "check_imports.py"), "--root", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "SCALE-OUT IN THE CORE: update imports scale.distributed (lazy)" in done.stdout
    assert "SCALE-OUT IN THE CORE: sat" not in done.stdout and "SCALE-OUT IN THE CORE: scale" not in done.stdout
