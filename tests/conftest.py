"""Shared pytest configuration: hypothesis profiles.

Select with SAT_HYPOTHESIS_PROFILE=ci|dev (default ci):
- ci:  deterministic (derandomize), few examples, no deadline: same result on every run.
- dev: many random examples, for hunting counterexamples locally.
"""

import os

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", derandomize=True, max_examples=30, deadline=None, print_blob=True)
settings.register_profile("dev", max_examples=300, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("SAT_HYPOTHESIS_PROFILE", "ci"))


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
