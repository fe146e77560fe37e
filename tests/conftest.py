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


@pytest.fixture(scope="session", autouse=True)
def single_thread():
    """Tiny models and [5, 3]-sized tensors: one intra-op thread avoids OpenMP
    barrier stalls on a busy 2-core machine (measured up to 50x) and is the
    fastest setting for these sizes anyway."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
