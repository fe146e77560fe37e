"""The policy update of one agent: OPTIMIZE(L_i), Algorithm 1's inner step.

Paper: Eq. (5) of Section 5, the practical form of the surrogate L_i (Section 3),
and Algorithm 1's line 8 (Section 5), the optimiser that maximises it. At step i
of a stage the agent j = sigma(i) maximises, over the joint trajectories tau of
the batch,

    L_i(theta_j) = E_tau[ w(tau) * min( r_j(tau) A(tau), clip(r_j(tau), 1-eps, 1+eps) A(tau) ) ]
                   - beta_j * KL(pi_j || pi_j,cur)

    r_j(tau) = exp( sum over agent j's tokens t of log pi_j(a_t|s_t) - log pi_j,cur(a_t|s_t) )
    w(tau)   = prod over the tokens of agents sigma(1..i-1) of min(1, rho_t)

where A is the group-relative advantage (or token-level GAE with a value head)
and the KL penalty is estimated on the sampled tokens (``--kl-estimator``,
k3_new by default: unbiased for KL(pi_j || pi_j,cur), the trust region's
direction). The paper's ratio is the sequence ratio (``--ratio seq``); this
project also offers the length-normalised sequence ratio of GSPO (``seq-mean``,
exp of the mean token log-ratio: the default, because the plain sequence ratio
over hundreds of tokens is almost always clipped) and the per-token PPO ratio
(``token``). The clip is applied to r, computed in log space and capped at
``logprobs.LOG_RATIO_CAP`` before ``exp`` so neither branch overflows.

``train_agents`` runs the optimiser over mini-batches, each accumulated over
micro-batches sized by a token budget; only the agent being updated holds
gradients and optimizer state (``--update joint`` passes every agent, which is
the memory cost SAT avoids). What it trains on, ``advantage.UpdateInputs``
(advantages, the truncated weights of the agents already updated this stage,
and for GAE value targets), comes from ``advantage.build_inputs``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import NamedTuple

import numpy as np
import torch

from adapter import own_parameters
from advantage import UpdateInputs
from logprobs import LOG_RATIO_CAP, masked_mean, masked_sum, measure_kl, turn_forward, turn_rows
from sat_config import SatConfig
from team import Agent, Team
from trust_region import TrustRegion

GRAD_CLIP_NORM = 1.0  # each optimizer step clips the agent's gradient to this global L2 norm
VALUE_LOSS_WEIGHT = 0.5  # --adv gae: the value head's squared error, (V - G)^2 / 2, added to the loss

# ``cfg`` below is the run's ``sat_config.SatConfig`` (read for epochs, minibatch_size, ratio, eps_clip,
# kl_estimator, adv, ..., and the sampling temperature and token budget).


# -- Eq. (5) of Section 5: the objective L_i (ratio, clip, weights, KL penalty) ------------------------------------
def kl_penalty(logp_new: torch.Tensor, logp_cur: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token sampled KL estimators for tokens a ~ pi_cur (the behaviour policy), r = pi_new(a) / pi_cur(a)
    (J. Schulman, "Approximating KL Divergence", 2020):

        k1 = -log r                  E_cur[k1] = KL(cur || new)   unbiased, can be < 0
        k2 = (log r)^2 / 2           E_cur[k2] = KL(cur || new) + O(|new - cur|^3)   biased, >= 0, low variance
        k3 = (r - 1) - log r         E_cur[k3] = KL(cur || new)   unbiased, >= 0
        k3_new = r log r - (r - 1)   E_cur[.]  = KL(new || cur)   unbiased, >= 0, importance-weighted (more variance)

    The reverse KL(cur || new) agrees with the trust region's KL(new || cur) to second order near
    pi_new = pi_cur, and accept/reject uses the exact ``trust_region.per_state_kl``, so the penalty only has to pull the
    right way. Every kind is zero with zero gradient at pi_new = pi_cur, so it enters the loss directly.
    logp_new [...] carries the gradient; logp_cur [...] none. -> [...]"""
    log_r = logp_new - logp_cur  # [...]  log(pi_new / pi_cur)
    if kind == "k1":
        return -log_r  # [...]
    if kind == "k2":
        return 0.5 * log_r.pow(2)  # [...]
    if kind == "k3":
        # expm1 keeps (r - 1) accurate when r is close to 1, i.e. for every early step.
        return torch.expm1(log_r) - log_r  # [...]
    if kind == "k3_new":
        r = log_r.exp()  # [...]
        r_log_r = torch.where(r > 0, r * log_r, torch.zeros_like(r))  # [...] 0 * log 0 = 0
        return r_log_r - torch.expm1(log_r)  # [...]
    raise ValueError(f"unknown KL estimator kind {kind!r}; expected 'k1', 'k2', 'k3' or 'k3_new'")


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
    The log-ratio is capped at LOG_RATIO_CAP before exp: beyond that the clipped
    branch is active anyway for A > 0, and exp would overflow for A < 0."""
    if kind == "token":
        a = adv if adv.dim() == 2 else adv[:, None].expand_as(log_ratio_tok)  # [n, L]
        r = log_ratio_tok.clamp(max=LOG_RATIO_CAP).exp()  # [n, L]
        surr = torch.minimum(r * a, r.clamp(1 - eps, 1 + eps) * a)  # [n, L]
        clipped = ((r - 1).abs() > eps) & (mask > 0)  # [n, L]
        return masked_mean(surr, mask, dim=1), masked_sum(clipped.float(), mask, dim=1), r
    a = adv if adv.dim() == 1 else masked_mean(adv, mask, dim=1)  # [n]
    log_r = sequence_log_ratio(log_ratio_tok, mask, kind)  # [n]
    r = log_r.clamp(max=LOG_RATIO_CAP).exp()  # [n]
    surr = torch.minimum(r * a, r.clamp(1 - eps, 1 + eps) * a)  # [n]
    clipped = ((r - 1).abs() > eps).float() * mask.sum(1)  # [n] counted per token for a token fraction
    return surr, clipped, r


class Objective(NamedTuple):
    """-L_i on b joint trajectories and what the update logs of it."""

    loss: torch.Tensor  # scalar, what the optimiser minimises
    log_ratio: torch.Tensor  # [b, Lr] log pi_j - log pi_behaviour of agent j's tokens, 0 on padding
    clipped: torch.Tensor  # [b] clipped tokens per row
    ratio: torch.Tensor  # [b] r_j ([b, Lr] token ratios with --ratio token)


def negative_objective(logp: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor,
                       log_w: torch.Tensor, beta: float, cfg) -> Objective:
    """-L_i(theta_j), the paper's Eq. (5) (Section 5), on b joint trajectories: what the optimiser minimises.

        -L_i = -mean_tau[ w(tau) min(r_j A, clip(r_j, 1-eps, 1+eps) A) ] + beta_j mean_t[ k_t ]

    r_j: agent j's ratio from its token log-ratios (``sequence_log_ratio``, ``--ratio``; capped at
    log r = LOG_RATIO_CAP before exp in ``clipped_surrogate``); w(tau) = prod min(1, rho_t) over the agents
    promoted before j (``log_w``); k_t: the ``--kl-estimator`` estimate of KL(pi_j || pi_j,cur) at
    agent j's sampled tokens (``kl_penalty``), averaged over its valid tokens. ``adv``
    is [b] or [b, Lr] (GAE)."""
    log_ratio = (logp - behaviour) * mask  # [b, Lr] log r_t, 0 on padding
    surr, clipped, ratio = clipped_surrogate(log_ratio, mask, adv, cfg.ratio, cfg.eps_clip)  # [b] min(r A, clip A)
    weights = log_w.exp()  # [b] truncated importance weights w, <= 1
    policy_loss = -(weights * surr).mean()  # scalar
    kl = masked_mean(kl_penalty(logp, behaviour, cfg.kl_estimator), mask)  # scalar, over valid tokens
    return Objective(policy_loss + beta * kl, log_ratio, clipped, ratio)


# -- ALGO LOGIC: OPTIMIZE(L_i), Algorithm 1 line 8 -----------------------------------------------------------------
@dataclass
class TrainStats:
    """What one agent's optimisation did (logged per agent and stage), and
    ``anchor``: the last iterate an in-loop check found inside the trust region
    (None if none did), where the line search backtracks to instead of pi_j,cur."""

    loss: float  # mean of the minibatches' -L_i (+ the KL penalty and, with GAE, the value loss)
    clip_fraction: float  # the share of response tokens whose ratio the clip cut off
    ratio_mean: float  # the sequence ratios pi_new / pi_behaviour seen in training
    ratio_min: float
    ratio_max: float
    grad_norm: float  # mean gradient norm before clipping to GRAD_CLIP_NORM
    train_tokens_per_s: float  # (context + response) tokens through the optimiser per second
    inner_steps: int  # AdamW steps taken
    early_stopped: bool  # an in-loop KL check found the quantile beyond delta and stopped
    step0_log_ratio_max: float  # max |log ratio| before the first step: 0 up to rounding (one forward for both)
    anchor: list[torch.Tensor] | None = field(default=None, repr=False)
    stopped_at: tuple[float, float] | None = None  # early-stopped: the KL quantiles at the anchor (0: pi_cur) and stop

    def logged(self) -> dict:
        """The fields of the metrics record (all but ``anchor`` and ``stopped_at``)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("anchor", "stopped_at")}


@dataclass
class _Tally:
    """Running sums of one agent's gradient steps."""

    loss: list = field(default_factory=list)
    grad_norm: list = field(default_factory=list)
    ratio: list = field(default_factory=list)
    clip_tokens: float = 0.0
    tokens: float = 0.0
    steps: int = 0
    step0_log_ratio_max: float = 0.0


def train_agents(team: Team, slots: list[int], inputs: dict[int, UpdateInputs], cfg: SatConfig,
                 regions: dict[int, TrustRegion], value_heads: dict, references: dict) -> dict[int, TrainStats]:
    """Maximise the clipped, weighted surrogate L_i for the agents in ``slots``:
    ``cfg.epochs`` passes over the batch in minibatches of ``cfg.minibatch_size``
    joint trajectories, one AdamW step each at the agent's lr and KL penalty
    weight beta (its ``trust_region.TrustRegion``, ``regions[j]``). Sequential SAT passes one slot; ``--update joint``
    passes all (every agent holds gradients and optimizer state at once: the
    memory cost SAT avoids).

    Every ``cfg.kl_check_every`` steps the trust region's statistic (the exact
    per-state KL quantile to pi_j,cur, ``references[j]``) is measured; an agent
    whose statistic crossed delta stops there (like PPO's target-KL stop, on the trust-region statistic
    itself) and ``sat.trust_region_step`` backtracks toward the last iterate found
    inside (``TrainStats.anchor``)."""
    agents = {j: team.agents[j] for j in slots}
    heads = {j: value_heads.get(j) if cfg.adv == "gae" else None for j in slots}
    optimizers = {j: _start_training(agents[j], heads[j], cfg, regions[j].lr) for j in slots}
    tallies = {j: _Tally() for j in slots}
    anchors: dict[int, list[torch.Tensor]] = {}  # the last iterate each in-loop check found inside
    kls: dict[int, list[float]] = {j: [0.0] for j in slots}  # the KL quantiles each in-loop check measured
    stopped: set[int] = set()
    n, steps, start = len(inputs[slots[0]].turn.texts), 0, time.time()
    for _epoch in range(cfg.epochs):
        perm = torch.randperm(n)  # [N]
        for s in range(0, n, cfg.minibatch_size):
            active = [j for j in slots if j not in stopped]
            if not active:
                break
            for j in active:
                _gradient_step(agents[j], inputs[j], perm[s : s + cfg.minibatch_size], cfg, regions[j].beta,
                               optimizers[j], heads[j], tallies[j])
            steps += 1
            if cfg.kl_check_every and steps % cfg.kl_check_every == 0:
                for j in active:
                    kl = measure_kl(agents[j], references[j], inputs[j].turn, cfg.sampling.temperature,
                                    cfg.sampling.token_budget)[0]
                    kls[j].append(regions[j].statistic(kl))
                    if regions[j].violates(kls[j][-1]):
                        stopped.add(j)
                    else:
                        anchors[j] = _copy_parameters(agents[j])
    seconds = time.time() - start
    return {j: _stop_training(agents[j], heads[j], cfg, tallies[j], (kls[j][-2], kls[j][-1]) if j in stopped
                              else None, anchors.get(j), seconds) for j in slots}


def _copy_parameters(agent: Agent) -> list[torch.Tensor]:
    return [p.detach().clone() for p in own_parameters(agent.model)]


def _start_training(agent: Agent, head, cfg, lr: float) -> torch.optim.Optimizer:
    """Gradients and an optimizer at ``lr`` for the agent (and its GAE value head)."""
    if head is not None:
        head.requires_grad_(True)
    if cfg.gradient_checkpointing:
        agent.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return agent.start_training(lr, extra_params=head.parameters() if head is not None else None)


def _stop_training(agent: Agent, head, cfg, tally: _Tally, stopped_at: tuple[float, float] | None, anchor,
                   seconds: float) -> TrainStats:
    """Freeze the agent again and summarise its steps (summed over the ranks under torchrun)."""
    if cfg.gradient_checkpointing:
        agent.model.gradient_checkpointing_disable()
    agent.freeze(offload_optimizer=cfg.keep_optimizer_state)
    if head is not None:
        head.requires_grad_(False)
    procs = agent.procs  # token counts and ratios of every process's rows
    tally.clip_tokens, tally.tokens = procs.sum(torch.tensor([tally.clip_tokens, tally.tokens],
                                                             dtype=torch.float64)).tolist()
    tally.ratio = [r for part in procs.gather(tally.ratio) for r in part]
    tally.step0_log_ratio_max = max(procs.gather(tally.step0_log_ratio_max))
    return TrainStats(loss=float(np.mean(tally.loss)), clip_fraction=tally.clip_tokens / max(tally.tokens, 1),
                      ratio_mean=float(np.mean(tally.ratio)), ratio_min=float(np.min(tally.ratio)),
                      ratio_max=float(np.max(tally.ratio)), grad_norm=float(np.mean(tally.grad_norm)),
                      train_tokens_per_s=tally.tokens / max(seconds, 1e-9), inner_steps=tally.steps,
                      early_stopped=stopped_at is not None, step0_log_ratio_max=tally.step0_log_ratio_max,
                      anchor=anchor, stopped_at=stopped_at)


def _gradient_step(agent: Agent, inp: UpdateInputs, idx: torch.Tensor, cfg, beta: float, opt, value_head,
                   tally: _Tally) -> None:
    """One optimizer step on the minibatch ``idx``, accumulated over
    micro-batches of at most ``cfg.sampling.token_budget`` (context + response) tokens."""
    turn = inp.turn
    rows = turn_rows(turn.tensors, cfg.sampling.token_budget)
    procs = agent.procs
    lo, hi = procs.rows(len(idx))  # this process's rows of the minibatch (all of them on one process)
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for s in range(lo, hi, rows):
        micro = idx[s : min(s + rows, hi)]
        loss = _micro_batch_loss(agent, inp, micro, cfg, beta, value_head, tally) * (len(micro) / len(idx))
        procs.backward(loss)
        total += loss.item()
    if value_head is not None:  # GAE's value head is whole on every process
        procs.average_gradients(value_head.parameters())
    grad_norm = torch.nn.utils.clip_grad_norm_(agent.grad_parameters(), GRAD_CLIP_NORM)  # fp32 master grads of bf16
    opt.step()
    tally.loss.append(float(procs.sum(torch.tensor(total, dtype=torch.float64))))
    tally.grad_norm.append(procs.number(grad_norm))
    tally.steps += 1


def _micro_batch_loss(agent: Agent, inp: UpdateInputs, idx: torch.Tensor, cfg, beta: float, value_head,
                      tally: _Tally) -> torch.Tensor:
    """``negative_objective`` (+ the value loss with GAE) on rows ``idx``.

    The log-probs come from ``logprobs.turn_forward``, the function (full turn
    width, fp32 LM head) that computed the behaviour log-probs, so before the
    first step log r = 0 up to kernel nondeterminism (exactly 0 on CPU); the
    largest |log r| of the first step is logged as ``step0_log_ratio_max``."""
    turn, device = inp.turn, agent.device
    rmask = turn.response_mask[idx].to(device)  # [b, Lr]
    behaviour = turn.behaviour_logprobs[idx].to(device)  # [b, Lr]
    logp, hidden = turn_forward(agent.model, turn.tensors, idx, cfg.sampling.temperature)  # [b, Lr], [b, Lr, H]
    adv, log_w = inp.adv[idx].to(device), inp.log_w[idx].to(device)  # [b] or [b, Lr]; [b]
    objective = negative_objective(logp, behaviour, rmask, adv, log_w, beta, cfg)
    if tally.steps == 0:  # before any update: a health check of the one log-prob path
        tally.step0_log_ratio_max = max(tally.step0_log_ratio_max, float(objective.log_ratio.detach().abs().max()))
    loss = objective.loss
    if value_head is not None:  # token-level value regression toward the GAE returns
        values = value_head(hidden.float()).squeeze(-1)  # [b, Lr]
        loss = loss + VALUE_LOSS_WEIGHT * masked_mean((values - inp.returns[idx].to(device)) ** 2, rmask)
    ratio = objective.ratio  # [b] or [b, Lr]
    tally.clip_tokens += float(objective.clipped.sum())
    tally.tokens += float(rmask.sum())
    tally.ratio.append(float((ratio[rmask > 0] if ratio.dim() == 2 else ratio).detach().float().mean()))
    return loss
