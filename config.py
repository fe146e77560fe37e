"""The run's configuration: one documented dataclass, its two presets, and the
checks that turn a bad option into one clear line before anything is loaded.

Presets: the tiny preset sizes Algorithm 1 for two CPU cores; the paper
preset holds the settings of the paper's Section 6.1 (lr 1e-5, G = 4,
temperature 0.8, 32k new tokens). Every error message here has its row in
docs/errors.md (tests/test_errors.py drives them). ``sat.py`` reads a Config
and runs Algorithm 1 with it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from records import latest_checkpoint
from rollout import TOP_P_TRAINING_ERROR, default_backend
from team import check_hub_available, parse_agents, resolve_agent_spec

ORDERS = ("static", "random", "greedy")
RATIOS = ("seq", "seq-mean", "token")
ADVANTAGES = ("grpo", "gae")
UPDATES = ("sequential", "joint")
DTYPES = ("float32", "bfloat16")  # bfloat16: the agent being trained keeps fp32 master weights (team.MasterWeightAdamW)
REUSES = ("weights", "regenerate")
BASELINES = ("counterfactual", "group")


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------
@dataclass
class Config:
    """Every knob of a run. ``None`` means "take the preset": the tiny preset
    when every agent is tiny, else the paper preset (paper, Section 6.1)."""

    agents: str = "tiny x3"  # "Qwen3-4B x3", "Qwen3-4B x2, Qwen3-8B", "tiny x3", local folders
    protocol: str = "independent"  # independent (majority vote) | chain (shared context)
    task: str | None = None  # arithmetic | dapo-math-17k | aime24 | math500 | ... (dataset by name)
    data: str | None = None  # a JSONL file of problems; overrides --task
    eval_data: str | None = None  # held-out JSONL; default: the task's held-out split
    stages: int | None = None
    order: str = "static"  # static | random | greedy (weakest agent on this batch first)
    ratio: str = "seq-mean"  # seq (the paper) | seq-mean (GSPO-style) | token (PPO)
    adv: str = "grpo"  # grpo (group-relative) | gae (token-level with a value head)
    baseline: str = "counterfactual"  # counterfactual (independent protocol: R - the vote with the agent's other answers) | group
    reuse: str | None = None  # weights (the paper: one rollout, truncated weights) | regenerate (redraw what a promotion changed)
    update: str = "sequential"  # sequential (SAT) | joint (all agents at once, no weights)
    delta: float | None = None  # trust-region radius on the per-state KL quantile
    quantile: float = 0.99  # 1 - alpha
    beta: float | None = None  # initial KL-penalty weight (adapted by the controller)
    lr: float | None = None
    group_size: int | None = None  # G joint trajectories per prompt
    batch_size: int | None = None  # joint trajectories per stage (prompts = batch_size / G)
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float = 1.0
    seed: int = 0
    out: str = "runs/sat"
    resume: str | None = None
    overwrite: bool = False  # replace a run already in --out (otherwise refused)
    device: str | None = None  # default: cuda if available else cpu
    dtype: str | None = None  # float32 | bfloat16 weights of every agent (default: bfloat16 on CUDA, float32 on CPU)
    backend: str | None = None  # hf | vllm (default: vllm when importable with CUDA, else hf)
    upgrade: list[str] = field(default_factory=list)  # "SLOT=MODEL", 1-based slots (plug-and-play)
    stage0_delta: float = 0.01  # Stage-0 radius delta_0 on the per-state KL quantile to the incumbent
    stage0_max_passes: int = 200  # passes over the Stage-0 states before giving up (a clear error)
    stage0_fit_tol: float | None = None  # Stage-0 stops once mean KL(target || pi_new) <= this x its start value (default 0.1)
    upgrade_warmup_steps: int | None = None  # warm start of a tiny replacement (default 2 x warmup_steps)
    stage0_problems: int | None = None  # Stage-0 prompts, a quarter held out (default batch_size // group_size)
    # optimisation details
    epochs: int | None = None  # passes over the batch per agent update
    minibatch_size: int | None = None  # joint trajectories per gradient step
    eps_clip: float = 0.2
    adv_clip: float = 5.0
    kl_estimator: str = "k3_new"  # k3_new is unbiased for KL(new || cur), the trust-region direction
    max_backtracks: int = 6
    gae_lambda: float = 0.95
    token_budget: int | None = None
    gradient_checkpointing: bool | None = None  # recompute activations in the backward pass (real models)
    share_prefix: bool | None = None  # teacher-forced forwards compute each distinct context once, in the turns where a minibatch computes fewer tokens so (default: on without gradient checkpointing; off under torchrun)
    keep_optimizer_state: bool | None = None  # keep each agent's AdamW moments (on the host) between its turns
    kl_check_every: int | None = None  # measure the exact KL quantile every k gradient steps and stop at delta (0: only at the end)
    eval_size: int | None = None
    # warm start (tiny agents only): stands in for pretraining
    warmup_steps: int | None = None
    warmup_p_wrong: float = 0.5
    # several processes (torchrun): rollouts in seeded blocks, so the batch does not depend on their number
    shard_rollouts: bool = False  # always on under torchrun; with one process it reproduces a torchrun run's batches
    rollout_blocks: int = 8  # blocks per rollout (each with its own seed); a multiple of the process count balances them
    shard_frozen: bool | None = None  # under torchrun: agents and the reference as FSDP2 shards (default: on on CUDA, unless --vllm-tensor-parallel > 1)
    offload_frozen: bool | None = None  # frozen agents in host memory during another agent's turn (default: on under torchrun on CUDA)
    vllm_tensor_parallel: int = 1  # --backend vllm: ranks per engine (1: one engine per agent per rank; K > 1: CUDA, external launcher)
    threads: int | None = None  # torch CPU threads (default: $OMP_NUM_THREADS, else 1; see configure_threads)

    def apply_preset(self) -> "Config":
        tiny = all(s.kind == "tiny" for s in parse_agents(self.agents))
        preset = TINY_PRESET if tiny else PAPER_PRESET
        for k, v in preset.items():
            if getattr(self, k) is None:
                setattr(self, k, v)
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.dtype is None:
            self.dtype = "float32" if self.device == "cpu" else "bfloat16"
        if self.backend is None:
            self.backend = default_backend(self.device)
        if self.share_prefix is None:  # from the options only, never the data: every rank makes as many model calls
            self.share_prefix = not self.gradient_checkpointing
        return self

    def validate(self) -> None:
        """One clear line per bad option; called before anything is loaded."""
        choices = {"protocol": ("independent", "chain"), "order": ORDERS, "ratio": RATIOS, "adv": ADVANTAGES,
                   "update": UPDATES, "reuse": REUSES, "baseline": BASELINES, "kl_estimator": ("k1", "k2", "k3", "k3_new"),
                   "backend": ("hf", "vllm"), "dtype": DTYPES}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)!r} is not one of: {', '.join(allowed)}")
        positive = ["lr", "group_size", "batch_size", "max_new_tokens", "temperature", "delta", "epochs",
                    "minibatch_size", "token_budget", "eval_size", "stage0_delta", "rollout_blocks"]
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 (got {getattr(self, name)})")
        if self.stage0_problems is not None and not self.stage0_problems >= 2:
            raise ValueError(f"--stage0-problems must be >= 2 (got {self.stage0_problems}): some fit, a quarter held out")
        if self.stage0_fit_tol is not None and not self.stage0_fit_tol > 0:
            raise ValueError(f"--stage0-fit-tol must be > 0 (got {self.stage0_fit_tol}): a share of the start value, e.g. 0.1")
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
        if self.share_prefix and self.gradient_checkpointing:
            raise ValueError("--share-prefix needs the key/value cache, which --gradient-checkpointing turns off: "
                             "add --no-gradient-checkpointing or --no-share-prefix")
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be >= 0 (got {self.warmup_steps})")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device} but CUDA is not available here: use --device cpu")
        validate_run_inputs(self)


def validate_run_inputs(cfg: "Config") -> None:
    """Checks across options, on disk and network, before any model is built (docs/errors.md)."""
    import importlib.util

    if cfg.group_size == 1 and cfg.adv == "grpo":
        raise ValueError("--group-size 1: every group-relative advantage (Eq. (2)) would be 0 and nothing would be "
                         "trained; use --group-size 2 or more (or --adv gae)")
    if cfg.vllm_tensor_parallel != 1:  # before any process group or engine: WORLD_SIZE is torchrun's
        from scale.vllm_ranks import check_tensor_parallel

        if cfg.backend != "vllm":
            raise ValueError("--vllm-tensor-parallel applies to the vLLM engines: add --backend vllm (or drop the option)")
        check_tensor_parallel(cfg.vllm_tensor_parallel, int(os.environ.get("WORLD_SIZE", "1")), cfg.device,
                              cfg.rollout_blocks, cfg.reuse)
    if cfg.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ValueError("--backend vllm but vLLM is not installed: pip install -r requirements-vllm.txt, or use --backend hf")
    if cfg.upgrade and not cfg.resume:
        raise ValueError("--upgrade needs --resume RUN_DIR: plug-and-play replaces an agent of a trained team")
    if cfg.upgrade:
        n_agents = len(json.loads((latest_checkpoint(cfg.resume) / "team" / "team.json").read_text())["agents"])
        for item in cfg.upgrade:
            slot, _, model = item.partition("=")
            if not slot.strip().isdigit() or not model.strip():
                raise ValueError(f"--upgrade {item!r}: write SLOT=MODEL with a 1-based slot, e.g. --upgrade 2=Qwen3-8B")
            if not 1 <= int(slot) <= n_agents:
                raise ValueError(f"--upgrade slot {int(slot)} is out of range: the team has agents 1..{n_agents}")
            check_hub_available(resolve_agent_spec(model))
    if not cfg.resume:
        for spec in parse_agents(cfg.agents):
            check_hub_available(spec)


# Tiny agents on the synthetic task, sized for two CPU cores.
TINY_PRESET = dict(task="arithmetic", reuse="weights", stages=40, delta=0.5, beta=0.01, lr=3e-4, group_size=8, batch_size=512,
                   max_new_tokens=4, temperature=1.0, epochs=4, minibatch_size=128, token_budget=1 << 16,
                   kl_check_every=2, keep_optimizer_state=False, gradient_checkpointing=False, eval_size=256, warmup_steps=300)
# The paper's settings for real models (Section 6.1: lr 1e-5, G = 4, temperature 0.8, 32k new tokens).
PAPER_PRESET = dict(task="dapo-math-17k", reuse="regenerate", stages=10, delta=0.05, beta=0.01, lr=1e-5, group_size=4, batch_size=512,
                    max_new_tokens=32768, temperature=0.8, epochs=1, minibatch_size=32, token_budget=1 << 16,
                    kl_check_every=0, keep_optimizer_state=False, gradient_checkpointing=True, eval_size=64, warmup_steps=0)
