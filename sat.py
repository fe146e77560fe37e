"""SAT: Sequential Agent Tuning -- Algorithm 1 (the stage loop) and the CLI.

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

import argparse
import importlib.util
import json
import math
import os
import random
import re
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

import records
from advantage import LOG_WEIGHT_CAP, credit_correlation, masked_sum, truncation_bias
from bounds import paired_change_bound
from config import Config, add_options, parse_agents, resolve_agent_spec, threads_from_env
from logprobs import measure_kl
from plug_and_play import apply_upgrades
from processes import ONE_PROCESS, OneProcess
from records import AgentStep, StageRecord
from rollout import (
    HF,
    REWARD_RANGE,
    SamplingConfig,
    TeamBatch,
    check_sampler,
    draw_seed,
    regenerate,
    rng_devices,
    rollout,
)
from scale import memory  # the entry point picks the processes (scale.torchrun) and the backend
from scale.distributed import rank_main
from scale.rollout_vllm import make_backend
from scale.torchrun import Torchrun
from scale.vllm_ranks import check_tensor_parallel
from tasks import Problem, load_task
from team import Agent, Team, TeamConfig, check_hub_available, warm_start
from trust_region import (
    QuantileController,
    backtracking_line_search,
    dkw_upper_quantile,
    interpolate_parameters,
    kl_quantile,
)
from update import TrainStats, UpdateInputs, build_inputs, make_value_head, train_agents

ESS_WARN_RATIO = 0.1  # warn when an agent's ESS of the weights falls below this fraction of N


@dataclass
class RunState:
    """What a run holds and changes from stage to stage (``start_team``); its settings are the ``Config``."""

    team: Team
    controllers: dict[int, QuantileController]  # each agent's beta and trust-region statistic
    value_heads: dict[int, torch.nn.Linear]  # --adv gae: each agent's value head
    rng: random.Random  # the run's Python RNG: prompts, the agents' order, Stage-0 prompts
    backend: object = HF  # the sampler: rollout.HFBackend, or vLLM engines (scale.rollout_vllm)
    log: Callable[[str], None] = print


# ---------------------------------------------------------------------------
# ALGO LOGIC: one SAT stage (Algorithm 1, lines 4-14)
# ---------------------------------------------------------------------------
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
    acc = batch.agent_correct.mean(1).tolist()  # [n]
    return sorted(range(n), key=lambda k: (acc[k], k))


def sat_stage(run: RunState, problems: list[Problem], cfg: Config, sampling: SamplingConfig,
              pbar=None) -> tuple[StageRecord, TeamBatch]:
    """One stage: roll out pi_cur, order the agents, then for each agent j =
    sigma(i) optimise L_i under pi_hat^{i-1}, hold the step inside the trust
    region and promote it; then either cache log rho on its tokens for the
    later agents' weights (``--reuse weights``, the paper) or redraw the turns
    the promotion changed (``--reuse regenerate``: the batch stays on-policy for
    pi_hat^i). Returns the stage's metrics record and its rollout B (what the team said)."""
    team, controllers, value_heads, backend = run.team, run.controllers, run.value_heads, run.backend
    n_agents, t0 = len(team), time.time()
    batch = rollout_b = team_rollout(team, problems, cfg.group_size, sampling, backend)  # line 4: B <- ROLLOUT
    backend.sleep()
    rollout_fields = records.rollout_record(batch, time.time() - t0, health=backend.health(team, batch))
    sigma = order_agents(batch, n_agents, cfg.order, run.rng)  # line 4: sigma <- ORDERAGENTS(B)
    generations, generation_seconds = len(batch) * n_agents, time.time() - t0
    bounded = has_step_bounds(cfg)
    if cfg.update == "joint":
        agents = joint_update(run, sigma, batch, cfg)  # no step bounds: no sequence of steps
    else:
        agents, cached = [None] * n_agents, []  # cached: log rho of the agents promoted this stage
        for i, j in enumerate(sigma):  # line 5: for i = 1..n, j = sigma(i)
            if pbar is not None:
                pbar.set_postfix_str(f"agent {j + 1} ({i + 1}/{n_agents})")
            t_gen, pair_seed = time.time(), draw_seed()  # one seed per row for the step's before and after draws
            if bounded:  # the turns step i changes, drawn afresh under pi_hat^{i-1}: the bound's "before"
                before, generated = redraw(team, batch, j, sampling, backend, pair_seed)
                generations, generation_seconds = generations + generated, generation_seconds + time.time() - t_gen
            agents[j], log_rho = update_agent(team, j, batch, cached, cfg, controllers[j], value_heads)
            backend.sync(team.agents[j])  # line 12: promote pi_j,cur <- pi_tar^j
            t_gen = time.time()
            if cfg.reuse == "regenerate" and (bounded or i < n_agents - 1):  # on-policy for pi_hat^i: the "after"
                batch, generated = redraw(team, batch, j, sampling, backend, pair_seed)
                generations, generation_seconds = generations + generated, generation_seconds + time.time() - t_gen
            elif i < n_agents - 1:
                cached.append((log_rho, batch.turns[j].response_mask))
            agents[j].step_bound = (paired_change_bound(before.rewards.tolist(), batch.rewards.tolist(),
                                                           REWARD_RANGE, cfg.delta_conf / n_agents)
                                       if bounded else None)
    # line 14: pi_cur <- the assembled team; the stage's certificate is records.stage_row's held-out bound
    record = StageRecord(**rollout_fields, order=[k + 1 for k in sigma], agents=agents, generations=generations,
                         generation_seconds=generation_seconds, step_bounds=step_bounds_kind(cfg),
                         seconds=time.time() - t0)
    return record, rollout_b


def has_step_bounds(cfg: Config) -> bool:
    """Whether a stage draws each step's changed turns before and after it (``bounds.paired_change_bound``)."""
    return cfg.update == "sequential" and cfg.reuse == "regenerate" and cfg.step_bounds


def step_bounds_kind(cfg: Config) -> str:
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


def update_agent(team: Team, j: int, batch: TeamBatch, cached: list, cfg: Config, controller: QuantileController,
                 value_heads: dict) -> tuple[AgentStep, torch.Tensor]:
    """Lines 6-11 for agent j: weights w = prod min(1, rho_t) of the agents
    promoted before it and its advantages under pi_hat^{i-1}; pi_tar^j <-
    OPTIMIZE(L_i); the trust-region check. Returns its record and log rho."""
    inputs = build_inputs(batch, j, cached, cfg, team.agents[j].model, value_heads.get(j))
    reference = team.procs.frozen_copy(team.agents[j].model)  # pi_j,cur, frozen
    stats = team.procs.train(team, j, lambda: train_agents(team, [j], {j: inputs}, cfg, {j: controller}, value_heads,
                                                           {j: reference})[j])
    return finish_update(team, j, reference, inputs, stats, cfg, controller, batch)


def joint_update(run: RunState, sigma: list[int], batch: TeamBatch, cfg: Config) -> list[AgentStep]:
    """``--update joint``, the baseline SAT argues against: every agent at
    once on the same batch, no importance weights."""
    team, controllers, value_heads = run.team, run.controllers, run.value_heads
    inputs = {j: build_inputs(batch, j, [], cfg, team.agents[j].model, value_heads.get(j)) for j in sigma}
    references = {j: team.procs.frozen_copy(team.agents[j].model) for j in sigma}
    stats = team.procs.train(team, sigma, lambda: train_agents(team, sigma, inputs, cfg, controllers, value_heads,
                                                               references))
    agent_records = [None] * len(team)
    for j in sigma:
        agent_records[j] = finish_update(team, j, references.pop(j), inputs[j], stats[j], cfg, controllers[j], batch)[0]
        run.backend.sync(team.agents[j])
    return agent_records


def finish_update(team: Team, j: int, reference, inputs: UpdateInputs, stats: TrainStats, cfg: Config,
                  controller: QuantileController, batch: TeamBatch) -> tuple[AgentStep, torch.Tensor]:
    """Lines 10-11: the trust-region check with backtracking, beta's update and
    the step's estimates; returns the record and log rho on agent j's tokens.

    The line search tries anchor + f (proposal - anchor) for f = 1, 1/2, 1/4,
    ... until the (1 - alpha) quantile of the exact per-state KL is inside
    delta; the anchor is pi_j,cur, or the last iterate the in-loop check found
    inside (``stats.anchor``). After the budget the anchor is restored: a
    violating step is never kept. The record's KL and log rho are those of the
    weights kept."""
    agent, turn = team.agents[j], inputs.turn
    params = agent.procs.parameters(agent.model)  # views: the model reads them at its next forward
    anchor = stats.anchor or [p.detach().clone() for p in agent.procs.parameters(reference)]
    proposal = [p.detach().clone() for p in params]

    def step_to(frac: float) -> None:
        agent.procs.release(agent.model)
        interpolate_parameters(params, anchor, proposal, frac)

    def measure() -> tuple[torch.Tensor, torch.Tensor]:  # per-state KL [M], log rho [N, Lr] of the weights in place
        kl, _, log_rho = measure_kl(agent, reference, turn, cfg.temperature, cfg.token_budget)
        return kl, log_rho

    # an early-stopped proposal was measured outside by the in-loop check: the search starts at its first halving
    search = backtracking_line_search(step_to, measure, cfg.delta, max_backtracks=cfg.max_backtracks,
                                      first_try=1 if stats.early_stopped and cfg.max_backtracks else 0,
                                      quantile_of=lambda m: kl_quantile(m[0], cfg.quantile))
    accepted = search.accepted or stats.anchor is not None  # the anchor was measured inside: keep it
    kl, log_rho = search.measurement if search.accepted else measure()  # [M], [N, Lr] at the weights kept
    beta_used = controller.beta
    controller.update(kl_quantile(kl, cfg.quantile) if accepted else math.inf)  # a rejection counts as a violation
    step = AgentStep(agent=j + 1, kl_mean=float(kl.mean()), kl_quantile=kl_quantile(kl, cfg.quantile),
                     kl_max=float(kl.max()), kl_quantile_dkw=dkw_upper_quantile(kl, cfg.quantile), delta=cfg.delta,
                     beta=beta_used, beta_next=controller.beta, backtracks=search.backtracks, accepted=accepted,
                     step_fraction=search.fraction, **step_estimates(inputs, log_rho, kl, batch, j), train=stats)
    return step, log_rho


def step_estimates(inputs: UpdateInputs, log_rho: torch.Tensor, kl: torch.Tensor, batch: TeamBatch, j: int) -> dict:
    """The paper's surrogate L_i (Section 3, Eq. (5) at the step kept, in reward units), an ESTIMATE of the
    step's change: agent j acts once per joint trajectory and the states at its turn come from agents the
    step does not change, so J(pi_hat^i) - J(pi_hat^{i-1}) = E_{pi_hat^{i-1}}[(r_j - 1)(R - b)] exactly, for
    any baseline b of the problem; the sample mean of w (r_j - 1) A estimates it. It is not a bound: the
    rows are those the step was trained on, and r_j, a whole response's ratio, is heavy-tailed at real
    response lengths (``surrogate_ess``: the effective sample size of w r_j). Also the truncation bias
    zeta of the weights and their effective sample size."""
    mask = inputs.turn.response_mask  # [N, Lr]
    log_r_seq = masked_sum(log_rho, mask, dim=1).clamp(-20, 20)  # [N] sequence ratio of the step kept
    w = inputs.log_w.exp()  # [N] truncated weights of the agents promoted before j
    surrogate = float((w * (log_r_seq.exp() - 1) * inputs.raw_adv).mean())  # E_new[A] - E_cur[A]
    zeta = truncation_bias(inputs.log_w_full, inputs.log_w, log_r_seq.exp(), inputs.raw_adv)
    # the response is the agent's action: its KL is the sum of its tokens' per-state KLs
    seq_kl = torch.zeros(mask.shape).masked_scatter_(mask.bool(), kl).sum(1)  # [N]
    n, wr = len(batch), w * log_r_seq.exp()  # wr: [N] the estimate's importance weights
    ess = float(w.sum() ** 2 / (w ** 2).sum())
    if ess < ESS_WARN_RATIO * n:
        warnings.warn(f"the effective sample size of the sequence-aware weights fell below {ESS_WARN_RATIO:.0%} of N: "
                      "later agents get little gradient; consider --reuse regenerate", stacklevel=2)
    return {"surrogate_estimate": surrogate, "surrogate_ess": float(wr.sum() ** 2 / (wr ** 2).sum()), "zeta": zeta,
            "zeta_capped_rows": int((inputs.log_w_full > LOG_WEIGHT_CAP).sum()), "N": n, "ess": ess,
            "ess_ratio": ess / n, "seq_kl_max": float(seq_kl.max()),
            "credit_correlation": credit_correlation(inputs.adv, batch.agent_correct[j])}


def team_rollout(team: Team, problems: list[Problem], group_size: int, sampling: SamplingConfig, backend=HF,
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
def evaluate(team: Team, problems: list[Problem], sampling: SamplingConfig, cfg: Config, backend=HF) -> dict:
    """Held-out team accuracy (``cfg.eval_samples`` joint samples per problem at the training temperature:
    the policy being trained) and each agent's own accuracy. Every evaluation of a run draws its rows
    under the same seeds (fixed by the run seed; row p * K + s is sample s of problem p), so consecutive
    evaluations and stage 0 pair row by row (``bounds.paired_change_bound``); it runs on an RNG stream of
    its own, so the training stream does not depend on when the evaluation ran."""
    t0 = time.time()
    with torch.random.fork_rng(devices=rng_devices(cfg.device)):
        torch.manual_seed(random.Random(f"held-out evaluation {cfg.seed}").getrandbits(63))
        batch = team_rollout(team, problems, cfg.eval_samples, sampling, backend, score=False)
    acc = float(batch.rewards.mean())
    return {"eval_accuracy": acc, "eval_n": len(batch), "eval_samples": cfg.eval_samples,
            "eval_seconds": time.time() - t0,
            "eval_stderr": math.sqrt(max(acc * (1 - acc), 1e-12) / len(batch)),
            "eval_agent_accuracy": batch.agent_correct.mean(1).tolist(),
            "eval_rewards": [round(float(r), 6) for r in batch.rewards]}


# ---------------------------------------------------------------------------
# The run: configuration, the team, the stage loop
# ---------------------------------------------------------------------------
class Resolved(NamedTuple):
    """A run ready to start (``resolve``): its final configuration, the checkpoint it resumes from, its processes."""

    cfg: Config
    resume_from: Path | None
    procs: OneProcess


def resolve(cfg: Config) -> Resolved:
    """Presets, device, dtype and backend, then one validation, then the processes
    that run Algorithm 1: one, or (under torchrun, or --shard-rollouts) ``Torchrun``,
    the one block that knows about it (it sets this rank's device and torchrun's defaults)."""
    cfg = cfg.apply_preset()
    cfg.validate()
    validate_run_inputs(cfg)
    cfg = replace(cfg, threads=configure_threads(cfg.threads, cfg.device))
    if cfg.shard_rollouts or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        procs, cfg = Torchrun.join(cfg)
    else:
        procs, cfg = ONE_PROCESS, replace(cfg, shard_frozen=False)  # one process: nothing to shard
    return Resolved(cfg, records.latest_checkpoint(cfg.resume) if cfg.resume else None, procs)


def configure_threads(threads: int | None, device: str) -> int:
    """torch's CPU threads: ``--threads``, else $OMP_NUM_THREADS, else 1. One thread by default: the thread count
    changes float summation order (so the same seed would give other metrics on other machines), and a second busy
    process on a 2-core machine makes every parallel region wait for a descheduled thread. On CUDA the host
    threads only feed the GPU and are left alone."""
    if threads is None:
        threads = threads_from_env() or 1
    if not str(device).startswith("cuda"):
        torch.set_num_threads(threads)
    return threads


def validate_run_inputs(cfg: "Config") -> None:
    """Checks across options, on disk and network, before any model is built (docs/errors.md)."""
    if cfg.group_size == 1 and cfg.adv == "grpo":
        raise ValueError("--group-size 1: every group-relative advantage (Eq. (2)) would be 0 and nothing would be "
                         "trained; use --group-size 2 or more (or --adv gae)")
    if cfg.vllm_tensor_parallel != 1:  # before any process group or engine: WORLD_SIZE is torchrun's
        if cfg.backend != "vllm":
            raise ValueError("--vllm-tensor-parallel applies to the vLLM engines: "
                             "add --backend vllm (or drop the option)")
        check_tensor_parallel(cfg.vllm_tensor_parallel, int(os.environ.get("WORLD_SIZE", "1")), cfg.device,
                              cfg.rollout_blocks, cfg.reuse)
    if cfg.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ValueError("--backend vllm but vLLM is not installed: "
                         "pip install -r requirements-vllm.txt, or use --backend hf")
    if cfg.upgrade and not cfg.resume:
        raise ValueError("--upgrade needs --resume RUN_DIR: plug-and-play replaces an agent of a trained team")
    if cfg.upgrade:
        n_agents = len(json.loads((records.latest_checkpoint(cfg.resume) / "team" / "team.json").read_text())["agents"])
        for item in cfg.upgrade:
            slot, _, model = item.partition("=")
            if not slot.strip().isdigit() or not model.strip():
                raise ValueError(f"--upgrade {item!r}: write SLOT=MODEL with a 1-based slot, e.g. --upgrade 2=Qwen3-8B")
            if not 1 <= int(slot) <= n_agents:
                raise ValueError(f"--upgrade slot {int(slot)} is out of range: the team has agents 1..{n_agents}")
            check_hub_available(resolve_agent_spec(model))
    if not cfg.resume:
        memory.check_team_ram(cfg, parse_agents(cfg.agents))  # CPU: a team too large for the RAM, before the hub
        for spec in parse_agents(cfg.agents):
            check_hub_available(spec)


def load_problems(cfg: Config) -> tuple[list[Problem], list[Problem], str]:
    """(training problems, held-out problems, the task's instruction to the agents)."""
    train, heldout, instruction = load_task(cfg)
    if not train:
        raise ValueError(f"no training problems in {cfg.data or cfg.task!r} (after holding out the evaluation set); "
                         "pass a JSONL file with problems")
    if not heldout:
        raise ValueError(f"no held-out problems in {cfg.eval_data or cfg.data or cfg.task!r}; "
                         "pass a non-empty --eval-data")
    return train, heldout, instruction


def build_team(cfg: Config, instruction: str, procs: OneProcess = ONE_PROCESS) -> Team:
    dtype = getattr(torch, cfg.dtype)
    agents = [procs.load_agent(Agent.load, spec, cfg.device, dtype, seed=cfg.seed * 100 + k)
              for k, spec in enumerate(parse_agents(cfg.agents))]
    return Team(agents, TeamConfig(protocol=cfg.protocol, instruction=instruction))


def start_team(cfg: Config, train: list[Problem], instruction: str, resume_from: Path | None, procs: OneProcess,
               log) -> tuple[RunState, dict, list[dict]]:
    """(the run's state with the HF backend, the checkpoint's other saved state, the metrics so far):
    from a checkpoint (the run's metrics of stages 0..k kept), or new (tiny
    agents warm-started: it stands in for pretraining); every agent then on ``procs``."""
    if resume_from is not None:
        team, state, rng, controllers = records.load_checkpoint(resume_from, cfg.device, getattr(torch, cfg.dtype),
                                                                procs)
        start, run_dir = state["stage"], records.run_folder_of(resume_from) or Path(cfg.resume)
        rows = [r for r in records.read_metrics(run_dir) if r["stage"] <= start]
        if [r["stage"] for r in rows] != list(range(start + 1)):
            raise ValueError(f"{run_dir / 'metrics.jsonl'} lacks the records of stages 0..{start} that {resume_from} "
                             "continues; resume from the run folder that holds both")
        log(f"resumed from {resume_from} at stage {start}")
    else:
        rng = seed_run(cfg.seed)
        team, state, rows = build_team(cfg, instruction, procs), {}, []
        controllers = {k: QuantileController(delta=cfg.delta, quantile=cfg.quantile, beta=cfg.beta)
                       for k in range(len(team))}
        if cfg.warmup_steps and any(a.spec.kind == "tiny" for a in team.agents):
            t0 = time.time()
            warm_start(team, train, cfg.warmup_steps, cfg.warmup_p_wrong, cfg.seed)
            log(f"warm start: {cfg.warmup_steps} supervised steps per tiny agent on labels wrong "
                f"{cfg.warmup_p_wrong:.0%} of the time (stands in for pretraining), {time.time() - t0:.1f}s")
    procs.adopt(team.agents)  # torchrun: every rank starts from rank 0's weights
    value_heads = {}
    if cfg.adv == "gae":
        saved = {int(k): v for k, v in state.get("value_heads", {}).items()}
        for k, agent in enumerate(team.agents):
            value_heads[k] = make_value_head(agent)
            if k in saved:
                value_heads[k].load_state_dict(saved[k])
    return RunState(team, controllers, value_heads, rng, log=log), state, rows


def seed_run(seed: int) -> random.Random:
    """Seed torch's and NumPy's global generators for a run; returns the run's own Python generator (the
    global ``random`` is left alone)."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    return random.Random(seed)


def run(cfg: Config, log=None) -> list[dict]:
    """Train a team with SAT; returns the metrics records (stage 0 = before training)."""
    return run_resolved(resolve(cfg), log)


def run_resolved(resolved: Resolved, log=None) -> list[dict]:
    """``run`` once ``resolve`` has checked the configuration and picked the processes."""
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    cfg, resume_from, procs = resolved
    hf_logging.disable_progress_bar()
    log = (log or tqdm.write) if procs.main else (lambda *args: None)  # one process speaks and writes
    out = Path(cfg.out)
    resume_run = (records.run_folder_of(resume_from) or Path(cfg.resume)) if resume_from is not None else None
    replaced = records.check_out_folder(out, resume_run, cfg.overwrite)  # never write over another run's history
    procs.barrier()  # every process has looked before one writes anything
    train, heldout, instruction = load_problems(cfg)
    run, state, rows = start_team(cfg, train, instruction, resume_from, procs, log)
    train_fraction = memory.check_run(cfg, run.team, log)  # a team that cannot fit: refused before anything is written
    if procs.main:
        records.clear_run_files(replaced)  # --overwrite: only now that the input is valid
    out.mkdir(parents=True, exist_ok=True)
    run.backend = make_backend(cfg.backend, len(run.team), cfg.seed, train_fraction=train_fraction,
                               tensor_parallel=cfg.vllm_tensor_parallel,
                               max_model_len=memory.run_max_len(cfg, len(run.team)))
    try:
        return train_team(cfg, run, train, heldout, state, rows)
    finally:
        run.backend.close()


def train_team(cfg: Config, run: RunState, train: list[Problem], heldout: list[Problem], state: dict,
               rows: list[dict]) -> list[dict]:
    """Plug-and-play upgrades, if asked for, then Algorithm 1's stages; after
    each, the held-out evaluation, its metrics row and a checkpoint. ``state``: what
    the checkpoint resumed from saved besides the run's state; ``rows``: the metrics so far."""
    from tqdm import tqdm

    team, backend, log = run.team, run.backend, run.log
    out = Path(cfg.out)
    sampling = SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                              token_budget=cfg.token_budget)
    if backend.name == "hf":
        for agent in team.agents:
            check_sampler(agent, sampling)  # nothing but the tempered softmax, whatever the checkpoint ships
    if not cfg.device.startswith("cuda"):
        log(f"torch CPU threads: {cfg.threads} (--threads / $OMP_NUM_THREADS; default: every core for a real model, "
            "1 for the tiny team)")
    start = state.get("stage", 0)
    baseline = state.get("baseline_eval")  # held-out accuracy right after an upgrade, if any
    pending = state.get("pending_upgrades", [])  # recorded in the next stage's metrics
    if cfg.upgrade:  # once: the config.json below records no upgrade, so a later --resume does not repeat it
        baseline, pending = upgrade(cfg, run, train, heldout, start, sampling, pending)
    for agent in team.agents:  # vLLM with sharded agents: each rank's engines take the shards now
        backend.sync(agent)
    how, main = team.procs.describe(cfg.device), team.procs.main  # the main process writes the run's files
    if main:
        names = [a.spec.name for a in team.agents]  # the team after any upgrade, as --agents would name it
        agents = cfg.agents if [s.name for s in parse_agents(cfg.agents)] == names else ", ".join(names)
        records.atomic_write(out / "config.json", json.dumps({**asdict(cfg), "agents": agents, "upgrade": [], **how},
                                                             indent=2))

    def close(row: dict) -> None:  # the metrics row on disk before the checkpoint that continues from it
        rows.append(row)
        if main:
            records.write_metrics(out, rows)
        records.save_checkpoint(out, row["stage"], team, run.controllers, run.value_heads, run.rng, {})
        log(records.stage_line(row) if row["stage"] else f"stage 0 (before SAT): held-out team accuracy "
            f"{row['eval_accuracy']:.3f} agents {records.fmt_list(row['eval_agent_accuracy'])}\n{records.STAGE_HEADER}")

    if not rows:
        close({"stage": 0, "seconds": 0.0, **evaluate(team, heldout, sampling, cfg, backend), **how})
    else:
        log(records.STAGE_HEADER)
    n_prompts = cfg.batch_size // cfg.group_size
    pbar = tqdm(range(start + 1, cfg.stages + 1), desc="SAT stages", leave=False, initial=start, total=cfg.stages,
                disable=None if team.procs.main else True)  # None: off unless a terminal
    for stage in pbar:
        prompts = [train[run.rng.randrange(len(train))] for _ in range(n_prompts)]
        rec, rollout_b = sat_stage(run, prompts, cfg, sampling, pbar)
        evaluation = evaluate(team, heldout, sampling, cfg, backend)
        samples = records.stage_samples(rollout_b, stage, cfg.samples, cfg.group_size)
        if main:
            records.write_samples(out, stage, samples)
        close(records.stage_row(rec, {**evaluation, **how}, stage, rows, baseline or rows[-1], pending,
                                cfg.delta_conf))
        if samples:
            log(records.sample_text(samples[0]))
        baseline, pending = None, []
    if len(rows) > 1 and main:
        records.plot_run(out, rows)
    plot = f", plot in {out / 'progress.png'}" if len(rows) > 1 else " (no plot: no stage trained)"
    log(f"held-out team accuracy: {rows[0]['eval_accuracy']:.3f} -> {rows[-1]['eval_accuracy']:.3f}; "
        f"metrics in {out / 'metrics.jsonl'}{plot}")
    if len(rows) > 1:
        log(records.run_summary(rows[-1]))
    return rows


def upgrade(cfg: Config, run: RunState, train: list[Problem], heldout: list[Problem], start: int,
            sampling: SamplingConfig, pending: list) -> tuple[dict, list]:
    """Plug-and-play (Section 5): Stage-0 for every --upgrade SLOT=MODEL, the
    held-out accuracy after it, and a checkpoint of the upgraded team."""
    out, team, backend = Path(cfg.out), run.team, run.backend
    events = apply_upgrades(cfg, run, train, start, sampling, evaluate=lambda t: evaluate(t, heldout, sampling, cfg,
                                                                                          backend))
    baseline = evaluate(team, heldout, sampling, cfg, backend)
    for event in events:
        event["eval_accuracy_after_stage0"] = baseline["eval_accuracy"]
    if team.procs.main:
        records.record_upgrades(out, events)
    pending = pending + events
    records.save_checkpoint(out, start, team, run.controllers, run.value_heads, run.rng,
                            {"baseline_eval": baseline, "pending_upgrades": pending}, suffix="_upgraded")
    run.log(f"held-out team accuracy after Stage-0: {baseline['eval_accuracy']:.3f}")
    return baseline, pending


# ---------------------------------------------------------------------------
# CLI: every option is a Config field, with the help text written there
# ---------------------------------------------------------------------------
def parse_args(argv=None) -> Config:
    p = argparse.ArgumentParser(prog="sat.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                argument_default=argparse.SUPPRESS)
    add_options(p, Config)
    args = vars(p.parse_args(numbers_as_values(sys.argv[1:] if argv is None else argv)))
    if "resume" in args:  # continue with the saved configuration; explicit flags override it
        saved = Path(args["resume"])
        cfg_path = (saved if (saved / "config.json").exists()
                    else records.latest_checkpoint(saved).parent.parent) / "config.json"
        if not cfg_path.exists():
            p.error(f"--resume {saved}: no config.json there; pass the run folder written by sat.py")
        args = {**json.loads(cfg_path.read_text()), "upgrade": [], "overwrite": False, "out": str(cfg_path.parent),
                **args}
    known = {f.name for f in fields(Config)}
    return Config(**{k: v for k, v in args.items() if k in known})


def numbers_as_values(argv: list[str]) -> list[str]:
    """argparse reads "-1e-4" as an option; glue such a negative number to the
    option before it ("--lr=-1e-4") so validation can say what is wrong."""
    out = []
    for tok in argv:
        negative = re.fullmatch(r"-[\d.]+(?:e[-+]?\d+)?|-inf|-nan", tok, re.I)
        if out and out[-1].startswith("--") and "=" not in out[-1] and negative:
            out[-1] = f"{out[-1]}={tok}"
        else:
            out.append(tok)
    return out


@rank_main  # under torchrun: one barrier, the group destroyed, the rank ended (a failed rank aborts the group)
def main(argv=None) -> int:
    try:
        cfg = parse_args(argv)
        resolved = resolve(cfg)
    except (ValueError, FileNotFoundError, RuntimeError) as err:  # refused before any work
        print(f"sat.py: error: {err}", file=sys.stderr)
        return 2
    try:
        run_resolved(resolved)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"sat.py: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
