"""The monotonic-improvement guarantee: the paper's bound, and the lower bounds a run logs.

Paper, Section 4: Lemma 4.1 (occupancy shift), Theorem 4.2 (single-step
bound), Lemma 4.3 (a product policy's KL is the sum of its factors'),
Theorem 4.4 (joint-stage bound, any order), Theorems 4.7 / 4.9 (the
finite-sample term). ``certificate`` and ``stage_certificate`` are Theorems
4.2 and 4.4 with exact quantities (the toy-MDP tests check them exactly).

What a run logs as a lower bound must be one at any response length, from
what the run samples: ``paired_change_bound`` on paired draws under common
random numbers, per step (``--reuse regenerate``: the changed turns drawn
before and after the step with one seed per row), per stage and for the whole
run (the held-out evaluation: the same problems under the same seeds at every
stage, against the previous evaluation and against stage 0). The bound is
the larger of Hoeffding and a variance-adaptive Bernstein bound
(``paired_lower_bound``). The paper's sample estimate of L_i is logged as an
estimate (``advantage.step_estimates``), never as a bound.
"""
from __future__ import annotations

import math

CERTIFICATE_TERMS = ("gain", "occupancy_penalty", "bias_penalty", "sample_penalty", "lower_bound")
VIOLATION_STDERRS = 2.0  # a violation (paper, Section 5): a paired held-out fall beyond this many standard errors


def certificate(surrogate_advantage: float, kl_max: float, adv_max: float, gamma: float, zeta: float = 0.0,
                n_samples: int | None = None, n_agents: int = 1, delta_conf: float = 0.05) -> dict:
    """Lower bound on J(pi_hat_i) - J(pi_hat_{i-1}) for one SAT step (paper, Theorem 4.2).

        J(pi_hat_i) - J(pi_hat_{i-1}) >= L_i - 2 gamma/(1-gamma)^2 * A_max * sqrt(KL_max/2)
                                         - zeta_i/(1-gamma)  [- sampling term]

    with L_i = E_{s~d^{old}, a~pi_new}[A^{old}(s, a)] / (1-gamma) ("gain"), d^{old} the
    normalised discounted occupancy of pi_hat_{i-1}, A_max = max |A^{old}|, KL_max =
    max_s KL(pi_new(.|s) || pi_old(.|s)).

    Why it holds: the performance-difference lemma gives exactly
    J(new) - J(old) = E_{s~d^{new}, a~pi_new}[A^{old}(s, a)] / (1-gamma). Swapping d^{new}
    for d^{old} costs at most ||d^{new} - d^{old}||_1 * max_s |E_{pi_new}[A^{old}(s, .)]| /
    (1-gamma); coupling the two state chains step by step gives ||d^{new} - d^{old}||_1 <=
    2 gamma/(1-gamma) * max_s TV(pi_new(.|s), pi_old(.|s)), and Pinsker gives TV <= sqrt(KL/2).
    In SAT only agent sigma(i)'s factor of the product policy changes, and for
    p_j x q vs p_j' x q the KL (and the TV) equals that of the changed factor, so KL_max
    is the active agent's own per-state KL. A biased advantage estimator moves the
    surrogate by at most zeta_i; with N_i samples, Hoeffding plus a union bound over the
    n agents adds A_max/(1-gamma) * sqrt(log(2n/delta_conf)/(2 N_i)) with probability
    1 - delta_conf. Summing over the steps of a stage gives the stage bound, for any order.

    Returns a dict of floats: gain, occupancy_penalty, bias_penalty, sample_penalty,
    lower_bound = gain - occupancy_penalty - bias_penalty - sample_penalty.
    """
    for name, value in (("surrogate_advantage", surrogate_advantage), ("kl_max", kl_max), ("adv_max", adv_max),
                        ("zeta", zeta)):
        if not math.isfinite(float(value)):
            raise ValueError(f"{name} must be finite, got {value}")
    if not 0.0 <= gamma < 1.0:
        raise ValueError(f"gamma must be in [0, 1), got {gamma}")
    for name, value, what in (("kl_max", kl_max, "a KL divergence"), ("adv_max", adv_max, "a maximum of |A|"),
                              ("zeta", zeta, "an absolute bias")):
        if value < 0:
            raise ValueError(f"{name} must be >= 0 ({what}), got {value}")
    if n_samples is not None and (int(n_samples) != n_samples or n_samples < 1):
        raise ValueError(f"n_samples must be a positive integer or None, got {n_samples}")
    if int(n_agents) != n_agents or n_agents < 1:
        raise ValueError(f"n_agents must be a positive integer, got {n_agents}")
    if not 0.0 < delta_conf < 1.0:
        raise ValueError(f"delta_conf must be in (0, 1), got {delta_conf}")

    horizon = 1.0 / (1.0 - gamma)
    gain = float(surrogate_advantage) * horizon
    occupancy_penalty = 2.0 * gamma * horizon**2 * float(adv_max) * math.sqrt(float(kl_max) / 2.0)
    bias_penalty = float(zeta) * horizon
    sample_penalty = (0.0 if n_samples is None else
                      float(adv_max) * horizon * math.sqrt(math.log(2.0 * n_agents / delta_conf) / (2.0 * n_samples)))
    return {"gain": gain, "occupancy_penalty": occupancy_penalty, "bias_penalty": bias_penalty,
            "sample_penalty": sample_penalty, "lower_bound": gain - occupancy_penalty - bias_penalty - sample_penalty}


def hoeffding_radius(n: int, value_range: float, delta: float) -> float:
    """t such that the mean of n independent variables, each in an interval of width ``value_range``, exceeds
    the mean of their expectations by t with probability at most delta (Hoeffding, one-sided)."""
    return value_range * math.sqrt(math.log(1.0 / delta) / (2.0 * n))


def bernstein_radius(diffs: list[float], width: float, delta: float) -> float:
    """t such that mean(D) - t lower-bounds the mean of the D_i's expectations with probability >= 1 - delta,
    for independent D_1..D_n in [-width, width] that need not be identically distributed.

    Derivation. Write mu_i = E[D_i], S = sum_i D_i, M = sum_i E[D_i^2] / width^2, L = log(2 / delta).
    (a) Bernstein's inequality needs only D_i - mu_i <= b (here b = 2 width) and Var(D_i) <= E[D_i^2]:
        P(S - sum mu_i >= t') <= exp(-t'^2 / (2 (width^2 M + b t' / 3))), so with probability 1 - delta/2,
        S - sum mu_i < t'(M) = b L / 3 + sqrt((b L / 3)^2 + 2 L width^2 M), increasing in M.
    (b) The Y_i = D_i^2 / width^2 are independent in [0, 1], so E[Y_i^2] <= E[Y_i], and the lower tail of a
        sum of non-negative variables (Maurer 2003; Boucheron, Lugosi, Massart, Ex. 2.9) gives
        P(sum Y_i <= M - u) <= exp(-u^2 / (2 M)): with probability 1 - delta/2,
        M <= M+ = (sqrt(L / 2) + sqrt(L / 2 + sum Y_i))^2.
    On both events t'(M) <= t'(M+), so t = t'(M+) / n holds with probability 1 - delta. Where D is 0 in
    most rows (paired draws under common random numbers), M+ is small and t falls like 1 / n rather than
    Hoeffding's 1 / sqrt(n). Maurer and Pontil's empirical Bernstein (2009, Thm. 4) is as tight but
    assumes identically distributed samples; the held-out rows are not (each asks its own problem)."""
    n = len(diffs)
    log_term = math.log(2.0 / delta)
    squares = sum((d / width) ** 2 for d in diffs)
    m_plus = (math.sqrt(log_term / 2) + math.sqrt(log_term / 2 + squares)) ** 2
    b = 2.0 * width
    return (b * log_term / 3 + math.sqrt((b * log_term / 3) ** 2 + 2 * log_term * width ** 2 * m_plus)) / n


def paired_lower_bound(diffs: list[float], width: float, delta: float) -> dict:
    """The rule every logged paired bound uses, fixed before any data: the larger of Hoeffding's and
    ``bernstein_radius``'s lower bounds, each at delta / 2 (a union bound: both hold with probability
    1 - delta), clamped at -width. Valid for independent D_i in [-width, width] with any means."""
    mean = sum(diffs) / len(diffs)
    hoeffding = mean - hoeffding_radius(len(diffs), 2.0 * width, delta / 2)
    bernstein = mean - bernstein_radius(diffs, width, delta / 2)
    return {"lower_bound": max(hoeffding, bernstein, -width), "hoeffding_lower_bound": hoeffding,
            "bernstein_lower_bound": bernstein}


def paired_change_bound(before: list[float], after: list[float], reward_range: tuple[float, float],
                        delta_conf: float) -> dict:
    """A valid (1 - delta_conf) lower confidence bound on a change in expected team reward, from paired
    draws: row k was drawn once before the change (reward ``before[k]``) and once after it
    (``after[k]``) on the same context, and D_k = after[k] - before[k].

    What it bounds, and why the conditions hold. Write H for everything fixed before the first of the two
    draws and c_k for row k's context. The two policies compared are functions of H and of randomness
    that never sees the two draws (training's own), and row k's draws use only row k's random numbers,
    so given H the D_k are independent, each in [-(R_max - R_min), R_max - R_min], with
        E[D_k | H] = E_after[R | c_k] - E_before[R | c_k]
    whether or not the two draws of a row share their random numbers (``scale.rollout_hf.SeededSampler``: a
    coupling leaves each draw's distribution exactly as it was and only makes D_k = 0 more often). The
    target T is the mean of these over the rows: the change on the contexts drawn, not on the problem
    population. Rows of one problem (several samples, or a group) are independent given H too, since
    each has its own random numbers, so n counts every row; T weights each problem by its number of
    rows. ``paired_lower_bound`` then gives P(lower_bound > T | H) <= delta_conf, and the same rule on
    -D gives ``upper_bound`` (P(upper_bound < T | H) <= delta_conf).

    Uses: each SAT step (``sat.sequential_update``), each stage and the whole run (``records.stage_row``), as the
    module docstring says. Not the paper's L_i with Hoeffding (Theorems 4.7/4.9): that estimate is taken on the
    rows the step was trained on, with an unbounded r_j (``advantage.step_estimates``; tests/test_certificate.py
    measures how often it exceeds the exact change).

    Returns mean_change (mean(D), unbiased for T), stderr (its standard error), nonzero (the fraction of
    rows with D != 0), lower_bound, upper_bound, hoeffding_lower_bound, bernstein_lower_bound,
    sample_penalty (mean_change - lower_bound), n, delta_conf.
    """
    if len(before) != len(after) or not before:
        raise ValueError(f"need the same positive number of paired rewards before and after, got {len(before)} "
                         f"and {len(after)} (the evaluations must ask the same rows)")
    if not 0.0 < delta_conf < 1.0:
        raise ValueError(f"delta_conf must be in (0, 1), got {delta_conf}")
    width = reward_range[1] - reward_range[0]
    diffs = [float(b) - float(a) for a, b in zip(before, after)]
    if any(abs(d) > width + 1e-9 for d in diffs):
        raise ValueError(f"a reward lies outside {reward_range}: the bound needs the reward range")
    n, mean = len(diffs), sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / max(n - 1, 1)
    lower = paired_lower_bound(diffs, width, delta_conf)
    upper = -paired_lower_bound([-d for d in diffs], width, delta_conf)["lower_bound"]
    return {"mean_change": mean, "stderr": math.sqrt(var / n), "nonzero": sum(d != 0 for d in diffs) / n, **lower,
            "upper_bound": upper, "sample_penalty": mean - lower["lower_bound"], "n": n, "delta_conf": delta_conf}


def heldout_change_bound(acc_before: float, n_before: int, acc_after: float, n_after: int,
                         reward_range: tuple[float, float], delta_conf: float) -> float:
    """The unpaired comparison: a valid (1 - delta_conf) lower confidence bound on the change of the
    team's expected reward between two evaluations that each draw their rows independently, Hoeffding on
    each mean (delta_conf / 2 each): acc_after - acc_before - t_before - t_after, clamped at
    -(R_max - R_min). A run logs it beside the paired certificate (``unpaired_lower_bound``) to show what
    pairing gains; it ignores that the evaluations share their draws, which only makes it looser.

    Why not the per-step bounds summed for a stage: each step's bound is about the change on the contexts
    that step sampled, and those differ from step to step, so their sum bounds no single quantity of the
    stage (it can exceed R_max - R_min)."""
    width = reward_range[1] - reward_range[0]
    penalty = (hoeffding_radius(n_before, width, delta_conf / 2) + hoeffding_radius(n_after, width, delta_conf / 2))
    return max(acc_after - acc_before - penalty, -width)


def change_certificate(before: list[float], after: list[float], mean_before: float, mean_after: float,
                       reward_range: tuple[float, float], delta_conf: float) -> dict:
    """The certificate of a held-out change (a stage's, the run's, an upgrade's): ``paired_change_bound`` on the
    paired rewards, with the unpaired ``heldout_change_bound`` of the two means on the same draws beside it
    (``unpaired_lower_bound``: what pairing gains)."""
    paired = paired_change_bound(before, after, reward_range, delta_conf)
    unpaired = heldout_change_bound(mean_before, len(before), mean_after, len(after), reward_range, delta_conf)
    return {**paired, "unpaired_lower_bound": unpaired}


def is_violation(change: dict) -> bool:
    """A violation (paper, Section 5): a paired fall beyond noise, mean_change < -VIOLATION_STDERRS * stderr
    (``change``: a ``paired_change_bound``)."""
    return change["mean_change"] < -VIOLATION_STDERRS * change["stderr"]


def is_certified_fall(change: dict) -> bool:
    """A fall the bound certifies: the upper confidence bound on the change is below 0."""
    return change["upper_bound"] < 0


def fall_rates(changes: list[dict]) -> tuple[float, float]:
    """(violation rate, certified-fall rate): the shares of ``changes`` (one ``paired_change_bound`` per
    evaluated trained stage) that are violations and certified falls (paper, Section 5)."""
    return (sum(map(is_violation, changes)) / len(changes), sum(map(is_certified_fall, changes)) / len(changes))


def fewest_certifying_rows(delta_conf: float) -> int:
    """The fewest paired rows on which ``paired_lower_bound`` can exceed 0 at all: every row rising by the
    reward's whole range, its best case. The bound scales with the range, so the count depends on
    ``delta_conf`` alone (8 at 0.05)."""
    n = 1
    while paired_lower_bound([1.0] * n, 1.0, delta_conf)["lower_bound"] <= 0:
        n += 1
    return n


def stage_certificate(steps: list[dict]) -> dict:
    """Stage bound: the per-step certificates summed (J telescopes over the steps of a stage); the keys of
    `certificate` plus "n_steps"."""
    total = {key: 0.0 for key in CERTIFICATE_TERMS}
    for step in steps:
        for key in CERTIFICATE_TERMS:
            total[key] += float(step[key])
    total["n_steps"] = len(steps)
    return total
