"""The certified acceptance rule: a replacement enters the team only with a certified gain (a rule beyond the
paper; ``--upgrade-accept certified``).

Paper, Section 4.3: swapping one factor of the product policy changes the team's expected reward by an amount
that paired draws bound (``bounds.paired_change_bound``). The candidates are Stage-0 of the replacement
(``plug_and_play``, Eqs. (6)-(7)) at each radius of CERTIFIED_RADII and the raw swap; one split of training
problems ranks them, a second, disjoint one certifies the winner (``certify``), and the incumbent stays unless
that bound is > 0. Both splits leave out every problem the held-out set asks (``acceptance_splits``).
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch

from bounds import paired_change_bound
from plug_and_play import Stage0Unreachable, stage0_align
from reward import DEFAULT_RANGE
from rollout import SamplingConfig, rng_devices
from stage0_states import with_agent
from team import Agent, Problem, Team, check_same_vocabulary

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


def stage0_candidate(team: Team, slot: int, raw: Agent, prompts: list[Problem], cfg, sampling: SamplingConfig, log,
                     backend) -> tuple[Agent, dict]:
    """A copy of the raw replacement after Stage-0 (Eqs. (6)-(7)) at ``cfg.stage0_delta``, on the states of a
    rollout seeded by the run seed alone: every radius fits the same states, and the run's RNG streams are left
    as they were."""
    agent = Agent(raw.spec, raw.procs.frozen_copy(raw.model), raw.tokenizer, raw.procs)
    with torch.random.fork_rng(devices=rng_devices(cfg.device)):
        torch.manual_seed(random.Random(f"stage-0 states {cfg.seed}").getrandbits(63))
        fitted = stage0_align(team, slot, agent, prompts, cfg, sampling, lr=cfg.lr, log=log, backend=backend)
    return agent, fitted.record


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
