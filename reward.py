"""The team reward R(tau) of a joint trajectory (paper, Section 3): one number for the whole team, shared by
every agent's tokens, and the counterfactual baselines and per-agent scores built from it.

A ``Reward`` is a function in TRL's shape, ``f(prompts, completions, **columns) -> list[float]``, with its range
(R_min, R_max): the range every bound and certificate uses (``bounds``). ``score`` calls it on joint trajectories;
``counterfactual_baselines`` and ``agent_scores`` call it again on swapped outputs, so it must be deterministic
in its row. The task hands the Team its reward (``team.TeamConfig``); ``harness.user_reward`` loads a user's
function and checks its contract on every call (``CheckedReward``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

DEFAULT_RANGE = (0.0, 1.0)


@dataclass(frozen=True)
class Reward:
    """A team reward function, the name the user gave it and its range (R_min, R_max): the certificates'
    A_max = R_max - R_min."""

    fn: Callable
    name: str
    range: tuple[float, float] = DEFAULT_RANGE

    def values(self, prompts: list[str], completions: list[list[str]], columns: dict,
               ids: list[str] | None = None) -> list[float]:
        """R of each row as a float: ``fn`` on the rows, the columns by keyword. ``ids`` (the rows' problem ids)
        name a row in a checked reward's errors (``harness.user_reward.CheckedReward``)."""
        return [float(v) for v in self.fn(list(prompts), [list(c) for c in completions], **columns)]



def columns_of(problems: list, agent_answers: list[list[str | None]], protocol: str) -> dict:
    """The reward's keyword arguments for rows of ``problems``: ``answer`` (the gold: the raw value a data file
    holds, else the Problem's text), every other column the rows carry (None where a row lacks it), the agents'
    extracted answers and the protocol."""
    rows = [{"answer": p.answer, **p.columns} for p in problems]
    names = list(dict.fromkeys(k for row in rows for k in row))
    columns = {name: [row.get(name) for row in rows] for name in names}
    return {**columns, "agent_answers": [list(a) for a in agent_answers], "protocol": protocol}


def score(reward: Reward, problems: list, completions: list[list[str]], agent_answers: list[list[str | None]],
          protocol: str, extra: dict | None = None) -> list[float]:
    """R of joint trajectories ``completions[i]`` (one text per agent) on ``problems[i]``: the one path every
    reward takes, the built-in one included. ``extra``: more per-row columns (an episode's ``env_reward`` and
    ``transcript``)."""
    return reward.values([p.problem for p in problems], completions,
                         {**columns_of(problems, agent_answers, protocol), **(extra or {})}, [p.id for p in problems])


def counterfactual_baselines(reward: Reward, problems: list, completions: list[list[str]],
                             agent_answers: list[list[str | None]], protocol: str, group_ids: torch.Tensor
                             ) -> torch.Tensor:
    """b_k(tau), agent k's counterfactual baseline in the independent protocol [n_agents, N]: the team
    reward of tau with agent k's response (text and answer) swapped for each of its other responses in the
    group, averaged. Agent k's responses to one prompt are i.i.d. and independent of the others', so b_k(tau)
    is unbiased for E[R | the others' responses in tau] and does not depend on agent k's own: R - b_k is a
    valid advantage for agent k without the noise of the other agents' responses. Every distinct swapped
    row is scored once, all in one call."""
    n_agents = len(completions[0])
    rows: dict[tuple, int] = {}  # (trajectory, texts, answers) -> its index in the call
    plan: list[tuple[int, int, list[int]]] = []  # (k, t, the indices of its swapped rows)
    for g in torch.unique(group_ids).tolist():
        idx = (group_ids == g).nonzero().flatten().tolist()
        if len(idx) < 2:  # no other response to swap in: b_k stays 0
            continue
        for k in range(n_agents):
            for t in idx:
                keys = [(idx[0], tuple(completions[t][:k]) + (completions[u][k],) + tuple(completions[t][k + 1:]),
                         tuple(agent_answers[t][:k]) + (agent_answers[u][k],) + tuple(agent_answers[t][k + 1:]))
                        for u in idx if u != t]
                plan.append((k, t, [rows.setdefault(key, len(rows)) for key in keys]))
    keys = list(rows)
    values = score(reward, [problems[t] for t, _, _ in keys], [list(c) for _, c, _ in keys],
                   [list(a) for _, _, a in keys], protocol) if keys else []
    out = torch.zeros(n_agents, len(problems))  # [n_agents, N]
    for k, t, swaps in plan:
        out[k, t] = sum(values[s] for s in swaps) / len(swaps)
    return out


def agent_scores(reward: Reward, problems: list, completions: list[list[str]], agent_answers: list[list[str | None]],
                 protocol: str) -> torch.Tensor:
    """Each agent's own score [n_agents, N]: R of the trajectory in which every agent gave agent k's response
    (the built-in reward: 1 if agent k's answer is right). Logged per agent, and ``--order greedy`` ranks by it."""
    n_agents, n = len(completions[0]), len(problems)
    values = score(reward, [p for _ in range(n_agents) for p in problems],
                   [[c[k]] * n_agents for k in range(n_agents) for c in completions],
                   [[a[k]] * n_agents for k in range(n_agents) for a in agent_answers], protocol)
    return torch.tensor(values).view(n_agents, n)  # [n_agents, N]
