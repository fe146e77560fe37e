"""Run records: a stage's metrics row (``stage_row``: the ``stage_record.StageRecord`` that ``sat.sat_stage``
returns, the held-out evaluation and the certificates it carries), the samples of what the agents said, and the
console's stage line. Files: ``harness.run_folder``.

The arithmetic (paper, Section 4: the stage certificate; Section 5: the violation rate, the fraction of stages
whose measured team reward fell beyond noise) is ``bounds.py``'s; this module reads and writes the rows.
"""
from __future__ import annotations

from bounds import change_certificate, fall_rates, fewest_certifying_rows, is_certified_fall, is_violation
from stage_record import StageRecord


def stage_row(record: StageRecord, evaluation: dict | None, stage: int, rows: list[dict], prev: dict,
              upgrades: list, delta_conf: float, reward_range: tuple[float, float]) -> dict:
    """A stage's metrics row: its record, the held-out evaluation, and its certificates from the paired
    held-out rows (``bounds.paired_change_bound``; the rows of every evaluation share their seeds):
    ``certificate`` on the change since ``prev`` (the previous evaluated row, or the evaluation right after
    an upgrade: with ``--eval-every N`` it covers the stages since then, from ``certified_since_stage``),
    ``run_certificate`` on the change since stage 0 (``rows[0]``); ``violation`` and ``certified_fall`` are
    ``bounds.is_violation`` and ``bounds.is_certified_fall`` of ``certificate``.
    ``violation_rate`` and ``certified_fall_rate`` count the evaluated trained stages so far. A stage
    without an evaluation (``evaluation`` None) has its record alone."""
    rec = {**record.row(), **(evaluation or {})}
    rec["stage"] = stage
    if upgrades:
        rec["upgrades"] = upgrades
    if evaluation is None:
        return rec
    since_stage = prev.get("stage", rows[-1]["stage"])  # an upgrade's evaluation happened at the last row's stage
    since = "the previous row" if since_stage == stage - 1 else f"the evaluation of stage {since_stage}"
    rec["measured_change"] = rec["eval_accuracy"] - prev["eval_accuracy"]
    rec["certificate"] = heldout_certificate(prev, rec, delta_conf, since, reward_range)
    rec["certified_since_stage"] = since_stage
    rec["run_certificate"] = heldout_certificate(rows[0], rec, delta_conf, "stage 0 (before training)", reward_range)
    rec["violation"], rec["certified_fall"] = is_violation(rec["certificate"]), is_certified_fall(rec["certificate"])
    trained = [r["certificate"] for r in rows[1:] if "certificate" in r] + [rec["certificate"]]  # evaluated stages
    rec["violation_rate"], rec["certified_fall_rate"] = fall_rates(trained)
    return rec


def last_evaluated(rows: list[dict]) -> dict:
    """The latest row with a held-out evaluation (stage 0 has one)."""
    return next(r for r in reversed(rows) if "eval_accuracy" in r)


def heldout_certificate(before: dict, after: dict, delta_conf: float, since: str,
                        reward_range: tuple[float, float]) -> dict:
    """The held-out change from ``before`` to ``after`` (two metrics rows): ``bounds.change_certificate`` of their
    paired rewards, and what it bounds (``kind``)."""
    if "eval_rewards" not in before:
        raise ValueError(f"the held-out row of {since} has no paired rewards (a run written before paired "
                         "evaluations): start a new run with a new --out")
    if len(before["eval_rewards"]) != len(after["eval_rewards"]):
        raise ValueError(f"the held-out evaluation has {len(after['eval_rewards'])} rows, {since} had "
                         f"{len(before['eval_rewards'])}: keep --eval-size and --eval-samples when resuming")
    change = change_certificate(before["eval_rewards"], after["eval_rewards"], before["eval_accuracy"],
                                after["eval_accuracy"], reward_range, delta_conf)
    return {**change, "kind": f"held-out, paired: lower bound on the change in expected team reward on the "
                              f"held-out rows since {since}, with probability >= 1 - delta_conf"}


def heldout_warning(problems: int, samples: int, delta_conf: float) -> str | None:
    """One console line when the held-out evaluation (``problems`` x ``samples`` paired rows) is too small for any
    certificate to exceed 0 (``fewest_certifying_rows``), else None."""
    need = fewest_certifying_rows(delta_conf)
    if problems * samples >= need:
        return None
    return (f"warning: the held-out evaluation has {problems} problem(s) x {samples} sample(s) = "
            f"{problems * samples} paired row(s); no certificate can exceed 0 on fewer than {need} "
            f"(--delta-conf {delta_conf:g}), so held-out accuracy and the certificates measure nothing: pass more "
            "held-out problems with --eval-data (or raise --eval-size / --eval-samples)")


TRUNCATION_WARNING = 0.5  # a stage whose share of responses cut at --max-new-tokens exceeds this gets a console line


def truncation_warning(row: dict, max_new_tokens: int) -> str | None:
    """One console line when most of a stage's responses were cut at the token limit (``truncated_fraction`` of
    its metrics row above TRUNCATION_WARNING): a cut response rarely holds an answer. None otherwise."""
    cut = row.get("truncated_fraction", 0.0)
    if cut <= TRUNCATION_WARNING:
        return None
    return (f"warning: stage {row['stage']} cut {cut:.0%} of its responses at --max-new-tokens {max_new_tokens}: "
            "raise --max-new-tokens (or ask for shorter answers) so that an answer fits")


SURROGATE_ESS_WARNING = 0.1  # an agent whose surrogate_ess is under this share of N gets a console line


def surrogate_ess_warning(row: dict) -> str | None:
    """One console line when some agent's ``surrogate_estimate`` rests on an effective sample (``surrogate_ess``)
    under SURROGATE_ESS_WARNING of its N rows: a few heavy importance weights then carry the estimate, which says
    little. None otherwise, and for a row without trained agents."""
    thin = [a for a in row.get("agents", []) if a["surrogate_ess"] < SURROGATE_ESS_WARNING * a["N"]]
    if not thin:
        return None
    who = ", ".join(f"{a['agent']} ({a['surrogate_ess']:.1f} of {a['N']})" for a in thin)
    return (f"warning: stage {row['stage']}: the surrogate_estimate of agent(s) {who} rests on an effective sample "
            "under a tenth of the batch: read it as noise (no certificate uses it); longer responses or longer steps "
            "make the importance weights this uneven")


def run_summary(row: dict) -> str:
    """The run's guarantee in one sentence, from its last row."""
    cert = row["run_certificate"]
    return (f"certified gain >= {cert['lower_bound']:+.3f} with probability {1 - cert['delta_conf']:.2f} (held-out "
            f"team reward since stage 0: measured {cert['mean_change']:+.3f}, standard error "
            f"{cert['stderr']:.3f}, over {cert['n']} paired rows); stages with a violation "
            f"{row['violation_rate']:.0%}, with a certified fall {row['certified_fall_rate']:.0%}")


def stage_samples(batch, stage: int, count: int, group_size: int) -> list[dict]:
    """What the agents said: the first joint trajectory of each of the stage rollout's first ``count`` groups
    (problem, gold answer, each agent's response, extracted answer, its own score (``reward.agent_scores``) and
    whether that is nonzero, its length, whether it
    was cut at the token limit; the team's answer and reward)."""
    rows = range(0, min(len(batch), count * group_size), group_size)
    return [{"stage": stage, "problem": batch.problems[r].problem, "gold": batch.problems[r].answer,
             "agents": [{"response": t.texts[r], "answer": t.answers[r], "correct": bool(batch.agent_reward[k, r]),
                         "score": float(batch.agent_reward[k, r]), "tokens": int(t.response_mask[r].sum()),
                         "truncated": bool(t.truncated[r])}
                        for k, t in enumerate(batch.turns)],
             "team_answer": batch.team_answers[r], "reward": float(batch.rewards[r]),
             **({"transcript": batch.transcripts[r], "rounds": batch.rounds[r]} if batch.transcripts else {})}
            for r in rows]


def sample_text(sample: dict, width: int = 160) -> str:
    """A sample on a few console lines: the problem, then each agent's response (cut to ``width``)."""
    def cut(text: str) -> str:
        text = " ".join(text.split())
        return text if len(text) <= width else text[: width - 3] + "..."

    lines = [f"  sample, stage {sample['stage']}: {cut(sample['problem'])}  (gold {sample['gold']}; team "
             f"{sample['team_answer']}, reward {sample['reward']:.2f})"]
    if "transcript" in sample:  # an episode: every turn of every round, the environment's included
        lines[0] = (f"  sample, stage {sample['stage']}: an episode of {sample['rounds']} round(s), team reward "
                    f"{sample['reward']:.2f}")
        return "\n".join(lines + [f"    {cut(turn)}" for turn in sample["transcript"].split("\n\n")])
    for k, a in enumerate(sample["agents"]):
        score = a.get("score", float(a["correct"]))
        mark = {1.0: "right", 0.0: "wrong"}.get(score, f"score {score:.2f}")
        lines.append(f"    agent {k + 1} [{a['tokens']} tok{', cut' if a['truncated'] else ''}] -> {a['answer']} "
                     f"({mark}): {cut(a['response'])}")
    return "\n".join(lines)


def fmt_list(xs) -> str:
    return "[" + ", ".join(f"{x:.2f}" for x in xs) + "]"


STAGE_HEADER = (f"{'stage':>5} {'reward':>7} {'eval':>6} {'change':>7} "
                f"{'kl_q':>14} {'bt':>6} {'acc':>6} {'bound':>8} {'run>=':>7} {'sec':>5}")


def stage_line(rec: dict) -> str:
    """One console line per stage, under STAGE_HEADER; ``-`` where the stage had no held-out evaluation."""
    ag = rec["agents"]
    kl_q = "/".join(f"{a['kl_quantile']:.3f}" for a in ag)
    backtracks = "/".join(str(a["backtracks"]) for a in ag)
    accepted = "".join("y" if a["accepted"] else "n" for a in ag)
    if "certificate" in rec:
        evaluated = (f"{rec['eval_accuracy']:>6.3f} {rec['measured_change']:>+7.3f}",
                     f"{rec['certificate']['lower_bound']:>+8.3f} {rec['run_certificate']['lower_bound']:>+7.3f}")
    else:
        evaluated = (f"{'-':>6} {'-':>7}", f"{'-':>8} {'-':>7}")
    lr_next = "/".join(f"{a['lr_next']:.2g}" for a in ag if "lr_next" in a)  # --step-size adaptive: next lrs
    lrs = f" lr {lr_next}" if lr_next else ""
    return (f"{rec['stage']:>5} {rec['team_reward']:>7.3f} {evaluated[0]} {kl_q:>14} {backtracks:>6} {accepted:>6} "
            f"{evaluated[1]} {rec['seconds']:>5.1f}{lrs}{success_words(rec)}")


def success_words(rec: dict) -> str:
    """An environment's headline on the stage line: the share of episodes solved (reward at the top of the range),
    in training and held out; empty without an environment."""
    parts = [f"{label} {rec[key]:.3f}" for label, key in (("train", "success"), ("held-out", "eval_success"))
             if rec.get(key) is not None]
    return "  solved " + " ".join(parts) if parts else ""


def stage_zero_line(rec: dict) -> str:
    """Stage 0's console line (before SAT): the held-out team reward, each agent's, and with an environment the
    share of episodes solved; then STAGE_HEADER."""
    solved = f" solved {rec['eval_success']:.3f}" if rec.get("eval_success") is not None else ""
    return (f"stage 0 (before SAT):{solved} held-out team accuracy {rec['eval_accuracy']:.3f} agents "
            f"{fmt_list(rec['eval_agent_reward'])}\n{STAGE_HEADER}")
