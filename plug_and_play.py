"""Plug-and-play: replace an agent by a stronger model without retraining the rest.

Paper, Section 5 (Eqs. (6)-(7)) and Section 4.3 (plug-and-play invariance of the bound). Stage-0
projects the replacement pi_pre onto the per-state KL ball of radius delta_0 around the incumbent:

    pi_new = argmin_pi E_s[ KL(pi(.|s) || pi_pre(.|s)) ]  s.t.  KL(pi(.|s) || pi_j,cur(.|s)) <= delta_0   (6)
    pi_new(a|s)  ~  pi_pre(a|s)^(1/(1+lambda(s))) * pi_j,cur(a|s)^(lambda(s)/(1+lambda(s)))          (7)

with lambda(s) >= 0 found by bisection per state (``kl_projection.geometric_mixture_projection``): 0
where pi_pre is already inside, else the value that makes the constraint tight. A network cannot be
set to Eq. (7) state by state, so Stage-0 *fits* it (``fit_stage0``): pi_pre stays frozen and the
trainable copy minimises E_s KL(target(.|s) || pi_new(.|s)), measured in sample and on held-out states.

Memory is bounded by ``token_budget`` (rows per trunk micro-batch) and ``logits_budget`` (LM-head positions
per block, recomputed in the backward pass), not by the response length (``memory.stage0_rank_bytes``).
Each model reads a state through its own chat template; per-token mixing needs a shared vocabulary.
The states it fits, and how a model reads them, are ``stage0_states.py``; the certified acceptance rule (a rule
beyond the paper) is ``harness/certified_acceptance.py``; the command line's ``--upgrade SLOT=MODEL`` is
``harness.upgrades``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adapter import own_parameters
from harness.processes import ONE_PROCESS, OneProcess
from kl_projection import geometric_mixture_at, geometric_mixture_projection
from rollout import SamplingConfig, rollout
from stage0_states import Stage0States, final_hidden, row_slices, slot_states, split_problems
from team import ADAMW_BETAS, Agent, MasterWeightAdamW, Problem, Team
from trust_region import beyond, kl_from_logprobs, kl_quantile

# ``cfg`` below is the run's ``harness.config.Config``.
STAGE0_LOGITS_BUDGET = 1 << 22  # elements of one [positions, V] LM-head block (16 MiB in fp32)
STAGE0_HELDOUT_FRACTION = 0.25  # share of the Stage-0 problems whose states are held out of the fit
STAGE0_SHRINK = 0.9  # a state past 0.9 delta_0 has its target exponent t(s) = 1/(1+lambda(s)) shrunk by this
STAGE0_EVERY = 5  # passes between two such retargetings, so the fit can follow
STAGE0_PATIENCE = 10  # passes with neither a 1% better fit nor a 1% lower quantile before the learning rate halves
STAGE0_FIT_TOL = 0.1  # default fit tolerance: mean KL(target || pi_new) <= 0.1 x its start value KL(target || pi_pre)


class Stage0Unreachable(RuntimeError):
    """Stage-0 ran out of passes with the KL quantile still above delta_0 (``fit_stage0``); ``fit`` holds what
    it reached (record, exponents, masters)."""

    def __init__(self, message: str, fit: Stage0Fit | None = None):
        super().__init__(message)
        self.fit = fit


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
class Stage0Fit:
    """What Stage-0 returns (``fit_stage0``, ``stage0_align``): its record, the fit states with their Eq. (7)
    exponents t(s) = 1/(1+lambda(s)), and a bf16 replacement's fp32 master weights, which its first SAT turn
    continues (``master_shards``: this rank's shards of them under torchrun; both None for an fp32 model)."""

    record: dict  # what upgrades.json keeps: KL quantiles and fit before and after, passes, states, ...
    states: Stage0States  # the fit states
    t: torch.Tensor  # [M] the exponents fitted: t_exact, shrunk where a state was retargeted
    t_exact: torch.Tensor  # [M] the argmin's exponents
    master_weights: list[torch.Tensor] | None = None
    master_shards: list[torch.Tensor] | None = None


def _mean(x: torch.Tensor) -> float:
    return float(x.mean()) if x.numel() else 0.0


def _logp(head, h: torch.Tensor, temperature: float) -> torch.Tensor:
    return F.log_softmax(head(h).float() / temperature, dim=-1)  # [c, V] fp32


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
        h_new = final_hidden(new_model, part.new_turn)  # [M_b, H]
        h_pre = final_hidden(pre_model, part.new_turn)  # [M_b, H]
        h_cur = final_hidden(cur_model, part.cur_turn)  # [M_b, H]
        for c in range(0, h_new.shape[0], step):
            logp_new = _logp(head_new, h_new[c : c + step], temperature)  # [c, V]
            logp_pre = _logp(head_pre, h_pre[c : c + step], temperature)  # [c, V]
            logp_cur = _logp(head_cur, h_cur[c : c + step], temperature)  # [c, V]
            if t is None:  # lambda(s) = 0 (t = 1) where pi_pre is inside; bisection only where it is not
                t_c = torch.ones(logp_pre.shape[0], dtype=logp_pre.dtype, device=logp_pre.device)  # [c]
                out = kl_from_logprobs(logp_pre, logp_cur) > delta0  # [c] pi_pre outside the ball
                if bool(out.any()):
                    _, lam = geometric_mixture_projection(logp_pre[out], logp_cur[out], delta0)  # [c_out]
                    t_c[out] = torch.where(torch.isinf(lam), torch.zeros_like(lam), 1.0 / (1.0 + lam)).to(t_c.dtype)
            else:
                t_c = t[offset + c : offset + c + logp_new.shape[0]].to(logp_new.device)  # [c]
            target = geometric_mixture_at(logp_pre, logp_cur, t_c)  # [c, V] Eq. (7)
            kls.append(kl_from_logprobs(logp_new, logp_cur).cpu())  # [c] KL(new || cur)
            fits.append(kl_from_logprobs(target, logp_new).cpu())  # [c] KL(target || new)
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
    dummy = lambda: [final_hidden(m, x) for m, x in zip(models, (one_row.new_turn, one_row.new_turn,  # noqa: E731
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
    return kl_from_logprobs(target, logp_new).sum()


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
            h_pre = final_hidden(pre_model, part.new_turn)  # [M_b, H]
            h_cur = final_hidden(cur_model, part.cur_turn)  # [M_b, H]
        h_new = final_hidden(new_model, part.new_turn)  # [M_b, H] with grad
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
    processes' fp32 training copy whose parts are the masters (``procs.trainable``). What it fits is the model's
    own parameters (``adapter.own_parameters``): the whole model, or with --lora its fresh adapter alone. An
    adapter agent's base is frozen and may be shared with the team's other agents (``lora.replacement_agent``), so
    fitting it would move them; and after Stage-0 the agent trains, checkpoints and is served as base + adapter, so
    Eq. (7)'s target is fitted in that family (the fit tolerance reports how close a rank-r adapter gets)."""
    trained = procs.trainable(new_model)
    own = own_parameters(trained)
    for p in own:
        p.requires_grad_(True)
    trained.train()
    if next(new_model.parameters()).dtype != torch.float32 and trained is new_model:
        return trained, MasterWeightAdamW(own, None, [], lr=lr)
    return trained, torch.optim.AdamW(own, lr=lr, weight_decay=0.0, betas=ADAMW_BETAS)


def fit_stage0(new_model, cur_model, fit: Stage0States, held: Stage0States, settings: Stage0Settings, log=None,
               label: str = "agent", procs: OneProcess = ONE_PROCESS) -> Stage0Fit:
    """Stage-0 (Eqs. (6)-(7)) on given states: ``new_model`` enters as pi_pre and leaves aligned (a frozen
    copy keeps pi_pre). Stops when the (1-alpha) quantile of KL(pi_new || pi_cur) over the fit states is
    <= delta0 and the mean fit KL(target || pi_new) is <= fit_tol x its start value KL(target || pi_pre)
    (the absolute tolerance is reported as ``fit_tol``); the passes are ``_fit_passes``. Raises
    ``Stage0Unreachable`` if still outside after ``max_passes``; a missed fit tolerance keeps the feasible
    model (``fit_ok`` False). Returns the record, the exponents t and t_exact, and the fp32 masters.

    Each process (``procs``) fits and measures its share: every decision is the one-process one up to float
    summation order."""
    log = log or (lambda *_: None)
    delta0, q_level = settings.delta0, settings.q_level
    pre_model = procs.frozen_copy(new_model).requires_grad_(False).eval()  # pi_pre
    models = (new_model, pre_model, cur_model)
    kl, fit_kl, t = measure_all(*models, fit, None, settings, procs)  # [M] each
    t_exact = t.clone()  # [M] the argmin's exponents
    kl_held = measure_all(*models, held, None, settings, procs)[0] if len(held) else torch.zeros(0)  # [M_held]
    # relative -> absolute: a share of KL(target || pi_pre); the floor absorbs rounding when pi_pre is inside
    fit_tol = max(settings.fit_tol * _mean(fit_kl), 1e-6)
    before = {"fit_mean_before": _mean(fit_kl), "kl_quantile_before": kl_quantile(kl, q_level),
              "heldout_kl_quantile_before": kl_quantile(kl_held, q_level),
              "share_outside_before": _mean((t < 1).float())}
    low = next(new_model.parameters()).dtype != torch.float32
    trained, opt = _trainable(new_model, settings.lr, procs)
    passes, q, fit_mean, kl, fit_kl = _fit_passes(models, trained, opt, fit, t, t_exact, kl, fit_kl, fit_tol,
                                                  settings, procs, log)
    masters, shards = _stop_fitting(new_model, trained, opt, low, procs)
    del opt, trained
    record = {**before, "kl_quantile": q, "kl_mean": _mean(kl), "fit_mean": fit_mean,
              "fit_quantile": kl_quantile(fit_kl, q_level), "fit_tol": fit_tol,
              "fit_ok": fit_mean <= fit_tol, "passes": passes, "states": fit.num_states, "delta0": delta0,
              "retargeted": _mean((t < t_exact).float()),
              "mean_lambda_finite": float(((1 - t[t > 0]) / t[t > 0]).mean()) if bool((t > 0).any()) else 0.0}
    result = Stage0Fit(record, fit, t, t_exact, masters, shards)
    if beyond(q, delta0):  # a NaN quantile too
        del pre_model
        raise Stage0Unreachable(f"Stage-0 could not bring {label} inside delta_0={delta0}: KL quantile still {q:.4f} "
                                f"after {passes} passes; raise --stage0-delta or --stage0-max-passes", result)
    if len(held):
        record.update(_heldout_report(models, held, settings, procs, q, log))
    del pre_model
    return result


def _fit_passes(models: tuple, trained, opt, fit: Stage0States, t: torch.Tensor, t_exact: torch.Tensor,
                kl: torch.Tensor, fit_kl: torch.Tensor, fit_tol: float, settings: Stage0Settings, procs: OneProcess,
                log) -> tuple[int, float, float, torch.Tensor, torch.Tensor]:
    """Stage-0's passes (``fit_pass``, then a measurement), from the per-state KL(pi_new || pi_cur) ``kl`` [M]
    and fit KL(target || pi_new) ``fit_kl`` [M] of the start; returns (passes, KL quantile, mean fit, kl, fit_kl)
    at the end.

    The exact targets t(s) = 1/(1+lambda(s)) are solved once per state. Those of violating states lie *on*
    the boundary, so fit error leaves about half of them outside while the quantile asks for all but alpha
    inside: once the fit is within tolerance (checked every STAGE0_EVERY passes) or stalls with the quantile
    above delta0, every state with KL > STAGE0_SHRINK x delta0 gets t(s) <- STAGE0_SHRINK x t(s) (in ``t``, in
    place), still an Eq. (7) mixture at a smaller radius of its own (t -> 0 is pi_cur, always feasible, so no
    floor). Inside the ball the lr halves after STAGE0_PATIENCE passes without a 1% gain in fit or quantile."""
    new_model, pre_model, cur_model = models
    delta0, lr, max_passes = settings.delta0, settings.lr, settings.max_passes
    best_fit, best_q, stall, since = float("inf"), float("inf"), 0, 0
    for passes in range(max_passes + 1):
        q = kl_quantile(kl, settings.q_level)
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
    return passes, q, fit_mean, kl, fit_kl


def _stop_fitting(new_model, trained, opt, low: bool,
                  procs: OneProcess) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
    """Stage-0's model frozen again and its optimizer's hooks off the bf16 weights; returns (master_weights,
    master_shards): a bf16 model's fp32 masters, whole or (under torchrun) this rank's shards of them."""
    trained.zero_grad(set_to_none=True)
    new_model.requires_grad_(False).eval()
    masters = opt.release() if isinstance(opt, MasterWeightAdamW) else None  # hooks off the bf16 weights
    if not low:
        return None, None
    shards = procs.kept_masters(trained)
    return (masters, None) if shards is None else (None, shards)


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


def stage0_align(team: Team, slot: int, new_agent: Agent, problems: list[Problem], cfg, sampling: SamplingConfig,
                 lr: float, log, backend) -> Stage0Fit:
    """Bring ``new_agent`` inside the per-state KL ball of radius delta_0 around the incumbent of ``slot``
    (``fit_stage0``). States: every position of the incumbent's responses in fresh rollouts of the trained
    team; a quarter of the distinct problems is held out of the fit and only measured. With --shard-rollouts
    (always under torchrun) the rollouts are seeded blocks: the same states for any number of processes.
    Returns ``fit_stage0``'s result, its record also counting the contexts; the replacement keeps its masters."""
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
    settings = Stage0Settings(cfg.stage0_delta, cfg.quantile, lr, cfg.stage0_max_passes, fit_tol, cfg.temperature,
                              max(1, cfg.minibatch_size), cfg.token_budget)
    fitted = fit_stage0(new_agent.model, incumbent.model, fit, held, settings, log=log,
                        label=f"agent {slot + 1} ('{new_agent.spec.name}')", procs=team.procs)
    new_agent.master_weights = fitted.master_weights  # bf16: its next turn continues these fp32 masters
    new_agent.master_shards = fitted.master_shards  # (this rank's shards of them under torchrun)
    if cfg.gradient_checkpointing:
        new_agent.model.gradient_checkpointing_disable()
    new_agent.freeze()
    fitted.record.update(template_differs=differ, contexts=len(batch))
    return fitted
