"""Plug-and-play: replace an agent by a stronger model without retraining the rest.

Paper, Section 5 ("plug-and-play upgrades", Eqs. (6)-(7)) and Section 4.3
(plug-and-play invariance of the bound). Stage-0 projects the replacement
pi_pre onto the per-state KL ball of radius delta_0 around the incumbent:

    pi_new = argmin_pi E_s[ KL(pi(.|s) || pi_pre(.|s)) ]  s.t.  KL(pi(.|s) || pi_j,cur(.|s)) <= delta_0
    pi_new(a|s)  ~  pi_pre(a|s)^(1/(1+lambda(s))) * pi_j,cur(a|s)^(lambda(s)/(1+lambda(s)))

with lambda(s) >= 0 found by bisection per state (``trust_region.
geometric_mixture_projection``). Per-token mixing needs a shared vocabulary;
a replacement with another tokenizer is refused (``team.check_same_vocabulary``).
Then SAT continues with the new agent in the team.

    python sat.py --resume runs/sat --upgrade 2=tiny-6L --stages 12
"""
from __future__ import annotations

import random
import time

import torch
import torch.nn.functional as F

from logprobs import measure_kl, response_hidden_states
from rollout import SamplingConfig, Turn, rollout
from tasks import Problem
from team import Agent, Team, check_same_vocabulary, warm_start
from trust_region import QuantileController, geometric_mixture_projection, quantile
from update import make_value_head

# ``cfg`` below is the run's ``sat.Config``.


def state_logprobs(model, turn: Turn, rows: slice, temperature: float) -> torch.Tensor:
    """Full-vocabulary log pi(.|s) at every valid response position of ``rows``. [M, V]"""
    device = next(model.parameters()).device
    args = [t[rows].to(device) for t in (turn.context_ids, turn.context_mask, turn.response_ids, turn.response_mask)]
    hidden = response_hidden_states(model, *args)[args[3].bool()]  # [M, H]
    return F.log_softmax(model.get_output_embeddings()(hidden).float() / temperature, dim=-1)  # [M, V]


STAGE0_MARGIN = 0.5  # Stage-0 trains toward the projection onto the ball of radius 0.5 * delta_0


def stage0_align(team: Team, slot: int, new_agent: Agent, problems: list[Problem], cfg,
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


def load_replacement(spec: str, cfg, team: Team, train: list[Problem], slot: int) -> Agent:
    """The new model for an upgraded slot. A tiny spec gets its own (longer)
    warm start, standing in for a stronger pretrained model."""
    dtype = getattr(torch, cfg.dtype or ("float32" if cfg.device == "cpu" else "bfloat16"))
    agent = Agent.load(spec, device=cfg.device, dtype=dtype, seed=cfg.seed * 100 + 50 + slot)
    if agent.spec.kind == "tiny":
        steps = cfg.upgrade_warmup_steps if cfg.upgrade_warmup_steps is not None else 2 * cfg.warmup_steps
        holder = Team(list(team.agents), team.config)  # the slot's own prompt format (chain: earlier answers)
        holder.agents[slot] = agent
        warm_start(holder, train, steps, cfg.warmup_p_wrong, cfg.seed + 7, slots=[slot])
    return agent


def apply_upgrades(cfg, team: Team, train: list[Problem], stage: int, sampling: SamplingConfig,
                   controllers: dict, value_heads: dict, rng: random.Random, log) -> list[dict]:
    """Replace the agents named by --upgrade SLOT=MODEL, each after Stage-0; a
    new agent gets a fresh controller (and a fresh value head with --adv gae)."""
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
        if cfg.adv == "gae":
            value_heads[slot] = make_value_head(new_agent)
        event = {"slot": slot + 1, "from": old_name, "to": new_agent.spec.name, "at_stage": stage,
                 "seconds": time.time() - t0, "stage0": stage0}
        log(f"  stage-0 done: KL quantile {stage0['kl_quantile_before']:.4f} -> {stage0['kl_quantile']:.4f} in "
            f"{stage0['passes']} passes over {stage0['states']} states, mean lambda {stage0['mean_lambda']:.3f}")
        events.append(event)
    return events
