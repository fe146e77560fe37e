"""The evaluation's metrics (paper, Section 6, Table 1): avg@K, the unbiased pass@k and maj@K, with bootstrap intervals.

Each problem has K samples, each one joint trajectory of the whole team. ``problem_metrics`` gives a problem's
avg@K, pass@1, pass@K and maj@K (with a benchmark's own reward: avg@K is the mean reward, pass@k counts samples at
the reward's maximum, maj@K is the reward of the first sample giving the most common answer); ``aggregate`` their
means over problems, each with a 95% percentile bootstrap interval (2000 resamples, seed 0), the dominant
uncertainty with 30 problems. ``python eval_aime.py`` runs the evaluation (``harness.evaluation``; ``--help``).
"""
from __future__ import annotations

import math
import statistics

import numpy as np

from harness.math_grading import answers_match, majority_vote, normalize_answer

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


# -- Metrics (pure functions of per-problem sample outcomes); the loop that feeds them: harness/evaluation.py --
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are right: 1 - C(n-c, k) / C(n, k), as the product
    prod_{i<k} (n-c-i) / (n-i) (no huge binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:  # every k-subset contains a right sample
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def majority_correct(answers: list[str | None], gold: str) -> bool:
    """maj@K of one problem (all abstaining is wrong); a tie goes to the answer seen first: deterministic."""
    return answers_match(majority_vote(answers), gold)


def bootstrap_ci(scores: list[float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED,
                 level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of per-problem scores."""
    x = np.asarray(scores, dtype=np.float64)  # [P]
    if len(x) == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(resamples, len(x)))].mean(axis=1)  # [resamples]
    lo, hi = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    return (float(lo), float(hi))


def problem_metrics(correct: list[bool], answers: list[str | None], gold: str, k: int,
                    scores: list[float] | None = None) -> dict[str, float]:
    """avg@K, pass@1, pass@K and maj@K of one problem from its K samples. ``scores``: each sample's reward (a
    benchmark with a reward of its own): avg@K is their mean and maj@K the score of the first sample that gives
    the majority answer; ``correct`` then says which samples earned the reward's maximum."""
    n, c = len(correct), sum(correct)
    if scores is None:
        return {f"avg@{k}": c / n, "pass@1": pass_at_k(n, c, 1), f"pass@{k}": pass_at_k(n, c, k),
                f"maj@{k}": float(majority_correct(answers, gold))}
    majority = majority_vote(answers)
    first = next((s for a, s in zip(answers, scores) if a is not None and majority is not None
                  and normalize_answer(a) == normalize_answer(majority)), 0.0)
    return {f"avg@{k}": sum(scores) / n, "pass@1": pass_at_k(n, c, 1), f"pass@{k}": pass_at_k(n, c, k),
            f"maj@{k}": float(first)}


def aggregate(per_problem: list[dict[str, float]]) -> dict[str, dict]:
    """Mean over problems of each metric, with its 95% bootstrap interval."""
    out = {}
    for name in per_problem[0]:
        scores = [m[name] for m in per_problem]
        out[name] = {"value": float(np.mean(scores)), "ci95": list(bootstrap_ci(scores))}
    return out


def length_stats(tokens: list[int], truncated: list[bool]) -> dict[str, float]:
    """Response length (tokens) and the share that hit --max-new-tokens."""
    return {"mean_tokens": float(np.mean(tokens)), "median_tokens": float(statistics.median(tokens)),
            "max_tokens": int(max(tokens)), "truncated": float(np.mean(truncated))}


if __name__ == "__main__":
    import sys

    from harness.evaluation import main  # the loop, its options and the run folder: harness/

    sys.exit(main())
