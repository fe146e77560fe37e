"""An enumerable team: every joint action listed, every expectation a finite sum, every step the exact trust-region
maximiser (SAT, arXiv 2605.05216: Algorithm 1 and Theorem 4.2; TeamTR, arXiv 2605.15207).

A game has n agents with K actions each (an action stands for a whole answer) and a team reward R(a_1..a_n) in
[0, 1], held as a [K]*n tensor over the grid of joint actions. Two protocols, as in SAT.md section 2:

- ``independent``: every agent has one context (the prompt) and acts alone;
- ``chain``: agent k (0-based) sees the answers a_0..a_{k-1} of the agents before it: K^k contexts,
  row ravel(a_0..a_{k-1}) of its [K^k, K] table.

A team is one [C_k, K] log-prob table per agent. A SAT stage updates the agents one at a time in an order sigma;
each step is ``kl_projection.exponential_tilt_step``: per context, argmax E_{a~pi}[A(c, a)] subject to
KL(pi || pi_cur(.|c)) <= delta. Three ways to get the advantage a step tilts on:

- ``regenerate``: fresh, from the team with the earlier agents of sigma already promoted (Q - J, exact);
- ``weights`` (Algorithm 1): the stage-start rollouts with the truncated importance weight
  w = prod over the earlier-promoted agents of min(1, pi_new / pi_cur) on their actions, and the w-weighted
  baseline b_w = E[w R] / E[w] (the weighted group mean of ``advantage.group_advantages``), in the limit of
  infinitely many rollouts; advantage clipping and std normalisation are left out (a positive per-context scale
  does not move the tilt);
- ``joint``: every agent steps at once on the stage start's advantages. A sequential stage on the stage start's
  advantages without weights makes exactly this update.

Each step's surrogate is the gain its estimator claims, E_{tau ~ behaviour}[w * r_k * (R - b)] with r_k the
stepping agent's ratio: for ``regenerate`` it equals the true change of J exactly (only agent k moved and its
contexts' law is unchanged); for ``weights`` it is the importance-sampled estimate whose error TeamTR bounds.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the paper modules at the repository root

import kl_projection as kp  # noqa: E402
import trust_region as tr  # noqa: E402

DTYPE = torch.float64
PROTOCOLS = ("independent", "chain")
REUSE = ("regenerate", "weights")


@dataclass(frozen=True)
class Game:
    """n agents, K actions each, a protocol, and the team reward [K]*n of every joint action."""

    protocol: str
    reward: torch.Tensor  # [K]*n in [0, 1]

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        if len(set(self.reward.shape)) != 1 or not ((self.reward >= 0) & (self.reward <= 1)).all():
            raise ValueError("reward must be a [K]*n tensor (same K for every agent) with values in [0, 1]")

    @property
    def n_agents(self) -> int:
        return self.reward.dim()

    @property
    def n_actions(self) -> int:
        return self.reward.shape[0]

    def n_contexts(self, k: int) -> int:
        """Rows of agent k's table: 1 (independent) or K^k (chain: the earlier agents' answers)."""
        return 1 if self.protocol == "independent" else self.n_actions ** k

    def free_agents(self, k: int) -> list[int]:
        """The agents whose actions agent k's (context, action) leaves open: all others (independent), the later
        ones (chain: the earlier ones are the context)."""
        later = list(range(k + 1, self.n_agents))
        return list(range(k)) + later if self.protocol == "independent" else later


def uniform_team(game: Game, probs: list[float]) -> list[torch.Tensor]:
    """Every agent at the same action distribution ``probs`` in every context: a symmetric start."""
    p = torch.tensor(probs, dtype=DTYPE)
    if p.shape != (game.n_actions,) or (p < 0).any() or abs(float(p.sum()) - 1) > 1e-12:
        raise ValueError(f"probs must be {game.n_actions} non-negative numbers summing to 1, got {probs}")
    return [p.log().expand(game.n_contexts(k), -1).clone() for k in range(game.n_agents)]  # [C_k, K] each


def random_team(game: Game, seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    """Full-support random tables: softmax of N(0, scale^2) logits per context and agent."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.log_softmax(scale * torch.randn(game.n_contexts(k), game.n_actions, generator=gen, dtype=DTYPE), -1)
            for k in range(game.n_agents)]  # [C_k, K] each


def factor(game: Game, k: int, logp: torch.Tensor) -> torch.Tensor:
    """pi_k(a_k | context_k) at every joint action, broadcastable to [K]*n."""
    n, K = game.n_agents, game.n_actions
    if logp.shape != (game.n_contexts(k), K):
        raise ValueError(f"agent {k}'s table must be [{game.n_contexts(k)}, {K}], got {tuple(logp.shape)}")
    if game.protocol == "chain":
        return logp.exp().reshape([K] * (k + 1) + [1] * (n - k - 1))  # [K..K (k+1), 1..1]
    return logp.exp().reshape([1] * k + [K] + [1] * (n - k - 1))  # [1.., K, ..1]


def joint_probs(game: Game, team: list[torch.Tensor], agents: list[int] | None = None) -> torch.Tensor:
    """prod over ``agents`` (default all) of their factors, as [K]*n: the law of the joint action."""
    out = torch.ones([game.n_actions] * game.n_agents, dtype=DTYPE)  # [K]*n
    for m in range(game.n_agents) if agents is None else agents:
        out = out * factor(game, m, team[m])
    return out


def value(game: Game, team: list[torch.Tensor]) -> float:
    """J = E[R] under the team (exact)."""
    return float((joint_probs(game, team) * game.reward).sum())


def per_context(game: Game, team: list[torch.Tensor], k: int, values: torch.Tensor) -> torch.Tensor:
    """E[values | context_k = c, a_k = a] under ``team``'s free agents, as agent k's [C_k, K] table. Defined
    also where (c, a) has probability 0: only the free agents' law enters."""
    free = game.free_agents(k)
    summed = (joint_probs(game, team, free) * values).sum(dim=free) if free else values  # [K]*(k+1) or [K]
    return summed.reshape(game.n_contexts(k), game.n_actions)  # [C_k, K]


# -- Estimators: what a step tilts on, and the gain it claims ---------------------------------------------------------
def truncated_weight(game: Game, start: list[torch.Tensor], promoted: dict[int, torch.Tensor]) -> torch.Tensor:
    """w(tau) = prod over the promoted agents m of min(1, pi_m,new / pi_m,cur) at their actions (Algorithm 1's
    truncated importance weight), [K]*n. An action pi_m,cur never takes is never in the stage-start rollouts:
    weight 0 there (no data), not 0/0."""
    w = torch.ones([game.n_actions] * game.n_agents, dtype=DTYPE)  # [K]*n
    for m, new in promoted.items():
        cur, nxt = factor(game, m, start[m]), factor(game, m, new)  # broadcastable to [K]*n
        w = w * torch.where(cur > 0, torch.minimum(nxt, cur) / cur.clamp_min(torch.finfo(DTYPE).tiny), 0.0)
    return w


def advantage(game: Game, team: list[torch.Tensor], k: int, w: torch.Tensor | None = None) -> tuple:
    """(agent k's [C_k, K] advantage, the baseline b) from rollouts of ``team`` weighted by w [K]*n (None: 1):
    E[w (R - b) | c, a] with b = E[w R] / E[w], the weighted group mean in the limit of infinite groups. With
    w = 1, b = J and the table is Q(c, a) - J: the exact advantage up to a per-context constant, which does not
    move the tilt."""
    w = torch.ones_like(game.reward) if w is None else w  # [K]*n
    p = joint_probs(game, team)  # [K]*n
    mass = float((p * w).sum())
    b = float((p * w * game.reward).sum()) / mass if mass > 0 else 0.0
    return per_context(game, team, k, w * (game.reward - b)), b


def claimed_gain(game: Game, behaviour: list[torch.Tensor], k: int, new_k: torch.Tensor, w: torch.Tensor | None,
                 b: float) -> float:
    """The surrogate E_{tau ~ behaviour}[w * r_k * (R - b)], r_k = pi_k,new / pi_k at agent k's action: the gain
    the estimator reports for agent k's step (an estimate; ``regenerate``'s is exact)."""
    team = list(behaviour)
    team[k] = new_k
    w = torch.ones_like(game.reward) if w is None else w  # [K]*n
    return float((joint_probs(game, team) * w * (game.reward - b)).sum())


# -- Steps and stages ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One agent's exact step: J before and after, the gain its estimator claimed, its largest per-context KL."""

    agent: int
    j_before: float
    j_after: float
    claimed: float
    kl_max: float

    @property
    def gap(self) -> float:
        """claimed - true change: the surrogate's error on this step."""
        return self.claimed - (self.j_after - self.j_before)


@dataclass(frozen=True)
class Stage:
    """One stage: its steps (one per agent; for a joint stage one Step with agent -1) and the team after it."""

    steps: tuple[Step, ...]
    team: tuple[torch.Tensor, ...]

    @property
    def j_before(self) -> float:
        return self.steps[0].j_before

    @property
    def j_after(self) -> float:
        return self.steps[-1].j_after


def tilt(logp: torch.Tensor, adv: torch.Tensor, delta: float) -> tuple[torch.Tensor, float]:
    """The exact trust-region step per context (``kl_projection.exponential_tilt_step``) and its largest KL."""
    new = kp.exponential_tilt_step(logp, adv, delta)  # [C, K]
    return new, float(tr.per_state_kl(new, logp).max())


def sequential_stage(game: Game, team: list[torch.Tensor], delta: float, order: list[int], reuse: str) -> Stage:
    """One SAT stage (Algorithm 1): agents in ``order``, each tilting inside KL <= delta on the advantage of
    ``reuse`` (module docstring), promoted before the next agent's step."""
    if reuse not in REUSE:
        raise ValueError(f"reuse must be one of {REUSE}, got {reuse!r}")
    if sorted(order) != list(range(game.n_agents)):
        raise ValueError(f"order must be a permutation of 0..{game.n_agents - 1}, got {order}")
    start, cur, promoted, steps = list(team), list(team), {}, []
    for k in order:
        if reuse == "regenerate":
            w, behaviour = None, cur
        else:
            w, behaviour = truncated_weight(game, start, promoted), start
        adv, b = advantage(game, behaviour, k, w)
        new_k, kl = tilt(cur[k], adv, delta)
        j_before = value(game, cur)
        claimed = claimed_gain(game, behaviour, k, new_k, w, b)
        cur[k] = promoted[k] = new_k
        steps.append(Step(k, j_before, value(game, cur), claimed, kl))
    return Stage(tuple(steps), tuple(cur))


def joint_stage(game: Game, team: list[torch.Tensor], delta: float) -> Stage:
    """Every agent tilts at once on the stage start's exact advantages; the claimed gain is the sum of the agents'
    surrogates, as if their changes added up."""
    new, kls, claimed = [], [], 0.0
    j0 = value(game, team)
    for k in range(game.n_agents):
        adv, b = advantage(game, team, k)
        new_k, kl = tilt(team[k], adv, delta)
        new.append(new_k)
        kls.append(kl)
        claimed += claimed_gain(game, team, k, new_k, None, b)
    return Stage((Step(-1, j0, value(game, new), claimed, max(kls)),), tuple(new))


CONDITIONS = ("regenerate", "weights", "joint")


def run(game: Game, team: list[torch.Tensor], delta: float, stages: int, condition: str,
        order: list[int] | None = None) -> list[Stage]:
    """``stages`` stages of one condition (``regenerate``, ``weights`` or ``joint``) from ``team``."""
    if condition not in CONDITIONS:
        raise ValueError(f"condition must be one of {CONDITIONS}, got {condition!r}")
    if not (delta > 0 and math.isfinite(delta)):
        raise ValueError(f"delta must be a finite number > 0, got {delta}")
    order = list(range(game.n_agents)) if order is None else list(order)
    out, cur = [], list(team)
    for _ in range(stages):
        stage = joint_stage(game, cur, delta) if condition == "joint" else sequential_stage(
            game, cur, delta, order, condition)
        out.append(stage)
        cur = list(stage.team)
    return out


def markdown(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def parse_list(text: str, kind, flag: str, example: str, zero_ok: bool = False) -> list:
    """Comma-separated numbers for an argparse option: positive ones (``zero_ok``: >= 0, e.g. seeds)."""
    try:
        values = [kind(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{flag} {text!r}: write comma-separated numbers, e.g. {example}") from None
    if not values or min(values) < 0 or (not zero_ok and min(values) <= 0):
        raise argparse.ArgumentTypeError(f"{flag} {text!r}: give {'numbers >= 0' if zero_ok else 'positive numbers'}, "
                                         f"e.g. {example}")
    return values
