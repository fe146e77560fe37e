"""Shared pytest configuration: hypothesis profiles.

Select with SAT_HYPOTHESIS_PROFILE=ci|dev (default ci):
- ci:  deterministic (derandomize), few examples, no deadline: same result on every run.
- dev: many random examples, for hunting counterexamples locally.
"""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, max_examples=30, deadline=None, print_blob=True)
settings.register_profile("dev", max_examples=300, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("SAT_HYPOTHESIS_PROFILE", "ci"))
