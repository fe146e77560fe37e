"""A run from its configuration: checks, the processes, the problems, the team (new or resumed), the
sampler backend, then ``sat.run_stages`` with a recorder that writes each stage's metrics row, samples and
checkpoint; plug-and-play upgrades before the first stage.

``python sat.py`` reaches this through ``harness.cli``; ``run(cfg)`` is the same from Python (the
experiments call it).
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from advantage import make_value_head
from harness import lora, reasoning_gym_task, records, run_folder
from harness.certified_acceptance import AcceptanceDraws, acceptance_splits
from harness.config import Config, check_episode_options, parse_agents, resolve_agent_spec, threads_from_env
from harness.environments import (
    Environment,
    episode_columns,
    episode_reward,
    game_options,
    load_environment,
    opening_line,
    probe_environment,
    responder_spec,
)
from harness.loading import check_hub_available, folder_spec, load_agent, load_agents, warm_start
from harness.lora import bases_team, check_resume_lora, lora_settings
from harness.math_grading import DEFAULT_REWARD, math_team_config
from harness.processes import ONE_PROCESS, OneProcess
from harness.responder import shared_responder
from harness.roles import Roles, load_roles, save_roles
from harness.tasks import env_game, load_task
from harness.trackers import Trackers, check_report_to, parse_report_to
from harness.upgrades import apply_upgrades
from harness.user_reward import check_reward, load_reward
from reward import Reward
from rollout import SamplingConfig
from sat import RunState, evaluate, run_stages
from scale import distributed, memory  # the entry point picks the processes (scale.torchrun) and the backend
from scale.rollout_hf import HF, check_sampler
from scale.torchrun import Torchrun
from scale.vllm_lora import make_team_backend
from scale.vllm_ranks import check_tensor_parallel
from stage_record import StageRecord
from team import Agent, Problem, Team
from trust_region import QuantileController
from update import StepSize

WARM_START_EPISODES = 512  # environment rows whose opening observations a tiny team warm-starts on
# Said once by a run in an environment (harness.config.EPISODE_OPTIONS): what its per-agent figures mean there.
EPISODE_CREDIT_LINE = ("environment {name}: each agent's own score is the team reward (an episode cannot be split "
                       "among its agents), so the baseline is {baseline}, --order greedy is refused and "
                       "credit_correlation is not logged")


class Resolved(NamedTuple):
    """A run ready to start (``resolve``): its final configuration, the checkpoint it resumes from, its processes."""

    cfg: Config
    resume_from: Path | None
    procs: OneProcess


def resolve(cfg: Config) -> Resolved:
    """Presets, device, dtype and backend, then one validation, then the processes
    that run Algorithm 1: one, or (under torchrun, or --shard-rollouts) ``Torchrun``,
    the one block that knows about it (it sets this rank's device and torchrun's defaults)."""
    check_episode_options(cfg)  # options given explicitly, before the preset fills the defaults
    cfg = cfg.apply_preset()
    cfg.validate()
    validate_run_inputs(cfg)
    env = team_environment(cfg)
    if env is not None:  # T, resolved: the memory plan and config.json count the episode's rounds
        cfg = replace(cfg, max_rounds=env.max_rounds)
    cfg = replace(cfg, threads=configure_threads(cfg.threads, cfg.device))
    if cfg.shard_rollouts or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        procs, cfg = Torchrun.join(cfg)
    else:
        procs, cfg = ONE_PROCESS, replace(cfg, shard_frozen=False)  # one process: nothing to shard
    return Resolved(cfg, run_folder.latest_checkpoint(cfg.resume) if cfg.resume else None, procs)


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
    check_report_to(parse_report_to(cfg.report_to))  # a missing package: refused before any work
    if cfg.task_option and not (reasoning_gym_task.task_name(cfg.task) or env_game(cfg.task)):
        raise ValueError("--task-option configures a --task reasoning-gym:NAME dataset; pass that task, or drop the "
                         "option")
    if cfg.task_prompt and not reasoning_gym_task.task_name(cfg.task):
        raise ValueError("--task-prompt chooses the system prompt of a --task reasoning-gym:NAME dataset; pass that "
                         "task, or drop the option (--roles sets any other task's prompts)")
    if reasoning_gym_task.task_name(cfg.task) and not cfg.data:
        reasoning_gym_task.check_installed()
    team_reward(cfg)  # a missing file or name, or wrong arguments: refused in seconds, before any model is loaded
    if not cfg.resume:  # a resumed team keeps the roles in its checkpoint
        team_roles(cfg, len(parse_agents(cfg.agents)))
    if cfg.lora is not None and (cfg.shard_rollouts or int(os.environ.get("WORLD_SIZE", "1")) > 1):
        raise ValueError("--lora runs on one process: launch with python, not torchrun, and drop --shard-rollouts "
                         "(one GPU holds a team of adapters on a shared base: python -m scale.memory ... --lora R)")
    if cfg.resume:
        check_resume_lora(run_folder.latest_checkpoint(cfg.resume), lora_settings(cfg.lora, cfg.lora_alpha,
                                                                                   cfg.lora_targets))
    if cfg.upgrade and not cfg.resume:
        raise ValueError("--upgrade needs --resume RUN_DIR: plug-and-play replaces an agent of a trained team")
    if cfg.upgrade:
        team_json = run_folder.latest_checkpoint(cfg.resume) / "team" / "team.json"
        n_agents = len(json.loads(team_json.read_text())["agents"])
        for item in cfg.upgrade:
            slot, _, model = item.partition("=")
            if not slot.strip().isdigit() or not model.strip():
                raise ValueError(f"--upgrade {item!r}: write SLOT=MODEL with a 1-based slot, e.g. --upgrade 2=Qwen3-8B")
            if not 1 <= int(slot) <= n_agents:
                raise ValueError(f"--upgrade slot {int(slot)} is out of range: the team has agents 1..{n_agents}")
            check_hub_available(resolve_agent_spec(model))
    if not cfg.resume:
        responder = team_responder_spec(cfg, team_environment(cfg))
        memory.check_team_ram(cfg, parse_agents(cfg.agents),  # CPU: a team too large for the RAM, before the hub
                              parse_agents(responder)[0] if responder else None)
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


def team_environment(cfg: Config) -> Environment | None:
    """The environment the team acts in over rounds: --env, else a built-in --task env:NAME, else none."""
    spec = cfg.environment_spec()
    if spec is None:
        if cfg.max_rounds is not None:
            raise ValueError("--max-rounds applies to an environment's episodes: add --env FILE.py:NAME or "
                             "--task env:NAME, or drop the option")
        return None
    return load_environment(spec, cfg.max_rounds)


def team_reward(cfg: Config) -> Reward:
    """The team reward: --reward (with an environment, its columns hold ``env_reward`` and ``transcript``), else
    the environment's own, else a reasoning-gym task's own scorer, else the built-in one
    (``harness.math_grading.DEFAULT_REWARD``)."""
    if cfg.reward:
        return load_reward(cfg.reward)
    env = team_environment(cfg)
    if env is not None:
        return episode_reward(env)
    if reasoning_gym_task.task_name(cfg.task) and not cfg.data:
        return reasoning_gym_task.task_reward(cfg.task, cfg.task_option)
    return DEFAULT_REWARD


def team_roles(cfg: Config, n_agents: int) -> Roles | None:
    """Each agent's system turn and user template: --roles, else a reasoning-gym task's, else none (the paper)."""
    if cfg.roles:
        return load_roles(cfg.roles, n_agents, cfg.protocol)
    if reasoning_gym_task.task_name(cfg.task) and not cfg.data:
        return reasoning_gym_task.task_roles(n_agents, cfg.protocol, cfg.task_prompt or "default")
    return None


def build_team(cfg: Config, instruction: str, procs: OneProcess = ONE_PROCESS, reward: Reward = DEFAULT_REWARD
               ) -> Team:
    dtype = getattr(torch, cfg.dtype)
    specs = parse_agents(cfg.agents)
    agents = load_agents(specs, cfg.device, dtype, [cfg.seed * 100 + k for k in range(len(specs))],
                         lora_settings(cfg.lora, cfg.lora_alpha, cfg.lora_targets),
                         lambda spec, device, dt, seed: procs.load_agent(load_agent, spec, device, dt, seed=seed))
    team = Team(agents, math_team_config(protocol=cfg.protocol, instruction=instruction,
                                         roles=team_roles(cfg, len(specs)), reward=reward,
                                         environment=team_environment(cfg)))
    attach_responder(cfg, team)
    return team


def team_responder_spec(cfg: Config, env: Environment | None) -> str | None:
    """The responder's spec: --env-model, or a built-in game's --task-option responder=NAME (``responder_spec``)."""
    game = env_game(cfg.task) if env is not None and not cfg.data else None
    return responder_spec(env, game_options(game, cfg.task_option, cfg.env_model) if game else {}, cfg.env_model)


def attach_responder(cfg: Config, team: Team, at_start: bool = True) -> None:
    """The responder model the team's environment asks (``responder_spec``), held frozen in the team's config
    (never trained, never checkpointed: its spec is in the run's config): on the team's own weights where it can
    (``harness.responder``: a --lora base for the whole run; an agent of the same model, ``at_start``, until that
    agent first trains), else loaded once on the run's device (tiny weights: those of the slot after the team's
    last)."""
    spec = team_responder_spec(cfg, team.config.environment)
    team.config.responder_max_tokens = cfg.env_model_max_tokens
    if spec:
        parsed = folder_spec(parse_agents(spec)[0])
        responder = (shared_responder(team, parsed, at_start, not distributed.active())
                     or load_agent(parsed, cfg.device, getattr(torch, cfg.dtype), seed=cfg.seed * 100 + len(team)))
        responder.model.requires_grad_(False)
        team.config.responder = responder


def start_team(cfg: Config, train: list[Problem], instruction: str, resume_from: Path | None, procs: OneProcess,
               log, reward: Reward = DEFAULT_REWARD) -> tuple[RunState, dict, list[dict]]:
    """(the run's state with the HF backend, the checkpoint's other saved state, the metrics so far):
    from a checkpoint (the run's metrics of stages 0..k kept; its roles from its team.json, the reward from
    config.json), or new (tiny agents warm-started: it stands in for pretraining); every agent then on ``procs``."""
    if resume_from is not None:
        team, state, rng, controllers = run_folder.load_checkpoint(resume_from, cfg.device, getattr(torch, cfg.dtype),
                                                                procs)
        team.config.reward, team.config.environment = reward, team_environment(cfg)
        attach_responder(cfg, team, at_start=False)  # its agents have moved: only a --lora base is shared
        start, run_dir = state["stage"], run_folder.run_folder_of(resume_from) or Path(cfg.resume)
        rows = [r for r in run_folder.read_metrics(run_dir) if r["stage"] <= start]
        if [r["stage"] for r in rows] != list(range(start + 1)):
            raise ValueError(f"{run_dir / 'metrics.jsonl'} lacks the records of stages 0..{start} that {resume_from} "
                             "continues; resume from the run folder that holds both")
        log(f"resumed from {resume_from} at stage {start}")
    else:
        rng = seed_run(cfg.seed)
        team, state, rows = build_team(cfg, instruction, procs, reward), {}, []
        controllers = {k: QuantileController(delta=cfg.delta, quantile=cfg.quantile, beta=cfg.beta)
                       for k in range(len(team))}
        if cfg.warmup_steps and any(a.spec.kind == "tiny" for a in team.agents):
            tiny_warm_start(cfg, team, train, log)
    procs.adopt(team.agents)  # torchrun: every rank starts from rank 0's weights
    value_heads = {}
    if cfg.adv == "gae":
        saved = {int(k): v for k, v in state.get("value_heads", {}).items()}
        for k, agent in enumerate(team.agents):
            value_heads[k] = make_value_head(agent)
            if k in saved:
                value_heads[k].load_state_dict(saved[k])
    step_sizes = step_sizes_for(cfg, len(team), state.get("step_sizes", {}))
    return RunState(team, controllers, step_sizes, value_heads, rng, HF, log=log), state, rows


def step_sizes_for(cfg: Config, n: int, saved: dict) -> dict[int, StepSize]:
    """Each agent's ``update.StepSize``: at --lr, or, when an adaptive run resumes with --step-size adaptive,
    at the lr its checkpoint saved (a fixed rule, or a change of rule, starts from --lr)."""
    sizes = {k: StepSize(rule=cfg.step_size, lr=cfg.lr, delta=cfg.delta) for k in range(n)}
    for k, s in saved.items():
        if cfg.step_size == s["rule"] == "adaptive":
            sizes[int(k)] = StepSize(rule="adaptive", lr=s["lr"], delta=cfg.delta, lr_start=s["lr_start"])
    return sizes


def tiny_warm_start(cfg: Config, team: Team, train: list[Problem], log) -> None:
    """The tiny agents' supervised warm start (it stands in for pretraining) on the rows' gold answers. An
    environment's rows need no answer (its reward is its own): when one of them has none there is no target, and
    the warm start is skipped in one line rather than teaching the agents to say an empty or dummy label."""
    env = team.config.environment
    if env is not None and not all(p.answer for p in train[:WARM_START_EPISODES]):
        log(f"warm start skipped: environment {env.name}'s rows have no gold answer to train the tiny agents on "
            "(its reward is its own); they start from their initial weights")
        return
    t0 = time.time()
    warm_start(bases_team(team) if cfg.lora is not None else team, opening_problems(team, train),
               cfg.warmup_steps, cfg.warmup_p_wrong, cfg.seed)  # --lora: the shared base stands in for pretraining
    target = f" (environment {env.name}'s openings, its rows' {cfg.answer_key!r} as the target)" if env else ""
    log(f"warm start: {cfg.warmup_steps} supervised steps per tiny agent on labels wrong "
        f"{cfg.warmup_p_wrong:.0%} of the time{target} (stands in for pretraining), {time.time() - t0:.1f}s")


def opening_problems(team: Team, problems: list[Problem]) -> list[Problem]:
    """The problems as the team's first prompts show them: with an environment, its opening observations (of the
    first WARM_START_EPISODES rows: each is an episode started), else the problems themselves."""
    env = team.config.environment
    if env is None:
        return problems
    return [replace(p, problem=env.start(p)[1]) for p in problems[:WARM_START_EPISODES]]


def team_size(cfg: Config, resume_from: Path | None) -> int:
    """The number of agents: the checkpoint's team, or --agents."""
    if resume_from is not None:
        return len(json.loads((resume_from / "team" / "team.json").read_text())["agents"])
    return len(parse_agents(cfg.agents))


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
    resume_run = (run_folder.run_folder_of(resume_from) or Path(cfg.resume)) if resume_from is not None else None
    replaced = run_folder.check_out_folder(out, resume_run, cfg.overwrite)  # never write over another run's history
    procs.barrier()  # every process has looked before one writes anything
    train, heldout, instruction = load_problems(cfg)
    if (too_few := records.heldout_warning(len(heldout), cfg.eval_samples, cfg.delta_conf)) is not None:
        log(too_few)
    reward, env = team_reward(cfg), team_environment(cfg)
    team_responder_spec(cfg, env)  # an --env-model the environment cannot ask: refused before any model loads
    if env is not None:  # before any model is loaded: the environment's contract, then the reward's on its columns
        probe_environment(env, train, team_size(cfg, resume_from))
        log(opening_line(env, train[0]))
        log(EPISODE_CREDIT_LINE.format(name=env.name, baseline=cfg.baseline))
    check_reward(reward, train, team_size(cfg, resume_from), cfg.protocol, episode_columns(env))
    run, state, rows = start_team(cfg, train, instruction, resume_from, procs, log, reward)
    train_fraction = memory.check_run(cfg, run.team, log)  # a team that cannot fit: refused before anything is written
    if procs.main:
        run_folder.clear_run_files(replaced)  # --overwrite: only now that the input is valid
    out.mkdir(parents=True, exist_ok=True)
    run.backend = make_team_backend(cfg.backend, run.team, cfg.seed, train_fraction=train_fraction,
                                    tensor_parallel=cfg.vllm_tensor_parallel,
                                    max_model_len=memory.run_max_len(cfg, len(run.team)))
    try:
        return train_team(cfg, run, train, heldout, state, rows)
    finally:
        run.backend.close()


def train_team(cfg: Config, run: RunState, train: list[Problem], heldout: list[Problem], state: dict,
               rows: list[dict]) -> list[dict]:
    """Plug-and-play upgrades, if asked for, then Algorithm 1's stages (``sat.run_stages``), each
    evaluated stage recorded by a ``RunRecorder``. ``state``: what the checkpoint resumed from saved
    besides the run's state; ``rows``: the metrics so far."""
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
    recorder = RunRecorder(cfg, run, rows, team.procs.describe(cfg.device), state.get("baseline_eval"),
                           state.get("pending_upgrades", []))  # held-out accuracy right after an upgrade, if any
    names = parse_report_to(cfg.report_to) if team.procs.main else ()  # one process reports
    recorder.trackers = Trackers(names, out, asdict(cfg))
    if team.procs.main and team.config.roles is not None:
        save_roles(team.config.roles, out)  # also in every checkpoint's team.json, which --resume reads
    try:
        train_stages(cfg, run, train, heldout, recorder, start, sampling)
    finally:
        recorder.trackers.close()
    return rows


def train_stages(cfg: Config, run: RunState, train: list[Problem], heldout: list[Problem], recorder: "RunRecorder",
                 start: int, sampling: SamplingConfig) -> None:
    """``train_team`` once its recorder is made: the upgrades, config.json, the stages, the plot and the summary."""
    team, backend, log, rows, out = run.team, run.backend, run.log, recorder.rows, Path(cfg.out)
    if cfg.upgrade:  # once: the config.json below records no upgrade, so a later --resume does not repeat it
        recorder.baseline, recorder.pending = upgrade(cfg, run, train, heldout, start, sampling, recorder.pending,
                                                      rows[-1])
    for agent in team.agents:  # vLLM with sharded agents: each rank's engines take the shards now
        backend.sync(agent)
    if team.procs.main:
        names = [a.spec.name for a in team.agents]  # the team after any upgrade, as --agents would name it
        agents = cfg.agents if [s.name for s in parse_agents(cfg.agents)] == names else ", ".join(names)
        run_folder.atomic_write(out / "config.json", json.dumps({**asdict(cfg), "agents": agents, "upgrade": [],
                                                                 "upgrade_accept": "stage0", **recorder.how},
                                                                indent=2))
    if rows:
        log(records.STAGE_HEADER)
    run_stages(run, train, heldout, cfg, sampling, start, recorder, new_run=not rows)
    if len(rows) > 1 and team.procs.main:
        run_folder.plot_run(out, rows)
    plot = f", plot in {out / 'progress.png'}" if len(rows) > 1 else " (no plot: no stage trained)"
    last = records.last_evaluated(rows)
    log(f"held-out team accuracy: {rows[0]['eval_accuracy']:.3f} -> {last['eval_accuracy']:.3f}; "
        f"metrics in {out / 'metrics.jsonl'}{plot}")
    if last["stage"] > 0:
        log(records.run_summary(last))


@dataclass
class RunRecorder:
    """What a run writes after each evaluated stage (``sat.Recorder``): the metrics row on disk
    before the checkpoint that continues from it, the stage's samples, the console line."""

    cfg: Config
    run: RunState
    rows: list[dict]  # the metrics so far, stage 0 first
    how: dict  # the processes and device, in every row
    baseline: dict | None = None  # the held-out evaluation right after an upgrade: the next stage's reference
    pending: list = field(default_factory=list)  # upgrade events, recorded in the next stage's row
    trackers: Trackers | None = None  # --report-to: each row and its samples also go there

    def stage_zero(self, evaluation: dict) -> None:
        self.close({"stage": 0, "seconds": 0.0, **evaluation, **self.how})

    def stage(self, stage: int, record: StageRecord, evaluation: dict, batch) -> None:
        cfg, out = self.cfg, Path(self.cfg.out)
        samples = records.stage_samples(batch, stage, cfg.samples, cfg.group_size)
        if self.run.team.procs.main:
            run_folder.write_samples(out, stage, samples)
        prev = self.baseline or records.last_evaluated(self.rows)
        row = records.stage_row(record, evaluation, stage, self.rows, prev, self.pending, cfg.delta_conf,
                                self.run.team.config.reward.range)
        self.close({**row, **self.how}, samples)
        if samples:
            self.run.log(records.sample_text(samples[0]))
        if (cut := records.truncation_warning(row, cfg.max_new_tokens)) is not None:
            self.run.log(cut)
        if (thin := records.surrogate_ess_warning(row)) is not None:
            self.run.log(thin)
        self.pending = []  # recorded in this row
        if evaluation is not None:
            self.baseline = None  # an upgrade's evaluation is the reference until the next evaluation

    def close(self, row: dict, samples: list[dict] = ()) -> None:
        run, out = self.run, Path(self.cfg.out)
        self.rows.append(row)
        if run.team.procs.main:
            run_folder.write_metrics(out, self.rows)
        if self.trackers is not None:
            self.trackers.log_stage(row, list(samples))
        run_folder.save_checkpoint(out, row["stage"], run.team, run.controllers, run.value_heads, run.rng, {},
                                   step_sizes=run.step_sizes)
        run.log(records.stage_line(row) if row["stage"] else records.stage_zero_line(row))


def upgrade(cfg: Config, run: RunState, train: list[Problem], heldout: list[Problem], start: int,
            sampling: SamplingConfig, pending: list, last_row: dict) -> tuple[dict, list]:
    """Plug-and-play (Section 5): every --upgrade SLOT=MODEL entering as --upgrade-accept says, the
    held-out accuracy after it, and a checkpoint of the upgraded team. With --upgrade-accept raw or certified
    each event also holds ``heldout_change``: the paired held-out certificate of the change from ``last_row``
    (the metrics row the run resumed from) to the team after this run's upgrades."""
    out, team, backend = Path(cfg.out), run.team, run.backend
    events = apply_upgrades(cfg, run, train, start, sampling,
                            lambda spec, slot: load_replacement(spec, cfg, team, train, slot),
                            evaluate=lambda t: evaluate(t, heldout, sampling, cfg, backend),
                            acceptance=acceptance_draws(cfg, train, heldout, sampling, backend))
    baseline = evaluate(team, heldout, sampling, cfg, backend)
    for event in events:
        event["eval_accuracy_after_stage0"] = baseline["eval_accuracy"]
        if "accept" in event:
            event["heldout_change"] = records.heldout_certificate(
                last_row, baseline, cfg.delta_conf, "the row before the upgrade", team.config.reward.range)
    if team.procs.main:
        run_folder.record_upgrades(out, events)
    pending = pending + events
    run_folder.save_checkpoint(out, start, team, run.controllers, run.value_heads, run.rng,
                            {"baseline_eval": baseline, "pending_upgrades": pending}, suffix="_upgraded",
                            step_sizes=run.step_sizes)
    run.log(f"held-out team accuracy after Stage-0: {baseline['eval_accuracy']:.3f}")
    return baseline, pending


def acceptance_draws(cfg: Config, train: list[Problem], heldout: list[Problem], sampling: SamplingConfig,
                     backend) -> AcceptanceDraws | None:
    """``--upgrade-accept certified``'s splits (training problems only, none a held-out one asks) and how a team
    is drawn on them: ``sat.evaluate`` with one sample per row under the label's seeds; None for other rules."""
    if cfg.upgrade_accept != "certified":
        return None
    one_per_row = replace(cfg, eval_samples=1)
    return AcceptanceDraws(acceptance_splits(train, heldout, cfg.seed, cfg.upgrade_accept_rows),
                           lambda team, rows, label: evaluate(team, rows, sampling, one_per_row, backend,
                                                              label=label)["eval_rewards"])


def load_replacement(spec: str, cfg, team: Team, train: list[Problem], slot: int) -> Agent:
    """The new model for an upgraded slot (--shard-frozen: read straight into shards). A tiny spec gets its
    own (longer) warm start, standing in for a stronger pretrained model. With --lora: its base with a fresh
    adapter, the base shared with the team where an agent holds it (``lora.replacement_agent``)."""
    dtype = getattr(torch, cfg.dtype or ("float32" if cfg.device == "cpu" else "bfloat16"))
    seed = cfg.seed * 100 + 50 + slot
    steps = cfg.upgrade_warmup_steps if cfg.upgrade_warmup_steps is not None else 2 * cfg.warmup_steps

    def warm(agent: Agent) -> None:
        holder = Team(team.agents[:slot] + [agent] + team.agents[slot + 1 :], team.config)  # the slot's prompt format
        warm_start(holder, train, steps, cfg.warmup_p_wrong, cfg.seed + 7, slots=[slot])

    settings = lora_settings(cfg.lora, cfg.lora_alpha, cfg.lora_targets)
    if settings is not None:
        parsed = folder_spec(resolve_agent_spec(spec))
        return lora.replacement_agent(team, parsed, settings, seed,
                                      lambda s, sd: team.procs.load_agent(load_agent, s, cfg.device, dtype, seed=sd),
                                      warm if parsed.kind == "tiny" and steps > 0 else None)
    agent = team.procs.load_agent(load_agent, spec, cfg.device, dtype, seed=seed)
    if agent.spec.kind == "tiny":
        warm(agent)
    return agent
