"""SAT: Sequential Agent Tuning -- Algorithm 1, top to bottom.

Paper: Xie, Xu, Fan, Liu, "SAT: Sequential Agent Tuning for Coordinator-Free
Plug-and-Play Multi-LLM Training with Monotonic Improvement Guarantees"
(AAMAS 2026, arXiv 2605.05216), Section 5 and Algorithm 1. A team of n LLMs is
one factorized policy (Section 3). Each stage rolls the team out once, then
updates the agents one at a time in an order sigma, each inside its own KL
trust region, with advantages reweighted by truncated importance weights of
the agents already updated in this stage. Theorems 4.2 and 4.4 bound the
improvement of every step and of the stage with exact quantities; a run logs
lower bounds that hold with probability 1 - delta_conf from what it samples
(bounds.py): per step with --reuse regenerate, per stage on the held-out set.

Reading order: ``sat_stage`` (one stage: lines 4-14), ``sequential_update`` (the
agents in turn: lines 5-13), ``agent_step`` (one agent: lines 6-9,
advantage.build_inputs and update.train_agents), ``trust_region_step``
(lines 10-11: the agent's ``trust_region.TrustRegion``), ``evaluate`` (the held-out
draws the certificates pair), ``run_stages`` (the loop over stages).
The command line, model loading, tasks, checkpoints and resume live in
``harness/`` and reach this file only through what they hand it.

    python sat.py                                     # tiny team, CPU, a few minutes
    python sat.py --protocol chain                    # agents speak in turn
    python sat.py --update joint                      # the baseline SAT argues against
    python sat.py --reuse regenerate                  # redraw what each promotion changed, no weights
    python sat.py --agents "Qwen3-4B x3"              # the paper preset on a GPU
    python sat.py --resume runs/sat --stages 60       # continue a run
    python sat.py --resume runs/sat/checkpoints/stage_0005 --stages 8   # redo from stage 5 (rows 0..5 kept)
    python sat.py --resume runs/sat --upgrade 2=tiny-6L --stages 12   # plug-and-play

Outputs in --out: metrics.jsonl (one object per stage), progress.png,
config.json, checkpoints/stage_XXXX (atomic, checksummed; --resume picks the
latest). A folder holding a run is never overwritten: --resume it, pass a new
--out, or --overwrite. Bad input gets one line before any work: docs/errors.md.
"""
from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from advantage import UpdateInputs, build_inputs, step_estimates
from bounds import paired_change_bound
from logprobs import measure_kl
from rollout import SamplingConfig, TeamBatch, draw_seed, regenerate, rng_devices, rollout
from sat_config import SatConfig
from stage_record import AgentStep, StageClock, StageRecord
from team import Problem, Team
from trust_region import TrustRegion, interpolate_parameters
from update import TrainStats, train_agents


@dataclass
class RunState:
    """What a run holds and changes from stage to stage (``harness.run.start_team``); its settings are the
    ``SatConfig``."""

    team: Team
    regions: dict[int, TrustRegion]  # each agent's trust region: its check, line search, beta and lr (--step-size)
    value_heads: dict[int, torch.nn.Linear]  # --adv gae: each agent's value head
    rng: random.Random  # the run's Python RNG: prompts, the agents' order, Stage-0 prompts
    backend: object  # the sampler the entry point hands in (scale.rollout_vllm.make_backend: HF or vLLM engines)
    log: Callable[[str], None] = print


# -- ALGO LOGIC: one SAT stage (Algorithm 1, lines 4-14) -----------------------------------------------------------
def order_agents(batch: TeamBatch, n: int, how: str, rng: random.Random) -> list[int]:
    """sigma for this stage. greedy: the agent that is weakest on this batch
    (lowest own accuracy) first, so the largest expected gain comes first and
    later agents see its improvement through the weights."""
    if how == "static":
        return list(range(n))
    if how == "random":
        sigma = list(range(n))
        rng.shuffle(sigma)
        return sigma
    acc = batch.agent_reward.mean(1).tolist()  # [n]
    return sorted(range(n), key=lambda k: (acc[k], k))


def sat_stage(run: RunState, problems: list[Problem], cfg: SatConfig, sampling: SamplingConfig,
              pbar=None) -> tuple[StageRecord, TeamBatch]:
    """One stage: roll out pi_cur, order the agents, then step each agent in turn (``sequential_update``; with
    ``--update joint`` the baseline, ``joint_update``). Returns the stage's metrics record and its rollout B
    (what the team said); ``clock`` keeps the record's timings and counts and the progress bar ``pbar``."""
    team, backend, clock = run.team, run.backend, StageClock(pbar)
    batch = team_rollout(team, problems, cfg.group_size, sampling, backend)  # line 4: B <- ROLLOUT(pi_cur)
    backend.sleep()
    clock.rolled_out(batch, backend.health(team, batch))
    sigma = order_agents(batch, len(team), cfg.order, run.rng)  # line 4: sigma <- ORDERAGENTS(B)
    if cfg.update == "joint":
        agents = joint_update(run, sigma, batch, cfg)  # no step bounds: no sequence of steps
    else:
        agents = sequential_update(run, sigma, batch, cfg, sampling, clock)  # lines 5-13
    # line 14: pi_cur <- the assembled team; the stage's certificate is harness.records.stage_row's held-out bound
    return clock.record(sigma, agents, step_bounds_kind(cfg)), batch


def sequential_update(run: RunState, sigma: list[int], batch: TeamBatch, cfg: SatConfig, sampling: SamplingConfig,
                      clock: StageClock) -> list[AgentStep]:
    """Lines 5-13: for each agent j = sigma(i) optimise L_i under pi_hat^{i-1}, hold the step inside the trust
    region and promote it; then either cache log rho on its tokens for the later agents' weights (``--reuse
    weights``, the paper) or redraw the turns the promotion changed (``--reuse regenerate``: the batch stays
    on-policy for pi_hat^i). With step bounds the turns step i changes are also drawn just before it, under the
    same seed per row as the draw after it: the pair ``bounds.paired_change_bound`` compares."""
    team, backend, n_agents, bounded = run.team, run.backend, len(run.team), has_step_bounds(cfg)
    agents, cached = [None] * n_agents, []  # cached: log rho of the agents promoted this stage
    for i, j in enumerate(sigma):  # line 5: for i = 1..n, j = sigma(i)
        clock.stepping(i, j)
        pair_seed = draw_seed()  # one seed per row for the step's before and after draws
        if bounded:  # the turns step i changes, drawn afresh under pi_hat^{i-1}: the bound's "before"
            before = clock.generate(redraw, team, batch, j, sampling, backend, pair_seed)
        agents[j], log_rho = agent_step(team, j, batch, cached, cfg, run.regions[j], run.value_heads)  # lines 6-11
        backend.sync(team.agents[j])  # line 12: promote pi_j,cur <- pi_tar^j
        if cfg.reuse == "regenerate" and (bounded or i < n_agents - 1):  # on-policy for pi_hat^i: the "after"
            batch = clock.generate(redraw, team, batch, j, sampling, backend, pair_seed)
        elif i < n_agents - 1:  # log rho on agent j's tokens, for the later agents' weights
            cached.append((log_rho, batch.turns[j].response_mask))
        agents[j].step_bound = (paired_change_bound(before.rewards.tolist(), batch.rewards.tolist(),
                                                    team.config.reward.range, cfg.delta_conf / n_agents)
                                if bounded else None)
    return agents


def agent_step(team: Team, j: int, batch: TeamBatch, cached: list, cfg: SatConfig, region: TrustRegion,
               value_heads: dict) -> tuple[AgentStep, torch.Tensor]:
    """Lines 6-11 for agent j: weights w = prod min(1, rho_t) of the agents
    promoted before it and its advantages under pi_hat^{i-1}; pi_tar^j <-
    OPTIMIZE(L_i); the trust-region check. Returns its record and log rho."""
    inputs = build_inputs(batch, j, cached, cfg, team.agents[j].model, value_heads.get(j))
    reference = team.procs.frozen_copy(team.agents[j].model)  # pi_j,cur, frozen
    stats = team.procs.train(team, j, lambda: train_agents(team, [j], {j: inputs}, cfg, {j: region}, value_heads,
                                                           {j: reference})[j])
    return trust_region_step(team, j, reference, inputs, stats, cfg, region, batch)


def joint_update(run: RunState, sigma: list[int], batch: TeamBatch, cfg: SatConfig) -> list[AgentStep]:
    """``--update joint``, the baseline SAT argues against: every agent at
    once on the same batch, no importance weights."""
    team, regions, value_heads = run.team, run.regions, run.value_heads
    inputs = {j: build_inputs(batch, j, [], cfg, team.agents[j].model, value_heads.get(j)) for j in sigma}
    references = {j: team.procs.frozen_copy(team.agents[j].model) for j in sigma}
    stats = team.procs.train(team, sigma, lambda: train_agents(team, sigma, inputs, cfg, regions, value_heads,
                                                               references))
    agent_records = [None] * len(team)
    for j in sigma:
        agent_records[j] = trust_region_step(team, j, references.pop(j), inputs[j], stats[j], cfg, regions[j],
                                             batch)[0]
        run.backend.sync(team.agents[j])
    return agent_records


def trust_region_step(team: Team, j: int, reference, inputs: UpdateInputs, stats: TrainStats, cfg: SatConfig,
                      region: TrustRegion, batch: TeamBatch) -> tuple[AgentStep, torch.Tensor]:
    """Lines 10-11: agent j's trust region (``TrustRegion.step``) holds the proposal inside the ball, moving
    along anchor + f (proposal - anchor), and moves beta and the lr on; this records what it kept, with the
    step's estimates. Returns the record and log rho on agent j's tokens at the weights kept.

    The anchor is pi_j,cur, or the last iterate the in-loop check found inside (``stats.anchor``); a step the
    search cannot bring inside leaves the anchor exactly."""
    agent, turn = team.agents[j], inputs.turn
    params = agent.procs.parameters(agent.model)  # views: the model reads them at its next forward
    anchor = stats.anchor or list(agent.procs.parameters(reference))  # read, never written: no copy
    proposal = [p.detach().clone() for p in params]

    def step_to(frac: float) -> None:
        agent.procs.release(agent.model)
        interpolate_parameters(params, anchor, proposal, frac)

    def measure() -> tuple[torch.Tensor, torch.Tensor]:  # per-state KL [M], log rho [N, Lr] of the weights in place
        kl, _, log_rho = measure_kl(agent, reference, turn, cfg.sampling.temperature, cfg.sampling.token_budget)
        return kl, log_rho

    kept = region.step(step_to, measure, stats.early_stopped, stats.stopped_at, anchored=stats.anchor is not None)
    kl, log_rho = kept.measurement  # [M], [N, Lr] at the weights kept
    estimates = step_estimates(inputs, log_rho, kl, batch, j)
    if not batch.has_own_scores:  # an episode's: corr(advantage, R) would pass for the agent's credit
        estimates["credit_correlation"] = None
    return AgentStep(agent=j + 1, **kept.logged(), **estimates, train=stats), log_rho


def has_step_bounds(cfg: SatConfig) -> bool:
    """Whether a stage draws each step's changed turns before and after it (``bounds.paired_change_bound``)."""
    return cfg.update == "sequential" and cfg.reuse == "regenerate" and cfg.step_bounds


def step_bounds_kind(cfg: SatConfig) -> str:
    """What each agent's ``step_bound`` in a stage record is, or why it is None."""
    if has_step_bounds(cfg):
        return ("each a (1 - delta_conf/n) lower bound on its step's change in expected team reward on the "
                "contexts the stage sampled, from its turns drawn before and after it under one seed per row "
                "(bounds.paired_change_bound)")
    if cfg.update == "joint":
        return "none: a simultaneous update makes no sequence of steps to bound"
    if cfg.reuse != "regenerate":
        return ("none: --reuse weights never samples the stepped team, and the importance-weighted estimate is "
                "not a bound at real response lengths; use --reuse regenerate")
    return "none: --no-step-bounds"


def team_rollout(team: Team, problems: list[Problem], group_size: int, sampling: SamplingConfig, backend,
                 score: bool = True) -> TeamBatch:
    """ROLLOUT(pi_cur): ``rollout.rollout`` of the problems, as the team's processes share it out
    (``processes.py``; torchrun: seeded blocks, the same batch for any number of processes)."""
    return team.procs.rollout(rollout, team, problems, group_size, sampling, backend, score)


def redraw(team: Team, batch: TeamBatch, j: int, sampling: SamplingConfig, backend, seed: int) -> tuple:
    """``--reuse regenerate`` around agent j's promotion: the turns it changes,
    drawn again under ``seed`` (rollout.regenerate), once for every process."""
    out = team.procs.on_main(lambda: regenerate(team, batch, j, sampling, backend, seed))
    backend.sleep()
    return out


@torch.no_grad()
def evaluate(team: Team, problems: list[Problem], sampling: SamplingConfig, cfg: SatConfig, backend,
             label: str = "held-out evaluation") -> dict:
    """Held-out team accuracy (``cfg.eval_samples`` joint samples per problem at the training temperature:
    the policy being trained) and each agent's own accuracy. Every evaluation of a run draws its rows
    under the same seeds (fixed by the run seed and ``label``; row p * K + s is sample s of problem p), so
    consecutive evaluations and stage 0 pair row by row (``bounds.paired_change_bound``); it runs on an RNG
    stream of its own, so the training stream does not depend on when the evaluation ran. Another ``label``
    draws other seeds: plug-and-play's acceptance splits (``harness.certified_acceptance.certified_upgrade``)."""
    t0 = time.time()
    with torch.random.fork_rng(devices=rng_devices(cfg.device)):
        torch.manual_seed(random.Random(f"{label} {cfg.seed}").getrandbits(63))
        batch = team_rollout(team, problems, cfg.eval_samples, sampling, backend, score=False)
    acc = float(batch.rewards.mean())
    episodes = {} if batch.rounds is None else {"eval_success": sum(batch.solved) / len(batch),
                                                "eval_rounds": sum(batch.rounds) / len(batch)}
    return {**episodes, "eval_accuracy": acc, "eval_n": len(batch), "eval_samples": cfg.eval_samples,
            "eval_seconds": time.time() - t0,
            "eval_stderr": standard_error(batch.rewards),
            "eval_agent_reward": batch.agent_reward.mean(1).tolist(),
            "eval_rewards": [round(float(r), 6) for r in batch.rewards]}


def standard_error(values: torch.Tensor) -> float | None:
    """The standard error of the mean of ``values`` [N]: their sample standard deviation (n - 1) over sqrt(N),
    whatever the reward's range (partial credit, or R outside [0, 1]); None for fewer than two values."""
    if len(values) < 2:
        return None
    return float(values.double().std(correction=1)) / math.sqrt(len(values))


# -- The loop over stages (Algorithm 1, lines 2-15) ----------------------------------------------------------------
class Recorder(Protocol):
    """Where each evaluated stage goes (``harness.run.RunRecorder``: metrics, samples, checkpoints)."""

    def stage_zero(self, evaluation: dict) -> None: ...

    def stage(self, stage: int, record: StageRecord, evaluation: dict | None, batch: TeamBatch) -> None: ...


def run_stages(run: RunState, train: list[Problem], heldout: list[Problem], cfg: SatConfig, sampling: SamplingConfig,
               start: int, recorder: Recorder, new_run: bool) -> None:
    """Stages ``start + 1 .. cfg.stages``: each draws its prompts, runs ``sat_stage`` and, every
    ``cfg.eval_every`` stages and at the last, the held-out ``evaluate``; it hands both (or no evaluation)
    to ``recorder``. A ``new_run`` first evaluates the team before training (stage 0: the reference of the
    run certificate)."""
    from tqdm import tqdm

    team, backend = run.team, run.backend
    if new_run:
        recorder.stage_zero(evaluate(team, heldout, sampling, cfg, backend))
    n_prompts = cfg.batch_size // cfg.group_size
    pbar = tqdm(range(start + 1, cfg.stages + 1), desc="SAT stages", leave=False, initial=start, total=cfg.stages,
                disable=None if team.procs.main else True)  # None: off unless a terminal
    for stage in pbar:
        prompts = [train[run.rng.randrange(len(train))] for _ in range(n_prompts)]  # line 3: a batch of prompts
        record, rollout_b = sat_stage(run, prompts, cfg, sampling, pbar)
        evaluated = stage % cfg.eval_every == 0 or stage == cfg.stages
        recorder.stage(stage, record, evaluate(team, heldout, sampling, cfg, backend) if evaluated else None,
                       rollout_b)


if __name__ == "__main__":
    from harness.cli import main  # the command line: options, checks, loading, then run_stages

    sys.exit(main())
