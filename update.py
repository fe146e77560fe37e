"""The policy update of one agent: the objective L_i of Algorithm 1's inner step.

Paper, Section 4 (Algorithm 1, the per-agent objective). At step i of a stage
the agent j = sigma(i) maximises, over the joint trajectories tau of the batch,

    L_i(theta_j) = E_tau[ w(tau) * min( r_j(tau) A(tau), clip(r_j(tau), 1-eps, 1+eps) A(tau) ) ]
                   - beta_j * KL(pi_j || pi_j,cur)

    r_j(tau) = exp( sum over agent j's tokens t of log pi_j(a_t|s_t) - log pi_j,cur(a_t|s_t) )
    w(tau)   = prod over the tokens of agents sigma(1..i-1) of min(1, rho_t)

where A is the group-relative advantage (or token-level GAE with a value head)
and the KL penalty is estimated on the sampled tokens (k3 by default). The
paper's ratio is the sequence ratio (``--ratio seq``); this project also
offers the length-normalised sequence ratio of GSPO (``seq-mean``, exp of the
mean token log-ratio: the default, because the plain sequence ratio over
hundreds of tokens is almost always clipped) and the per-token PPO ratio
(``token``). The clip is applied to r, computed in log space and capped
before ``exp`` so neither branch overflows.

``train_agents`` runs the optimiser over mini-batches, each accumulated over
micro-batches sized by a token budget; only the agent being updated holds
gradients and optimizer state (``--update joint`` passes every agent, which is
the memory cost SAT avoids). ``build_inputs`` assembles what the update needs:
advantages, the truncated weights of the agents already updated this stage,
and (for GAE) value targets.
"""
from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from scale import distributed
import parallel
from advantage import full_log_weights, gae, group_advantages, masked_mean, masked_sum, truncated_log_weights
from logprobs import measure_kl, response_hidden_states, turn_forward, turn_rows
from rollout import TeamBatch, Turn
from team import Agent, Team
from trust_region import QuantileController, beyond, interpolate_parameters, kl_penalty, kl_quantile, outside_trust_region

# ``cfg`` below is the run's ``config.Config`` (read for lr, epochs, minibatch_size,
# token_budget, ratio, eps_clip, kl_estimator, adv, adv_clip, gae_lambda, ...).


# ---------------------------------------------------------------------------
# The clipped sequence-ratio surrogate
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


# ---------------------------------------------------------------------------
# What agent j's update reads from the batch: advantages and weights
# ---------------------------------------------------------------------------
@dataclass
class UpdateInputs:
    """What agent j's update needs from the batch."""

    turn: Turn
    adv: torch.Tensor  # [N] or [N, L] advantages (normalised, clipped)
    raw_adv: torch.Tensor  # [N] R - group mean, in reward units, for the certificate
    log_w: torch.Tensor  # [N] truncated log weights from earlier agents (0 for the first)
    log_w_full: torch.Tensor  # [N] untruncated, for zeta
    returns: torch.Tensor | None = None  # [N, L] value targets (gae)


def build_inputs(batch: TeamBatch, j: int, cached_log_ratios: list[tuple[torch.Tensor, torch.Tensor]], cfg,
                 model=None, value_head=None) -> UpdateInputs:
    """Sequence-aware weights and advantages for the agent updated at this step.

    w(tau) = prod over the tokens of agents already updated this stage of
    min(1, rho_t), from their cached log-ratios (empty for the first agent, with
    --reuse regenerate, and with --update joint). Group advantages use w as weights, so
    the baseline is an estimate under pi_hat_{i-1}, not under the stale pi_cur."""
    n = len(batch)
    log_w = truncated_log_weights(cached_log_ratios, batch_size=n).float()  # [N]
    log_w_full = full_log_weights(cached_log_ratios, batch_size=n).float()  # [N]
    weights = log_w.exp()  # [N]
    if getattr(cfg, "baseline", "group") == "counterfactual" and batch.counterfactual is not None:
        # R - b_j: the others' answers held fixed (rollout.counterfactual_baselines), then Eq. (2)'s normalisation
        signal = batch.rewards - batch.counterfactual[j]  # [N], in [-(R_max - R_min), R_max - R_min]
        adv = group_advantages(signal, batch.group_ids, clip=cfg.adv_clip, weights=weights).float()  # [N]
        raw_adv = signal.float()  # [N] reward units, for the certificate
    else:
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


def make_value_head(agent: Agent) -> torch.nn.Linear:
    hidden = agent.model.config.hidden_size
    head = torch.nn.Linear(hidden, 1).to(agent.device, torch.float32)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.constant_(head.bias, 0.5)  # a neutral prior for a {0, 1} reward
    return head


# ---------------------------------------------------------------------------
# The optimisation loop
# ---------------------------------------------------------------------------
def train_agents(team: Team, slots: list[int], inputs: dict[int, UpdateInputs], cfg,
                 controllers: dict[int, QuantileController], value_heads: dict, references: dict) -> dict[int, dict]:
    """Optimise the clipped, weighted surrogate for the agents in ``slots``.

    Sequential SAT passes one slot; ``--update joint`` passes all of them, so
    every agent holds gradients and optimizer state at the same time (the
    memory cost SAT avoids). Returns per-slot training statistics.

    With ``--kl-check-every`` the exact KL quantile is checked in the loop; a
    check likely to pass (``worth_speculating``) may run in a forked child on
    an idle core while this process trains on (``_speculate``); if it crossed,
    the steps trained since are undone (``_settle``), so the result is the
    serial loop's bit for bit."""
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
    # In-loop measurements are handed to finish_update (same weights, same forwards) only
    # where they are the ones it would make: one process (FSDP copies are another model)
    # and no dropout (the loop runs in train mode, finish_update in eval mode).
    reusable = not distributed.active() and all(dropout_free(team.agents[j].model) for j in slots)
    # A check may run in a forked child while this process trains on (``_speculate``): one agent
    # (sequential SAT), reusable measurements, and plain fp32 AdamW (its state is cheap to snapshot).
    can_speculate = reusable and len(slots) == 1 and bool(cfg.kl_check_every) and \
        type(optimizers[slots[0]]) is torch.optim.AdamW
    last_step = cfg.epochs * -(-n // cfg.minibatch_size)
    passed = {j: [] for j in slots}  # (inner step, KL quantile) of this turn's checks found inside
    spec = None  # the check running in a child, with the state to return to if it crossed
    try:
        for _ in range(cfg.epochs):
            perm = torch.randperm(n)
            for s in range(0, n, cfg.minibatch_size):
                idx = perm[s : s + cfg.minibatch_size]
                for j in sorted(active):
                    _gradient_step(team.agents[j], inputs[j], idx, cfg, controllers[j].beta, optimizers[j],
                                   value_heads.get(j), stats[j])
                    stats[j]["steps"] += 1
                steps += 1
                due = cfg.kl_check_every and steps % cfg.kl_check_every == 0
                if spec is not None and (due or spec["pending"].ready()):
                    spec, settling = None, spec  # (a failing child is reaped by _settle: nothing left to cancel)
                    _settle(settling, optimizers[settling["slot"]], stats, inside, passed, active, cfg)
                if active and due:
                    # Early stop on the exact KL quantile (like PPO's target-KL stop, but on
                    # the trust-region statistic itself): go back to the last inside iterate.
                    for j in sorted(active):
                        if can_speculate and steps < last_step and parallel.idle_core() and \
                                worth_speculating(passed[j], stats[j]["steps"], cfg.delta):
                            spec = _speculate(team.agents[j], j, optimizers[j], stats[j], references[j], inputs[j].turn,
                                              inside[j], cfg)
                            continue
                        # the line search's first backtrack, measured on an idle core meanwhile (None: no fork)
                        half = parallel.fork_call(lambda: measure_at_fraction(team.agents[j], references[j], inputs[j].turn,
                                                                              inside[j], 0.5, cfg), parallel=True) \
                            if reusable and cfg.max_backtracks >= 1 and parallel.idle_core() else None
                        try:
                            with weights_as_frozen(team.agents[j].model, reusable):  # as finish_update will see them
                                measured = measure_kl(team.agents[j], references[j], inputs[j].turn, cfg.temperature,
                                                      cfg.token_budget, return_log_rho=True, frozen_reference=True)
                        except BaseException:
                            if half is not None:  # leave no child behind
                                half.cancel()
                            raise
                        q = kl_quantile(measured[0], cfg.quantile)
                        if reusable:  # finish_update measures these same weights again: hand it the answer
                            stats[j]["last_measure"] = (stats[j]["steps"], measured, None)
                        if beyond(q, cfg.delta):
                            # this step crossed the boundary: stop; the line search in
                            # finish_update backtracks from here toward the last inside iterate
                            stats[j]["early_stopped"] = True
                            active.discard(j)
                            if half is not None:
                                stats[j]["last_measure"] = (stats[j]["steps"], measured, half.result())
                        else:
                            if half is not None:  # inside: no backtracking from here
                                half.cancel()
                            inside[j] = [p.detach().clone() for p in team.agents[j].model.parameters()]
                            passed[j].append((stats[j]["steps"], q))
                            if reusable:
                                stats[j]["anchor_measure"] = measured
                if not active:
                    break
            if not active:
                break
        if spec is not None:  # the epochs ended while the last speculated check was still out
            spec, settling = None, spec
            _settle(settling, optimizers[settling["slot"]], stats, inside, passed, active, cfg)
    except BaseException:
        if spec is not None:  # leave no child behind
            spec["pending"].cancel()
        raise
    for j in slots:
        if cfg.gradient_checkpointing:
            team.agents[j].model.gradient_checkpointing_disable()
        team.agents[j].freeze(offload_optimizer=cfg.keep_optimizer_state)
        if cfg.adv == "gae":
            value_heads[j].requires_grad_(False)
        if distributed.active():  # token counts and ratios of every rank's rows
            stats[j]["clip_tokens"], stats[j]["tokens"] = distributed.sum_ranks(
                torch.tensor([stats[j]["clip_tokens"], stats[j]["tokens"]], dtype=torch.float64)).tolist()
            stats[j]["ratio"] = [r for part in distributed.gather_objects(stats[j]["ratio"]) for r in part]
            stats[j]["step0_log_ratio_max"] = max(distributed.gather_objects(stats[j].get("step0_log_ratio_max", 0.0)))
        tokens = stats[j]["tokens"]
        last = stats[j].get("last_measure")
        fresh = last is not None and last[0] == stats[j]["steps"]  # measured at the weights training ended on
        measures = {"proposal_measure": last[1] if fresh else None, "half_measure": last[2] if fresh else None,
                    "anchor_measure": stats[j].get("anchor_measure")}  # popped by finish_update, never logged
        stats[j] = {**measures, "loss": float(np.mean(stats[j]["loss"])), "clip_fraction": stats[j]["clip_tokens"] / max(tokens, 1),
                    "ratio_mean": float(np.mean(stats[j]["ratio"])), "ratio_min": float(np.min(stats[j]["ratio"])),
                    "ratio_max": float(np.max(stats[j]["ratio"])), "grad_norm": float(np.mean(stats[j]["grad_norm"])),
                    "train_tokens_per_s": tokens / max(time.time() - start, 1e-9), "inner_steps": stats[j]["steps"],
                    "early_stopped": stats[j]["early_stopped"], "anchor": inside.get(j),
                    "step0_log_ratio_max": stats[j].get("step0_log_ratio_max", 0.0)}
    return stats


@contextmanager
def weights_as_frozen(model, on: bool = True):
    """requires_grad off while measuring: with it on, the 3-D LM-head matmul of
    the log-probs takes another kernel (4.8e-7 apart on CPU), so the in-loop
    measurement would not be the one finish_update makes on the frozen agent.
    Off (``on=False``) for an FSDP2-sharded copy, whose hooks follow requires_grad."""
    if not on:
        yield
        return
    flags = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(model.parameters(), flags):
            p.requires_grad_(flag)


def measure_at_fraction(agent: Agent, reference, turn, anchor: list[torch.Tensor], frac: float, cfg):
    """``measure_kl`` (with log rho) at anchor + frac (theta - anchor), theta the
    agent's weights now: what finish_update's line search measures at step
    fraction ``frac`` (same ``interpolate_parameters``, frozen flags, rows and
    chunks). Changes the agent's weights: run it in a forked child
    (``parallel.fork_call``), where the change dies with the child."""
    params = list(agent.model.parameters())
    interpolate_parameters(params, anchor, [p.detach().clone() for p in params], frac)
    with weights_as_frozen(agent.model):
        return measure_kl(agent, reference, turn, cfg.temperature, cfg.token_budget, return_log_rho=True,
                          frozen_reference=True)


def worth_speculating(passed: list[tuple[int, float]], step: int, delta: float) -> bool:
    """Whether the in-loop check at inner step ``step`` is likely to find the
    weights inside delta, so that training on while a child measures them pays
    (a crossing throws the steps trained meanwhile away, and the child measures
    the first backtrack only after the proposal, not beside it). Extrapolates
    linearly from this turn's last inside check; with none yet, no: in the tiny
    run 110 of 120 agent turns crossed delta at their first check, and the
    quantiles of later checks grew about linearly with the steps (e.g. 0.235,
    0.413, 0.665 at steps 2, 4, 6 with delta = 0.5: a little faster late). Decides only
    whether to fork, never what is computed."""
    if not passed:
        return False
    s0, q0 = passed[-1]
    return q0 * step / s0 <= delta


def _speculate(agent: Agent, j: int, opt, stats: dict, reference, turn, anchor: list[torch.Tensor], cfg) -> dict:
    """Start the in-loop check of the weights now in a forked child
    (``parallel.fork_call``) and keep what ``_settle`` puts back if they crossed
    delta: the weights, the AdamW state, the statistics and the torch RNG state
    (the next epoch's permutation). Only on the fork path (one process, CPU,
    tiny fp32 agents), where this snapshot costs a few milliseconds; on a GPU
    run the check stays in line."""
    snapshot = {"params": [p.detach().clone() for g in opt.param_groups for p in g["params"]],
                "optimizer": copy.deepcopy(opt.state_dict()), "rng": torch.get_rng_state(),
                "stats": {k: list(v) if isinstance(v, list) else v for k, v in stats.items()}}
    n_model = len(list(agent.model.parameters()))  # the optimizer's first group is the model's parameters, in order

    def check():  # in the child: the proposal and, if it crossed, the line search's first backtrack
        with weights_as_frozen(agent.model):
            measured = measure_kl(agent, reference, turn, cfg.temperature, cfg.token_budget, return_log_rho=True,
                                  frozen_reference=True)
        crossed = outside_trust_region(measured[0], cfg.quantile, cfg.delta)
        half = measure_at_fraction(agent, reference, turn, anchor, 0.5, cfg) if crossed and cfg.max_backtracks >= 1 else None
        return measured, half

    return {"slot": j, "snapshot": snapshot, "anchor": snapshot["params"][:n_model],
            "pending": parallel.fork_call(check, parallel=True)}


def _settle(spec: dict, opt, stats: dict, inside: dict, passed: dict, active: set, cfg) -> None:
    """Read a speculated check (``_speculate``) and leave the state the serial
    check would have left: inside, its weights become the anchor and training
    goes on; crossed, everything trained since is undone and the agent stops,
    with the measurements finish_update reuses (the proposal, its first backtrack)."""
    measured, half = spec["pending"].result()
    j, snap = spec["slot"], spec["snapshot"]
    q, step = kl_quantile(measured[0], cfg.quantile), snap["stats"]["steps"]
    if beyond(q, cfg.delta):
        with torch.no_grad():
            for p, saved in zip([p for g in opt.param_groups for p in g["params"]], snap["params"], strict=True):
                p.copy_(saved)
        opt.load_state_dict(snap["optimizer"])
        torch.set_rng_state(snap["rng"])
        stats[j].clear()
        stats[j].update(snap["stats"], early_stopped=True, last_measure=(step, measured, half))
        active.discard(j)
    else:
        stats[j]["last_measure"] = (step, measured, None)
        stats[j]["anchor_measure"] = measured
        inside[j] = spec["anchor"]
        passed[j].append((step, q))


def dropout_free(model) -> bool:
    """No dropout anywhere (train and eval mode compute the same function)."""
    config_p = [getattr(model.config, k, 0.0) or 0.0 for k in ("attention_dropout", "hidden_dropout", "dropout")]
    return not any(config_p) and all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))


def train_sharded(team: Team, slots: int | list[int], train):
    """``train()`` (``train_agents`` of one agent j, or of every slot for
    ``--update joint``) with each trained agent replaced by an FSDP2-sharded
    fp32 copy under torchrun; afterwards the whole trained weights are written
    back into each agent's own model (and the in-loop anchor made whole), so
    the trust-region check sees plain models. A bf16 agent's fp32 shards are
    its master weights: this rank's shards stay on the host (``master_shards``)
    for its next turn, as one process keeps ``master_weights``. With
    ``--shard-frozen`` the agent is sharded already: the fp32 copy is built
    from its shards and written back into them, so no rank ever holds it
    whole (``distributed.training_copy``, ``copy_local_into``). With one
    process: just ``train()``."""
    if not distributed.active():
        return train()
    single = isinstance(slots, int)
    slots = [slots] if single else list(slots)
    plains = {j: team.agents[j] for j in slots}
    for j, plain in plains.items():
        low = plain.dtype != torch.float32
        masters = plain.master_shards if low else None
        if distributed.is_sharded(plain.model):  # --shard-frozen: built shard by shard, no whole copy
            copy_ = distributed.training_copy(plain.model, masters)
        else:
            copy_ = distributed.shard_model(plain.model, masters)
        team.agents[j] = Agent(plain.spec, copy_, plain.tokenizer)
        if plain.saved_optimizer_state is not None:  # --keep-optimizer-state: this rank's shards of the moments
            team.agents[j].saved_optimizer_state = distributed.sharded_optimizer_state(
                plain.saved_optimizer_state, list(team.agents[j].model.parameters()))
            plain.saved_optimizer_state = None
    try:
        out = train()
    finally:
        sharded = {j: team.agents[j] for j in slots}
        for j, plain in plains.items():
            team.agents[j] = plain
    for j, plain in plains.items():
        if plain.dtype != torch.float32:
            plain.master_shards = distributed.master_shards_of(sharded[j].model)
        plain.saved_optimizer_state = sharded[j].saved_optimizer_state  # host shards (team._to_cpu), or None
        sharded[j].model.reshard()
        stats = out if single else out[j]
        if distributed.is_sharded(plain.model):  # --shard-frozen: the agent stays sharded, each rank its shards
            distributed.copy_local_into(sharded[j].model, plain.model)
            if stats.get("anchor") is not None:  # this rank's rows of each (the root's may have been gathered)
                stats["anchor"] = [distributed.local_rows(a).to(p.dtype) for a, p in
                                   zip(stats["anchor"], distributed.local_parameters(plain.model), strict=True)]
            continue
        distributed.copy_full_into(sharded[j].model, plain.model)
        if stats.get("anchor") is not None:
            stats["anchor"] = [distributed.full(a).to(p.dtype) for a, p in zip(stats["anchor"], plain.model.parameters(), strict=True)]
    return out


def _gradient_step(agent: Agent, inp: UpdateInputs, idx: torch.Tensor, cfg, beta: float, opt, value_head,
                   stats: dict) -> None:
    """One optimizer step on the minibatch ``idx``, accumulated over
    micro-batches of at most ``cfg.token_budget`` (context + response) tokens."""
    turn = inp.turn
    rows = turn_rows((turn.context_ids, turn.context_mask, turn.response_ids, turn.response_mask), cfg.token_budget)
    lo, hi = distributed.row_range(len(idx))  # under torchrun: this rank's rows of the minibatch
    world = distributed.STATE.world  # FSDP2 averages gradients over ranks; the loss is a sum over them
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for s in range(lo, hi, rows):
        micro = idx[s : min(s + rows, hi)]
        loss = _micro_batch_loss(agent, inp, micro, cfg, beta, value_head, stats) * (len(micro) / len(idx))
        (loss * world if world > 1 else loss).backward()
        total += loss.item()
    if value_head is not None and world > 1:  # GAE's value head is whole on every rank: average like FSDP2 does
        for p in value_head.parameters():
            p.grad = distributed.sum_ranks(p.grad) / world
    grad_norm = torch.nn.utils.clip_grad_norm_(agent.grad_parameters(), 1.0)  # fp32 master grads of a bf16 agent
    opt.step()
    stats["loss"].append(float(distributed.sum_ranks(torch.tensor(total, dtype=torch.float64))) if world > 1 else total)
    stats["grad_norm"].append(distributed.as_float(grad_norm))


def _micro_batch_loss(agent: Agent, inp: UpdateInputs, idx: torch.Tensor, cfg, beta: float, value_head,
                      stats: dict) -> torch.Tensor:
    """-E[w * min(r A, clip(r) A)] + beta * KL penalty (+ value loss) on rows ``idx``.

    The log-probs come from ``logprobs.turn_forward``, the function (full turn
    width, fp32 LM head) that computed the behaviour log-probs, so before the
    first step log r = 0 up to kernel nondeterminism (exactly 0 on CPU); the
    largest |log r| of the first step is logged as ``step0_log_ratio_max``."""
    turn, device = inp.turn, agent.device
    rmask = turn.response_mask[idx].to(device)  # [b, Lr]
    behaviour = turn.behaviour_logprobs[idx].to(device)  # [b, Lr]
    turn_like = (turn.context_ids, turn.context_mask, turn.response_ids, turn.response_mask)
    logp, hidden = turn_forward(agent.model, turn_like, idx, cfg.temperature)  # [b, Lr], [b, Lr, H]
    log_ratio = (logp - behaviour) * rmask  # [b, Lr]
    if stats["steps"] == 0:  # before any update: a health check of the one log-prob path
        stats["step0_log_ratio_max"] = max(stats.get("step0_log_ratio_max", 0.0), float(log_ratio.detach().abs().max()))
    adv = inp.adv[idx].to(device)  # [b] or [b, Lr]
    surr, clipped, ratio = clipped_surrogate(log_ratio, rmask, adv, cfg.ratio, cfg.eps_clip)
    weights = inp.log_w[idx].to(device).exp()  # [b] truncated importance weights, <= 1
    policy_loss = -(weights * surr).mean()
    kl = masked_mean(kl_penalty(logp, behaviour, cfg.kl_estimator), rmask)
    loss = policy_loss + beta * kl
    if value_head is not None:  # token-level value regression toward the GAE returns
        values = value_head(hidden.float()).squeeze(-1)  # [b, Lr]
        loss = loss + 0.5 * masked_mean((values - inp.returns[idx].to(device)) ** 2, rmask)
    stats["clip_tokens"] += float(clipped.sum())
    stats["tokens"] += float(rmask.sum())
    stats["ratio"].append(ratio[rmask > 0].detach().float().mean().item() if ratio.dim() == 2 else ratio.detach().float().mean().item())
    return loss
