"""The states Stage-0 fits (paper, Section 5, Eq. (6)'s expectation over s), and how a model reads them.

A state s is a prefix of one of the incumbent's responses in a fresh rollout of the trained team: its context
is rendered in each model's own chat template (the replacement's and the incumbent's may differ), its response
tokens are shared. A share of the distinct problems is held out of the fit and only measured. A model reads the
states through one trunk forward per row slice (``row_slices``: at most ``token_budget`` tokens), so memory does
not grow with the response length.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from logprobs import TurnTensors, left_pad, response_hidden_states
from team import Agent, Problem, Team


@dataclass
class Stage0States:
    """The states s of one slot: shared response prefixes after each model's own rendering of the context."""

    ctx_new: torch.Tensor  # [N, Lc'] the replacement's template
    cmask_new: torch.Tensor  # [N, Lc']
    ctx_cur: torch.Tensor  # [N, Lc] the incumbent's template
    cmask_cur: torch.Tensor  # [N, Lc]
    resp: torch.Tensor  # [N, Lr] right-padded
    rmask: torch.Tensor  # [N, Lr]

    def rows(self, sl: slice) -> "Stage0States":
        parts = (self.ctx_new, self.cmask_new, self.ctx_cur, self.cmask_cur, self.resp, self.rmask)
        return Stage0States(*(t[sl] for t in parts))

    def __len__(self) -> int:
        return self.resp.shape[0]

    @property
    def new_turn(self) -> TurnTensors:
        """The states in the replacement's template: what pi_new and pi_pre read."""
        return TurnTensors(self.ctx_new, self.cmask_new, self.resp, self.rmask)

    @property
    def cur_turn(self) -> TurnTensors:
        """The states in the incumbent's template: what pi_cur reads."""
        return TurnTensors(self.ctx_cur, self.cmask_cur, self.resp, self.rmask)

    @property
    def num_states(self) -> int:
        return int(self.rmask.sum())


def with_agent(team: Team, slot: int, agent: Agent) -> Team:
    """The team with ``agent`` in ``slot`` (the team itself unchanged)."""
    return Team(team.agents[:slot] + [agent] + team.agents[slot + 1 :], team.config)


def slot_states(team: Team, slot: int, new_agent: Agent, batch) -> tuple[Stage0States, int]:
    """The slot's states: the incumbent's rollout contexts and the same messages in the replacement's own
    chat template (chain: the same earlier answers); and how many rows the two templates tokenise differently."""
    turn = batch.turns[slot]
    holder = with_agent(team, slot, new_agent)
    chain = team.protocol == "chain"
    previous = [[t.answers[i] for t in batch.turns[:slot]] if chain else [] for i in range(len(batch))]
    contexts = [holder.prompt_ids(slot, p, prev) for p, prev in zip(batch.problems, previous)]
    ctx_new, cmask_new = left_pad(contexts, new_agent.tokenizer.pad_token_id)  # [N, Lc']
    differ = sum(ctx != turn.context_ids[i][turn.context_mask[i].bool()].tolist() for i, ctx in enumerate(contexts))
    return Stage0States(ctx_new, cmask_new, *turn.tensors), differ


def split_problems(problems: list[Problem], heldout_fraction: float) -> tuple[list[Problem], list[Problem]]:
    """Distinct problems, split into fit and held-out (no problem in both)."""
    unique = list({p.id: p for p in problems}.values())
    n_held = int(round(heldout_fraction * len(unique))) if len(unique) > 1 else 0
    n_held = min(max(n_held, 1 if len(unique) > 1 and heldout_fraction > 0 else 0), len(unique) - 1)
    return unique[: len(unique) - n_held], unique[len(unique) - n_held :]


def trim_left_padding(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the left-padding columns all rows share (exact, cheaper)."""
    keep = mask.any(0).nonzero()
    c0 = int(keep[0]) if len(keep) else ids.shape[1] - 1
    return ids[:, c0:], mask[:, c0:]


def final_hidden(model, tensors: TurnTensors) -> torch.Tensor:
    """``model``'s final hidden states at the valid response positions, one trunk forward on the rows as given
    (``row_slices`` keeps it within the token budget). [M, H]"""
    device = next(model.parameters()).device
    ctx, cmask = trim_left_padding(tensors.context_ids, tensors.context_mask)  # [N, Lc_trimmed]
    width = max(1, int(tensors.response_mask.sum(1).max()))
    resp, rmask = tensors.response_ids[:, :width], tensors.response_mask[:, :width]  # [N, width]
    part = TurnTensors(*(t.to(device) for t in (ctx, cmask, resp, rmask)))
    return response_hidden_states(model, *part)[part.response_mask.bool()]  # [M, H]


def row_slices(states: Stage0States, rows_per_step: int, token_budget: int) -> list[slice]:
    """Consecutive row slices of at most ``rows_per_step`` rows and about ``token_budget`` (context +
    response) tokens: the trunks' activations do not grow with the response length."""
    width = max(states.ctx_new.shape[1], states.ctx_cur.shape[1]) + states.resp.shape[1]
    rows = max(1, min(rows_per_step, token_budget // width))
    return [slice(s, s + rows) for s in range(0, len(states), rows)]
