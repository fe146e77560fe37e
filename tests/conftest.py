"""Shared pytest configuration: hypothesis profiles, and the order files reach pytest-xdist's workers.

Select with SAT_HYPOTHESIS_PROFILE=ci|dev (default ci):
- ci:  deterministic (derandomize), few examples, no deadline: same result on every run.
- dev: many random examples, for hunting counterexamples locally.

The README's test command is `pytest -n 2 --dist loadfile`: each file's tests run on one worker, and a worker takes
the next file from a queue when it runs low. xdist's default queue puts the files with the most tests first, so the
files of two or three whole real-model runs (the longest ones) went last and the run ended on one worker.
`LONGEST_FILES` lists them longest first and `pytest_collection_modifyitems` puts them at the head of the queue
(longest-processing-time first), which leaves the short files to fill in at the end.
"""

import os

import pytest
import torch
from hypothesis import settings

# Every process the tests start (sat.py, torchrun ranks, vLLM engines) runs one torch thread unless told otherwise,
# and a vLLM CPU engine is not pinned: by default the CPU build binds each engine's one thread to core 0 and reserves
# the other, so two engines at once (two ranks, or both workers) share one core while the other waits. The suite runs
# two workers on two cores; a second thread beside the other worker spins at OpenMP barriers (docs/results.md, "CI
# on a fresh clone, two workers"). A value already in the environment wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

settings.register_profile("ci", derandomize=True, max_examples=30, deadline=None, print_blob=True)
settings.register_profile("dev", max_examples=300, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("SAT_HYPOTHESIS_PROFILE", "ci"))

# The files that take longest on an idle two-core machine, longest first (each file's seconds: its entries among the
# 80 slowest of `pytest -n 2 --dist loadfile --durations=80` on a fresh clone at 31d7aae, setup + call + teardown;
# docs/results.md, "CI on a fresh clone, two workers"). A file not listed keeps xdist's order after them (most tests
# first). The order changes only when a file starts, never what a test computes; a stale list costs time, not
# correctness.
LONGEST_FILES = (
    "test_real_team.py",       # 203 s: the HF and the vLLM run of a real SmolLM2 team
    "test_distributed.py",     # 182 s: four torchrun sat.py runs, six in-process ones, seven torchrun workers
    "test_vllm_engine.py",     # 163 s: real vLLM engines, two ranks, an evaluation
    "test_vllm_rounds.py",     # 81 s: three vLLM engines over rounds
    "test_vllm_lora.py",       # 75 s: one vLLM engine serving LoRA adapters, and a sat.py run on one
    "test_experiments.py",     # 63 s: the sequential-vs-joint and plug-and-play runs
    "test_sat.py",             # 57 s: whole tiny runs and their resumes
    "test_real_model.py",      # 54 s: the GGUF conversion and its logits
    "test_plug_and_play.py",   # 51 s: Stage-0's memory profile and the closed-form fit
    "test_run_records.py",     # 48 s: a kill -9 at three points and the resumes
    "test_upgrade_accept.py",  # 44 s: runs with a certified upgrade
    "test_certificate.py",     # 36 s: the enumerable team's steps
)


def file_rank(item) -> tuple[int, int]:
    """(0, place in LONGEST_FILES) for a listed file, (1, 0) for the rest: a sort key that keeps the order inside
    a file and among the files not listed."""
    name = item.path.name
    return (0, LONGEST_FILES.index(name)) if name in LONGEST_FILES else (1, 0)


def pytest_configure(config):
    """Queue files in collection order: xdist's reordering by test count (on by default) would undo
    `pytest_collection_modifyitems`'s order."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """The longest files first, then the rest with the files of most tests first (xdist's default order): a stable
    sort, so each file's tests keep their order (some share a module's engines in that order)."""
    count = {}
    for item in items:
        count[item.path] = count.get(item.path, 0) + 1
    items.sort(key=lambda item: (file_rank(item), -count[item.path]))


@pytest.fixture(scope="session")
def one_stage_tiny_run(tmp_path_factory):
    """The folder of a finished 1-stage run of two tiny agents (32 trajectories, 30 warm-start steps): the run
    that test_upgrade_accept and test_plug_and_play upgrade, once for the session. Read it, resume it into
    another --out, or copy it before changing it."""
    import harness.run
    from harness.config import Config

    out = tmp_path_factory.mktemp("one_stage") / "run"
    cfg = Config(agents="tiny x2", stages=1, batch_size=32, group_size=4, epochs=1, minibatch_size=16,
                 warmup_steps=30, eval_size=16, out=str(out), device="cpu").apply_preset()
    harness.run.run(cfg, log=lambda *_: None)
    return out


@pytest.fixture(scope="session", autouse=True)
def single_thread():
    """Tiny models and [5, 3]-sized tensors: one intra-op thread avoids OpenMP
    barrier stalls on a busy 2-core machine (measured up to 50x) and is the
    fastest setting for these sizes anyway."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
