"""``--upgrade SLOT=MODEL``: replacing agents of a resumed run before its first stage (plug-and-play, paper
Section 5), each entering as ``--upgrade-accept`` says: stage0 (Stage-0, ``plug_and_play.stage0_align``), raw
(the swap as loaded) or certified (``harness.certified_acceptance.certified_upgrade``). A swapped slot gets a fresh
controller (and value head); each upgrade is one event of ``upgrades.json``.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from advantage import make_value_head
from harness.certified_acceptance import AcceptanceDraws, certified_upgrade
from plug_and_play import stage0_align
from rollout import SamplingConfig
from stage0_states import with_agent
from team import Agent, Problem, check_same_vocabulary
from trust_region import TrustRegion


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
    """Replace the agents named by --upgrade SLOT=MODEL in ``run`` (``sat.RunState``: its team, trust regions,
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
            f"{before['eval_accuracy']:.3f}; agent {slot + 1} alone {before['eval_agent_reward'][slot]:.3f}")
    n_prompts = cfg.stage0_problems or cfg.batch_size // cfg.group_size
    prompts = [] if rule == "raw" else [train[run.rng.randrange(len(train))] for _ in range(n_prompts)]
    log(f"upgrade: agent {slot + 1} '{old_name}' -> '{new_agent.spec.name}', " + {
        "stage0": f"Stage-0 alignment (delta_0 = {cfg.stage0_delta})", "raw": "swapped in raw (no Stage-0)",
        "certified": "certified acceptance (Stage-0 candidates and the raw swap)"}[rule])
    t0 = time.time()
    if rule == "stage0":
        chosen = new_agent
        found = {"stage0": stage0_align(team, slot, new_agent, prompts, cfg, sampling, lr=cfg.lr, log=log,
                                        backend=backend).record}
    elif rule == "raw":
        chosen, found = new_agent, {"accept": {"rule": "raw", "swapped": True}}
    else:
        chosen, accept = certified_upgrade(team, slot, new_agent, prompts, cfg, sampling, acceptance, stage, log,
                                           backend)
        found = {"accept": accept}
    if chosen is not None:
        backend.release(team.swap(slot, chosen, projected=rule == "stage0"))  # the incumbent's engine, if kept
        run.regions[slot] = TrustRegion.fresh(cfg.delta, cfg.quantile, cfg.max_backtracks, cfg.beta, cfg.step_size,
                                              cfg.lr)
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
