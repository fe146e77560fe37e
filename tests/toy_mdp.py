"""Exact solver for small cooperative multi-agent MDPs (test helper).

A toy MDP has S states, n agents with A_i actions each, a transition kernel
P(s' | s, a_1..a_n), a team reward R(s, a_1..a_n) in [0, 1], a discount gamma and an
initial distribution mu. A team is a product policy: one [S, A_i] tensor of
log-probabilities per agent. Everything here is exact linear algebra in float64, so the
tests can check SAT's guarantee (the paper's Theorems 4.2 and 4.4) with no sampling noise:

    V = (I - gamma P_pi)^-1 r_pi,   Q = R + gamma P V,   A = Q - V,   J = mu . V,
    d = (1 - gamma) mu^T (I - gamma P_pi)^-1   (normalised discounted occupancy).

`sat_stage` runs one SAT stage with the exact KL-constrained step of
`kl_projection.exponential_tilt_step` for each agent in turn, and `joint_update` lets all
agents take that step at once on the same stale advantages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import bounds
import kl_projection as kp
import trust_region as tr

DTYPE = torch.float64


@dataclass
class ToyMDP:
    P: torch.Tensor  # [S, A_1, ..., A_n, S] transition probabilities
    R: torch.Tensor  # [S, A_1, ..., A_n] team reward in [0, 1]
    mu: torch.Tensor  # [S] initial distribution
    gamma: float

    @property
    def n_states(self) -> int:
        return self.R.shape[0]

    @property
    def n_actions(self) -> tuple[int, ...]:
        return tuple(self.R.shape[1:])

    @property
    def n_agents(self) -> int:
        return self.R.dim() - 1


def _simplex(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Uniform (Dirichlet(1)) samples on the simplex over the last axis."""
    e = -torch.rand(*shape, generator=gen, dtype=DTYPE).clamp_min(1e-300).log()  # [..., K] Exp(1)
    return e / e.sum(-1, keepdim=True)  # [..., K]


def random_mdp(seed: int, n_agents: int, n_states: int, n_actions, gamma: float, coordination: float = 0.0) -> ToyMDP:
    """A random cooperative MDP; n_actions is an int (same for all agents) or a sequence.

    R = (1 - coordination) * U + coordination * [all agents pick the same action index],
    U uniform on [0, 1]. Uniform rewards alone rarely make agents' updates interfere;
    the agreement term is what makes simultaneous (joint) updates overshoot.
    """
    if isinstance(n_actions, int):
        n_actions = (n_actions,) * n_agents
    n_actions = tuple(n_actions)
    if not 0.0 <= coordination <= 1.0:
        raise ValueError(f"coordination must be in [0, 1], got {coordination}")
    gen = torch.Generator().manual_seed(seed)
    P = _simplex(gen, n_states, *n_actions, n_states)  # [S, A..., S]
    R = torch.rand(n_states, *n_actions, generator=gen, dtype=DTYPE)  # [S, A...]
    agree = torch.zeros_like(R)  # [S, A...]
    for a in range(min(n_actions)):
        agree[(slice(None),) + (a,) * n_agents] = 1.0
    R = (1 - coordination) * R + coordination * agree  # [S, A...] still in [0, 1]
    mu = _simplex(gen, n_states)  # [S]
    return ToyMDP(P=P, R=R, mu=mu, gamma=float(gamma))


def random_policy(gen: torch.Generator, n_states: int, n_actions: int, scale: float = 1.5) -> torch.Tensor:
    """Log-probs [S, A] of a random full-support policy (softmax of Gaussian logits)."""
    logits = scale * torch.randn(n_states, n_actions, generator=gen, dtype=DTYPE)  # [S, A]
    return torch.log_softmax(logits, dim=-1)


def random_team(seed: int, mdp: ToyMDP, scale: float = 1.5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [random_policy(gen, mdp.n_states, a, scale) for a in mdp.n_actions]


# ---------------------------------------------------------------------------
# Exact evaluation
# ---------------------------------------------------------------------------


def joint_probs(logps: list[torch.Tensor], skip: int | None = None) -> torch.Tensor:
    """prod_i pi_i(a_i|s) as [S, A_1, ..., A_n]; agent `skip`'s factor is replaced by ones."""
    S = logps[0].shape[0]
    n = len(logps)
    out = torch.ones(S, *([1] * n), dtype=DTYPE)  # [S, 1, ..., 1]
    for i, lp in enumerate(logps):
        shape = [S] + [1] * n
        shape[i + 1] = lp.shape[1]
        factor = torch.ones(shape, dtype=DTYPE) if i == skip else lp.exp().reshape(shape)  # [S, 1..A_i..1]
        out = out * factor
    return out  # [S, A_1, ..., A_n]


def solve_policy(mdp: ToyMDP, logps: list[torch.Tensor]) -> dict:
    """Exact J, V [S], Q and A [S, A_1..A_n], occupancy d [S] of the product policy."""
    S, g = mdp.n_states, mdp.gamma
    pi = joint_probs(logps)  # [S, A...]
    action_dims = tuple(range(1, mdp.n_agents + 1))
    P_pi = (pi[..., None] * mdp.P).sum(dim=action_dims)  # [S, S]
    r_pi = (pi * mdp.R).sum(dim=action_dims)  # [S]
    M = torch.eye(S, dtype=DTYPE) - g * P_pi  # [S, S]
    V = torch.linalg.solve(M, r_pi)  # [S]
    Q = mdp.R + g * (mdp.P * V).sum(-1)  # [S, A...]
    A = Q - V.reshape(S, *([1] * mdp.n_agents))  # [S, A...]
    d = (1 - g) * torch.linalg.solve(M.T, mdp.mu)  # [S]
    return {"J": float(mdp.mu @ V), "V": V, "Q": Q, "A": A, "d": d}


def marginal_advantage(A: torch.Tensor, logps: list[torch.Tensor], j: int) -> torch.Tensor:
    """A_j(s, a_j) = E_{a_-j ~ pi_-j(.|s)}[A(s, a_j, a_-j)] as [S, A_j] (others at logps)."""
    w = joint_probs(logps, skip=j)  # [S, A...] with ones on agent j's axis
    others = tuple(k + 1 for k in range(len(logps)) if k != j)
    return (A * w).sum(dim=others) if others else A * w  # [S, A_j]


def expected(logp: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """E_{a ~ pi(.|s)}[values(s, a)] per state, with 0 * anything = 0 off the support."""
    p = logp.exp()  # [S, A]
    return torch.where(p > 0, p * values, torch.zeros_like(p)).sum(-1)  # [S]


def surrogate(d: torch.Tensor, logp_new: torch.Tensor, adv_j: torch.Tensor) -> float:
    """E_{s ~ d} E_{a_j ~ pi_new}[A_j(s, a_j)]: the surrogate advantage of one agent."""
    return float(d @ expected(logp_new, adv_j))


# ---------------------------------------------------------------------------
# SAT stage and joint update with the exact step
# ---------------------------------------------------------------------------


def sat_step(mdp: ToyMDP, logps: list[torch.Tensor], j: int, delta: float) -> tuple[list[torch.Tensor], dict]:
    """Agent j takes the exact KL step on its marginal advantage under the current team."""
    old = solve_policy(mdp, logps)
    adv_j = marginal_advantage(old["A"], logps, j)  # [S, A_j]
    new_j = kp.exponential_tilt_step(logps[j], adv_j, delta)  # [S, A_j]
    kl = tr.per_state_kl(new_j, logps[j])  # [S]
    surr = surrogate(old["d"], new_j, adv_j)
    cert = bounds.certificate(
        surrogate_advantage=surr,
        kl_max=float(kl.max()),
        adv_max=float(old["A"].abs().max()),
        gamma=mdp.gamma,
    )
    new_logps = list(logps)
    new_logps[j] = new_j
    info = {
        "agent": j,
        "J_before": old["J"],
        "J_after": solve_policy(mdp, new_logps)["J"],
        "kl": kl,
        "surrogate": surr,
        "adv_j": adv_j,
        "d": old["d"],
        "logp_old": logps[j],
        "certificate": cert,
    }
    return new_logps, info


def sat_stage(mdp: ToyMDP, logps: list[torch.Tensor], order, deltas) -> dict:
    """One exact SAT stage (Algorithm 1): agents in `order`, step i with radius deltas[i].

    Returns J (n+1 values: before, and after each step), the per-step infos and
    certificates, the stage certificate and the final team.
    """
    if isinstance(deltas, (int, float)):
        deltas = [float(deltas)] * len(order)
    team = list(logps)
    J = [solve_policy(mdp, team)["J"]]
    steps = []
    for i, j in enumerate(order):
        team, info = sat_step(mdp, team, j, deltas[i])
        J.append(info["J_after"])
        steps.append(info)
    certs = [s["certificate"] for s in steps]
    return {"J": J, "steps": steps, "certificates": certs, "stage": bounds.stage_certificate(certs), "logps": team}


def joint_update(mdp: ToyMDP, logps: list[torch.Tensor], deltas) -> dict:
    """Every agent takes the exact KL step at once, on advantages of the same (stale) team."""
    if isinstance(deltas, (int, float)):
        deltas = [float(deltas)] * len(logps)
    old = solve_policy(mdp, logps)
    team = [
        kp.exponential_tilt_step(logps[j], marginal_advantage(old["A"], logps, j), deltas[j])
        for j in range(len(logps))
    ]
    return {"J_before": old["J"], "J_after": solve_policy(mdp, team)["J"], "logps": team}


# ---------------------------------------------------------------------------
# Random feasible competitors (for optimality checks)
# ---------------------------------------------------------------------------


def pull_inside(logp_cand: torch.Tensor, logp_cur: torch.Tensor, delta: float, iters: int = 60) -> torch.Tensor:
    """Per row, the arithmetic mixture (1 - a) pi_cur + a pi_cand with the largest a in [0, 1]
    whose KL(. || pi_cur) <= delta. That KL is convex in a and 0 at a = 0, hence
    nondecreasing, so bisection works; the result is always feasible."""
    p_cur, p_cand = logp_cur.exp(), logp_cand.exp()  # [N, A]

    def mix(a: torch.Tensor) -> torch.Tensor:  # a [N, 1] -> log-probs [N, A]
        return ((1 - a) * p_cur + a * p_cand).log()

    def kl(a: torch.Tensor) -> torch.Tensor:  # [N]
        return tr.per_state_kl(mix(a), logp_cur)

    lo = torch.zeros(p_cur.shape[0], 1, dtype=DTYPE)  # [N, 1]
    hi = torch.ones_like(lo)  # [N, 1]
    lo = torch.where((kl(hi) <= delta)[:, None], hi, lo)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        ok = (kl(mid) <= delta)[:, None]
        lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid)
    return mix(lo)  # [N, A]


def random_feasible(
    gen: torch.Generator,
    logp_cur: torch.Tensor,
    delta: float,
    n: int,
    anchors: list[torch.Tensor] = (),
    noise: float = 0.3,
) -> list[torch.Tensor]:
    """n random policies [S, A] inside KL(. || pi_cur) <= delta per state.

    Half are uniform random directions, half are noisy versions of the anchors (e.g. the
    claimed optimum), so competitors also probe the neighbourhood of the answer; all are
    restricted to pi_cur's support and pulled onto or inside the ball."""
    support = torch.isfinite(logp_cur)  # [S, A]
    out = []
    for k in range(n):
        if anchors and k % 2 == 1:
            base = anchors[(k // 2) % len(anchors)]  # [S, A]
            logits = torch.where(support, base, torch.full_like(base, -1e4))
            logits = logits.clamp_min(-1e4) + noise * torch.randn(logits.shape, generator=gen, dtype=DTYPE)
        else:
            logits = 2.0 * torch.randn(logp_cur.shape, generator=gen, dtype=DTYPE)
        logits = torch.where(support, logits, torch.full_like(logits, -torch.inf))  # [S, A]
        out.append(pull_inside(torch.log_softmax(logits, -1), logp_cur, delta))
    return out
