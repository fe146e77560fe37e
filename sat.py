"""SAT: Sequential Agent Tuning -- Algorithm 1 (the stage loop) and the CLI.

Paper: Xie, Xu, Fan, Liu, "SAT: Sequential Agent Tuning for Coordinator-Free
Plug-and-Play Multi-LLM Training with Monotonic Improvement Guarantees"
(AAMAS 2026, arXiv 2605.05216), Section 5 and Algorithm 1. A team of n LLMs is
one factorized policy (Section 3). Each stage rolls the team out once, then
updates the agents one at a time in an order sigma, each inside its own KL
trust region, with advantages reweighted by truncated importance weights of
the agents already updated in this stage; Theorems 4.2 and 4.4 bound the
improvement of every step and of the stage (the certificate logged per stage).

    python sat.py                                     # tiny team, CPU, a few minutes
    python sat.py --protocol chain                    # agents speak in turn
    python sat.py --update joint                      # the baseline SAT argues against
    python sat.py --reuse regenerate                  # redraw what each promotion changed, no weights
    python sat.py --agents "Qwen3-4B x3"              # the paper preset on a GPU
    python sat.py --resume runs/sat                   # continue a run (more --stages)
    python sat.py --resume runs/sat/checkpoints/stage_0005 --stages 8   # redo from stage 5 (rows 0..5 kept)
    python sat.py --resume runs/sat --upgrade 2=tiny-6L --stages 12   # plug-and-play

Where the rest lives: the options, presets and their checks in
``config.py``, the objective L_i and its optimiser in ``update.py``, the
exact per-state KL in ``logprobs.py``, the trust-region tools and the
certificate in ``bounds.py``, rollouts in ``rollout.py``, Stage-0 in
``plug_and_play.py``, checkpoints and metrics in ``records.py``.

Outputs in --out: metrics.jsonl (one object per stage), progress.png,
config.json, checkpoints/stage_XXXX (atomic, checksummed; --resume picks the
latest). A folder holding a run is never overwritten: --resume it, pass a new
--out, or --overwrite. Bad input gets one line before any work: docs/errors.md.
"""
from __future__ import annotations

import gc

if __name__ == "__main__":  # the CLI (not an import): no cyclic GC until the libraries are in (parallel.freeze_libraries)
    gc.disable()

import argparse
import json
import math
import random
import re
import sys
import time
import warnings
from dataclasses import asdict, fields
from pathlib import Path

import torch

from scale import distributed
import parallel
from scale.distributed import configure_threads, seed_everything
from advantage import LOG_WEIGHT_CAP, credit_correlation, masked_sum, truncation_bias
from config import ADVANTAGES, BASELINES, DTYPES, ORDERS, RATIOS, REUSES, UPDATES, Config
from bounds import stage_certificate, turn_certificate
from logprobs import adopt_scoring, measure_kl, set_share_prefix
from scale.memory import check_run
from plug_and_play import apply_upgrades
from records import (STAGE_HEADER, latest_checkpoint, load_checkpoint, plot_run, read_metrics,
                     record_upgrades, rollout_record, save_checkpoint, finish_checkpoints, close_stage, collect_stage, prepare_plot, stage_row,
                     atomic_write, check_out_folder, clear_run_files, run_folder_of)
from rollout import (REWARD_RANGE, SamplingConfig, TeamBatch, after_rollout, check_sampler,
                     regenerate, rollout, rollout_in_blocks, start_backend, stop_backend,
                     sync_weights)
from tasks import Problem, load_task
from team import Agent, Team, TeamConfig, parse_agents, warm_start
from trust_region import QuantileController, backtracking_line_search, dkw_upper_quantile, interpolate_parameters, kl_quantile
from update import UpdateInputs, build_inputs, make_value_head, train_agents, train_sharded

ESS_WARN_RATIO = 0.1  # warn (once per run) when an agent's ESS of the weights falls below this fraction of N


# ---------------------------------------------------------------------------
# Ordering
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


def team_rollout(team: Team, problems: list[Problem], group_size: int, sampling: SamplingConfig, cfg: Config,
                 score: bool = True) -> TeamBatch:
    """ROLLOUT(pi_cur): one batched call, or (--shard-rollouts, always under
    torchrun) seeded blocks shared out over the ranks, the same batch for any
    number of processes."""
    if cfg is None or not cfg.shard_rollouts:
        return rollout(team, problems, group_size, sampling, score)
    seed = int(torch.randint(0, 2 ** 62, ()))  # from the global RNG: the same draw on every rank
    return rollout_in_blocks(team, problems, group_size, sampling, seed, cfg.rollout_blocks, score)


# ---------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------
@torch.no_grad()
def evaluate(team: Team, problems: list[Problem], sampling: SamplingConfig, cfg: Config | None = None) -> dict:
    """Held-out team accuracy (one joint sample per problem at the training
    temperature: the policy being trained), and each agent's own accuracy."""
    batch = team_rollout(team, problems, 1, sampling, cfg, score=False)
    acc = float(batch.rewards.mean())
    return {"eval_accuracy": acc, "eval_stderr": math.sqrt(max(acc * (1 - acc), 1e-12) / len(batch)),
            "eval_agent_accuracy": batch.agent_correct.mean(1).tolist()}


def evaluate_seeded(team: Team, problems: list[Problem], sampling: SamplingConfig, cfg: Config, stage: int) -> dict:
    """``evaluate`` on its own random stream, seeded by the run seed and the
    stage: the training stream does not depend on whether, when or in which
    process the evaluation ran (``records.close_stage`` runs it in a child)."""
    with torch.random.fork_rng(devices=distributed.rng_devices(cfg.device)):
        torch.manual_seed(random.Random(f"held-out evaluation {cfg.seed} {stage}").getrandbits(63))
        return evaluate(team, problems, sampling, cfg)


# ---------------------------------------------------------------------------
# ALGO LOGIC: one SAT stage (Algorithm 1, lines 4-14)
# ---------------------------------------------------------------------------
def sat_stage(team: Team, problems: list[Problem], cfg: Config, sampling: SamplingConfig,
              controllers: dict[int, QuantileController], value_heads: dict, rng: random.Random, pbar=None) -> dict:
    """One stage: roll out pi_cur, order the agents, then for each agent j =
    sigma(i) build its weighted advantages under pi_hat^{i-1}, optimise L_i,
    hold the step inside the trust region, promote it, and either cache log rho
    on its tokens for the later agents' weights (``--reuse weights``, the
    paper) or redraw the turns the promotion changed (``--reuse regenerate``:
    the batch stays exactly on-policy for pi_hat^i, at the price of extra
    generation). Returns the stage's metrics record."""
    n_agents = len(team)
    t0 = time.time()
    # line 4: B <- ROLLOUT(pi_cur) (behaviour log-probs kept); sigma <- ORDERAGENTS(B)
    batch = team_rollout(team, problems, cfg.group_size, sampling, cfg)
    rollout_seconds = time.time() - t0
    record = rollout_record(batch, rollout_seconds, health=after_rollout(team, batch, sampling))
    sigma = order_agents(batch, n_agents, cfg.order, rng)
    record["order"] = [k + 1 for k in sigma]
    generations, generation_seconds = len(batch) * n_agents, rollout_seconds
    cached: list[tuple[torch.Tensor, torch.Tensor]] = []  # log rho of the agents promoted this stage
    agent_records: list[dict] = [None] * n_agents
    if cfg.update == "joint":  # the baseline SAT argues against: every agent at once, no weights
        inputs = {j: build_inputs(batch, j, [], cfg, team.agents[j].model, value_heads.get(j)) for j in sigma}
        references = {j: distributed.frozen_copy(team.agents[j].model) for j in sigma}
        for j in sigma:
            adopt_scoring(references[j], team.agents[j].model, batch.turns[j])
        train_stats = train_sharded(team, sigma, lambda: train_agents(team, sigma, inputs, cfg, controllers, value_heads,
                                                                     references))  # FSDP2 under torchrun
        for j in sigma:
            agent_records[j] = finish_update(team, j, references.pop(j), inputs[j], train_stats[j], cfg, controllers[j],
                                             sampling, n_agents, batch)[0]
            sync_weights(team.agents[j], sampling)
    else:
        for i, j in enumerate(sigma):  # line 5: for i = 1..n, j = sigma(i)
            if pbar is not None:
                pbar.set_postfix_str(f"agent {j + 1} ({i + 1}/{n_agents})")
            # lines 6-7: pi_hat^{i-1}; weights w = prod min(1, rho_t) of agents sigma(1..i-1); advantages
            inputs = build_inputs(batch, j, cached, cfg, team.agents[j].model, value_heads.get(j))
            reference = distributed.frozen_copy(team.agents[j].model)  # pi_j,cur, frozen (sharded with --shard-frozen)
            adopt_scoring(reference, team.agents[j].model, batch.turns[j])  # its outputs on the turn: the rollout's
            # lines 8-9: pi_tar^j <- OPTIMIZE(L_i)
            with distributed.frozen_on_host(team, j, cfg.offload_frozen):  # --offload-frozen: the others wait on the host
                stats = train_sharded(team, j, lambda: train_agents(team, [j], {j: inputs}, cfg, controllers, value_heads,
                                                                    {j: reference})[j])  # FSDP2 under torchrun
                # lines 10-11: quantile of the exact per-state KL > delta -> backtrack, raise beta
                agent_records[j], log_rho = finish_update(team, j, reference, inputs, stats, cfg, controllers[j],
                                                          sampling, n_agents, batch)
            del reference
            # line 12: promote pi_j,cur <- pi_tar^j (the engine samples from the new weights from now on)
            sync_weights(team.agents[j], sampling)
            if i == n_agents - 1:
                break
            if cfg.reuse == "regenerate":  # redraw what the promotion changed: behaviour = pi_hat^i, no weights
                t_gen = time.time()
                # under torchrun rank 0 draws; every rank receives its batch and RNG state (one process: just the call)
                # (--shard-frozen: every rank redraws the same rows, the sharded agents' forwards are collectives)
                on = (lambda fn: fn()) if cfg.shard_frozen else distributed.on_main
                batch, generated = on(lambda: regenerate(team, batch, j, sampling))
                after_rollout(team, batch, sampling)
                generations, generation_seconds = generations + generated, generation_seconds + time.time() - t_gen
            else:  # cache log rho on agent j's tokens (from the KL's forwards) for the later agents' weights
                cached.append((log_rho, batch.turns[j].response_mask))
    # line 14: pi_cur <- the assembled team; the stage certificate (Theorem 4.4)
    record["agents"] = agent_records
    record["generations"], record["generation_seconds"] = generations, generation_seconds
    record["certificate"] = stage_certificate([a["certificate"] for a in agent_records])
    if cfg.update == "joint":  # Theorem 4.4 telescopes over sequential steps; a simultaneous update has no such sum
        record["certificate"]["kind"] = "sum of per-agent bounds: not a bound for a simultaneous update"
    record["seconds"] = time.time() - t0
    return record


_warned: set[str] = set()


def finish_update(team, j, reference, inputs: UpdateInputs, stats: dict, cfg: Config, controller: QuantileController,
                  sampling: SamplingConfig, n_agents: int, batch: TeamBatch):
    """Trust-region check with backtracking, controller update, certificate.

    The step found by the optimiser is theta_new; if the (1-alpha) quantile of
    the exact per-state KL exceeds delta, try theta_cur + f (theta_new -
    theta_cur) for f = 1/2, 1/4, ...; after the budget, restore theta_cur
    (reject). A violating step is never kept."""
    agent, turn = team.agents[j], inputs.turn
    params = distributed.local_parameters(agent.model)  # this rank's shards of a sharded agent (elementwise below)
    # Backtrack from the proposal toward the anchor: pi_j,cur itself, or the last
    # iterate that the in-loop check measured inside the ball (--kl-check-every).
    anchor = stats.pop("anchor", None)
    ref_params = distributed.local_parameters(reference)
    moved_inside = distributed.any_rank(anchor is not None and any(not torch.equal(a, r) for a, r in zip(anchor, ref_params)))
    cur = anchor if anchor is not None else [p.detach().clone() for p in ref_params]
    new = [p.detach().clone() for p in params]
    measured = {}
    # the in-loop check may already have measured the proposal (fraction 1) and the anchor,
    # and, on the spare core, the first backtrack (fraction 1/2: update.measure_at_fraction)
    known = {1.0: stats.pop("proposal_measure", None), 0.0: stats.pop("anchor_measure", None),
             0.5: stats.pop("half_measure", None)}
    at = {"frac": 1.0}

    def apply_step(frac: float) -> None:
        distributed.reshard(agent.model)  # a sharded agent gathers the new shards at its next forward
        interpolate_parameters(params, cur, new, frac)
        at["frac"] = frac

    def measure() -> float:
        kl, logp, log_rho = known.pop(at["frac"], None) or measure_kl(agent, reference, turn, cfg.temperature, cfg.token_budget,
                                                                       return_log_rho=True, frozen_reference=True)
        measured.update(kl=kl, logp=logp, log_rho=log_rho)
        return kl_quantile(kl, cfg.quantile)

    search = backtracking_line_search(apply_step, measure, cfg.delta, max_backtracks=cfg.max_backtracks)
    if not search["accepted"] and moved_inside:  # the anchor is a measured inside step: keep it
        apply_step(0.0)  # (the line search restored it already)
        search.update(accepted=True, kl_quantile=measure())
    elif not search["accepted"]:  # pi_cur restored: KL 0, new log-probs = behaviour
        measured = {"kl": torch.zeros(1), "logp": turn.behaviour_logprobs.clone(), "log_rho": torch.zeros(turn.response_mask.shape)}
    beta_used = controller.beta
    # beta reacts to the step that is kept (a rejection counts as a violation). Not to
    # the raw proposal: with --kl-check-every the proposal crosses delta by design.
    controller.update(search["kl_quantile"] if search["accepted"] else math.inf)
    kl = measured["kl"]
    mask = turn.response_mask
    log_ratio_tok = measured["log_rho"]  # [N, Lr] log pi_new - log pi_cur, from the forwards that measured the KL
    log_r_seq = masked_sum(log_ratio_tok, mask, dim=1).clamp(-20, 20)  # [N] sequence ratio of the accepted step
    w = inputs.log_w.exp()  # [N]
    surrogate = float((w * (log_r_seq.exp() - 1) * inputs.raw_adv).mean())  # E_new[A] - E_cur[A], reward units
    zeta = truncation_bias(inputs.log_w_full, inputs.log_w, log_r_seq.exp(), inputs.raw_adv)
    # turn-level KL: the response is the agent's action, so its per-state KL is
    # the sum of the token-level KLs along the response (estimated on sampled paths)
    seq_kl = torch.zeros(len(mask))
    if search["accepted"] and kl.numel() == int(mask.sum()):
        seq_kl = torch.zeros(mask.shape).masked_scatter_(mask.bool(), kl).sum(1)  # [N]
    n_samples = len(batch)
    # per-step bound in episode units, both protocols (bounds.turn_certificate); A_max = R_max - R_min
    cert = turn_certificate(surrogate, REWARD_RANGE[1] - REWARD_RANGE[0], zeta=zeta, n_samples=n_samples, n_agents=n_agents)
    ess = float(w.sum() ** 2 / (w ** 2).sum())
    if ess < ESS_WARN_RATIO * n_samples and "ess" not in _warned:
        _warned.add("ess")
        warnings.warn(f"agent {j + 1}: effective sample size of the sequence-aware weights is {ess:.1f} of N = {n_samples} "
                      f"(< {ESS_WARN_RATIO:.0%}); later agents get little gradient: consider --reuse regenerate", stacklevel=2)
    record = {"agent": j + 1, "kl_mean": float(kl.mean()), "kl_quantile": search["kl_quantile"], "kl_max": float(kl.max()),
              "kl_quantile_dkw": dkw_upper_quantile(kl, cfg.quantile),  # upper bound on the true quantile (DKW)
              "delta": cfg.delta, "beta": beta_used, "beta_next": controller.beta, "backtracks": search["backtracks"],
              "accepted": search["accepted"], "step_fraction": search["fraction"], "surrogate": surrogate,
              "zeta": zeta, "zeta_capped_rows": int((inputs.log_w_full > LOG_WEIGHT_CAP).sum()), "N": n_samples, "ess": ess,
              "ess_ratio": ess / n_samples, "credit_correlation": credit_correlation(inputs.adv, batch.agent_correct[j]),
              "seq_kl_max": float(seq_kl.max()),
              "certificate": cert, **stats}
    return record, log_ratio_tok


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------

def build_team(cfg: Config, instruction: str) -> Team:
    dtype = getattr(torch, cfg.dtype)
    agents = [Agent.load(spec, device=cfg.device, dtype=dtype, seed=cfg.seed * 100 + k, shard=bool(cfg.shard_frozen))
              for k, spec in enumerate(parse_agents(cfg.agents))]
    return Team(agents, TeamConfig(protocol=cfg.protocol, instruction=instruction))


def run(cfg: Config, log=None) -> list[dict]:
    """Train a team with SAT; returns the metrics records (stage 0 = before training)."""
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    log = log or tqdm.write  # prints above the progress bar instead of through it
    out = Path(cfg.out)
    resume_from = latest_checkpoint(cfg.resume) if cfg.resume else None
    cfg.apply_preset()
    cfg.validate()
    cfg.threads = configure_threads(cfg.threads, cfg.device)  # recorded in config.json
    cfg.device = distributed.setup(cfg.device)  # torchrun: join the process group; every rank runs this loop
    distributed.check_options(cfg)
    cfg.share_prefix = bool(cfg.share_prefix) and not distributed.active()  # torchrun: the FSDP2 agent's forward keeps no cache
    # logprobs.turn_forward: each distinct context once (recorded in config.json), in the turns where the update's calls
    # compute fewer tokens so; with --shard-rollouts in every turn (its blocks' turns are scored apart from the merged one)
    set_share_prefix(cfg.share_prefix, *(() if cfg.shard_rollouts else (cfg.minibatch_size, cfg.token_budget)))
    if cfg.shard_frozen is None:  # recorded in config.json as resolved
        cfg.shard_frozen = distributed.active() and cfg.device.startswith("cuda") and cfg.vllm_tensor_parallel == 1
    cfg.shard_frozen = bool(cfg.shard_frozen) and distributed.active()  # one process: nothing to shard
    if cfg.offload_frozen is None:  # recorded in config.json as resolved
        cfg.offload_frozen = distributed.active() and cfg.device.startswith("cuda") and not cfg.shard_frozen
    if not distributed.is_main():
        log = lambda *args: None  # noqa: E731  rank 0 speaks and writes
    resume_run = (run_folder_of(resume_from) or Path(cfg.resume)) if resume_from is not None else None
    replaced = check_out_folder(out, resume_run, cfg.overwrite)  # never write over another run's history
    distributed.barrier()  # torchrun: every rank has looked before rank 0 writes anything
    train, heldout, instruction = load_task(cfg)
    if not train:
        raise ValueError(f"no training problems in {cfg.data or cfg.task!r} (after holding out the evaluation set); "
                         "pass a JSONL file with problems")
    if not heldout:
        raise ValueError(f"no held-out problems in {cfg.eval_data or cfg.data or cfg.task!r}; pass a non-empty --eval-data")
    if distributed.is_main():
        clear_run_files(replaced)  # --overwrite: only now that the input is valid
    out.mkdir(parents=True, exist_ok=True)
    sampling = SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                              token_budget=cfg.token_budget, backend=cfg.backend)
    dtype = getattr(torch, cfg.dtype)
    if resume_from is not None:
        # --shard-frozen: each agent read straight into shards (shard_load), Stage-0 included
        team, state, rng, controllers = load_checkpoint(resume_from, cfg.device, dtype, shard=cfg.shard_frozen)
        start = state["stage"]
        records = [r for r in read_metrics(resume_run) if r["stage"] <= start]  # the run's history, 0..start
        if [r["stage"] for r in records] != list(range(start + 1)):
            raise ValueError(f"{resume_run / 'metrics.jsonl'} lacks the records of stages 0..{start} that {resume_from} "
                             "continues; resume from the run folder that holds both")
        log(f"resumed from {resume_from} at stage {start}")
        cfg.agents = ", ".join(a.spec.name for a in team.agents)
    else:
        rng = seed_everything(cfg.seed)
        team = build_team(cfg, instruction)
        controllers = {k: QuantileController(delta=cfg.delta, quantile=cfg.quantile, beta=cfg.beta) for k in range(len(team))}
        start, records, state = 0, [], {}
        if cfg.warmup_steps and any(a.spec.kind == "tiny" for a in team.agents):
            t0 = time.time()
            warm_start(team, train, cfg.warmup_steps, cfg.warmup_p_wrong, cfg.seed)
            log(f"warm start: {cfg.warmup_steps} supervised steps per tiny agent on labels wrong "
                f"{cfg.warmup_p_wrong:.0%} of the time (stands in for pretraining), {time.time() - t0:.1f}s")
    for agent in team.agents:
        distributed.broadcast_module(agent.model)  # every rank starts from rank 0's weights
    value_heads = {}
    if cfg.adv == "gae":
        for k, agent in enumerate(team.agents):
            value_heads[k] = make_value_head(agent)
            if str(k) in state.get("value_heads", {}) or k in state.get("value_heads", {}):
                value_heads[k].load_state_dict(state["value_heads"].get(k, state["value_heads"].get(str(k))))
    start_backend(cfg.backend, len(team), cfg.seed, train_fraction=check_run(cfg, team, log),
                  tensor_parallel=cfg.vllm_tensor_parallel)
    if not cfg.device.startswith("cuda"):
        log(f"torch CPU threads: {cfg.threads} (--threads / $OMP_NUM_THREADS; default 1)")
    for agent in team.agents:
        if cfg.backend == "hf":
            check_sampler(agent, sampling)  # nothing but the tempered softmax, whatever the checkpoint ships
    baseline = state.get("baseline_eval")  # held-out accuracy right after an upgrade, if any
    pending_upgrades = state.get("pending_upgrades", [])  # recorded in the next stage's metrics
    if cfg.upgrade:
        if resume_from is None:
            raise ValueError("--upgrade needs --resume RUN_DIR: plug-and-play replaces an agent of a trained team")
        events = apply_upgrades(cfg, team, train, start, sampling, controllers, value_heads, rng, log,
                                evaluate=lambda t: evaluate(t, heldout, sampling, cfg))
        baseline = evaluate(team, heldout, sampling, cfg)
        for event in events:
            event["eval_accuracy_after_stage0"] = baseline["eval_accuracy"]
        record_upgrades(out, events)
        pending_upgrades = pending_upgrades + events
        cfg.agents = ", ".join(a.spec.name for a in team.agents)
        cfg.upgrade = []  # done: a later --resume must not upgrade again
        save_checkpoint(out, start, team, controllers, value_heads, rng,
                        {"baseline_eval": baseline, "pending_upgrades": pending_upgrades}, suffix="_upgraded")
        log(f"held-out team accuracy after Stage-0: {baseline['eval_accuracy']:.3f}")
    distributed.shard_team(team, cfg.shard_frozen)  # --shard-frozen: agents built whole (tiny) as FSDP2 shards too
    for agent in team.agents:  # vLLM with sharded agents: each rank's engines take the shards now, every rank at once
        sync_weights(agent, sampling)
    how = {"world_size": distributed.STATE.world, "device_kind": distributed.STATE.device_kind}  # how a result was produced
    atomic_write(out / "config.json", json.dumps({**asdict(cfg), **how}, indent=2))
    fork = None if cfg.backend == "hf" else False  # the end of a stage runs in a child (records.close_stage); vLLM stays here

    def close(stage: int, make_row) -> None:  # evaluation, metrics row, checkpoint: overlaps the next stage
        close_stage(out, records, make_row, lambda: save_checkpoint(out, stage, team, controllers, value_heads, rng, {}), fork)

    if not records:
        close(0, lambda: {"stage": 0, "seconds": 0.0, **evaluate_seeded(team, heldout, sampling, cfg, 0), **how})
    else:
        log(STAGE_HEADER)
    n_prompts = cfg.batch_size // cfg.group_size
    pbar = tqdm(range(start + 1, cfg.stages + 1), desc="SAT stages", leave=False, initial=start, total=cfg.stages,
                disable=not distributed.is_main())
    for stage in pbar:
        prompts = [train[rng.randrange(len(train))] for _ in range(n_prompts)]
        rec = sat_stage(team, prompts, cfg, sampling, controllers, value_heads, rng, pbar)
        collect_stage(records, log)  # the previous stage's row: this one's measured change is against it
        prev, upgrades = baseline or records[-1], pending_upgrades
        baseline, pending_upgrades = None, []
        close(stage, lambda: stage_row(rec, evaluate_seeded(team, heldout, sampling, cfg, stage), how, stage, prev, upgrades))
    if cfg.stages > 0:
        prepare_plot()  # matplotlib's import overlaps the last evaluation
    collect_stage(records, log)  # the last row and checkpoint are on disk before the run returns
    finish_checkpoints()
    if len(records) > 1:
        plot_run(out, records)
    plot_note = f", plot in {out / 'progress.png'}" if len(records) > 1 else " (no plot: no stage trained)"
    stop_backend(cfg.backend)
    log(f"held-out team accuracy: {records[0]['eval_accuracy']:.3f} -> {records[-1]['eval_accuracy']:.3f}; "
        f"metrics in {out / 'metrics.jsonl'}{plot_note}")
    return records


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------
def parse_args(argv=None) -> Config:
    p = argparse.ArgumentParser(prog="sat.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                argument_default=argparse.SUPPRESS)
    p.add_argument("--agents", help='e.g. "tiny x3" (default), "Qwen3-4B x3", "Qwen3-4B x2, Qwen3-8B"')
    p.add_argument("--protocol", choices=["independent", "chain"])
    p.add_argument("--task", help="arithmetic (tiny default) or a dataset name: dapo-math-17k, deepscaler, aime24, aime25, math500")
    p.add_argument("--data", help="a JSONL file of problems (problem/prompt + answer); overrides --task")
    p.add_argument("--eval-data", dest="eval_data", help="held-out JSONL file")
    p.add_argument("--stages", type=int)
    p.add_argument("--order", choices=ORDERS)
    p.add_argument("--ratio", choices=RATIOS)
    p.add_argument("--adv", choices=ADVANTAGES)
    p.add_argument("--reuse", choices=REUSES, help="weights: one rollout per stage, truncated importance weights (the paper; "
                   "tiny default); regenerate: after each promotion redraw the turns it changed (paper-preset default)")
    p.add_argument("--resample", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--baseline", choices=BASELINES, help="counterfactual (default; independent protocol only): agent j's advantage "
                   "is R minus the vote with its other answers to the prompt swapped in; group: the group mean (Eq. (2))")
    p.add_argument("--gradient-checkpointing", dest="gradient_checkpointing", action=argparse.BooleanOptionalAction)
    p.add_argument("--share-prefix", dest="share_prefix", action=argparse.BooleanOptionalAction,
                   help="teacher-forced forwards compute each distinct context once, in the turns where a training minibatch "
                   "computes fewer tokens so (default: on without --gradient-checkpointing; one process only: off under torchrun)")
    p.add_argument("--keep-optimizer-state", dest="keep_optimizer_state", action=argparse.BooleanOptionalAction,
                   help="keep each agent's AdamW moments on the host between its turns (default: off)")
    p.add_argument("--update", choices=UPDATES)
    helps = {"delta": "trust-region radius on the per-state KL quantile", "quantile": "1 - alpha: the KL quantile held to delta",
             "beta": "initial KL-penalty weight (adapted per agent)", "group-size": "G joint trajectories per prompt",
             "batch-size": "joint trajectories per stage", "epochs": "passes over the batch per agent update",
             "minibatch-size": "joint trajectories per gradient step", "eps-clip": "PPO clip epsilon",
             "adv-clip": "advantage clip A_clip", "max-backtracks": "halvings before an update is rejected",
             "token-budget": "max tokens per generate chunk / gradient micro-batch",
             "kl-check-every": "exact KL check every k gradient steps, stop at delta (0: only at the end)",
             "eval-size": "held-out problems per evaluation", "warmup-steps": "supervised warm start of tiny agents",
             "stage0-delta": "Stage-0 radius delta_0 for --upgrade", "stage0-max-passes": "Stage-0 passes before giving up",
             "upgrade-warmup-steps": "warm start of a tiny replacement (default 2 x --warmup-steps)",
             "stage0-fit-tol": "Stage-0 fit tolerance: mean KL(target || new) <= this x its start value (default 0.1)",
             "stage0-problems": "Stage-0 prompts, a quarter held out (default --batch-size / --group-size)"}
    for name, typ in [("delta", float), ("quantile", float), ("beta", float), ("lr", float), ("group-size", int),
                      ("batch-size", int), ("max-new-tokens", int), ("temperature", float), ("top-p", float),
                      ("seed", int), ("epochs", int), ("minibatch-size", int), ("eps-clip", float), ("adv-clip", float),
                      ("max-backtracks", int), ("token-budget", int), ("kl-check-every", int), ("eval-size", int), ("warmup-steps", int),
                      ("stage0-delta", float), ("stage0-max-passes", int), ("upgrade-warmup-steps", int),
                      ("stage0-fit-tol", float), ("stage0-problems", int)]:
        p.add_argument(f"--{name}", dest=name.replace("-", "_"), type=typ, help=helps.get(name))
    p.add_argument("--kl-estimator", dest="kl_estimator", choices=["k1", "k2", "k3", "k3_new"])
    p.add_argument("--out")
    p.add_argument("--resume", help="a run folder (or a checkpoints/stage_XXXX folder) to continue")
    p.add_argument("--overwrite", action="store_true", help="replace the run already in --out (otherwise refused)")
    p.add_argument("--device")
    p.add_argument("--dtype", choices=DTYPES, help="agent weights (default: bfloat16 on CUDA, float32 on CPU); "
                   "bfloat16 trains the active agent on fp32 master weights")
    p.add_argument("--backend", choices=["hf", "vllm"])
    p.add_argument("--upgrade", action="append", help="SLOT=MODEL: replace agent SLOT (1-based) by MODEL, then continue SAT")
    p.add_argument("--shard-rollouts", dest="shard_rollouts", action=argparse.BooleanOptionalAction,
                   help="roll out in seeded blocks (on under torchrun; with one process: reproduce a torchrun run)")
    p.add_argument("--rollout-blocks", dest="rollout_blocks", type=int, help="seeded blocks per rollout (default 8)")
    p.add_argument("--vllm-tensor-parallel", dest="vllm_tensor_parallel", type=int,
                   help="ranks per vLLM engine under torchrun (default 1: one engine per agent per rank; >1 needs CUDA)")
    p.add_argument("--offload-frozen", dest="offload_frozen", action=argparse.BooleanOptionalAction,
                   help="frozen agents in host memory during another agent's turn (default: on under torchrun on CUDA)")
    p.add_argument("--shard-frozen", dest="shard_frozen", action=argparse.BooleanOptionalAction,
                   help="under torchrun hold every agent as FSDP2 shards, the reference too; vLLM engines fed from the shards "
                        "(default: on on CUDA, unless --vllm-tensor-parallel > 1)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: $OMP_NUM_THREADS, else 1)")
    args = vars(p.parse_args(numbers_as_values(sys.argv[1:] if argv is None else argv)))
    if args.pop("resample", False):
        p.error("--resample was replaced by --reuse regenerate (redraws only the turns a promotion changed)")
    if "resume" in args:  # continue with the saved configuration; explicit flags override it
        saved = Path(args["resume"])
        cfg_path = (saved if (saved / "config.json").exists() else latest_checkpoint(saved).parent.parent) / "config.json"
        if not cfg_path.exists():
            p.error(f"--resume {saved}: no config.json there; pass the run folder written by sat.py")
        base = json.loads(cfg_path.read_text())
        base.update({"upgrade": [], "overwrite": False})
        base.update(args)
        base.setdefault("out", str(saved))
        if "out" not in args:
            base["out"] = str(cfg_path.parent)
        args = base
    known = {f.name for f in fields(Config)}
    return Config(**{k: v for k, v in args.items() if k in known})


def numbers_as_values(argv: list[str]) -> list[str]:
    """argparse reads "-1e-4" as an option; glue such a negative number to the
    option before it ("--lr=-1e-4") so validation can say what is wrong."""
    out = []
    for tok in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and re.fullmatch(r"-[\d.]+(?:e[-+]?\d+)?|-inf|-nan", tok, re.I):
            out[-1] = f"{out[-1]}={tok}"
        else:
            out.append(tok)
    return out


def main(argv=None) -> int:
    try:
        cfg = parse_args(argv)
        cfg.apply_preset()
        cfg.validate()
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"sat.py: error: {err}", file=sys.stderr)
        return 2
    try:
        run(cfg)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"sat.py: error: {err}", file=sys.stderr)
        return 1
    finally:
        distributed.teardown()
    return 0


if __name__ == "__main__":
    parallel.freeze_libraries()
    try:
        code = main()
    except BaseException:  # a traceback or Ctrl-C: the interpreter's own exit, libraries unfrozen first
        gc.unfreeze()
        raise
    parallel.exit_process(code)  # everything is on disk: skip freeing the libraries' objects one by one
