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
from harness.loading import (
    UPGRADE_WARM_START_OFFSET,
    agent_seed,
    check_hub_available,
    folder_spec,
    load_agent,
    load_agents,
    replacement_seed,
    warm_start,
)
from harness.lora import bases_team, check_resume_lora, lora_settings
from harness.math_grading import DEFAULT_REWARD, math_team_config
from harness.processes import ONE_PROCESS, OneProcess
from harness.responder import shared_responder
from harness.roles import Roles, load_roles, save_roles
from harness.tasks import env_game, load_task
from harness.trackers import Trackers, check_report_to, parse_report_to
from harness.upgrades import apply_upgrades, parse_upgrade
from harness.user_reward import check_reward, load_reward
from reward import Reward
from sat import RunState, evaluate, run_stages
from sat_config import SatConfig
from scale import distributed, memory, run_memory  # the entry point picks the processes (scale.torchrun), the backend
from scale.rollout_hf import check_sampler
from scale.torchrun import Torchrun
from scale.vllm_lora import make_team_backend
from scale.vllm_ranks import check_tensor_parallel
from stage_record import StageRecord
from step_rules import StepSize
from team import Agent, AgentSpec, Problem, Team
from trust_region import QuantileController, TrustRegion

WARM_START_EPISODES = 512  # environment rows whose opening observations a tiny team warm-starts on
# Said once by a run in an environment (harness.config.EPISODE_OPTIONS): what its per-agent figures mean there.
EPISODE_CREDIT_LINE = ("environment {name}: each agent's own score is the team reward (an episode cannot be split "
                       "among its agents), so the baseline is {baseline}, --order greedy is refused and "
                       "credit_correlation is not logged")


class Resolved(NamedTuple):
    """A run's inputs, each built once by ``resolve`` and only read after: its final configuration, the checkpoint
    it resumes from, its processes, the agents' specs, the environment, the team reward, the roles and the
    responder's spec. The sampler backend is made once the team is loaded (``run_resolved``: its memory plan
    needs the team), and ``RunState`` is built with it."""

    cfg: Config
    resume_from: Path | None
    procs: OneProcess
    specs: list[AgentSpec]  # --agents, one per slot (a resumed team loads its checkpoint's agents instead)
    n_agents: int  # the team's size: len(specs), or the resumed checkpoint's team
    environment: Environment | None  # --env or --task env:NAME
    reward: Reward  # the team reward (``team_reward``)
    roles: Roles | None  # --roles or a reasoning-gym task's; None: the paper's, or a resumed team's own (team.json)
    responder: str | None  # the spec of the model the environment asks (``team_responder_spec``), if any


def resolve(cfg: Config) -> Resolved:
    """Presets, device, dtype and backend, then the run's inputs built and checked once (``validate_run_inputs``),
    then the processes that run Algorithm 1: one, or (under torchrun, or --shard-rollouts) ``Torchrun``, the one
    block that knows about it (it sets this rank's device and torchrun's defaults)."""
    check_episode_options(cfg)  # options given explicitly, before the preset fills the defaults
    cfg = cfg.apply_preset()
    cfg.validate()
    check_options(cfg)
    inputs = run_inputs(cfg)
    validate_run_inputs(inputs)
    cfg = inputs.cfg
    cfg = replace(cfg, threads=configure_threads(cfg.threads, cfg.device))
    if cfg.shard_rollouts or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        procs, cfg = Torchrun.join(cfg)
    else:
        procs, cfg = ONE_PROCESS, replace(cfg, shard_frozen=False)  # one process: nothing to shard
    return inputs._replace(cfg=cfg, procs=procs)


def run_inputs(cfg: Config) -> Resolved:
    """The run's inputs from its configuration, each built once (one process until ``resolve`` picks them); a
    missing file or name, or wrong arguments, of the environment or the reward is refused in seconds."""
    env = team_environment(cfg)
    if env is not None:  # T, resolved: the memory plan and config.json count the episode's rounds
        cfg = replace(cfg, max_rounds=env.max_rounds)
    resume_from = run_folder.latest_checkpoint(cfg.resume) if cfg.resume else None
    specs = parse_agents(cfg.agents)
    n_agents = team_size(resume_from) if resume_from is not None else len(specs)
    roles = None if cfg.resume else team_roles(cfg, len(specs))  # a resumed team keeps the roles in its checkpoint
    return Resolved(cfg, resume_from, ONE_PROCESS, specs, n_agents, env, team_reward(cfg, env), roles,
                    team_responder_spec(cfg, env))


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


def check_options(cfg: Config) -> None:
    """Checks across options, and of the packages they need, before anything is built (docs/errors.md)."""
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


def validate_run_inputs(inputs: Resolved) -> None:
    """Checks of the run's inputs, on disk and network, before any model is built (docs/errors.md)."""
    cfg = inputs.cfg
    if cfg.lora is not None and (cfg.shard_rollouts or int(os.environ.get("WORLD_SIZE", "1")) > 1):
        raise ValueError("--lora runs on one process: launch with python, not torchrun, and drop --shard-rollouts "
                         "(one GPU holds a team of adapters on a shared base: python -m scale.memory ... --lora R)")
    if inputs.resume_from is not None:
        check_resume_lora(inputs.resume_from, lora_settings(cfg.lora, cfg.lora_alpha, cfg.lora_targets))
    if cfg.upgrade and not cfg.resume:
        raise ValueError("--upgrade needs --resume RUN_DIR: plug-and-play replaces an agent of a trained team")
    for item in cfg.upgrade:
        check_hub_available(resolve_agent_spec(parse_upgrade(item, inputs.n_agents)[1]))
    if not cfg.resume:
        run_memory.check_team_ram(cfg, inputs.specs,  # CPU: a team too large for the RAM, before the hub
                                  parse_agents(inputs.responder)[0] if inputs.responder else None)
        for spec in inputs.specs:
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


def team_reward(cfg: Config, env: Environment | None) -> Reward:
    """The team reward: --reward (with an environment, its columns hold ``env_reward`` and ``transcript``), else
    the environment's own, else a reasoning-gym task's own scorer, else the built-in one
    (``harness.math_grading.DEFAULT_REWARD``)."""
    if cfg.reward:
        return load_reward(cfg.reward)
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


def build_team(inputs: Resolved, instruction: str) -> Team:
    """A new team of ``inputs.specs`` (tiny weights seeded per slot: ``harness.loading.agent_seed``), each agent
    loaded as the processes hold it, with the run's roles, reward, environment and responder."""
    cfg, procs, specs = inputs.cfg, inputs.procs, inputs.specs
    seeds = [agent_seed(cfg.seed, k) for k in range(len(specs))]
    agents = load_agents(specs, cfg.device, getattr(torch, cfg.dtype), seeds,
                         lora_settings(cfg.lora, cfg.lora_alpha, cfg.lora_targets),
                         lambda spec, device, dt, seed: procs.load_agent(load_agent, spec, device, dt, seed=seed))
    team = Team(agents, math_team_config(protocol=cfg.protocol, instruction=instruction, roles=inputs.roles,
                                         reward=inputs.reward, environment=inputs.environment))
    attach_responder(inputs, team)
    return team


def team_responder_spec(cfg: Config, env: Environment | None) -> str | None:
    """The responder's spec: --env-model, or a built-in game's --task-option responder=NAME (``responder_spec``);
    an --env-model the environment cannot ask is refused here, before any model loads."""
    game = env_game(cfg.task) if env is not None and not cfg.data else None
    return responder_spec(env, game_options(game, cfg.task_option, cfg.env_model) if game else {}, cfg.env_model)


def attach_responder(inputs: Resolved, team: Team, at_start: bool = True) -> None:
    """The responder model the team's environment asks (``inputs.responder``), held frozen in the team's config
    (never trained, never checkpointed: its spec is in the run's config): on the team's own weights where it can
    (``harness.responder``: a --lora base for the whole run; an agent of the same model, ``at_start``, until that
    agent first trains), else loaded once on the run's device (tiny weights: those of the slot after the team's
    last)."""
    cfg = inputs.cfg
    team.config.responder_max_tokens = cfg.env_model_max_tokens
    if inputs.responder:
        parsed = folder_spec(parse_agents(inputs.responder)[0])
        responder = (shared_responder(team, parsed, at_start, not distributed.active())
                     or load_agent(parsed, cfg.device, getattr(torch, cfg.dtype), seed=agent_seed(cfg.seed, len(team))))
        responder.model.requires_grad_(False)
        team.config.responder = responder


class Start(NamedTuple):
    """A run's team and state before its first stage (``start_team``); ``run_state`` adds the backend."""

    team: Team
    regions: dict[int, TrustRegion]  # each agent's trust region (``trust_regions_for``)
    value_heads: dict[int, torch.nn.Linear]
    rng: random.Random
    saved: dict  # what the checkpoint resumed from saved besides the run's state ({} for a new run)
    rows: list[dict]  # the metrics so far

    def run_state(self, backend, log) -> RunState:
        return RunState(self.team, self.regions, self.value_heads, self.rng, backend, log=log)


def start_team(inputs: Resolved, train: list[Problem], instruction: str, log) -> Start:
    """The run's team and state: from a checkpoint (the run's metrics of stages 0..k kept; its roles from its
    team.json, the reward and environment the run's), or new (tiny agents warm-started: it stands in for
    pretraining); every agent then on the run's processes."""
    cfg, procs, resume_from = inputs.cfg, inputs.procs, inputs.resume_from
    if resume_from is not None:
        team, state, rng, controllers = run_folder.load_checkpoint(resume_from, cfg.device, getattr(torch, cfg.dtype),
                                                                procs)
        team.config.reward, team.config.environment = inputs.reward, inputs.environment
        attach_responder(inputs, team, at_start=False)  # its agents have moved: only a --lora base is shared
        start, run_dir = state["stage"], run_folder.run_folder_of(resume_from) or Path(cfg.resume)
        rows = [r for r in run_folder.read_metrics(run_dir) if r["stage"] <= start]
        if [r["stage"] for r in rows] != list(range(start + 1)):
            raise ValueError(f"{run_dir / 'metrics.jsonl'} lacks the records of stages 0..{start} that {resume_from} "
                             "continues; resume from the run folder that holds both")
        log(f"resumed from {resume_from} at stage {start}")
    else:
        rng = seed_run(cfg.seed)
        team, state, rows = build_team(inputs, instruction), {}, []
        controllers = {}
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
    regions = trust_regions_for(cfg, len(team), controllers, state.get("step_sizes", {}))
    return Start(team, regions, value_heads, rng, state, rows)


def trust_regions_for(cfg: Config, n: int, controllers: dict | None = None,
                      saved_step_sizes: dict | None = None) -> dict[int, TrustRegion]:
    """Each agent's ``trust_region.TrustRegion`` at --delta, --quantile and --max-backtracks: its beta
    controller from a checkpoint (``controllers``) or new at --beta, its step rule from ``step_sizes_for``."""
    sizes = step_sizes_for(cfg, n, saved_step_sizes or {})
    controllers = controllers or {k: QuantileController(delta=cfg.delta, quantile=cfg.quantile, beta=cfg.beta)
                                  for k in range(n)}
    return {k: TrustRegion(cfg.delta, cfg.quantile, cfg.max_backtracks, controllers[k], sizes[k]) for k in range(n)}


def saved_trust_regions(run: RunState) -> tuple[dict, dict]:
    """(beta controllers, step sizes) by slot: the trust regions' state a checkpoint keeps."""
    return ({k: r.controller for k, r in run.regions.items()}, {k: r.step_size for k, r in run.regions.items()})


def step_sizes_for(cfg: Config, n: int, saved: dict) -> dict[int, StepSize]:
    """Each agent's ``step_rules.StepSize``: at --lr, or, when an adaptive run resumes with --step-size adaptive,
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


def team_size(resume_from: Path) -> int:
    """The number of agents of the team a checkpoint holds."""
    return len(json.loads((resume_from / "team" / "team.json").read_text())["agents"])


def seed_run(seed: int) -> random.Random:
    """Seed torch's and NumPy's global generators for a run; returns the run's own Python generator (the
    global ``random`` is left alone)."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    return random.Random(seed)


def run(cfg: Config, log=None) -> list[dict]:
    """Train a team with SAT; returns the metrics records (stage 0 = before training)."""
    return run_resolved(resolve(cfg), log)


def run_resolved(inputs: Resolved, log=None) -> list[dict]:
    """``run`` once ``resolve`` has built and checked the run's inputs and picked the processes: the problems and
    the checks on them, the team, the backend, then ``train_stages``."""
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    cfg, resume_from, procs, env = inputs.cfg, inputs.resume_from, inputs.procs, inputs.environment
    hf_logging.disable_progress_bar()
    log = (log or tqdm.write) if procs.main else (lambda *args: None)  # one process speaks and writes
    out = Path(cfg.out)
    resume_run = (run_folder.run_folder_of(resume_from) or Path(cfg.resume)) if resume_from is not None else None
    replaced = run_folder.check_out_folder(out, resume_run, cfg.overwrite)  # never write over another run's history
    procs.barrier()  # every process has looked before one writes anything
    train, heldout, instruction = load_problems(cfg)
    if (too_few := records.heldout_warning(len(heldout), cfg.eval_samples, cfg.delta_conf)) is not None:
        log(too_few)
    if env is not None:  # before any model is loaded: the environment's contract, then the reward's on its columns
        probe_environment(env, train, inputs.n_agents)
        log(opening_line(env, train[0]))
        log(EPISODE_CREDIT_LINE.format(name=env.name, baseline=cfg.baseline))
    check_reward(inputs.reward, train, inputs.n_agents, cfg.protocol, episode_columns(env))
    start = start_team(inputs, train, instruction, log)
    train_fraction = run_memory.check_run(cfg, start.team, log)  # a team that cannot fit: refused before any writing
    if procs.main:
        run_folder.clear_run_files(replaced)  # --overwrite: only now that the input is valid
    out.mkdir(parents=True, exist_ok=True)
    backend = make_team_backend(cfg.backend, start.team, cfg.seed, train_fraction=train_fraction,
                                tensor_parallel=cfg.vllm_tensor_parallel,
                                max_model_len=memory.run_max_len(cfg, len(start.team)))
    try:
        return train_stages(inputs, start.run_state(backend, log), train, heldout, start.saved, start.rows)
    finally:
        backend.close()


def train_stages(inputs: Resolved, run: RunState, train: list[Problem], heldout: list[Problem], saved: dict,
                 rows: list[dict]) -> list[dict]:
    """Plug-and-play upgrades, if asked for, then Algorithm 1's stages (``sat.run_stages``), each evaluated stage
    recorded by a ``RunRecorder``; the plot and the summary. ``saved``: what the checkpoint resumed from saved
    besides the run's state; ``rows``: the metrics so far (the stages run append theirs)."""
    cfg, team, log, start = inputs.cfg, run.team, run.log, saved.get("stage", 0)
    core = cfg.core()  # what Algorithm 1 reads
    sampling = core.sampling
    if run.backend.name == "hf":
        for agent in team.agents:
            check_sampler(agent, sampling)  # nothing but the tempered softmax, whatever the checkpoint ships
    if not cfg.device.startswith("cuda"):
        log(f"torch CPU threads: {cfg.threads} (--threads / $OMP_NUM_THREADS; default: every core for a real model, "
            "1 for the tiny team)")
    recorder = RunRecorder(cfg, run, rows, team.procs.describe(cfg.device), saved.get("baseline_eval"),
                           saved.get("pending_upgrades", []))  # held-out accuracy right after an upgrade, if any
    recorder.trackers = Trackers(parse_report_to(cfg.report_to) if team.procs.main else (),  # one process reports
                                 Path(cfg.out), asdict(cfg))
    try:
        if team.procs.main and team.config.roles is not None:
            save_roles(team.config.roles, Path(cfg.out))  # also in every checkpoint's team.json, which --resume reads
        if cfg.upgrade:  # once: config.json records no upgrade, so a later --resume does not repeat it
            recorder.baseline, recorder.pending = upgrade(cfg, core, run, train, heldout, start,
                                                          recorder.pending, rows[-1])
        for agent in team.agents:  # vLLM with sharded agents: each rank's engines take the shards now
            run.backend.sync(agent)
        if team.procs.main:
            write_config(cfg, inputs.specs, team, recorder.how)
        if rows:
            log(records.STAGE_HEADER)
        run_stages(run, train, heldout, core, sampling, start, recorder, new_run=not rows)
    finally:
        recorder.trackers.close()
    log_outcome(Path(cfg.out), rows, team.procs.main, log)
    return rows


def write_config(cfg: Config, specs: list[AgentSpec], team: Team, how: dict) -> None:
    """config.json: the run's options (what --resume reads), its agents as --agents would name the team after any
    upgrade, no upgrade left to repeat, and the processes and device."""
    names = [a.spec.name for a in team.agents]
    agents = cfg.agents if [s.name for s in specs] == names else ", ".join(names)
    run_folder.atomic_write(Path(cfg.out) / "config.json",
                            json.dumps({**asdict(cfg), "agents": agents, "upgrade": [], "upgrade_accept": "stage0",
                                        **how}, indent=2))


def log_outcome(out: Path, rows: list[dict], main: bool, log) -> None:
    """The run's plot (progress.png, once a stage has trained) and its closing lines."""
    if len(rows) > 1 and main:
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
        controllers, step_sizes = saved_trust_regions(run)
        run_folder.save_checkpoint(out, row["stage"], run.team, controllers, run.value_heads, run.rng, {},
                                   step_sizes=step_sizes)
        run.log(records.stage_line(row) if row["stage"] else records.stage_zero_line(row))


def upgrade(cfg: Config, core: SatConfig, run: RunState, train: list[Problem], heldout: list[Problem], start: int,
            pending: list, last_row: dict) -> tuple[dict, list]:
    """Plug-and-play (Section 5): every --upgrade SLOT=MODEL entering as --upgrade-accept says, the
    held-out accuracy after it, and a checkpoint of the upgraded team. With --upgrade-accept raw or certified
    each event also holds ``heldout_change``: the paired held-out certificate of the change from ``last_row``
    (the metrics row the run resumed from) to the team after this run's upgrades."""
    out, team, backend, sampling = Path(cfg.out), run.team, run.backend, core.sampling
    events = apply_upgrades(cfg, run, train, start, sampling,
                            lambda spec, slot: load_replacement(spec, cfg, team, train, slot),
                            evaluate=lambda t: evaluate(t, heldout, sampling, core, backend),
                            acceptance=acceptance_draws(cfg, core, train, heldout, backend))
    baseline = evaluate(team, heldout, sampling, core, backend)
    for event in events:
        event["eval_accuracy_after_stage0"] = baseline["eval_accuracy"]
        if "accept" in event:
            event["heldout_change"] = records.heldout_certificate(
                last_row, baseline, cfg.delta_conf, "the row before the upgrade", team.config.reward.range)
    if team.procs.main:
        run_folder.record_upgrades(out, events)
    pending = pending + events
    controllers, step_sizes = saved_trust_regions(run)
    run_folder.save_checkpoint(out, start, team, controllers, run.value_heads, run.rng,
                               {"baseline_eval": baseline, "pending_upgrades": pending}, suffix="_upgraded",
                               step_sizes=step_sizes)
    run.log(f"held-out team accuracy after Stage-0: {baseline['eval_accuracy']:.3f}")
    return baseline, pending


def acceptance_draws(cfg: Config, core: SatConfig, train: list[Problem], heldout: list[Problem],
                     backend) -> AcceptanceDraws | None:
    """``--upgrade-accept certified``'s splits (training problems only, none a held-out one asks) and how a team
    is drawn on them: ``sat.evaluate`` with one sample per row under the label's seeds; None for other rules."""
    if cfg.upgrade_accept != "certified":
        return None
    one_per_row = replace(core, eval_samples=1)
    return AcceptanceDraws(acceptance_splits(train, heldout, cfg.seed, cfg.upgrade_accept_rows),
                           lambda team, rows, label: evaluate(team, rows, core.sampling, one_per_row, backend,
                                                              label=label)["eval_rewards"])


def load_replacement(spec: str, cfg, team: Team, train: list[Problem], slot: int) -> Agent:
    """The new model for an upgraded slot (--shard-frozen: read straight into shards). A tiny spec gets its
    own (longer) warm start, standing in for a stronger pretrained model. With --lora: its base with a fresh
    adapter, the base shared with the team where an agent holds it (``lora.replacement_agent``)."""
    dtype = getattr(torch, cfg.dtype or ("float32" if cfg.device == "cpu" else "bfloat16"))
    seed = replacement_seed(cfg.seed, slot)
    steps = cfg.upgrade_warmup_steps if cfg.upgrade_warmup_steps is not None else 2 * cfg.warmup_steps

    def warm(agent: Agent) -> None:
        holder = Team(team.agents[:slot] + [agent] + team.agents[slot + 1 :], team.config)  # the slot's prompt format
        warm_start(holder, train, steps, cfg.warmup_p_wrong, cfg.seed + UPGRADE_WARM_START_OFFSET, slots=[slot])

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
