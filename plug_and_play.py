"""Plug-and-play: replace an agent by a stronger model without retraining the rest.

Paper, Section 5 (Eqs. (6)-(7)) and Section 4.3 (plug-and-play invariance of the bound). Stage-0
projects the replacement pi_pre onto the per-state KL ball of radius delta_0 around the incumbent:

    pi_new = argmin_pi E_s[ KL(pi(.|s) || pi_pre(.|s)) ]  s.t.  KL(pi(.|s) || pi_j,cur(.|s)) <= delta_0   (6)
    pi_new(a|s)  ~  pi_pre(a|s)^(1/(1+lambda(s))) * pi_j,cur(a|s)^(lambda(s)/(1+lambda(s)))          (7)

with lambda(s) >= 0 found by bisection per state (``trust_region.geometric_mixture_projection``): 0
where pi_pre is already inside, else the value that makes the constraint tight. A network cannot be
set to Eq. (7) state by state, so Stage-0 *fits* it (``fit_stage0``): pi_pre stays frozen and the
trainable copy minimises E_s KL(target(.|s) || pi_new(.|s)), measured in sample and on held-out states.

Memory is bounded by ``token_budget`` (rows per trunk micro-batch) and ``logits_budget`` (LM-head positions
per block, recomputed in the backward pass), not by the response length (``memory.stage0_rank_bytes``).
Each model reads a state through its own chat template; per-token mixing needs a shared vocabulary.

    python sat.py --resume runs/sat --upgrade 2=tiny-6L --stages 12
"""
from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F

from advantage import make_value_head
from bounds import paired_change_bound
from harness.processes import ONE_PROCESS, OneProcess
from logprobs import TurnTensors, left_pad, response_hidden_states
from reward import DEFAULT_RANGE
from rollout import SamplingConfig, rng_devices, rollout
from team import Agent, MasterWeightAdamW, Problem, Team, check_same_vocabulary
from trust_region import QuantileController, beyond, geometric_mixture_at, geometric_mixture_projection, kl_quantile

# ``cfg`` below is the run's ``config.Config``.
STAGE0_LOGITS_BUDGET = 1 << 22  # elements of one [positions, V] LM-head block (16 MiB in fp32)
STAGE0_HELDOUT_FRACTION = 0.25  # share of the Stage-0 problems whose states are held out of the fit
STAGE0_SHRINK = 0.9  # a state past 0.9 delta_0 has its target exponent t(s) = 1/(1+lambda(s)) shrunk by this
STAGE0_EVERY = 5  # passes between two such retargetings, so the fit can follow
STAGE0_PATIENCE = 10  # passes with neither a 1% better fit nor a 1% lower quantile before the learning rate halves
STAGE0_FIT_TOL = 0.1  # default fit tolerance: mean KL(target || pi_new) <= 0.1 x its start value KL(target || pi_pre)


class Stage0Unreachable(RuntimeError):
    """Stage-0 ran out of passes with the KL quantile still above delta_0 (``fit_stage0``)."""


@dataclass(frozen=True)
class Stage0Settings:
    """Stage-0's settings (Eqs. (6)-(7)); ``stage0_align`` builds them from the run's options."""

    delta0: float  # the ball's radius: per-state KL(pi_new || pi_j,cur) <= delta0
    q_level: float  # the (1 - alpha) quantile of that KL that must be <= delta0
    lr: float  # AdamW's learning rate for the fit
    max_passes: int  # passes over the fit states before Stage-0 gives up (an error)
    fit_tol: float  # relative fit tolerance: mean KL(target || pi_new) <= fit_tol x KL(target || pi_pre)
    temperature: float  # the policies are the tempered softmax, as in the rollout
    rows_per_step: int  # rows of one AdamW step
    token_budget: int  # (context + response) tokens of one trunk micro-batch
    logits_budget: int = STAGE0_LOGITS_BUDGET  # elements of one [positions, V] LM-head block


@dataclass
class Stage0States:
    """The states s of one slot: shared response prefixes after each model's own rendering of the context."""

    ctx_new: torch.Tensor  # [N, Lc'] the replacement's template
    cmask_new: torch.Tensor  # [N, Lc']
    ctx_cur: torch.Tensor  # [N, Lc] the incumbent's template
    cmask_cur: torch.Tensor  # [N, Lc]
    resp: torch.Tensor  # [N, Lr] right-padded
    rmask: torch.Tensor  # [N, Lr]

    def rows(self, sl: slice) -> "Stage0States":
        parts = (self.ctx_new, self.cmask_new, self.ctx_cur, self.cmask_cur, self.resp, self.rmask)
        return Stage0States(*(t[sl] for t in parts))

    def __len__(self) -> int:
        return self.resp.shape[0]

    @property
    def new_turn(self) -> TurnTensors:
        """The states in the replacement's template: what pi_new and pi_pre read."""
        return TurnTensors(self.ctx_new, self.cmask_new, self.resp, self.rmask)

    @property
    def cur_turn(self) -> TurnTensors:
        """The states in the incumbent's template: what pi_cur reads."""
        return TurnTensors(self.ctx_cur, self.cmask_cur, self.resp, self.rmask)

    @property
    def num_states(self) -> int:
        return int(self.rmask.sum())


def _trim(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the left-padding columns all rows share (exact, cheaper)."""
    keep = mask.any(0).nonzero()
    c0 = int(keep[0]) if len(keep) else ids.shape[1] - 1
    return ids[:, c0:], mask[:, c0:]


def _hidden(model, tensors: TurnTensors) -> torch.Tensor:
    """Final hidden states at the valid response positions. [M, H]"""
    device = next(model.parameters()).device
    ctx, cmask = _trim(tensors.context_ids, tensors.context_mask)  # [N, Lc_trimmed]
    width = max(1, int(tensors.response_mask.sum(1).max()))
    resp, rmask = tensors.response_ids[:, :width], tensors.response_mask[:, :width]  # [N, width]
    part = TurnTensors(*(t.to(device) for t in (ctx, cmask, resp, rmask)))
    return response_hidden_states(model, *part)[part.response_mask.bool()]  # [M, H]


def _mean(x: torch.Tensor) -> float:
    return float(x.mean()) if x.numel() else 0.0


def _logp(head, h: torch.Tensor, temperature: float) -> torch.Tensor:
    return F.log_softmax(head(h).float() / temperature, dim=-1)  # [c, V] fp32


def row_slices(states: Stage0States, rows_per_step: int, token_budget: int) -> list[slice]:
    """Consecutive row slices of at most ``rows_per_step`` rows and about ``token_budget`` (context +
    response) tokens: the trunks' activations do not grow with the response length."""
    width = max(states.ctx_new.shape[1], states.ctx_cur.shape[1]) + states.resp.shape[1]
    rows = max(1, min(rows_per_step, token_budget // width))
    return [slice(s, s + rows) for s in range(0, len(states), rows)]


@torch.no_grad()
def measure_stage0(new_model, pre_model, cur_model, states: Stage0States, t: torch.Tensor | None,
                   settings: Stage0Settings, slices=None):
    """Per state: KL(pi_new || pi_cur) and the fit KL(target || pi_new), exact over the vocabulary;
    ``t`` = 1/(1+lambda(s)) of the Eq. (7) targets, solved here by bisection when None. One trunk
    forward per model per row slice (``slices``: ``row_slices`` by the token budget unless given).
    Returns (kl_cur [M], fit [M], t [M]) in row-major state order."""
    delta0, temperature = settings.delta0, settings.temperature
    head_new, head_pre, head_cur = (m.get_output_embeddings() for m in (new_model, pre_model, cur_model))
    step = max(1, settings.logits_budget // head_new.weight.shape[0])  # positions per head block
    kls, fits, ts = [], [], []
    offset = 0
    for sl in row_slices(states, len(states), settings.token_budget) if slices is None else slices:
        part = states.rows(sl)
        h_new = _hidden(new_model, part.new_turn)  # [M_b, H]
        h_pre = _hidden(pre_model, part.new_turn)  # [M_b, H]
        h_cur = _hidden(cur_model, part.cur_turn)  # [M_b, H]
        for c in range(0, h_new.shape[0], step):
            logp_new = _logp(head_new, h_new[c : c + step], temperature)  # [c, V]
            logp_pre = _logp(head_pre, h_pre[c : c + step], temperature)  # [c, V]
            logp_cur = _logp(head_cur, h_cur[c : c + step], temperature)  # [c, V]
            if t is None:  # lambda(s) = 0 (t = 1) where pi_pre is inside; bisection only where it is not
                t_c = torch.ones(logp_pre.shape[0], dtype=logp_pre.dtype, device=logp_pre.device)  # [c]
                out = (logp_pre.exp() * (logp_pre - logp_cur)).sum(-1) > delta0  # [c]
                if bool(out.any()):
                    _, lam = geometric_mixture_projection(logp_pre[out], logp_cur[out], delta0)  # [c_out]
                    t_c[out] = torch.where(torch.isinf(lam), torch.zeros_like(lam), 1.0 / (1.0 + lam)).to(t_c.dtype)
            else:
                t_c = t[offset + c : offset + c + logp_new.shape[0]].to(logp_new.device)  # [c]
            target = geometric_mixture_at(logp_pre, logp_cur, t_c)  # [c, V] Eq. (7)
            kls.append((logp_new.exp() * (logp_new - logp_cur)).sum(-1).cpu())  # [c] KL(new || cur)
            fits.append((target.exp() * (target - logp_new)).sum(-1).cpu())  # [c] KL(target || new)
            ts.append(t_c.cpu())
        offset += h_new.shape[0]
    kl, fit = (torch.cat(xs) if xs else torch.zeros(0) for xs in (kls, fits))
    return kl.clamp_min(0.0), fit.clamp_min(0.0), torch.cat(ts) if ts else torch.zeros(0)


def measure_all(new_model, pre_model, cur_model, states: Stage0States, t: torch.Tensor | None,
                settings: Stage0Settings, procs: OneProcess = ONE_PROCESS) -> tuple[torch.Tensor, ...]:
    """``measure_stage0`` over all the states: each process measures its share of the rows and gathers the
    rest in row order, so every process holds the [M] vectors and takes the same decisions."""
    lo, hi = procs.share(len(states))
    first, last = int(states.rmask[:lo].sum()), int(states.rmask[:hi].sum())
    share = states.rows(slice(lo, hi))
    slices = row_slices(share, hi - lo, settings.token_budget)  # this process's forwards
    models = (new_model, pre_model, cur_model)
    one_row = states.rows(slice(0, 1))
    dummy = lambda: [_hidden(m, x) for m, x in zip(models, (one_row.new_turn, one_row.new_turn,  # noqa: E731
                                                               one_row.cur_turn))]
    with torch.no_grad(), procs.lockstep(new_model, len(slices), dummy):
        mine = measure_stage0(new_model, pre_model, cur_model, share, None if t is None else t[first:last],
                              settings, slices)
    for model in models:
        procs.release(model)
    parts = procs.gather(mine)
    return tuple(torch.cat([p[k] for p in parts]) for k in range(3))


def _fit_piece(head_new, head_pre, head_cur, h_new, h_pre, h_cur, t, temperature: float) -> torch.Tensor:
    """Sum over a block of states of KL(target || pi_new), the target (Eq. (7)) without gradient; run under
    checkpointing: one block of logits at a time."""
    with torch.no_grad():
        target = geometric_mixture_at(_logp(head_pre, h_pre, temperature), _logp(head_cur, h_cur, temperature), t)
    logp_new = _logp(head_new, h_new, temperature)  # [c, V]
    return (target.exp() * (target - logp_new)).sum()


def _my_rows(states: Stage0States, sl: slice, procs: OneProcess) -> tuple[slice, float]:
    """This process's rows of the micro-batch ``sl`` and their loss weight. A process left without states runs
    the first row with states at weight 0: FSDP2's collectives need the same calls on every rank."""
    start, stop = sl.start, min(sl.stop, len(states))
    lo, hi = procs.share(stop - start)
    if bool(states.rmask[start + lo : start + hi].any()):
        return slice(start + lo, start + hi), 1.0
    first = start + int(states.rmask[start:stop].any(1).nonzero()[0])
    return slice(first, first + 1), 0.0


def fit_pass(new_model, pre_model, cur_model, states: Stage0States, t: torch.Tensor, opt, settings: Stage0Settings,
             procs: OneProcess = ONE_PROCESS) -> float:
    """One pass over the fit states, one AdamW step per micro-batch of rows on the mean KL(target || pi_new);
    returns the mean loss. Each process's loss is its share of the micro-batch over the micro-batch's state
    count (``procs.backward``: the sum over processes), so the step is the one-process step up to float
    summation order."""
    head_new, head_pre, head_cur = (m.get_output_embeddings() for m in (new_model, pre_model, cur_model))
    step = max(1, settings.logits_budget // head_new.weight.shape[0])  # positions per head block
    losses = []
    starts = torch.cat([torch.zeros(1, dtype=torch.long), states.rmask.sum(1).long().cumsum(0)])  # [N + 1]
    for sl in row_slices(states, settings.rows_per_step, settings.token_budget):
        m_all = int(states.rmask[sl].sum())  # the micro-batch's states, on all ranks
        if m_all == 0:
            continue
        mine, weight = _my_rows(states, sl, procs)
        part = states.rows(mine)
        with torch.no_grad():
            h_pre = _hidden(pre_model, part.new_turn)  # [M_b, H]
            h_cur = _hidden(cur_model, part.cur_turn)  # [M_b, H]
        h_new = _hidden(new_model, part.new_turn)  # [M_b, H] with grad
        m = h_new.shape[0]
        first = int(starts[mine.start])
        t_b = t[first : first + m].to(h_new.device)  # [M_b]
        total = sum(torch.utils.checkpoint.checkpoint(_fit_piece, head_new, head_pre, head_cur, h_new[c : c + step],
                                                      h_pre[c : c + step], h_cur[c : c + step], t_b[c : c + step],
                                                      settings.temperature, use_reentrant=False)
                    for c in range(0, m, step))
        loss = total / m_all
        opt.zero_grad(set_to_none=True)
        procs.backward(loss * weight)
        opt.step()
        losses.append(float(loss.detach()) * weight)
    losses = procs.sum(torch.tensor(losses, dtype=torch.float64)).tolist()  # summed over the processes' shares
    return sum(losses) / max(len(losses), 1)


def _trainable(new_model, lr: float, procs: OneProcess):
    """(the copy Stage-0 trains, its optimizer): ``new_model`` itself (bf16: on fp32 master weights), or the
    processes' fp32 training copy whose parts are the masters (``procs.trainable``)."""
    trained = procs.trainable(new_model)
    trained.requires_grad_(True).train()
    if next(new_model.parameters()).dtype != torch.float32 and trained is new_model:
        return trained, MasterWeightAdamW(list(trained.parameters()), None, [], lr=lr)
    return trained, torch.optim.AdamW(trained.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.99))


def fit_stage0(new_model, cur_model, fit: Stage0States, held: Stage0States, settings: Stage0Settings, log=None,
               label: str = "agent", trace: dict | None = None, procs: OneProcess = ONE_PROCESS) -> dict:
    """Stage-0 (Eqs. (6)-(7)) on given states: ``new_model`` enters as pi_pre and leaves aligned (a frozen
    copy keeps pi_pre). Stops when the (1-alpha) quantile of KL(pi_new || pi_cur) over the fit states is
    <= delta0 and the mean fit KL(target || pi_new) is <= fit_tol x its start value KL(target || pi_pre)
    (the absolute tolerance is reported as ``fit_tol``).

    The exact targets t(s) = 1/(1+lambda(s)) are solved once per state. Those of violating states lie *on*
    the boundary, so fit error leaves about half of them outside while the quantile asks for all but alpha
    inside: once the fit is within tolerance (checked every STAGE0_EVERY passes) or stalls with the quantile
    above delta0, every state with KL > STAGE0_SHRINK x delta0 gets t(s) <- STAGE0_SHRINK x t(s), still an
    Eq. (7) mixture at a smaller radius of its own (t -> 0 is pi_cur, always feasible, so no floor). Inside
    the ball the lr halves after STAGE0_PATIENCE passes without a 1% gain in fit or quantile. Raises if
    still outside after ``max_passes``; a missed fit tolerance keeps the feasible model (``fit_ok`` False).
    ``trace`` receives t, t_exact and the fp32 masters (``master_weights``; ``master_shards`` under torchrun).

    Each process (``procs``) fits and measures its share: every decision is the one-process one up to float
    summation order."""
    log = log or (lambda *_: None)
    delta0, q_level, lr, max_passes = settings.delta0, settings.q_level, settings.lr, settings.max_passes
    pre_model = procs.frozen_copy(new_model).requires_grad_(False).eval()  # pi_pre
    models = (new_model, pre_model, cur_model)
    kl, fit_kl, t = measure_all(*models, fit, None, settings, procs)
    t_exact = t.clone()  # [M] the argmin's exponents
    kl_held = measure_all(*models, held, None, settings, procs)[0] if len(held) else torch.zeros(0)
    # relative -> absolute: a share of KL(target || pi_pre); the floor absorbs rounding when pi_pre is inside
    fit_tol = max(settings.fit_tol * _mean(fit_kl), 1e-6)
    before = {"fit_mean_before": _mean(fit_kl), "kl_quantile_before": kl_quantile(kl, q_level),
              "heldout_kl_quantile_before": kl_quantile(kl_held, q_level),
              "share_outside_before": _mean((t < 1).float())}
    low = next(new_model.parameters()).dtype != torch.float32
    trained, opt = _trainable(new_model, lr, procs)
    best_fit, best_q, stall, since = float("inf"), float("inf"), 0, 0
    for passes in range(max_passes + 1):
        q = kl_quantile(kl, q_level)
        fit_mean = _mean(fit_kl)
        lr_now = opt.param_groups[0]["lr"]
        if passes % 10 == 0:
            log(f"  stage-0 pass {passes}: KL(new||cur) quantile {q:.4f} (delta_0 {delta0}), fit KL(target||new) "
                f"mean {fit_mean:.5f} (tol {fit_tol:.5f}), retargeted {float((t < t_exact).float().mean()):.1%}, "
                f"lr {lr_now:.2e}")
        if (q <= delta0 and (fit_mean <= fit_tol or lr_now <= lr / 1000)) or passes == max_passes:
            break  # done (or inside delta0 with a fit that no longer improves: fit_ok says which)
        if passes >= 1:
            better = fit_mean < 0.99 * best_fit or q < 0.99 * best_q
            best_fit, best_q, stall = min(best_fit, fit_mean), min(best_q, q), (0 if better else stall + 1)
            since += 1
        stalled = stall >= STAGE0_PATIENCE
        if q > delta0 and ((fit_mean <= fit_tol and since >= STAGE0_EVERY) or stalled):  # the fit did what it can:
            outside = kl > STAGE0_SHRINK * delta0  # [M] past or near the boundary: work on them
            t[outside] *= STAGE0_SHRINK
            since, stall, best_q, best_fit = 0, 0, float("inf"), float("inf")  # the pass below fits the new targets
        elif stalled and lr_now > lr / 1000:  # inside, but the fit no longer improves at this lr: halve it
            for group in opt.param_groups:
                group["lr"] *= 0.5
            stall = 0
        fit_pass(trained, pre_model, cur_model, fit, t, opt, settings, procs)
        procs.write_back(trained, new_model)  # for the measurement
        new_model.eval()
        kl, fit_kl, _ = measure_all(*models, fit, t, settings, procs)
        trained.train()
    _stop_fitting(new_model, trained, opt, trace, t, t_exact, low, procs)
    del opt, trained
    if beyond(q, delta0):  # a NaN quantile too
        del pre_model
        raise Stage0Unreachable(f"Stage-0 could not bring {label} inside delta_0={delta0}: KL quantile still {q:.4f} "
                                f"after {passes} passes; raise --stage0-delta or --stage0-max-passes")
    out = {**before, "kl_quantile": q, "kl_mean": _mean(kl), "fit_mean": fit_mean,
           "fit_quantile": kl_quantile(fit_kl, q_level), "fit_tol": fit_tol,
           "fit_ok": fit_mean <= fit_tol, "passes": passes, "states": fit.num_states, "delta0": delta0,
           "retargeted": _mean((t < t_exact).float()),
           "mean_lambda_finite": float(((1 - t[t > 0]) / t[t > 0]).mean()) if bool((t > 0).any()) else 0.0}
    if len(held):
        out.update(_heldout_report(models, held, settings, procs, q, log))
    del pre_model
    return out


def _stop_fitting(new_model, trained, opt, trace: dict | None, t: torch.Tensor, t_exact: torch.Tensor, low: bool,
                  procs: OneProcess) -> None:
    """Stage-0's model frozen again, its optimizer's hooks off the bf16 weights, and ``trace`` filled."""
    trained.zero_grad(set_to_none=True)
    new_model.requires_grad_(False).eval()
    masters = opt.release() if isinstance(opt, MasterWeightAdamW) else None  # hooks off the bf16 weights
    if trace is not None:
        trace.update(t=t.clone(), t_exact=t_exact)
        if low:  # the replacement's first SAT turn continues these fp32 masters
            shards = procs.kept_masters(trained)
            trace.update(master_weights=masters) if shards is None else trace.update(master_shards=shards)


def _heldout_report(models: tuple, held: Stage0States, settings: Stage0Settings, procs: OneProcess, q: float,
                    log) -> dict:
    """Stage-0's KL and fit on states it was not fitted to; a warning when the ball does not carry to them."""
    kl_h, fit_h, _ = measure_all(*models, held, None, settings, procs)
    out = dict(heldout_states=held.num_states, heldout_kl_quantile=kl_quantile(kl_h, settings.q_level),
               heldout_kl_mean=_mean(kl_h), heldout_fit_mean=_mean(fit_h))
    if beyond(out["heldout_kl_quantile"], settings.delta0):
        log(f"  WARNING stage-0: on {held.num_states} held-out states the KL quantile is "
            f"{out['heldout_kl_quantile']:.4f} > delta_0 {settings.delta0} (in sample {q:.4f}): the fit does not "
            "carry to new states; more Stage-0 states (--stage0-problems) narrow the gap")
    return out


def slot_states(team: Team, slot: int, new_agent: Agent, batch) -> tuple[Stage0States, int]:
    """The slot's states: the incumbent's rollout contexts and the same messages in the replacement's own
    chat template (chain: the same earlier answers); and how many rows the two templates tokenise differently."""
    turn = batch.turns[slot]
    holder = Team(team.agents[:slot] + [new_agent] + team.agents[slot + 1 :], team.config)
    chain = team.protocol == "chain"
    previous = [[t.answers[i] for t in batch.turns[:slot]] if chain else [] for i in range(len(batch))]
    contexts = [holder.prompt_ids(slot, p, prev) for p, prev in zip(batch.problems, previous)]
    ctx_new, cmask_new = left_pad(contexts, new_agent.tokenizer.pad_token_id)  # [N, Lc']
    differ = sum(ctx != turn.context_ids[i][turn.context_mask[i].bool()].tolist() for i, ctx in enumerate(contexts))
    return Stage0States(ctx_new, cmask_new, *turn.tensors), differ


def split_problems(problems: list[Problem], heldout_fraction: float) -> tuple[list[Problem], list[Problem]]:
    """Distinct problems, split into fit and held-out (no problem in both)."""
    unique = list({p.id: p for p in problems}.values())
    n_held = int(round(heldout_fraction * len(unique))) if len(unique) > 1 else 0
    n_held = min(max(n_held, 1 if len(unique) > 1 and heldout_fraction > 0 else 0), len(unique) - 1)
    return unique[: len(unique) - n_held], unique[len(unique) - n_held :]


def stage0_align(team: Team, slot: int, new_agent: Agent, problems: list[Problem], cfg, sampling: SamplingConfig,
                 lr: float, log, backend, trace: dict | None = None) -> dict:
    """Bring ``new_agent`` inside the per-state KL ball of radius delta_0 around the incumbent of ``slot``
    (``fit_stage0``). States: every position of the incumbent's responses in fresh rollouts of the trained
    team; a quarter of the distinct problems is held out of the fit and only measured. With --shard-rollouts
    (always under torchrun) the rollouts are seeded blocks: the same states for any number of processes.
    ``trace`` receives the fit states besides ``fit_stage0``'s entries."""
    incumbent = team.agents[slot]
    fit_problems, held_problems = split_problems(problems, STAGE0_HELDOUT_FRACTION)
    problems = fit_problems + held_problems
    batch = team.procs.rollout(rollout, team, problems, cfg.group_size, sampling, backend, True)  # the team's states
    states, differ = slot_states(team, slot, new_agent, batch)
    if differ:
        log(f"  stage-0: the replacement's chat template renders {differ} of {len(batch)} contexts as other tokens "
            f"than the incumbent's; each model is evaluated on its own rendering")
    n_fit = len(fit_problems) * cfg.group_size
    fit, held = states.rows(slice(0, n_fit)), states.rows(slice(n_fit, len(states)))
    fit_tol = STAGE0_FIT_TOL if cfg.stage0_fit_tol is None else cfg.stage0_fit_tol
    new_agent.freeze()
    if cfg.gradient_checkpointing:  # as in the update: trunk activations recomputed in the backward pass
        new_agent.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trace = {} if trace is None else trace
    trace["fit"] = fit
    settings = Stage0Settings(cfg.stage0_delta, cfg.quantile, lr, cfg.stage0_max_passes, fit_tol, cfg.temperature,
                              max(1, cfg.minibatch_size), cfg.token_budget)
    info = fit_stage0(new_agent.model, incumbent.model, fit, held, settings, log=log,
                      label=f"agent {slot + 1} ('{new_agent.spec.name}')", trace=trace, procs=team.procs)
    new_agent.master_weights = trace.get("master_weights")  # bf16: its next turn continues these fp32 masters
    new_agent.master_shards = trace.get("master_shards")  # (this rank's shards of them under torchrun)
    if cfg.gradient_checkpointing:
        new_agent.model.gradient_checkpointing_disable()
    new_agent.freeze()
    info.update(template_differs=differ, contexts=len(batch))
    return info


# ---------------------------------------------------------------------------
# How a replacement enters the team: --upgrade-accept stage0 | raw | certified
# ---------------------------------------------------------------------------
CERTIFIED_RADII = (0.01, 0.03, 0.1, 0.3, 1.0)  # the Stage-0 radii delta_0 that `certified` tries beside the raw swap
ACCEPTANCE_SPLITS = ("selection", "certification")


@dataclass(frozen=True)
class AcceptanceDraws:
    """What ``--upgrade-accept certified`` draws on (``harness.run.upgrade`` builds it): its two splits of rows
    (``acceptance_splits``) and ``draw(team, rows, label)``, the team's reward on each row under seeds fixed by
    ``label`` (``sat.evaluate``), so two teams drawn under one label pair row by row (common random numbers)."""

    splits: dict[str, list[Problem]]  # "selection", "certification": one row per entry (problems repeat)
    draw: Callable[[Team, list[Problem], str], list[float]]


@dataclass(frozen=True)
class Candidate:
    """One way the replacement may enter the team: its name and ``build() -> (agent, Stage-0 record or None)``."""

    name: str
    build: Callable[[], tuple[Agent, dict | None]]


def acceptance_splits(train: list[Problem], heldout: list[Problem], seed: int, rows: int) -> dict[str, list[Problem]]:
    """The selection and certification rows of ``--upgrade-accept certified``, carved from the training problems:
    their distinct texts less every text a held-out problem asks (the held-out rows feed the stage and run
    certificates and are never tuned on), shuffled under ``seed``, the first half for selection and the second
    for certification (no text in both). Each split is ``rows`` rows cycling through its first min(rows, half)
    problems; every row is drawn under a seed of its own."""
    held = {p.problem for p in heldout}
    unique = list({p.problem: p for p in train if p.problem not in held}.values())
    if len(unique) < 2:
        raise ValueError(f"--upgrade-accept certified splits the training problems outside the held-out set in two, "
                         f"but only {len(unique)} remain: pass more problems (--data), or use --upgrade-accept stage0")
    random.Random(f"upgrade acceptance splits {seed}").shuffle(unique)
    half = len(unique) // 2
    parts = {"selection": unique[:half], "certification": unique[half : 2 * half]}
    return {name: [part[k % min(rows, half)] for k in range(rows)] for name, part in parts.items()}


def certify(candidates: list[Candidate], rewards: Callable[[Agent | None, str], list[float]], delta_conf: float,
            log, reward_range: tuple[float, float] = DEFAULT_RANGE) -> tuple[Agent | None, dict]:
    """The certified acceptance rule for one slot (Sec. 4.3: the team's change when one factor of the product
    policy is replaced, bounded from paired draws by ``bounds.paired_change_bound``). ``rewards(agent, split)``:
    the team with ``agent`` in the slot (None: the incumbent) on that split's rows, every team under the split's
    seeds. (1) Select: each candidate's paired lower bound at ``delta_conf`` on its gain over the incumbent on
    the selection split; the largest wins (on a tie the earlier: the smaller radius); a candidate whose Stage-0
    cannot reach its radius is recorded and skipped. (2) Certify: the winner's paired lower bound on the
    certification split, whose problems and seeds the choice never saw, so given everything before those draws it
    is a valid (1 - delta_conf) lower bound on the change on those rows however the winner was chosen. Returns
    (the winner if that bound is > 0, else None: the incumbent stays; the record)."""
    incumbent = {split: rewards(None, split) for split in ACCEPTANCE_SPLITS}
    best, best_bound, best_name, tried = None, -math.inf, None, []
    for candidate in candidates:
        try:
            agent, stage0 = candidate.build()
        except Stage0Unreachable as err:
            tried.append({"candidate": candidate.name, "error": " ".join(str(err).split())})
            log(f"  certified: {candidate.name} dropped: {err}")
            continue
        bound = paired_change_bound(incumbent["selection"], rewards(agent, "selection"), reward_range, delta_conf)
        tried.append({"candidate": candidate.name, "selection": bound, **({"stage0": stage0} if stage0 else {})})
        log(f"  certified: {candidate.name}: gain on the selection split {bound['mean_change']:+.4f}, "
            f"lower bound {bound['lower_bound']:+.4f}")
        if bound["lower_bound"] > best_bound:
            best, best_bound, best_name = agent, bound["lower_bound"], candidate.name
    cert = paired_change_bound(incumbent["certification"], rewards(best, "certification"), reward_range,
                                delta_conf)
    swapped = cert["lower_bound"] > 0
    log(f"  certified: {best_name} on the certification split: gain {cert['mean_change']:+.4f}, lower bound "
        f"{cert['lower_bound']:+.4f} -> {'swapped in' if swapped else 'not > 0: the incumbent stays'}")
    record = {"rule": "certified", "chosen": best_name, "swapped": swapped, "certification": cert,
              "candidates": tried,
              "kind": "certification: a lower bound, with probability >= 1 - delta_conf, on the change in expected "
                      "team reward from swapping the chosen candidate in, on the certification split's rows (training "
                      "problems outside the held-out set), paired under common random numbers; selection: the "
                      "same bound on the selection split, used only to rank the candidates"}
    return (best if swapped else None), record


def with_agent(team: Team, slot: int, agent: Agent) -> Team:
    """The team with ``agent`` in ``slot`` (the team itself unchanged)."""
    return Team(team.agents[:slot] + [agent] + team.agents[slot + 1 :], team.config)


def stage0_candidate(team: Team, slot: int, raw: Agent, prompts: list[Problem], cfg, sampling: SamplingConfig, log,
                     backend) -> tuple[Agent, dict]:
    """A copy of the raw replacement after Stage-0 (Eqs. (6)-(7)) at ``cfg.stage0_delta``, on the states of a
    rollout seeded by the run seed alone: every radius fits the same states, and the run's RNG streams are left
    as they were."""
    agent = Agent(raw.spec, raw.procs.frozen_copy(raw.model), raw.tokenizer, raw.procs)
    with torch.random.fork_rng(devices=rng_devices(cfg.device)):
        torch.manual_seed(random.Random(f"stage-0 states {cfg.seed}").getrandbits(63))
        info = stage0_align(team, slot, agent, prompts, cfg, sampling, lr=cfg.lr, log=log, backend=backend)
    return agent, info


def certified_upgrade(team: Team, slot: int, new_agent: Agent, prompts: list[Problem], cfg, sampling: SamplingConfig,
                      acceptance: AcceptanceDraws, stage: int, log, backend) -> tuple[Agent | None, dict]:
    """``--upgrade-accept certified`` for one slot (``certify``). The candidates: Stage-0 of the replacement at
    each radius of CERTIFIED_RADII (all fitted on the same states of ``prompts``), then the raw swap; Stage-0
    only where the replacement shares the incumbent's vocabulary (Eq. (7) mixes per-token distributions, so
    across vocabularies it is undefined and the raw swap is the one candidate, as the record says). Each split's
    seeds depend on the stage and slot, so a later upgrade in the same run draws afresh."""
    try:
        check_same_vocabulary(team.agents[slot], new_agent)
        radii, why = CERTIFIED_RADII, f"delta_0 in {list(CERTIFIED_RADII)}"
    except ValueError as err:
        radii, why = (), f"none: Stage-0 is undefined across vocabularies, so raw is the one candidate ({err})"
    candidates = [Candidate(f"stage0 delta0={d:g}", partial(stage0_candidate, team, slot, new_agent, prompts,
                                                            replace(cfg, stage0_delta=d), sampling, log, backend))
                  for d in radii] + [Candidate("raw", lambda: (new_agent, None))]
    labels = {split: f"upgrade {split} at stage {stage} slot {slot + 1}" for split in ACCEPTANCE_SPLITS}

    def rewards(agent: Agent | None, split: str) -> list[float]:
        holder = team if agent is None else with_agent(team, slot, agent)
        return acceptance.draw(holder, acceptance.splits[split], labels[split])

    chosen, record = certify(candidates, rewards, cfg.delta_conf, log, team.config.reward.range)
    record["stage0_candidates"] = why
    record["splits"] = {split: {"rows": len(rows), "problems": len({p.problem for p in rows})}
                        for split, rows in acceptance.splits.items()}
    return chosen, record


def parse_upgrade(item: str, n_agents: int) -> tuple[int, str]:
    """--upgrade SLOT=MODEL -> (0-based slot, model spec)."""
    slot_text, _, spec = item.partition("=")
    if not slot_text.strip().isdigit() or not spec.strip():
        raise ValueError(f"--upgrade {item!r}: write SLOT=MODEL with a 1-based slot, e.g. --upgrade 2=Qwen3-8B")
    slot = int(slot_text) - 1
    if not 0 <= slot < n_agents:
        raise ValueError(f"--upgrade slot {slot + 1} is out of range: the team has agents 1..{n_agents}")
    return slot, spec.strip()


def apply_upgrades(cfg, run, train: list[Problem], stage: int, sampling: SamplingConfig,
                   load_replacement: Callable[[str, int], Agent], evaluate=None,
                   acceptance: AcceptanceDraws | None = None) -> list[dict]:
    """Replace the agents named by --upgrade SLOT=MODEL in ``run`` (``sat.RunState``: its team, controllers,
    value heads, RNG, backend and log), each entering as --upgrade-accept says (``upgrade_slot``).
    ``load_replacement(spec, slot)`` builds the new agent (``harness.run``: loading, and a tiny agent's warm
    start); ``evaluate(team) -> dict`` records the accuracy with the raw replacement, if given; ``acceptance``:
    the splits of ``--upgrade-accept certified``."""
    events = []
    for item in cfg.upgrade:
        slot, spec = parse_upgrade(item, len(run.team))
        new_agent = load_replacement(spec, slot)
        run.team.procs.adopt([new_agent])  # torchrun: rank 0's weights on every rank (and as shards with them)
        events.append(upgrade_slot(cfg, run, train, stage, sampling, slot, new_agent, evaluate, acceptance))
    return events


def upgrade_slot(cfg, run, train: list[Problem], stage: int, sampling: SamplingConfig, slot: int, new_agent: Agent,
                 evaluate, acceptance: AcceptanceDraws | None) -> dict:
    """One slot's upgrade. stage0 (the paper, Sec. 5): Stage-0 at --stage0-delta, then the swap. raw: the swap
    as loaded. certified (``certified_upgrade``): the swap only with a certified gain. A swapped slot gets a
    fresh controller (and value head with --adv gae). Returns the event upgrades.json records."""
    team, log, backend, rule = run.team, run.log, run.backend, cfg.upgrade_accept
    old_name = team.agents[slot].spec.name
    if rule == "stage0":
        check_same_vocabulary(team.agents[slot], new_agent)
    before = None
    if evaluate is not None:  # the raw replacement in the team, and alone (its own accuracy)
        before = evaluate(with_agent(team, slot, new_agent))
        log(f"upgrade: before Stage-0, held-out team accuracy with the raw replacement "
            f"{before['eval_accuracy']:.3f}; agent {slot + 1} alone {before['eval_agent_accuracy'][slot]:.3f}")
    n_prompts = cfg.stage0_problems or cfg.batch_size // cfg.group_size
    prompts = [] if rule == "raw" else [train[run.rng.randrange(len(train))] for _ in range(n_prompts)]
    log(f"upgrade: agent {slot + 1} '{old_name}' -> '{new_agent.spec.name}', " + {
        "stage0": f"Stage-0 alignment (delta_0 = {cfg.stage0_delta})", "raw": "swapped in raw (no Stage-0)",
        "certified": "certified acceptance (Stage-0 candidates and the raw swap)"}[rule])
    t0 = time.time()
    if rule == "stage0":
        chosen = new_agent
        found = {"stage0": stage0_align(team, slot, new_agent, prompts, cfg, sampling, lr=cfg.lr, log=log,
                                        backend=backend)}
    elif rule == "raw":
        chosen, found = new_agent, {"accept": {"rule": "raw", "swapped": True}}
    else:
        chosen, accept = certified_upgrade(team, slot, new_agent, prompts, cfg, sampling, acceptance, stage, log,
                                           backend)
        found = {"accept": accept}
    if chosen is not None:
        backend.release(team.swap(slot, chosen, projected=rule == "stage0"))  # the incumbent's engine, if kept
        run.controllers[slot] = QuantileController(delta=cfg.delta, quantile=cfg.quantile, beta=cfg.beta)
        if cfg.adv == "gae":
            run.value_heads[slot] = make_value_head(chosen)
    event = {"slot": slot + 1, "from": old_name, "to": new_agent.spec.name, "at_stage": stage,
             "seconds": time.time() - t0, **found}
    if before is not None:
        event["before_stage0"] = before
    if rule == "stage0":
        log_stage0(found["stage0"], log)
    return event


def log_stage0(stage0: dict, log) -> None:
    """Stage-0's outcome on one console line."""
    held_q = stage0.get("heldout_kl_quantile", float("nan"))
    log(f"  stage-0 done in {stage0['passes']} passes over {stage0['states']} states: KL quantile "
        f"{stage0['kl_quantile_before']:.4f} -> {stage0['kl_quantile']:.4f} (held-out {held_q:.4f}), fit mean "
        f"{stage0['fit_mean']:.5f} (tol {stage0['fit_tol']:.5f}{'' if stage0['fit_ok'] else ', NOT reached'}), "
        f"{stage0['retargeted']:.0%} of the states aimed deeper inside")
