"""Every script in bench/ runs at its smallest size and prints its figures: run as ``python bench/SCRIPT``
runs it (``runpy``, as ``__main__``, with its arguments in ``sys.argv``), in this process, which spares a process
start per script (its torch and transformers imports); a script without its optional package, in a process of its
own."""
from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# script, its smallest arguments, a line every run of it prints with its figures
RUNS = {
    "gpu_stage.py": (["--tiny", "--device", "cpu"],
                     r"(?m)^== update joint: team reward [\d.]+.*\n(?:.*\n)*?"
                     r"scale\.memory estimate: peak_training [\d.]+ GiB"),
    "line_search_peak.py": (["--agents", "tiny", "--repeats", "1"],
                            r"(?m)^  read +\d+ MiB +[\d.]+ s +backtracks \[\d+\]\n  copy +\d+ MiB +[\d.]+ s"),
    "long_responses.py": (["--lengths", "4", "--batch-size", "8"],
                          r"(?m)^\s+4 +regenerate \| +1\.000/1\.000/1\.000 \| .* \| +\d+ +[\d.]+ +[\d.]+$"),
    "rollout.py": (["--prompts", "4", "--max-new-tokens", "4", "--repeats", "1"],
                   r"(?m)^median speed-up of the batched rollout: [\d.]+x$"),
    "backends.py": (["--agents", "tiny x2", "--prompts", "4", "--max-new-tokens", "4", "--repeats", "1", "--backends",
                     "hf-generate,hf"],
                    r"(?m)^hf-generate +[\d.]+ +\d+ +[\d.]+ +[\d.]+\nhf +[\d.]+ +\d+ +[\d.]+ +[\d.]+\n"
                    r"ratio hf/hf-generate tokens/s: [\d.]+$"),
    "rounds_backends.py": (["--agents", "tiny x2", "--prompts", "2", "--max-rounds", "2", "--max-new-tokens", "4",
                            "--repeats", "1", "--backends", "hf"],
                           r"(?m)^hf +[\d.]+ +\d+ +[\d.]+ +[\d.]+  -\n(?:.*\n)*? +2 +4 +\d+ +[\d.]+ +-?[\d.]+ +\d+%$"),
    "real_stage.py": (["--agents", "tiny x2", "--batch-size", "8", "--minibatch-size", "8", "--eval-size", "4",
                       "--warmup-steps", "0", "--reuse", "regenerate"],
                      r"(?m)^stage 1 \(sat_stage\) [\d.]+ s of [\d.]+ s; generated \d+ tokens in [\d.]+ s"),
    "reasoning_gym_start.py": (["--model", "tiny", "--n", "2", "--max-new-tokens", "4", "--team", "2", "--tasks",
                                "knights_knaves;tower_of_hanoi:max_disks=3"],
                               r"(?m)^tower_of_hanoi:max_disks=3 +2( +[\d.]+){6} +\d+$"),
    "lora_checkpoint.py": (["lora", "ckpt", "--agents", "tiny-2L x2", "--rank", "2"],
                           r"(?m)^lora: team \d+ bytes, sharded \d+ bytes, peak RSS \d+ MiB, loaded in [\d.]+ s$"),
    "arbench_policies.py": (["--episodes", "4", "--turns", "4"],
                            r"(?m)^DC generated random +accuracy [\d.]+ \+- [\d.]+ \(n=4\) +chance 0\.200\n(?:.*\n)*?"
                            r"SP generated keys +word F1 +[\d.]+ \+- [\d.]+ \(n=4\)$"),
    "game_baselines.py": (["--episodes", "4"],
                          r"(?m)^\| blocksworld, instances planbench \| lift-and-replace \| 4 \| "
                          r"\+0\.000 \(0\.000\) \| 0\.0% \| 0\.0% \|$"),
    "smollm2_task.py": (["--model", "tiny", "--n", "2", "--max-new-tokens", "4", "--temperatures", "1.0"],
                        r"(?m)^1\.00 +mean +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+$"),
}
# scripts whose run needs an optional package CI does not install: here only their --help and their one-line
# error without it (the package hidden from the process)
WITHOUT = {"trl_side_by_side.py": ("trl", "pip install trl==1.16.0")}


def test_every_bench_script_is_run_here():
    assert sorted(p.name for p in (ROOT / "bench").glob("*.py")) == sorted({**RUNS, **WITHOUT})


def run_without(script: str, package: str, args: list[str], tmp_path) -> subprocess.CompletedProcess:
    """``script`` with ``args``, in a process where importing ``package`` fails as if it were not installed."""
    hide = (f"import runpy, sys; sys.modules[{package!r}] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", hide, str(ROOT / "bench" / script), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("script", sorted(WITHOUT))
def test_bench_script_without_its_optional_package(script, tmp_path):
    package, install = WITHOUT[script]
    helped = run_without(script, package, ["--help"], tmp_path)
    assert helped.returncode == 0 and "usage:" in helped.stdout, helped.stderr[-3000:]
    refused = run_without(script, package, [], tmp_path)
    assert refused.returncode == 1 and install in refused.stderr, refused.stderr[-3000:]
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr[-3000:]


def run_as_main(path: Path, args: list[str], monkeypatch) -> None:
    """``python path *args`` in this process: ``sys.argv`` set, the script's folder first on ``sys.path``, run as
    ``__main__``; the torch thread count and random state a script sets are put back, so the tests after it on this
    worker are not changed by it."""
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    monkeypatch.syspath_prepend(str(path.parent))
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng():
            runpy.run_path(str(path), run_name="__main__")
    except SystemExit as done:
        assert done.code in (0, None), f"{path.name} exited with {done.code}"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow  # whole small runs: seconds each
@pytest.mark.parametrize("script", sorted(RUNS))
def test_bench_script_prints_its_figures(script, tmp_path, monkeypatch, capsys):
    args, pattern = RUNS[script]
    monkeypatch.chdir(tmp_path)
    run_as_main(ROOT / "bench" / script, args, monkeypatch)
    out = capsys.readouterr().out
    assert re.search(pattern, out), f"{script} did not print its figures:\n{out[-3000:]}"
