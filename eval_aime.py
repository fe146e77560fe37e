"""Evaluate a team on AIME24 / AIME25 / MATH-500, or any task: avg@K, pass@k, maj@K (paper, Section 6, Table 1).

Paper setting: avg@64 on AIME24/25, avg@4 on MATH-500, temperature 0.8, top_p 1.0, up to 32,768 new tokens. A
--ckpt team samples with its run's own temperature, top_p and max new tokens (the run folder's config.json) unless
the command line gives them (``harness.eval_setting.resolve_generation``).
Each sample is one joint trajectory of the whole team (``rollout.rollout``, as in training); the team answer
is the majority vote (independent) or the last agent's answer (chain).

    python eval_aime.py --agents "Qwen3-4B x3" --thinking --bench aime24,aime25 --k 64 --out runs/eval-base
    python eval_aime.py --ckpt runs/sat --bench aime24,aime25 --k 64 --out runs/eval-sat   # a sat.py run
    python eval_aime.py --agents "Qwen3-4B x3" --data data/aime24.jsonl --k 64             # offline copy
    OMP_NUM_THREADS=1 python eval_aime.py --agents "tiny x3" --data data/aime24.jsonl --limit 5 --k 4 \
        --max-new-tokens 16 --out /tmp/ev                                                 # CPU smoke run
    python eval_aime.py --ckpt runs/kk --bench reasoning-gym:knights_knaves --task-option n_people=2 --k 4
    python eval_aime.py --ckpt runs/mine --data mine.csv --reward my_reward.py:reward --k 8   # its own prompts

A benchmark with a reward of its own (a reasoning-gym task, or --reward as in sat.py) scores each sample with it:
avg@K is the mean reward (partial credit included), pass@k counts samples at the reward's maximum, maj@K is the
reward of the first sample that gives the most common team answer. The math benchmarks keep answer matching of
the team's voted answer.

Metrics per benchmark, for the team and each agent (its own answer inside the joint trajectory): avg@K,
the unbiased pass@1 and pass@K, maj@K, each with a 95% percentile bootstrap over problems (2000 resamples,
seed 0), the dominant uncertainty with 30 problems. --out holds predictions.jsonl (a row per benchmark,
problem, sample and who), summary.json and run.json. Resumable: rows are appended (fsync) after every chunk,
each chunk is seeded from (seed, benchmark, first problem, chunk), and the summary is computed from
predictions.jsonl alone, so an interrupted run gives the same summary; a rerun into the same --out with a
different setting (run.json) is refused.
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
