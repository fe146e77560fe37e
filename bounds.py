"""The monotonic-improvement guarantee: the paper's bound, and the lower bounds a run logs.

Paper, Section 4: Lemma 4.1 (occupancy shift), Theorem 4.2 (single-step
bound), Lemma 4.3 (a product policy's KL is the sum of its factors'),
Theorem 4.4 (joint-stage bound, any order), Theorems 4.7 / 4.9 (the
finite-sample term). ``certificate`` and ``stage_certificate`` are Theorems
4.2 and 4.4 with exact quantities (the toy-MDP tests check them exactly).

What a run logs as a lower bound must be one at any response length, from
what the run samples: ``paired_change_bound`` per step (``--reuse
regenerate``: fresh draws before and after the step, no importance ratio) and
``heldout_change_bound`` per stage (every mode). The paper's sample estimate
of L_i is logged as an estimate (``sat.step_estimates``), never as a bound.
"""
from __future__ import annotations

import math

CERTIFICATE_TERMS = ("gain", "occupancy_penalty", "bias_penalty", "sample_penalty", "lower_bound")


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
    if kl_max < 0:
        raise ValueError(f"kl_max must be >= 0 (a KL divergence), got {kl_max}")
    if adv_max < 0:
        raise ValueError(f"adv_max must be >= 0 (a maximum of |A|), got {adv_max}")
    if zeta < 0:
        raise ValueError(f"zeta must be >= 0 (an absolute bias), got {zeta}")
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
    if n_samples is None:
        sample_penalty = 0.0
    else:
        sample_penalty = float(adv_max) * horizon * math.sqrt(math.log(2.0 * n_agents / delta_conf) / (2.0 * n_samples))
    return {
        "gain": gain,
        "occupancy_penalty": occupancy_penalty,
        "bias_penalty": bias_penalty,
        "sample_penalty": sample_penalty,
        "lower_bound": gain - occupancy_penalty - bias_penalty - sample_penalty,
    }


def hoeffding_radius(n: int, value_range: float, delta: float) -> float:
    """t such that the mean of n independent variables, each in an interval of width ``value_range``, exceeds
    the mean of their expectations by t with probability at most delta (Hoeffding, one-sided)."""
    return value_range * math.sqrt(math.log(1.0 / delta) / (2.0 * n))


def paired_change_bound(before: list[float], after: list[float], reward_range: tuple[float, float],
                        delta_conf: float) -> dict:
    """A valid (1 - delta_conf) lower confidence bound on one SAT step's change in expected team reward.

    What the run samples (``sat.sat_stage`` with ``--reuse regenerate``): step i changes agent j = sigma(i)
    from pi_j (in pi_hat^{i-1}) to pi_j' (in pi_hat^i). Row k of the stage's batch fixes a context c_k: the
    problem and the turns step i does not change (independent protocol: the other agents' answers; chain:
    the turns before agent j's). Right before the step, the turns it will change are drawn afresh under
    pi_hat^{i-1} on every c_k (reward ``before[k]``); right after it, under pi_hat^i (``after[k]``, the next
    step's batch). Write H for everything drawn or computed before the first of these draws. pi_hat^{i-1}
    is a function of H and pi_hat^i a function of H and the training's own randomness, and neither sees the
    two draws, so given H the differences D_k = after[k] - before[k] are independent, each in
    [-(R_max - R_min), R_max - R_min], with means
        E[D_k | H] = E_{pi_hat^i}[R | c_k] - E_{pi_hat^{i-1}}[R | c_k].
    Their average over the rows, T_i, is the step's change in expected team reward on the contexts the
    stage sampled. Hoeffding gives P(mean(D) - t > T_i | H) <= delta_conf with
    t = 2 (R_max - R_min) sqrt(log(1/delta_conf) / (2N)), at every response length: no importance ratio
    enters. Since T_i >= -(R_max - R_min), max(mean(D) - t, -(R_max - R_min)) is valid as well, and it
    never exceeds R_max - R_min.

    Why not the paper's L_i with Hoeffding (Theorems 4.7/4.9): the estimate mean(w (r_j - 1) A) uses the
    rows the step was trained on, so pi_j' is chosen to make it large, and r_j, a whole response's ratio,
    is unbounded, so A's range does not bound its terms (tests/test_certificate.py measures how often it
    exceeds the exact change). ``sat`` logs it as ``surrogate_estimate``.

    Returns mean_change (mean(D), an unbiased estimate of T_i), sample_penalty (t), lower_bound, n,
    delta_conf.
    """
    if len(before) != len(after) or not before:
        raise ValueError(f"need the same positive number of rewards before and after, got {len(before)} "
                         f"and {len(after)}")
    if not 0.0 < delta_conf < 1.0:
        raise ValueError(f"delta_conf must be in (0, 1), got {delta_conf}")
    width = reward_range[1] - reward_range[0]
    diffs = [float(b) - float(a) for a, b in zip(before, after)]
    if any(abs(d) > width + 1e-9 for d in diffs):
        raise ValueError(f"a reward lies outside {reward_range}: the bound needs the reward range")
    mean_change = sum(diffs) / len(diffs)
    penalty = hoeffding_radius(len(diffs), 2.0 * width, delta_conf)
    return {"mean_change": mean_change, "sample_penalty": penalty,
            "lower_bound": max(mean_change - penalty, -width), "n": len(diffs), "delta_conf": delta_conf}


def heldout_change_bound(acc_before: float, n_before: int, acc_after: float, n_after: int,
                         reward_range: tuple[float, float], delta_conf: float) -> float:
    """The stage's certificate: a valid (1 - delta_conf) lower confidence bound on the change of the team's
    expected reward on the held-out problems between two evaluations, in every mode (``--reuse weights``,
    ``regenerate``, ``--update joint``). Each evaluation draws one joint trajectory per held-out problem
    afresh from a team fixed before the draw and never trained on, so Hoeffding bounds each mean
    (delta_conf / 2 each): acc_after - acc_before - t_before - t_after. Clamped at -(R_max - R_min); it
    cannot exceed R_max - R_min, since both accuracies lie in [R_min, R_max].

    Why not the per-step bounds summed: each step's bound (``paired_change_bound``) is about the change on
    the contexts that step sampled, and those differ from step to step, so their sum bounds no single
    quantity of the stage (it can exceed R_max - R_min)."""
    width = reward_range[1] - reward_range[0]
    penalty = (hoeffding_radius(n_before, width, delta_conf / 2) + hoeffding_radius(n_after, width, delta_conf / 2))
    return max(acc_after - acc_before - penalty, -width)


def stage_certificate(steps: list[dict]) -> dict:
    """Stage bound: the per-step certificates summed (J telescopes over the steps of a stage); the keys of
    `certificate` plus "n_steps"."""
    total = {key: 0.0 for key in CERTIFICATE_TERMS}
    for step in steps:
        for key in CERTIFICATE_TERMS:
            total[key] += float(step[key])
    total["n_steps"] = len(steps)
    return total
