"""What one stage of Algorithm 1 returns (paper, Section 5): an ``AgentStep`` per agent and the ``StageRecord``
of the stage, and ``StageClock``, the bookkeeping that runs beside the algorithm's lines (the stage's wall time,
the responses it generated and their seconds, the progress bar) so that ``sat.sat_stage`` shows the lines alone.

``harness.records.stage_row`` turns a record into a metrics row: the held-out evaluation and the certificates.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from rollout import TeamBatch
from update import TrainStats


@dataclass
class AgentStep:
    """One agent's step in a stage (Algorithm 1, lines 6-12; ``sat.trust_region_step``), an entry of
    ``StageRecord.agents``. In metrics.jsonl ``train``'s fields sit beside the others."""

    agent: int  # the agent's slot, 1-based
    kl_mean: float  # mean exact per-state KL(pi_new || pi_cur) over the agent's response positions, weights kept
    kl_quantile: float  # its (1 - alpha) quantile: the trust-region statistic, <= delta when accepted
    kl_max: float  # the largest per-state KL
    kl_quantile_dkw: float  # a DKW upper confidence bound on the population quantile (trust_region)
    delta: float  # the trust region's radius
    beta: float  # the KL penalty coefficient the step trained with
    beta_next: float  # beta after the controller's update
    backtracks: int  # halvings of the step by the line search (--step-size scaled: KL checks after the first)
    accepted: bool  # a step (or the in-loop anchor) kept; a rejected step leaves pi_j,cur exactly
    step_fraction: float  # the multiple of the proposed step kept (above 1 only under --step-size scaled)
    surrogate_estimate: float  # L_i (Section 3; Eq. (5) of Section 5) at the step kept: an estimate, not a bound
    surrogate_ess: float  # the effective sample size of that estimate's weights w r_j
    zeta: float  # the truncation bias zeta_i (Theorem 4.2) of the sequence-aware weights
    zeta_capped_rows: int  # rows whose log-weight reached advantage.LOG_WEIGHT_CAP
    N: int  # joint trajectories in the batch
    ess: float  # the effective sample size of the truncated weights w of the agents promoted before it
    ess_ratio: float  # ess / N
    seq_kl_max: float  # the largest whole-response KL (the sum over its tokens)
    credit_correlation: float | None  # correlation of its advantages with its own score (None: constant, or an episode)
    train: TrainStats  # the optimiser's figures: loss, clip fraction, ratio statistics, gradient norm, tokens/s
    step_bound: dict | None = None  # the step's paired bound (bounds.paired_change_bound), see step_bounds
    lr: float | None = None  # --step-size adaptive: the lr the step trained with (step_rules.StepSize)
    lr_next: float | None = None  # and the lr of the agent's next step

    def row(self) -> dict:
        row = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "train"}
        for optional in ("lr", "lr_next"):  # a fixed lr is the run's --lr
            if row[optional] is None:
                del row[optional]
        return {**row, **self.train.logged()}


@dataclass
class StageRecord:
    """What a trained stage logs before its evaluation (``sat.sat_stage``); ``harness.records.stage_row`` adds
    the stage number, the held-out evaluation (``sat.evaluate``) and the certificates."""

    team_reward: float  # mean team reward R on the stage's rollout B
    agent_reward: list[float]  # each agent's own correctness on B
    rollout_tokens_per_s: float  # generated tokens per second of B's rollout
    truncated_fraction: float  # the share of B's responses cut at --max-new-tokens
    mean_response_tokens: float
    order: list[int]  # sigma, 1-based
    agents: list[AgentStep]  # by slot
    generations: int  # responses generated in the stage: B and every redraw
    generation_seconds: float
    step_bounds: str  # what each AgentStep.step_bound is, or why it is None
    seconds: float  # the stage's wall time, its evaluation apart
    vllm_logprob_abs_diff: list[float] | None = None  # --backend vllm: mean |log pi_vllm - log pi_train| per agent
    episode_rounds: float | None = None  # an environment's episodes: the mean rounds they ran
    success: float | None = None  # an environment's episodes: the share solved (team reward at the top of its range)
    per_round: list[dict] | None = None  # an environment's episodes, round by round (harness.episodes.round_stats)

    def row(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["agents"] = [a.row() for a in self.agents]
        for optional in ("vllm_logprob_abs_diff", "episode_rounds", "success", "per_round"):
            if out[optional] is None:
                del out[optional]
        return out


def rollout_record(batch: TeamBatch, rollout_seconds: float, health=None) -> dict:
    """``StageRecord``'s rollout fields: rewards, throughput, lengths."""
    record = {"team_reward": float(batch.rewards.mean()), "agent_reward": batch.agent_reward.mean(1).tolist(),
              "rollout_tokens_per_s": batch.num_tokens / max(rollout_seconds, 1e-9),
              "truncated_fraction": float(torch.stack([t.truncated.float() for t in batch.turns]).mean()),
              "mean_response_tokens": batch.num_tokens / batch.responses}
    if batch.rounds is not None:  # an environment's episodes: how long they ran, how many reached the top reward
        record.update(episode_rounds=sum(batch.rounds) / len(batch), success=sum(batch.solved) / len(batch),
                      per_round=batch.per_round)
    if health is not None:  # mean |log pi_vllm - log pi_train| per agent: sampler numerics, never in the ratios
        record["vllm_logprob_abs_diff"] = health
    return record


class StageClock:
    """The bookkeeping of one stage beside Algorithm 1's lines: it starts with the stage, times and counts every
    generation (the rollout B, then each redraw), shows the agent being stepped on a progress bar (tqdm's
    ``set_postfix_str``, or None) and closes the stage into its ``StageRecord``."""

    def __init__(self, progress=None) -> None:
        self.start = time.time()
        self.progress = progress
        self.generations, self.generation_seconds = 0, 0.0  # responses generated in the stage, their seconds
        self.rollout_fields: dict = {}  # rollout_record of B
        self.n_agents = 0

    def rolled_out(self, batch: TeamBatch, health: list | None) -> None:
        """B is drawn: its record fields, timed from the stage's start, and its N x n responses."""
        self.rollout_fields = rollout_record(batch, time.time() - self.start, health=health)
        self.n_agents = len(batch.turns)
        self.generations, self.generation_seconds = batch.responses, time.time() - self.start

    def stepping(self, i: int, j: int) -> None:
        """Step i (0-based) of the stage updates agent j (0-based): shown on the progress bar."""
        if self.progress is not None:
            self.progress.set_postfix_str(f"agent {j + 1} ({i + 1}/{self.n_agents})")

    def generate(self, draw: Callable[..., tuple[TeamBatch, int]], *args) -> TeamBatch:
        """``draw(*args)``, which returns (a batch, the responses it generated), timed and counted; the batch."""
        t = time.time()
        batch, generated = draw(*args)
        self.generations += generated
        self.generation_seconds += time.time() - t
        return batch

    def record(self, sigma: list[int], agents: list[AgentStep], step_bounds: str) -> StageRecord:
        """The stage's record: B's fields, the order sigma (1-based), each agent's step, the generation
        counts and the stage's wall time."""
        return StageRecord(**self.rollout_fields, order=[k + 1 for k in sigma], agents=agents,
                           generations=self.generations, generation_seconds=self.generation_seconds,
                           step_bounds=step_bounds, seconds=time.time() - self.start)
