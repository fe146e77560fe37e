"""SAT: Sequential Agent Tuning -- the stage loop (Algorithm 1) and the CLI.

A team of n LLMs is one factorized policy. Each stage rolls the team out once,
then updates the agents one at a time in an order sigma, each inside its own
KL trust region, with advantages reweighted by truncated importance weights of
the agents already updated in this stage (SAT.md sections 3 and 4).

    python sat.py                                     # tiny team, CPU, a few minutes
    python sat.py --protocol chain                    # agents speak in turn
    python sat.py --update joint                      # the baseline SAT argues against
    python sat.py --agents "Qwen3-4B x3"              # the paper preset on a GPU
    python sat.py --resume runs/sat                   # continue a run (more --stages)
    python sat.py --resume runs/sat --upgrade 2=tiny-6L --stages 12   # plug-and-play

Outputs in --out: metrics.jsonl (one object per stage), progress.png,
config.json, checkpoints/stage_XXXX (atomic; --resume picks the latest).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from advantage import (full_log_weights, gae, group_advantages, masked_mean, masked_sum,
                       truncated_log_weights, truncation_bias)
from rollout import (SamplingConfig, TeamBatch, Turn, left_pad, response_hidden_states,
                     right_pad, rollout, token_logprobs_from_hidden)
from tasks import (Problem, arithmetic_problems, load_problems, noisy_label)
from team import Agent, Team, TeamConfig, check_same_vocabulary, parse_agents
from trust_region import (QuantileController, backtracking_line_search, certificate, geometric_mixture_projection,
                          interpolate_parameters, kl_penalty, per_state_kl, quantile, stage_certificate)

ORDERS = ("static", "random", "greedy")
RATIOS = ("seq", "seq-mean", "token")
ADVANTAGES = ("grpo", "gae")
UPDATES = ("sequential", "joint")
BOXED_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------
@dataclass
class Config:
    """Every knob of a run. ``None`` means "take the preset": the tiny preset
    when every agent is tiny, else the paper preset (SAT.md section 1)."""

    agents: str = "tiny x3"  # "Qwen3-4B x3", "Qwen3-4B x2, Qwen3-8B", "tiny x3", local folders
    protocol: str = "independent"  # independent (majority vote) | chain (shared context)
    task: str | None = None  # arithmetic | dapo-math-17k | aime24 | math500 | ... (dataset by name)
    data: str | None = None  # a JSONL file of problems; overrides --task
    eval_data: str | None = None  # held-out JSONL; default: the task's held-out split
    stages: int | None = None
    order: str = "static"  # static | random | greedy (weakest agent on this batch first)
    ratio: str = "seq-mean"  # seq (the paper) | seq-mean (GSPO-style) | token (PPO)
    adv: str = "grpo"  # grpo (group-relative) | gae (token-level with a value head)
    resample: bool = False  # fresh rollouts after each agent's update (TeamTR's fix)
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
    device: str | None = None  # default: cuda if available else cpu
    backend: str | None = None  # hf | vllm (default: vllm when importable with CUDA, else hf)
    upgrade: list[str] = field(default_factory=list)  # "SLOT=MODEL", 1-based slots (plug-and-play)
    stage0_delta: float = 0.01  # Stage-0 radius delta_0 on the per-state KL quantile to the incumbent
    stage0_max_passes: int = 200  # passes over the Stage-0 states before giving up (a clear error)
    upgrade_warmup_steps: int | None = None  # warm start of a tiny replacement (default 2 x warmup_steps)
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
    keep_optimizer_state: bool | None = None  # keep each agent's AdamW moments (on the host) between its turns
    kl_check_every: int | None = None  # measure the exact KL quantile every k gradient steps and stop at delta (0: only at the end)
    eval_size: int | None = None
    # warm start (tiny agents only): stands in for pretraining
    warmup_steps: int | None = None
    warmup_p_wrong: float = 0.5

    def apply_preset(self) -> "Config":
        tiny = all(s.kind == "tiny" for s in parse_agents(self.agents))
        preset = TINY_PRESET if tiny else PAPER_PRESET
        for k, v in preset.items():
            if getattr(self, k) is None:
                setattr(self, k, v)
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.backend is None:
            self.backend = default_backend(self.device)
        return self

    def validate(self) -> None:
        """One clear line per bad option; called before anything is loaded."""
        choices = {"protocol": ("independent", "chain"), "order": ORDERS, "ratio": RATIOS, "adv": ADVANTAGES,
                   "update": UPDATES, "kl_estimator": ("k1", "k2", "k3", "k3_new"), "backend": ("hf", "vllm")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)!r} is not one of: {', '.join(allowed)}")
        positive = ["lr", "group_size", "batch_size", "max_new_tokens", "temperature", "delta", "epochs",
                    "minibatch_size", "token_budget", "eval_size", "stage0_delta"]
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 (got {getattr(self, name)})")
        if not 0 < self.quantile <= 1:
            raise ValueError(f"--quantile must be in (0, 1] (got {self.quantile})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1] (got {self.top_p})")
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
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be >= 0 (got {self.warmup_steps})")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device} but CUDA is not available here: use --device cpu")


# Tiny agents on the synthetic task, sized for two CPU cores (SAT.md section 9).
TINY_PRESET = dict(task="arithmetic", stages=40, delta=0.5, beta=0.01, lr=3e-4, group_size=8, batch_size=512,
                   max_new_tokens=4, temperature=1.0, epochs=4, minibatch_size=128, token_budget=1 << 16,
                   kl_check_every=2, keep_optimizer_state=False, gradient_checkpointing=False, eval_size=256, warmup_steps=300)
# The paper's settings for real models (SAT.md section 1; issue: the paper preset).
PAPER_PRESET = dict(task="dapo-math-17k", stages=10, delta=0.05, beta=0.01, lr=1e-5, group_size=4, batch_size=512,
                    max_new_tokens=32768, temperature=0.8, epochs=1, minibatch_size=32, token_budget=1 << 17,
                    kl_check_every=0, keep_optimizer_state=False, gradient_checkpointing=True, eval_size=64, warmup_steps=0)


def default_backend(device: str) -> str:
    if not device.startswith("cuda"):
        return "hf"
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "hf"
    return "vllm"


# ---------------------------------------------------------------------------
# Problems
# ---------------------------------------------------------------------------
def load_task(cfg: Config) -> tuple[list[Problem], list[Problem], str]:
    """(train problems, held-out problems, instruction appended to each problem)."""
    if cfg.data:
        train = load_problems(cfg.data)
        instruction = BOXED_INSTRUCTION
    elif cfg.task == "arithmetic":
        train = arithmetic_problems(4096, seed=cfg.seed, split="train")
        instruction = ""  # tiny agents answer "23+15" with "38"
    else:
        train = load_problems(cfg.task)
        instruction = BOXED_INSTRUCTION
    if cfg.eval_data:
        heldout = load_problems(cfg.eval_data)
    elif cfg.task == "arithmetic" and not cfg.data:
        heldout = arithmetic_problems(cfg.eval_size, seed=cfg.seed + 1, split="heldout")
    else:  # hold out the tail of the training set
        rng = random.Random(cfg.seed)
        train = train[:]
        rng.shuffle(train)
        n_eval = min(cfg.eval_size, max(1, len(train) // 10))
        train, heldout = train[n_eval:], train[:n_eval]
    return train, heldout[: cfg.eval_size], instruction


# ---------------------------------------------------------------------------
# Warm start: a short supervised phase standing in for pretraining
# ---------------------------------------------------------------------------
def warm_start(team: Team, problems: list[Problem], steps: int, p_wrong: float, seed: int, lr: float = 1e-3,
               batch: int = 64, slots: list[int] | None = None) -> None:
    """Teach tiny agents the answer format on labels that are wrong with
    probability ``p_wrong`` (off by 1, 2 or 10), so they start weak but not at
    zero reward: sparse exact-match reward needs a policy that sometimes
    samples the right answer (SAT.md section 9). Each agent sees its real
    prompt format (in the chain protocol: noisy earlier answers)."""
    from tqdm import tqdm

    rng = random.Random(seed)
    for k, agent in enumerate(team.agents):
        if agent.spec.kind != "tiny" or (slots is not None and k not in slots):
            continue
        opt = agent.start_training(lr)
        tok = agent.tokenizer
        for _ in tqdm(range(steps), desc=f"warm start agent {k + 1} (stands in for pretraining)", leave=False):
            items = [rng.choice(problems) for _ in range(batch)]
            contexts = [team.prompt_ids(k, p, [noisy_label(p.answer, rng, p_wrong) for _ in range(k)]) for p in items]
            targets = [tok(noisy_label(p.answer, rng, p_wrong), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                       for p in items]
            ctx, cmask = left_pad(contexts, tok.pad_token_id)  # [b, Lc]
            resp, rmask = right_pad(targets, tok.pad_token_id)  # [b, Lr]
            hidden = response_hidden_states(agent.model, ctx, cmask, resp, rmask)  # [b, Lr, H]
            logp = token_logprobs_from_hidden(agent.model, hidden, resp, 1.0)  # [b, Lr]
            loss = -masked_mean(logp, rmask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        agent.freeze()


# ---------------------------------------------------------------------------
# Value head (only for --adv gae)
# ---------------------------------------------------------------------------
def make_value_head(agent: Agent) -> torch.nn.Linear:
    hidden = agent.model.config.hidden_size
    head = torch.nn.Linear(hidden, 1).to(agent.device, torch.float32)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.constant_(head.bias, 0.5)  # a neutral prior for a {0, 1} reward
    return head


# ---------------------------------------------------------------------------
# One agent's update (the inner step of Algorithm 1)
# ---------------------------------------------------------------------------
def sequence_log_ratio(log_ratio_tok: torch.Tensor, mask: torch.Tensor, kind: str) -> torch.Tensor:
    """log r_j per trajectory: the sum (seq, the paper) or the mean (seq-mean,
    GSPO) of agent j's token log-ratios. [n, L] -> [n]"""
    total = masked_sum(log_ratio_tok, mask, dim=1)  # [n]
    if kind == "seq":
        return total
    return total / mask.sum(1).clamp_min(1)  # [n]


def clipped_surrogate(log_ratio_tok, mask, adv, kind: str, eps: float):
    """Per-trajectory PPO surrogate min(r A, clip(r, 1-eps, 1+eps) A) and the
    clipped indicator. ``adv`` is [n] (sequence) or [n, L] (token-level GAE).
    The log-ratio is capped at 20 before exp: beyond that the clipped branch
    is active anyway for A > 0, and exp would overflow for A < 0."""
    if kind == "token":
        a = adv if adv.dim() == 2 else adv[:, None].expand_as(log_ratio_tok)  # [n, L]
        r = log_ratio_tok.clamp(max=20).exp()  # [n, L]
        surr = torch.minimum(r * a, r.clamp(1 - eps, 1 + eps) * a)  # [n, L]
        clipped = ((r - 1).abs() > eps) & (mask > 0)  # [n, L]
        return masked_mean(surr, mask, dim=1), masked_sum(clipped.float(), mask, dim=1), r
    a = adv if adv.dim() == 1 else masked_mean(adv, mask, dim=1)  # [n]
    log_r = sequence_log_ratio(log_ratio_tok, mask, kind)  # [n]
    r = log_r.clamp(max=20).exp()  # [n]
    surr = torch.minimum(r * a, r.clamp(1 - eps, 1 + eps) * a)  # [n]
    clipped = ((r - 1).abs() > eps).float() * mask.sum(1)  # [n] counted per token for a token fraction
    return surr, clipped, r


@dataclass
class UpdateInputs:
    """What agent j's update needs from the batch."""

    turn: Turn
    adv: torch.Tensor  # [N] or [N, L] advantages (normalised, clipped)
    raw_adv: torch.Tensor  # [N] R - group mean, in reward units, for the certificate
    log_w: torch.Tensor  # [N] truncated log weights from earlier agents (0 for the first)
    log_w_full: torch.Tensor  # [N] untruncated, for zeta
    returns: torch.Tensor | None = None  # [N, L] value targets (gae)


def train_agents(team: Team, slots: list[int], inputs: dict[int, UpdateInputs], cfg: Config,
                 controllers: dict[int, QuantileController], value_heads: dict, references: dict) -> dict[int, dict]:
    """Optimise the clipped, weighted surrogate for the agents in ``slots``.

    Sequential SAT passes one slot; ``--update joint`` passes all of them, so
    every agent holds gradients and optimizer state at the same time (the
    memory cost SAT avoids). Returns per-slot training statistics."""
    stats = {j: {"loss": [], "clip_tokens": 0.0, "tokens": 0.0, "ratio": [], "grad_norm": [], "steps": 0,
                 "early_stopped": False} for j in slots}
    optimizers = {}
    for j in slots:
        head = value_heads.get(j) if cfg.adv == "gae" else None
        if head is not None:
            head.requires_grad_(True)
        optimizers[j] = team.agents[j].start_training(cfg.lr, extra_params=head.parameters() if head is not None else None)
        if cfg.gradient_checkpointing:
            team.agents[j].model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n = len(inputs[slots[0]].turn.texts)
    start = time.time()
    active = set(slots)
    # Last iterate known to lie inside the trust region (only kept when checking in the loop).
    inside = {j: [p.detach().clone() for p in team.agents[j].model.parameters()] for j in slots} if cfg.kl_check_every else {}
    steps = 0
    for _ in range(cfg.epochs):
        perm = torch.randperm(n)
        for s in range(0, n, cfg.minibatch_size):
            idx = perm[s : s + cfg.minibatch_size]
            for j in sorted(active):
                _gradient_step(team.agents[j], inputs[j], idx, cfg, controllers[j].beta, optimizers[j],
                               value_heads.get(j), stats[j])
                stats[j]["steps"] += 1
            steps += 1
            if cfg.kl_check_every and steps % cfg.kl_check_every == 0:
                # Early stop on the exact KL quantile (like PPO's target-KL stop, but on
                # the trust-region statistic itself): go back to the last inside iterate.
                for j in sorted(active):
                    kl, _ = measure_kl(team.agents[j], references[j], inputs[j].turn, cfg.temperature, cfg.token_budget)
                    if kl.numel() and quantile(kl, cfg.quantile) > cfg.delta:
                        # this step crossed the boundary: stop; the line search in
                        # finish_update backtracks from here toward the last inside iterate
                        stats[j]["early_stopped"] = True
                        active.discard(j)
                    else:
                        inside[j] = [p.detach().clone() for p in team.agents[j].model.parameters()]
            if not active:
                break
        if not active:
            break
    for j in slots:
        if cfg.gradient_checkpointing:
            team.agents[j].model.gradient_checkpointing_disable()
        team.agents[j].freeze(offload_optimizer=cfg.keep_optimizer_state)
        if cfg.adv == "gae":
            value_heads[j].requires_grad_(False)
        tokens = stats[j]["tokens"]
        stats[j] = {"loss": float(np.mean(stats[j]["loss"])), "clip_fraction": stats[j]["clip_tokens"] / max(tokens, 1),
                    "ratio_mean": float(np.mean(stats[j]["ratio"])), "ratio_min": float(np.min(stats[j]["ratio"])),
                    "ratio_max": float(np.max(stats[j]["ratio"])), "grad_norm": float(np.mean(stats[j]["grad_norm"])),
                    "train_tokens_per_s": tokens / max(time.time() - start, 1e-9), "inner_steps": stats[j]["steps"],
                    "early_stopped": stats[j]["early_stopped"], "anchor": inside.get(j)}
    return stats


def _gradient_step(agent: Agent, inp: UpdateInputs, idx: torch.Tensor, cfg: Config, beta: float, opt, value_head,
                   stats: dict) -> None:
    """One optimizer step on the minibatch ``idx``, accumulated over
    micro-batches of at most ``cfg.token_budget`` (context + response) tokens."""
    turn = inp.turn
    width = turn.context_ids.shape[1] + int(turn.response_mask[idx].sum(1).max())
    rows = max(1, cfg.token_budget // width)
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for s in range(0, len(idx), rows):
        micro = idx[s : s + rows]
        loss = _micro_batch_loss(agent, inp, micro, cfg, beta, value_head, stats) * (len(micro) / len(idx))
        loss.backward()
        total += loss.item()
    grad_norm = torch.nn.utils.clip_grad_norm_(agent.model.parameters(), 1.0)
    opt.step()
    stats["loss"].append(total)
    stats["grad_norm"].append(float(grad_norm))


def _micro_batch_loss(agent: Agent, inp: UpdateInputs, idx: torch.Tensor, cfg: Config, beta: float, value_head,
                      stats: dict) -> torch.Tensor:
    """-E[w * min(r A, clip(r) A)] + beta * KL penalty (+ value loss) on rows ``idx``."""
    turn, device = inp.turn, agent.device
    rmask = turn.response_mask[idx].to(device)  # [b, Lr]
    keep = rmask.sum(0) > 0
    rmask = rmask[:, keep]  # trim padding columns shared by the micro-batch
    ctx, cmask = turn.context_ids[idx].to(device), turn.context_mask[idx].to(device)  # [b, Lc]
    resp = turn.response_ids[idx][:, keep.cpu()].to(device)  # [b, Lr]
    behaviour = turn.behaviour_logprobs[idx][:, keep.cpu()].to(device)  # [b, Lr]
    hidden = response_hidden_states(agent.model, ctx, cmask, resp, rmask)  # [b, Lr, H]
    logp = token_logprobs_from_hidden(agent.model, hidden, resp, cfg.temperature)  # [b, Lr]
    log_ratio = (logp - behaviour) * rmask  # [b, Lr]
    adv = inp.adv[idx].to(device)
    if adv.dim() == 2:
        adv = adv[:, keep.cpu()]  # [b, Lr]
    surr, clipped, ratio = clipped_surrogate(log_ratio, rmask, adv, cfg.ratio, cfg.eps_clip)
    weights = inp.log_w[idx].to(device).exp()  # [b] truncated importance weights, <= 1
    policy_loss = -(weights * surr).mean()
    kl = masked_mean(kl_penalty(logp, behaviour, cfg.kl_estimator), rmask)
    loss = policy_loss + beta * kl
    if value_head is not None:  # token-level value regression toward the GAE returns
        values = value_head(hidden.float()).squeeze(-1)  # [b, Lr]
        loss = loss + 0.5 * masked_mean((values - inp.returns[idx][:, keep.cpu()].to(device)) ** 2, rmask)
    stats["clip_tokens"] += float(clipped.sum())
    stats["tokens"] += float(rmask.sum())
    stats["ratio"].append(ratio[rmask > 0].detach().float().mean().item() if ratio.dim() == 2 else ratio.detach().float().mean().item())
    return loss


@torch.no_grad()
def measure_kl(agent: Agent, reference, turn: Turn, temperature: float, token_budget: int):
    """Exact per-state KL(pi_j(.|s) || pi_j,cur(.|s)) at every position of agent
    j's responses, and the new log-probabilities of the sampled tokens, from
    one forward of each model (SAT.md section 3: exact, not a sampled proxy).
    Returns (per_state_kl [M], new_logprobs [N, Lr])."""
    model, device = agent.model, agent.device
    width = turn.context_ids.shape[1] + turn.response_ids.shape[1]
    rows = max(1, token_budget // width)
    kls, new_logp = [], torch.zeros_like(turn.behaviour_logprobs)  # [N, Lr]
    for s in range(0, len(turn.texts), rows):
        sl = slice(s, s + rows)
        args = [t[sl].to(device) for t in (turn.context_ids, turn.context_mask, turn.response_ids, turn.response_mask)]
        mask = args[3].bool()  # [b, Lr]
        h_new = response_hidden_states(model, *args)[mask]  # [M_b, H] valid positions only
        h_cur = response_hidden_states(reference, *args)[mask]  # [M_b, H]
        head_new, head_cur = model.get_output_embeddings(), reference.get_output_embeddings()
        targets = args[2][mask]  # [M_b]
        lp_rows = []
        for c in range(0, h_new.shape[0], 1024):  # chunk rows: [1024, V] logits at a time
            logits_new = head_new(h_new[c : c + 1024]).float()  # [c, V]
            kls.append(per_state_kl(logits_new, head_cur(h_cur[c : c + 1024]).float(), temperature=temperature).cpu())
            lp = F.log_softmax(logits_new / temperature, -1).gather(-1, targets[c : c + 1024, None]).squeeze(-1)
            lp_rows.append(lp.cpu())
        block = torch.zeros(mask.shape)  # [b, Lr]
        block[mask.cpu()] = torch.cat(lp_rows) if lp_rows else torch.zeros(0)
        new_logp[sl] = block
    return torch.cat(kls) if kls else torch.zeros(0), new_logp


# ---------------------------------------------------------------------------
# Advantages for agent j at step i
# ---------------------------------------------------------------------------
def build_inputs(batch: TeamBatch, j: int, cached_log_ratios: list[tuple[torch.Tensor, torch.Tensor]], cfg: Config,
                 model=None, value_head=None) -> UpdateInputs:
    """Sequence-aware weights and advantages for the agent updated at this step.

    w(tau) = prod over the tokens of agents already updated this stage of
    min(1, rho_t), from their cached log-ratios (empty for the first agent, with
    --resample, and with --update joint). Group advantages use w as weights, so
    the baseline is an estimate under pi_hat_{i-1}, not under the stale pi_cur."""
    n = len(batch)
    log_w = truncated_log_weights(cached_log_ratios, batch_size=n).float()  # [N]
    log_w_full = full_log_weights(cached_log_ratios, batch_size=n).float()  # [N]
    weights = log_w.exp()  # [N]
    adv = group_advantages(batch.rewards, batch.group_ids, clip=cfg.adv_clip, weights=weights).float()  # [N]
    raw_adv = group_advantages(batch.rewards, batch.group_ids, clip=None, weights=weights, normalize=False).float()  # [N]
    turn = batch.turns[j]
    returns = None
    if cfg.adv == "gae":
        with torch.no_grad():
            values = torch.zeros_like(turn.behaviour_logprobs)  # [N, Lr]
            agent_device = value_head.weight.device
            for s in range(0, n, cfg.minibatch_size):
                sl = slice(s, s + cfg.minibatch_size)
                args = [t[sl].to(agent_device) for t in (turn.context_ids, turn.context_mask, turn.response_ids, turn.response_mask)]
                hidden = response_hidden_states(model, *args)  # [b, Lr, H]
                values[sl] = value_head(hidden.float()).squeeze(-1).cpu() * turn.response_mask[sl]
        mask = turn.response_mask.float()  # [N, Lr]
        last = (mask.sum(1) - 1).clamp_min(0).long()  # [N] index of the final token
        token_rewards = torch.zeros_like(mask).scatter_(1, last[:, None], batch.rewards[:, None].float()) * mask  # [N, Lr]
        tok_adv, returns = gae(token_rewards, values, mask, gamma=1.0, lam=cfg.gae_lambda)
        # whiten over valid tokens, then clip like the group advantages
        mean = masked_mean(tok_adv, mask)
        std = (masked_mean((tok_adv - mean) ** 2, mask)).sqrt()
        adv = (((tok_adv - mean) / (std + 1e-6)).clamp(-cfg.adv_clip, cfg.adv_clip) * mask).float()  # [N, Lr]
    return UpdateInputs(turn, adv, raw_adv, log_w, log_w_full, returns)


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


# ---------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------
@torch.no_grad()
def evaluate(team: Team, problems: list[Problem], sampling: SamplingConfig) -> dict:
    """Held-out team accuracy (one joint sample per problem at the training
    temperature: the policy being trained), and each agent's own accuracy."""
    batch = rollout(team, problems, 1, sampling, score=False)
    acc = float(batch.rewards.mean())
    return {"eval_accuracy": acc, "eval_stderr": math.sqrt(max(acc * (1 - acc), 1e-12) / len(batch)),
            "eval_agent_accuracy": batch.agent_correct.mean(1).tolist()}


# ---------------------------------------------------------------------------
# GPU backend hooks (no-ops with the HF backend)
# ---------------------------------------------------------------------------
def vllm_after_rollout(team: Team, batch: TeamBatch, sampling: SamplingConfig):
    """Put the engines to sleep before training; return the sampler-vs-trainer
    log-prob health metric per agent."""
    if sampling.backend != "vllm":
        return None
    import rollout_vllm

    rollout_vllm.sleep_all()
    health = []
    for agent, turn in zip(team.agents, batch.turns):
        vllm_lp = rollout_vllm.last_logprobs(agent)
        health.append(None if vllm_lp is None else rollout_vllm.logprob_health(vllm_lp, turn.behaviour_logprobs, turn.response_mask))
    return health


def vllm_sync(agent: Agent, sampling: SamplingConfig) -> None:
    if sampling.backend == "vllm":
        import rollout_vllm

        rollout_vllm.sync_weights(agent)


def memory_check(cfg: Config, team: Team, log) -> None:
    """On CUDA: print what each phase needs against what the GPU has, and
    refuse with a clear message if it cannot fit."""
    if not cfg.device.startswith("cuda"):
        return
    import memory

    biggest = max(team.agents, key=lambda a: sum(p.numel() for p in a.model.parameters()))
    seq = 1024 + cfg.max_new_tokens  # prompt allowance + response
    est = memory.estimate_memory(biggest.model.config, len(team), cfg.update,
                                 micro_batch_tokens=min(cfg.token_budget, cfg.minibatch_size * seq),
                                 max_seq_len=seq, gradient_checkpointing=cfg.gradient_checkpointing, backend=cfg.backend,
                                 rollout_tokens=cfg.token_budget, logits_chunk_tokens=4096)
    available = memory.available_bytes(cfg.device)
    log(memory.format_table(est, available))
    if available is not None:
        memory.check_fits(est, available)
    if cfg.backend == "vllm":
        import rollout_vllm

        rollout_vllm.configure(n_engines=len(team), train_fraction=min(0.9, est["peak_training"] / max(available or 1, 1)),
                               seed=cfg.seed, health_logprobs=True)


# ---------------------------------------------------------------------------
# One SAT stage (Algorithm 1)
# ---------------------------------------------------------------------------
def sat_stage(team: Team, problems: list[Problem], cfg: Config, sampling: SamplingConfig,
              controllers: dict[int, QuantileController], value_heads: dict, rng: random.Random, pbar=None) -> dict:
    n_agents = len(team)
    t0 = time.time()
    batch = rollout(team, problems, cfg.group_size, sampling)
    rollout_seconds = time.time() - t0
    health = vllm_after_rollout(team, batch, sampling)
    record = {"team_reward": float(batch.rewards.mean()), "agent_reward": batch.agent_correct.mean(1).tolist(),
              "rollout_tokens_per_s": batch.num_tokens / max(rollout_seconds, 1e-9),
              "truncated_fraction": float(torch.stack([t.truncated.float() for t in batch.turns]).mean()),
              "mean_response_tokens": batch.num_tokens / (len(batch) * n_agents)}
    if health is not None:  # mean |log pi_vllm - log pi_train| per agent: sampler numerics, never in the ratios
        record["vllm_logprob_abs_diff"] = health
    sigma = order_agents(batch, n_agents, cfg.order, rng)
    record["order"] = [k + 1 for k in sigma]
    gamma = 0.0 if team.protocol == "independent" else 1.0 - 1.0 / n_agents
    cached: list[tuple[torch.Tensor, torch.Tensor]] = []  # log rho of promoted agents (this stage)
    agent_records: list[dict] = [None] * n_agents
    if cfg.update == "joint":
        inputs = {j: build_inputs(batch, j, [], cfg, team.agents[j].model, value_heads.get(j)) for j in sigma}
        references = {j: copy.deepcopy(team.agents[j].model) for j in sigma}
        train_stats = train_agents(team, sigma, inputs, cfg, controllers, value_heads, references)
        for j in sigma:
            agent_records[j] = finish_update(team, j, references.pop(j), inputs[j], train_stats[j], cfg, controllers[j],
                                             sampling, gamma, n_agents, len(batch))[0]
            vllm_sync(team.agents[j], sampling)
    else:
        for i, j in enumerate(sigma):
            if pbar is not None:
                pbar.set_postfix_str(f"agent {j + 1} ({i + 1}/{n_agents})")
            inputs = build_inputs(batch, j, cached, cfg, team.agents[j].model, value_heads.get(j))
            reference = copy.deepcopy(team.agents[j].model)  # pi_j,cur, frozen
            stats = train_agents(team, [j], {j: inputs}, cfg, controllers, value_heads, {j: reference})[j]
            agent_records[j], new_logp = finish_update(team, j, reference, inputs, stats, cfg, controllers[j],
                                                       sampling, gamma, n_agents, len(batch))
            del reference
            vllm_sync(team.agents[j], sampling)  # the engine samples from the promoted weights from now on
            if cfg.resample and i < n_agents - 1:
                batch = rollout(team, problems, cfg.group_size, sampling)  # behaviour = pi_hat_i: no weights
                vllm_after_rollout(team, batch, sampling)
                cached = []
            else:  # cache log rho on agent j's tokens for the later agents' weights
                turn = batch.turns[j]
                cached.append(((new_logp - turn.behaviour_logprobs) * turn.response_mask, turn.response_mask))
    record["agents"] = agent_records
    record["certificate"] = stage_certificate([a["certificate"] for a in agent_records])
    record["seconds"] = time.time() - t0
    return record


def finish_update(team, j, reference, inputs: UpdateInputs, stats: dict, cfg: Config, controller: QuantileController,
                  sampling: SamplingConfig, gamma: float, n_agents: int, n_samples: int):
    """Trust-region check with backtracking, controller update, certificate.

    The step found by the optimiser is theta_new; if the (1-alpha) quantile of
    the exact per-state KL exceeds delta, try theta_cur + f (theta_new -
    theta_cur) for f = 1/2, 1/4, ...; after the budget, restore theta_cur
    (reject). A violating step is never kept."""
    agent, turn = team.agents[j], inputs.turn
    params = list(agent.model.parameters())
    # Backtrack from the proposal toward the anchor: pi_j,cur itself, or the last
    # iterate that the in-loop check measured inside the ball (--kl-check-every).
    anchor = stats.pop("anchor", None)
    moved_inside = anchor is not None and any(not torch.equal(a, r) for a, r in zip(anchor, reference.parameters()))
    cur = anchor if anchor is not None else [p.detach().clone() for p in reference.parameters()]
    new = [p.detach().clone() for p in params]
    measured = {}

    def apply_step(frac: float) -> None:
        interpolate_parameters(params, cur, new, frac)

    def measure() -> float:
        kl, logp = measure_kl(agent, reference, turn, cfg.temperature, cfg.token_budget)
        measured.update(kl=kl, logp=logp)
        return quantile(kl, cfg.quantile) if kl.numel() else 0.0

    search = backtracking_line_search(apply_step, measure, cfg.delta, max_backtracks=cfg.max_backtracks)
    if not search["accepted"] and moved_inside:  # the anchor is a measured inside step: keep it
        search.update(accepted=True, kl_quantile=measure())
    elif not search["accepted"]:  # pi_cur restored: KL 0, new log-probs = behaviour
        measured = {"kl": torch.zeros(1), "logp": turn.behaviour_logprobs.clone()}
    beta_used = controller.beta
    # beta reacts to the step that is kept (a rejection counts as a violation). Not to
    # the raw proposal: with --kl-check-every the proposal crosses delta by design.
    controller.update(search["kl_quantile"] if search["accepted"] else math.inf)
    kl, new_logp = measured["kl"], measured["logp"]
    mask = turn.response_mask
    log_ratio_tok = (new_logp - turn.behaviour_logprobs) * mask  # [N, Lr]
    log_r_seq = masked_sum(log_ratio_tok, mask, dim=1).clamp(-20, 20)  # [N] sequence ratio of the accepted step
    w = inputs.log_w.exp()  # [N]
    surrogate = float((w * (log_r_seq.exp() - 1) * inputs.raw_adv).mean())  # E_new[A] - E_cur[A], reward units
    zeta = truncation_bias(inputs.log_w_full, inputs.log_w, log_r_seq.exp(), inputs.raw_adv)
    # turn-level KL: the response is the agent's action, so its per-state KL is
    # the sum of the token-level KLs along the response (estimated on sampled paths)
    seq_kl = torch.zeros(len(mask))
    if search["accepted"] and kl.numel() == int(mask.sum()):
        seq_kl = torch.zeros(mask.shape).masked_scatter_(mask.bool(), kl).sum(1)  # [N]
    cert = certificate(surrogate, float(seq_kl.max()), float(inputs.raw_adv.abs().max()), gamma, zeta=zeta,
                       n_samples=n_samples, n_agents=n_agents)
    record = {"agent": j + 1, "kl_mean": float(kl.mean()), "kl_quantile": search["kl_quantile"], "kl_max": float(kl.max()),
              "delta": cfg.delta, "beta": beta_used, "beta_next": controller.beta, "backtracks": search["backtracks"],
              "accepted": search["accepted"], "step_fraction": search["fraction"], "surrogate": surrogate,
              "zeta": zeta, "N": n_samples, "ess": float(w.sum() ** 2 / (w ** 2).sum()), "seq_kl_max": float(seq_kl.max()),
              "certificate": cert, **stats}
    return record, new_logp


# ---------------------------------------------------------------------------
# Plug-and-play: Stage-0 alignment (SAT.md section 5)
# ---------------------------------------------------------------------------
def state_logprobs(model, turn: Turn, rows: slice, temperature: float) -> torch.Tensor:
    """Full-vocabulary log pi(.|s) at every valid response position of ``rows``. [M, V]"""
    device = next(model.parameters()).device
    args = [t[rows].to(device) for t in (turn.context_ids, turn.context_mask, turn.response_ids, turn.response_mask)]
    hidden = response_hidden_states(model, *args)[args[3].bool()]  # [M, H]
    return F.log_softmax(model.get_output_embeddings()(hidden).float() / temperature, dim=-1)  # [M, V]


STAGE0_MARGIN = 0.5  # Stage-0 trains toward the projection onto the ball of radius 0.5 * delta_0


def stage0_align(team: Team, slot: int, new_agent: Agent, problems: list[Problem], cfg: Config,
                 sampling: SamplingConfig, lr: float, log) -> dict:
    """Bring ``new_agent`` inside the per-state KL ball of radius delta_0 around
    the incumbent of ``slot``, on the team's current states (the stopping
    test uses delta_0; the training target uses STAGE0_MARGIN * delta_0).

    States: every position of the incumbent's responses in fresh rollouts of
    the trained team. Each pass trains the new model toward the exact
    geometric-mixture projection of itself onto the ball (pi_new ~ pi^(1/(1+l))
    pi_cur^(l/(1+l)), lambda by bisection per state; trust_region), minimising
    KL(projection || pi_new), until the (1-alpha) quantile of KL(pi_new ||
    pi_cur) over those states is <= delta_0. Gives up with a clear error after
    ``cfg.stage0_max_passes`` passes rather than letting an unaligned model in."""
    incumbent = team.agents[slot]
    batch = rollout(team, problems, cfg.group_size, sampling)  # the trained team's states
    turn = batch.turns[slot]
    delta0 = cfg.stage0_delta
    opt = new_agent.start_training(lr)
    rows_per_step = max(1, cfg.minibatch_size)
    history = []
    mean_lambda = 0.0  # no training pass: pi_pre already inside, lambda = 0 at every state
    for passes in range(cfg.stage0_max_passes + 1):
        kl, _ = measure_kl(new_agent, incumbent.model, turn, cfg.temperature, cfg.token_budget)
        q = quantile(kl, cfg.quantile)
        history.append(q)
        if q <= delta0:
            break
        if passes == cfg.stage0_max_passes:
            raise RuntimeError(f"Stage-0 could not bring agent {slot + 1} ('{new_agent.spec.name}') inside delta_0={delta0}: "
                               f"KL quantile still {q:.4f} after {passes} passes; raise --stage0-delta or --stage0-max-passes")
        lambdas = []
        for s in range(0, len(batch), rows_per_step):
            rows = slice(s, s + rows_per_step)
            with torch.no_grad():
                logp_cur = state_logprobs(incumbent.model, turn, rows, cfg.temperature)  # [M, V]
            logp_new = state_logprobs(new_agent.model, turn, rows, cfg.temperature)  # [M, V]
            # aim at half the radius: the projection of a model just outside delta_0 sits
            # on the boundary and gives a vanishing gradient; a margin ends Stage-0 in few passes
            target, lam = geometric_mixture_projection(logp_new.detach(), logp_cur, STAGE0_MARGIN * delta0)  # [M, V], [M]
            loss = (target.exp() * (target - logp_new)).sum(-1).mean()  # KL(projection || pi_new)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            lambdas.append(lam[torch.isfinite(lam)])
        mean_lambda = float(torch.cat(lambdas).mean()) if lambdas else 0.0
        if passes % 10 == 0:
            log(f"  stage-0 pass {passes}: KL quantile {q:.4f} (delta_0 {delta0}), mean lambda {mean_lambda:.3f}")
    new_agent.freeze()
    # mean_lambda: of the last training pass's projection targets (no extra forward for the log)
    return {"kl_quantile": history[-1], "kl_quantile_before": history[0], "passes": passes, "states": int(turn.response_mask.sum()),
            "mean_lambda": mean_lambda, "delta0": delta0}


def load_replacement(spec: str, cfg: Config, team: Team, train: list[Problem], slot: int) -> Agent:
    """The new model for an upgraded slot. A tiny spec gets its own (longer)
    warm start, standing in for a stronger pretrained model."""
    dtype = torch.float32 if cfg.device == "cpu" else torch.bfloat16
    agent = Agent.load(spec, device=cfg.device, dtype=dtype, seed=cfg.seed * 100 + 50 + slot)
    if agent.spec.kind == "tiny":
        steps = cfg.upgrade_warmup_steps if cfg.upgrade_warmup_steps is not None else 2 * cfg.warmup_steps
        holder = Team(list(team.agents), team.config)  # the slot's own prompt format (chain: earlier answers)
        holder.agents[slot] = agent
        warm_start(holder, train, steps, cfg.warmup_p_wrong, cfg.seed + 7, slots=[slot])
    return agent


def apply_upgrades(cfg: Config, team: Team, train: list[Problem], stage: int, sampling: SamplingConfig,
                   controllers: dict, rng: random.Random, log) -> list[dict]:
    """Replace the agents named by --upgrade SLOT=MODEL, each after Stage-0."""
    events = []
    for item in cfg.upgrade:
        slot_text, _, spec = item.partition("=")
        if not slot_text.strip().isdigit() or not spec.strip():
            raise ValueError(f"--upgrade {item!r}: write SLOT=MODEL with a 1-based slot, e.g. --upgrade 2=Qwen3-8B")
        slot = int(slot_text) - 1
        if not 0 <= slot < len(team):
            raise ValueError(f"--upgrade slot {slot + 1} is out of range: the team has agents 1..{len(team)}")
        new_agent = load_replacement(spec.strip(), cfg, team, train, slot)
        old_name = team.agents[slot].spec.name
        check_same_vocabulary(team.agents[slot], new_agent)
        prompts = [train[rng.randrange(len(train))] for _ in range(cfg.batch_size // cfg.group_size)]
        log(f"upgrade: agent {slot + 1} '{old_name}' -> '{new_agent.spec.name}', Stage-0 alignment (delta_0 = {cfg.stage0_delta})")
        t0 = time.time()
        stage0 = stage0_align(team, slot, new_agent, prompts, cfg, sampling, lr=cfg.lr, log=log)
        incumbent = team.swap(slot, new_agent)
        if cfg.backend == "vllm":
            import rollout_vllm

            rollout_vllm.release(incumbent)
        controllers[slot] = QuantileController(delta=cfg.delta, quantile=cfg.quantile, beta=cfg.beta)
        event = {"slot": slot + 1, "from": old_name, "to": new_agent.spec.name, "at_stage": stage,
                 "seconds": time.time() - t0, "stage0": stage0}
        log(f"  stage-0 done: KL quantile {stage0['kl_quantile_before']:.4f} -> {stage0['kl_quantile']:.4f} in "
            f"{stage0['passes']} passes over {stage0['states']} states, mean lambda {stage0['mean_lambda']:.3f}")
        events.append(event)
    return events


# ---------------------------------------------------------------------------
# Checkpoints (atomic) and metrics
# ---------------------------------------------------------------------------
def save_checkpoint(out: Path, stage: int, team: Team, controllers, value_heads, rng: random.Random, extra: dict,
                    suffix: str = "") -> Path:
    """Write checkpoints/stage_XXXX via a temporary folder and a rename, then
    point latest.json at it (also via rename): a crash leaves the previous
    checkpoint intact."""
    root = out / "checkpoints"
    final = root / f"stage_{stage:04d}{suffix}"
    tmp = root / f".stage_{stage:04d}{suffix}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    team.save(tmp / "team")
    state = {"stage": stage, "controllers": {k: c.state_dict() for k, c in controllers.items()},
             "value_heads": {k: v.state_dict() for k, v in value_heads.items()},
             "python_rng": rng.getstate(), "torch_rng": torch.get_rng_state(),
             "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
             "numpy_rng": np.random.get_state(),
             "optimizers": {k: a.saved_optimizer_state for k, a in enumerate(team.agents) if a.saved_optimizer_state is not None},
             **extra}
    torch.save(state, tmp / "state.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _atomic_write(out / "latest.json", json.dumps({"stage": stage, "path": final.name}))
    for old in sorted(root.glob("stage_*"))[:-2]:  # keep the last two
        shutil.rmtree(old, ignore_errors=True)
    return final


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def latest_checkpoint(run_dir: str | Path) -> Path:
    """A run folder (uses latest.json) or a stage folder itself."""
    run_dir = Path(run_dir)
    if (run_dir / "state.pt").exists():
        return run_dir
    pointer = run_dir / "latest.json"
    if not pointer.exists():
        raise FileNotFoundError(f"no checkpoint in '{run_dir}': expected latest.json written by sat.py (or a checkpoints/stage_XXXX folder)")
    return run_dir / "checkpoints" / json.loads(pointer.read_text())["path"]


def read_metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_metrics(out: Path, records: list[dict]) -> None:
    _atomic_write(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))


def plot_run(out: Path, records: list[dict]) -> None:
    """progress.png: team reward and held-out accuracy per stage; certificate terms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = [r["stage"] for r in records if r["stage"] > 0]
    trained = [r for r in records if r["stage"] > 0]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot([r["stage"] for r in records], [r["eval_accuracy"] for r in records], "o-", label="held-out team accuracy")
    ax1.plot(stages, [r["team_reward"] for r in trained], "s--", label="team reward (rollouts)")
    for k in range(len(records[-1]["eval_agent_accuracy"])):
        ax1.plot([r["stage"] for r in records], [r["eval_agent_accuracy"][k] for r in records], ":", alpha=0.6, label=f"agent {k + 1} alone")
    ax1.set_xlabel("stage")
    ax1.set_ylabel("accuracy")
    ax1.set_ylim(0, 1)
    ax1.legend(fontsize=8)
    ax1.set_title("SAT progress")
    for key in ("gain", "occupancy_penalty", "bias_penalty", "sample_penalty", "lower_bound"):
        ax2.plot(stages, [r["certificate"][key] for r in trained], "o-", label=key)
    ax2.plot(stages, [r["measured_change"] for r in trained], "k*", label="measured change (held-out)")
    ax2.axhline(0, color="grey", lw=0.5)
    ax2.set_xlabel("stage")
    ax2.set_title("stage certificate (reward units)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "progress.png", dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------
def seed_everything(seed: int) -> random.Random:
    torch.manual_seed(seed)
    np.random.seed(seed)
    return random.Random(seed)


def build_team(cfg: Config, instruction: str) -> Team:
    dtype = torch.float32 if cfg.device == "cpu" else torch.bfloat16
    agents = [Agent.load(spec, device=cfg.device, dtype=dtype, seed=cfg.seed * 100 + k) for k, spec in enumerate(parse_agents(cfg.agents))]
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
    out.mkdir(parents=True, exist_ok=True)
    train, heldout, instruction = load_task(cfg)
    sampling = SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                              token_budget=cfg.token_budget, backend=cfg.backend)
    dtype = torch.float32 if cfg.device == "cpu" else torch.bfloat16
    if resume_from is not None:
        team = Team.load(resume_from / "team", device=cfg.device, dtype=dtype)
        state = torch.load(resume_from / "state.pt", weights_only=False)
        rng = random.Random()
        rng.setstate(state["python_rng"])
        torch.set_rng_state(state["torch_rng"])
        np.random.set_state(state["numpy_rng"])
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        controllers = {int(k): QuantileController(**v) for k, v in state["controllers"].items()}
        for k, opt_state in state.get("optimizers", {}).items():
            team.agents[int(k)].saved_optimizer_state = opt_state
        start = state["stage"]
        records = [r for r in read_metrics(Path(cfg.resume)) if r["stage"] <= start]
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
    value_heads = {}
    if cfg.adv == "gae":
        for k, agent in enumerate(team.agents):
            value_heads[k] = make_value_head(agent)
            if str(k) in state.get("value_heads", {}) or k in state.get("value_heads", {}):
                value_heads[k].load_state_dict(state["value_heads"].get(k, state["value_heads"].get(str(k))))
    memory_check(cfg, team, log)
    baseline = state.get("baseline_eval")  # held-out accuracy right after an upgrade, if any
    pending_upgrades = state.get("pending_upgrades", [])  # recorded in the next stage's metrics
    if cfg.upgrade:
        if resume_from is None:
            raise ValueError("--upgrade needs --resume RUN_DIR: plug-and-play replaces an agent of a trained team")
        events = apply_upgrades(cfg, team, train, start, sampling, controllers, rng, log)
        for event in events:  # a new model gets a fresh value head
            if cfg.adv == "gae":
                value_heads[event["slot"] - 1] = make_value_head(team.agents[event["slot"] - 1])
        baseline = evaluate(team, heldout, sampling)
        for event in events:
            event["eval_accuracy_after_stage0"] = baseline["eval_accuracy"]
        history = json.loads((out / "upgrades.json").read_text()) if (out / "upgrades.json").exists() else []
        _atomic_write(out / "upgrades.json", json.dumps(history + events, indent=2))
        pending_upgrades = pending_upgrades + events
        cfg.agents = ", ".join(a.spec.name for a in team.agents)
        cfg.upgrade = []  # done: a later --resume must not upgrade again
        save_checkpoint(out, start, team, controllers, value_heads, rng,
                        {"baseline_eval": baseline, "pending_upgrades": pending_upgrades}, suffix="_upgraded")
        log(f"held-out team accuracy after Stage-0: {baseline['eval_accuracy']:.3f}")
    _atomic_write(out / "config.json", json.dumps(asdict(cfg), indent=2))
    if not records:
        t0 = time.time()
        records.append({"stage": 0, "seconds": 0.0, **evaluate(team, heldout, sampling)})
        write_metrics(out, records)
        save_checkpoint(out, 0, team, controllers, value_heads, rng, {})
        log(f"stage 0 (before SAT): held-out team accuracy {records[0]['eval_accuracy']:.3f} "
            f"agents {fmt_list(records[0]['eval_agent_accuracy'])}")
    log(f"{'stage':>5} {'reward':>7} {'eval':>6} {'change':>7} {'kl_q':>14} {'bt':>6} {'acc':>6} {'bound':>8} {'sec':>5}")
    n_prompts = cfg.batch_size // cfg.group_size
    pbar = tqdm(range(start + 1, cfg.stages + 1), desc="SAT stages", leave=False, initial=start, total=cfg.stages)
    for stage in pbar:
        prompts = [train[rng.randrange(len(train))] for _ in range(n_prompts)]
        rec = sat_stage(team, prompts, cfg, sampling, controllers, value_heads, rng, pbar)
        rec.update(evaluate(team, heldout, sampling))
        rec["stage"] = stage
        prev = baseline or records[-1]
        if pending_upgrades:
            rec["upgrades"], pending_upgrades = pending_upgrades, []
        baseline = None
        rec["measured_change"] = rec["eval_accuracy"] - prev["eval_accuracy"]
        noise = 2 * math.hypot(rec["eval_stderr"], prev["eval_stderr"])
        rec["violation"] = rec["measured_change"] < -noise  # fell beyond noise (2 standard errors)
        records.append(rec)
        write_metrics(out, records)
        save_checkpoint(out, stage, team, controllers, value_heads, rng, {})
        ag = rec["agents"]
        kl_q = "/".join(f"{a['kl_quantile']:.3f}" for a in ag)
        backtracks = "/".join(str(a["backtracks"]) for a in ag)
        accepted = "".join("y" if a["accepted"] else "n" for a in ag)
        log(f"{stage:>5} {rec['team_reward']:>7.3f} {rec['eval_accuracy']:>6.3f} {rec['measured_change']:>+7.3f} "
            f"{kl_q:>14} {backtracks:>6} {accepted:>6} {rec['certificate']['lower_bound']:>+8.3f} {rec['seconds']:>5.1f}")
    if len(records) > 1:
        plot_run(out, records)
    if cfg.backend == "vllm":
        import rollout_vllm

        rollout_vllm.shutdown()
    log(f"held-out team accuracy: {records[0]['eval_accuracy']:.3f} -> {records[-1]['eval_accuracy']:.3f}; "
        f"metrics in {out / 'metrics.jsonl'}, plot in {out / 'progress.png'}")
    return records


def fmt_list(xs) -> str:
    return "[" + ", ".join(f"{x:.2f}" for x in xs) + "]"


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------
def parse_args(argv=None) -> Config:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
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
    p.add_argument("--resample", action="store_true")
    p.add_argument("--gradient-checkpointing", dest="gradient_checkpointing", action=argparse.BooleanOptionalAction)
    p.add_argument("--keep-optimizer-state", dest="keep_optimizer_state", action=argparse.BooleanOptionalAction,
                   help="keep each agent's AdamW moments on the host between its turns (tiny default: on)")
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
             "upgrade-warmup-steps": "warm start of a tiny replacement (default 2 x --warmup-steps)"}
    for name, typ in [("delta", float), ("quantile", float), ("beta", float), ("lr", float), ("group-size", int),
                      ("batch-size", int), ("max-new-tokens", int), ("temperature", float), ("top-p", float),
                      ("seed", int), ("epochs", int), ("minibatch-size", int), ("eps-clip", float), ("adv-clip", float),
                      ("max-backtracks", int), ("token-budget", int), ("kl-check-every", int), ("eval-size", int), ("warmup-steps", int),
                      ("stage0-delta", float), ("stage0-max-passes", int), ("upgrade-warmup-steps", int)]:
        p.add_argument(f"--{name}", dest=name.replace("-", "_"), type=typ, help=helps.get(name))
    p.add_argument("--kl-estimator", dest="kl_estimator", choices=["k1", "k2", "k3", "k3_new"])
    p.add_argument("--out")
    p.add_argument("--resume", help="a run folder (or a checkpoints/stage_XXXX folder) to continue")
    p.add_argument("--device")
    p.add_argument("--backend", choices=["hf", "vllm"])
    p.add_argument("--upgrade", action="append", help="SLOT=MODEL: replace agent SLOT (1-based) by MODEL, then continue SAT")
    args = vars(p.parse_args(argv))
    if "resume" in args:  # continue with the saved configuration; explicit flags override it
        saved = Path(args["resume"])
        cfg_path = (saved if (saved / "config.json").exists() else latest_checkpoint(saved).parent.parent) / "config.json"
        if not cfg_path.exists():
            p.error(f"--resume {saved}: no config.json there; pass the run folder written by sat.py")
        base = json.loads(cfg_path.read_text())
        base.update({"upgrade": []})
        base.update(args)
        base.setdefault("out", str(saved))
        if "out" not in args:
            base["out"] = str(cfg_path.parent)
        args = base
    known = {f.name for f in fields(Config)}
    return Config(**{k: v for k, v in args.items() if k in known})


def main(argv=None) -> int:
    try:
        cfg = parse_args(argv)
        cfg.apply_preset()
        cfg.validate()
    except (ValueError, FileNotFoundError) as err:
        print(f"sat.py: error: {err}", file=sys.stderr)
        return 2
    try:
        run(cfg)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"sat.py: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
