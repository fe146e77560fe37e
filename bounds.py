"""The monotonic-improvement guarantee as numbers a run can log: the certificate.

Paper, Section 4: Lemma 4.1 (occupancy shift), Theorem 4.2 (single-step
bound), Lemma 4.3 (a product policy's KL is the sum of its factors'),
Theorem 4.4 (joint-stage bound, any order), Theorems 4.7 / 4.9 (the
finite-sample term). ``certificate`` is the paper's per-step bound with its
occupancy penalty; ``turn_certificate`` is the per-step bound this project
logs for whole-response actions (each agent acts once per episode, so the
finite-horizon difference lemma is exact and no occupancy term appears);
``stage_certificate`` sums per-step bounds over a stage.
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


def turn_certificate(surrogate_advantage: float, adv_max: float, zeta: float = 0.0, n_samples: int | None = None,
                     n_agents: int = 1, delta_conf: float = 0.05) -> dict:
    """Per-step lower bound for an LLM team, in episode (reward) units, both protocols.

    Here each agent acts exactly once per joint trajectory: agent k answers at
    turn k. Write s_k for the state at turn k (the problem, plus in the chain
    protocol the answers a_1..a_{k-1}; in the independent protocol just the
    problem), d_k for its distribution, and R(tau) in [R_min, R_max] for the
    team reward at the end. Step i of a stage changes only agent j = sigma(i),
    from pi_j (in pi_hat^{i-1}) to pi_j' (in pi_hat^i); every other agent is
    the same in both policies.

    Finite-horizon difference lemma, exact (no discount, no occupancy term):
      - d_j is produced by agents 1..j-1 (chain) or by nobody (independent): the
        same under pi_hat^{i-1} and pi_hat^i, so the state distribution at the
        changed agent's turn does not shift (this replaces Lemma 4.1's
        occupancy-shift term, which is where 1/(1-gamma) and the KL enter
        Theorem 4.2);
      - Q_j(s_j, a) = E[R | s_j, a_j = a] is taken over agents j+1..n (chain; in
        the independent protocol over the other agents' independent answers),
        also the same under both policies.
    Hence J(pi_hat^i) - J(pi_hat^{i-1}) = E_{s~d_j}[ E_{a~pi_j'} Q_j(s, a) - E_{a~pi_j} Q_j(s, a) ]
                                       = E_{tau~pi_hat^{i-1}}[ (r_j(tau) - 1) (R(tau) - b(s_1)) ]
    for any baseline b of the problem alone (E[r_j - 1 | s_j] = 0), with r_j the
    sequence ratio of agent j's response. That right-hand side is the surrogate
    L_i^SEQ of Section 3 computed by ``sat.finish_update`` (group-mean baseline,
    truncated weights for pi_hat^{i-1}), already one episode's worth: it is not
    multiplied by a horizon 1/(1-gamma).

    What remains is the estimation error: the truncation bias zeta_i
    (Theorem 4.2's zeta term) and the finite-sample term of Theorems 4.7/4.9,
    A_max sqrt(log(2n/delta_conf) / (2N)), with A_max = R_max - R_min (an
    advantage R - b with b a mean of rewards lies in [-(R_max - R_min),
    R_max - R_min]; the sample maximum of |A| could understate it). This is
    ``certificate`` at gamma = 0, which is what it returns; the occupancy penalty
    is 0 by the argument above, whatever the KL.
    """
    return certificate(surrogate_advantage, 0.0, adv_max, 0.0, zeta=zeta, n_samples=n_samples,
                       n_agents=n_agents, delta_conf=delta_conf)


def stage_certificate(steps: list[dict]) -> dict:
    """Stage bound: the per-step certificates summed (J telescopes over the steps of a stage); the keys of
    `certificate` plus "n_steps"."""
    total = {key: 0.0 for key in CERTIFICATE_TERMS}
    for step in steps:
        for key in CERTIFICATE_TERMS:
            total[key] += float(step[key])
    total["n_steps"] = len(steps)
    return total
