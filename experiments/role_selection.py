"""Claim 1 where the theory says it bites: the role-selection game (SAT, arXiv 2605.05216, Algorithm 1 and
Theorem 4.2; SAT.md section 10).

The game. n agents see one prompt; each either passes or answers. The team earns 1 only when exactly one agent
answers, and answers correctly. Tabular agents have three actions, PASS, RIGHT and WRONG (an answer and whether it
is correct), one context each (the independent protocol: nobody sees the others). Every agent starts from the same
policy: P(answer) = --p-answer (0.5), of which a share --p-correct (0.7) is right, so (PASS, RIGHT, WRONG) =
(0.5, 0.35, 0.15) by default. A symmetric policy (p, r, w) scores J = n r p^(n-1) <= n r (1-r)^(n-1), whose
maximum over r is (1 - 1/n)^(n-1) (at r = 1/n, w = 0): no symmetric team beats it. An asymmetric one scores 1
(one agent always RIGHT, the others always PASS).

`exact`: everything enumerated (3^n joint actions), no sampling. Three conditions (experiments/exact_team.py):
``regenerate`` (sequential, static order 1..n, each step on exact fresh advantages), ``weights`` (sequential, the
stage start's rollouts with Algorithm 1's truncated importance weights, infinitely many of them) and ``joint``
(all agents at once on the stage start's advantages; sequential steps on stale advantages without weights make
this same update). Each step is the exact maximiser of the surrogate subject to KL(pi_new || pi_old) <= delta.

Predictions and criterion, fixed before the table was run (n in {2, 3, 5}, delta in {0.01, 0.05, 0.2, 1.0},
10 stages, the default start). Tolerances: 1e-12 on J (float64 sums of at most 243 terms), 1e-9 on symmetry.

- P1, sequential never lowers J: in every cell, every step of ``regenerate`` has J_after >= J_before - 1e-12.
  Why: only agent k moves and its contexts' law is fixed, so the surrogate is the true change, and pi_old is
  feasible with surrogate 0, so the maximiser's surrogate is >= 0.
- P2, joint cannot break the symmetry: in every cell, after every stage of ``joint`` the agents' tables agree to
  1e-9 and J <= (1 - 1/n)^(n-1) + 1e-12. Why: equal tables get equal advantages, hence equal tilts.
- P3, joint falls: in every cell at least one of the 10 ``joint`` stages has J_after < J_before - 1e-12.
- P4, sequential breaks the symmetry: in every cell ``regenerate``'s J after 10 stages exceeds the bound.
- ``weights``: no prediction; its J and falls are reported.

A prediction holds if it holds in every cell; otherwise the cells where it fails are printed, and not re-run
with other settings.

    python experiments/role_selection.py exact --out docs/claims/role_selection_exact.md

`llm`: the same game played by tiny LLM agents through sat.py's own user-task path (``--data``, ``--reward``),
as a researcher would run it. Each agent reads "a+b" (the arithmetic task's 327 train and 73 held-out pairs) and
writes PASS or a number; ``game_reward`` gives the joint trajectory 1 iff exactly one response is not PASS and it
is the sum. The symmetric start: one tiny agent is warm-started (--warmup-steps 600, --warmup-p-wrong 0.2) on a
data file that lists every train problem twice, once labelled with its sum and once with PASS, so it answers
about half the time; the team is n copies of that one agent ("FOLDER xn"). Conditions: joint, sat-regenerate,
sat-weights (``sequential_vs_joint.CONDITIONS``) from the same stage-0 team, at each delta, lr 1e-3, the tiny
preset otherwise (G 8, 256 joint trajectories a stage, 4 epochs). Held-out: the 73 problems x 8 samples, each row
drawn under a seed fixed by the run seed (``sat.evaluate``), so every condition of a seed meets the same random
numbers (common random numbers) and the stage-to-stage certificates pair row by row.

The learning rate was set by a pilot (seed 0, n = 2, 3 stages, joint and sat-regenerate) on the line search's
backtracks alone, never on held-out accuracy: at lr 1e-3 every step backtracked 2-5 times at both deltas (the
trust region binds); at 3e-3 the line search rejected steps outright at delta 0.05.

Criterion, fixed before the runs (n in {2, 3}, delta in {0.05, 0.5}). D = joint's gain minus sat-regenerate's
(held-out team reward, last stage minus stage 0), paired by seed, with its 95% t interval over seeds; MDE =
h (t_0.975 + t_0.80) / t_0.975 from that interval's half-width h (80% power). A delta "binds" at n when at least
half of the steps of every condition backtracked.

- at a binding (n, delta), the claim **holds** if D < 0 with its interval excluding 0 and joint's certified-fall
  rate (stages whose paired upper bound on the held-out change is < 0) exceeds sat-regenerate's. Otherwise it
  is **underpowered** there if the MDE exceeds the effect the criterion names (a loss of 0.03, MDE_TARGET): such
  a cell could not have seen the effect, so it refutes nothing (docs/claims.md's four-way verdicts). With the MDE
  at most 0.03, it is **refuted** there if the interval's lower end is above -MDE (a loss of the detectable
  size, hence of 0.03, is excluded); otherwise **inconclusive** there.
- claim 1 holds in the LLM game if it holds at a binding delta for both n; it is refuted if it is refuted at every
  binding (n, delta); underpowered if every binding (n, delta) is underpowered; otherwise not established. The
  vote runs of docs/claims.md (an aligned reward) are the control.

    python experiments/role_selection.py llm --seeds 0,1,2 --out runs/experiments/role_selection
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # exact_team.py beside this file

import common  # noqa: E402
import exact_team as et  # noqa: E402

PASS, RIGHT, WRONG = 0, 1, 2
J_TOL, SYM_TOL = 1e-12, 1e-9


def role_game(n: int) -> et.Game:
    """Reward 1 iff exactly one agent does not PASS and that agent is RIGHT; independent protocol."""
    if n < 1:
        raise ValueError(f"the role-selection game needs n >= 1 agents, got {n}")
    reward = torch.zeros([3] * n, dtype=et.DTYPE)  # [3]*n
    for a in itertools.product(range(3), repeat=n):
        answers = [x for x in a if x != PASS]
        reward[a] = float(answers == [RIGHT])
    return et.Game("independent", reward)


def symmetric_bound(n: int) -> float:
    """max of J over symmetric policies: (1 - 1/n)^(n-1) (1 for n = 1)."""
    return (1 - 1 / n) ** (n - 1)


def start_policy(p_answer: float, p_correct: float) -> list[float]:
    """(PASS, RIGHT, WRONG) probabilities of the symmetric start."""
    if not (0 < p_answer < 1 and 0 <= p_correct <= 1):
        raise ValueError(f"need 0 < p_answer < 1 and 0 <= p_correct <= 1, got {p_answer}, {p_correct}")
    return [1 - p_answer, p_answer * p_correct, p_answer * (1 - p_correct)]


def one_answerer(team: list[torch.Tensor] | tuple) -> float:
    """P(exactly one agent answers), right or wrong: the share of rows where the roles are settled."""
    p_pass = [float(t.exp()[0, PASS]) for t in team]
    return sum((1 - p_pass[i]) * math.prod(p_pass[:i] + p_pass[i + 1:]) for i in range(len(team)))


def asymmetry(team: list[torch.Tensor] | tuple) -> float:
    """Largest difference between any agent's action probabilities and agent 1's."""
    first = team[0].exp()
    return max(float((t.exp() - first).abs().max()) for t in team)


# -- The exact table -------------------------------------------------------------------------------------------------
def exact_cell(n: int, delta: float, stages: int, start: list[float]) -> dict:
    """Every condition's stages for one (n, delta) from the symmetric start: {condition: [Stage]} plus J0."""
    game = role_game(n)
    team = et.uniform_team(game, start)
    out = {c: et.run(game, team, delta, stages, c) for c in et.CONDITIONS}
    return {"n": n, "delta": delta, "j0": et.value(game, team), "runs": out}


def stage_falls(stages: list[et.Stage]) -> int:
    """Stages whose J ended below where it began (beyond J_TOL)."""
    return sum(s.j_after < s.j_before - J_TOL for s in stages)


def step_falls(stages: list[et.Stage]) -> int:
    """Steps (one agent's update; a joint stage is one step) whose J fell beyond J_TOL."""
    return sum(st.j_after < st.j_before - J_TOL for s in stages for st in s.steps)


def predictions(cell: dict) -> dict[str, bool]:
    """P1-P4 of the module docstring for one cell."""
    n, runs = cell["n"], cell["runs"]
    bound = symmetric_bound(n)
    joint, regen = runs["joint"], runs["regenerate"]
    return {
        "P1": step_falls(regen) == 0,
        "P2": all(asymmetry(s.team) <= SYM_TOL and s.j_after <= bound + J_TOL for s in joint),
        "P3": stage_falls(joint) >= 1,
        "P4": regen[-1].j_after > bound + J_TOL,
    }


def exact_rows(cells: list[dict]) -> list[list[str]]:
    """One row per (n, delta): bound, J0, and per condition J after the last stage with its falls."""
    rows = []
    for cell in cells:
        runs = cell["runs"]
        row = [str(cell["n"]), f"{cell['delta']:g}", f"{symmetric_bound(cell['n']):.4f}", f"{cell['j0']:.4f}"]
        for c in et.CONDITIONS:
            row.append(f"{runs[c][-1].j_after:.4f} ({stage_falls(runs[c])}, {step_falls(runs[c])})")
        row.append(" / ".join(f"{one_answerer(runs[c][-1].team):.3f}" for c in et.CONDITIONS))
        row.append(f"{max(s.j_after for s in runs['joint']):.4f}")
        row.append(" ".join(k for k, ok in predictions(cell).items() if ok) or "-")
        rows.append(row)
    return rows


EXACT_HEADER = ["n", "delta", "(1-1/n)^(n-1)", "J start", "regenerate: J (stage falls, step falls)", "weights",
                "joint", "P(one answers): regenerate / weights / joint", "joint: max J over stages",
                "predictions held"]


def verdicts(cells: list[dict]) -> list[str]:
    """One line per prediction: held in every cell, or the cells where it failed."""
    lines = []
    for key in ("P1", "P2", "P3", "P4"):
        failed = [f"n={c['n']} delta={c['delta']:g}" for c in cells if not predictions(c)[key]]
        lines.append(f"{key}: " + ("held in every cell" if not failed else "FAILED in " + ", ".join(failed)))
    return lines


# -- The LLM game: tiny agents through sat.py -------------------------------------------------------------------
PASS_TEXT = "PASS"
LLM_DELTAS = (0.05, 0.5)
MDE_TARGET = 0.03
LLM_CONDITIONS = ("joint", "sat-regenerate", "sat-weights")  # sequential_vs_joint.CONDITIONS, in table order
GAME_OPTIONS = ["--batch-size", "256", "--group-size", "8", "--max-new-tokens", "4", "--temperature", "1.0",
                "--epochs", "4", "--minibatch-size", "128", "--beta", "0.01", "--eval-size", "73",
                "--eval-samples", "8", "--instruction", ""]


def _answers(texts: list[str]) -> list[str]:
    return [t.strip() for t in texts if t.strip() != PASS_TEXT]


def game_reward(prompts: list[str], completions: list[list[str]], total: list[int], **columns) -> list[float]:
    """The team reward R of the game: 1 iff exactly one agent did not write PASS and wrote the sum."""
    answers = [_answers(texts) for texts in completions]
    return [float(a == [str(gold)]) for a, gold in zip(answers, total)]


def one_answer_reward(prompts: list[str], completions: list[list[str]], **columns) -> list[float]:
    """1 iff exactly one agent answered, right or wrong: the rows where the roles are settled."""
    return [float(len(_answers(texts)) == 1) for texts in completions]


def answered_reward(prompts: list[str], completions: list[list[str]], **columns) -> list[float]:
    """The share of agents that answered (did not write PASS)."""
    return [len(_answers(texts)) / len(texts) for texts in completions]


def right_reward(prompts: list[str], completions: list[list[str]], total: list[int], **columns) -> list[float]:
    """The share of agents that wrote the sum."""
    return [sum(t.strip() == str(gold) for t in texts) / len(texts) for texts, gold in zip(completions, total)]


def write_game_data(folder: Path) -> tuple[Path, Path]:
    """train.jsonl (each train pair twice: labelled with its sum and with PASS, the warm start's 50/50) and
    heldout.jsonl (each held-out pair once); ``total`` is the gold sum the reward reads."""
    from harness.tasks import arithmetic_problems

    folder.mkdir(parents=True, exist_ok=True)
    train, heldout = folder / "train.jsonl", folder / "heldout.jsonl"
    rows = []
    for p in arithmetic_problems(327, seed=0, split="train"):
        rows.append({"id": p.id, "problem": p.problem, "answer": p.answer, "total": int(p.answer)})
        rows.append({"id": p.id + "-pass", "problem": p.problem, "answer": PASS_TEXT, "total": int(p.answer)})
    write_once(train, "".join(json.dumps(r) + "\n" for r in rows))
    write_once(heldout, "".join(json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer,
                                            "total": int(p.answer)}) + "\n"
                                for p in arithmetic_problems(73, seed=0, split="heldout")))
    return train, heldout


def write_once(path: Path, text: str) -> None:
    """``text`` at ``path``, replaced atomically and only if it differs: another invocation (other seeds into the
    same --out) may be reading it."""
    if not path.exists() or path.read_text() != text:
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(path)


def measure(ckpt: Path, heldout: Path, reward_name: str, samples: int, quiet: bool) -> float:
    """The team's mean ``reward_name`` on the held-out problems, ``samples`` draws each (eval_aime.py; resumable
    into ckpt/eval_<name>)."""
    from harness import evaluation

    out = Path(ckpt) / f"eval_{reward_name}"
    argv = ["--ckpt", str(ckpt), "--data", str(heldout), "--reward", f"{Path(__file__).resolve()}:{reward_name}",
            "--k", str(samples), "--max-new-tokens", "4", "--temperature", "1.0", "--instruction", "", "--out",
            str(out)]
    summary = evaluation.evaluate_benchmarks(evaluation.parse_args(argv), log=(lambda *_: None) if quiet else print)
    return summary["benchmarks"]["heldout"]["metrics"]["team"][f"avg@{samples}"]["value"]


def llm_runs(args: argparse.Namespace) -> tuple[dict, dict]:
    """Every run: ({(n, delta, condition): {seed: metrics rows}}, {seed or (n, seed): measured shares})."""
    from sequential_vs_joint import CONDITIONS

    train, heldout = write_game_data(Path(args.out) / "data")
    common_opts = ["--data", str(train), "--eval-data", str(heldout), "--threads", str(args.threads),
                   "--reward", f"{Path(__file__).resolve()}:game_reward"] + GAME_OPTIONS + args.sat_options
    runs, shares = {}, {}
    for seed in args.seeds:
        warm = common.run_folder(args.out, "warm", "tiny", seed)
        common.ensure_run(warm, ["--agents", "tiny", "--seed", str(seed), "--warmup-steps", str(args.warmup_steps),
                                 "--warmup-p-wrong", "0.2"] + common_opts, 0, args.quiet)
        agent = warm / "checkpoints" / "stage_0000" / "team" / "agent_0"
        shares[seed] = {name: measure(warm, heldout, f"{name}_reward", 8, args.quiet) for name in ("answered", "right")}
        for n in args.n:
            base = common.run_folder(args.out, f"n{n}", "stage0", seed)
            common.ensure_run(base, ["--agents", f"{agent} x{n}", "--seed", str(seed)] + common_opts, 0, args.quiet)
            shares[(n, seed)] = measure(base, heldout, "one_answer_reward", 8, args.quiet)
            for delta in args.deltas:
                for cond, flags in CONDITIONS.items():
                    folder = common.run_folder(args.out, f"n{n}-delta{delta:g}", cond, seed)
                    rows = common.ensure_run(folder, ["--resume", str(base / "checkpoints" / "stage_0000"),
                                                      "--lr", str(args.lr), "--delta", str(delta)]
                                             + common_opts + flags, args.stages, args.quiet)
                    runs.setdefault((n, delta, cond), {})[seed] = rows
                    shares[(n, delta, cond, seed)] = measure(folder, heldout, "one_answer_reward", 8, args.quiet)
    return runs, shares


def backtrack_share(rows: list[dict]) -> float:
    """Share of the trained stages' agent steps whose line search backtracked (the trust region bound the step)."""
    steps = [a for r in common.trained(rows) for a in r["agents"]]
    return statistics.mean(a["backtracks"] >= 1 for a in steps)


def mde(half_width: float, k: int) -> float:
    """Minimum detectable effect at 80% power from a 95% half-width over k seeds."""
    return half_width * (common.t_quantile(k - 1) + common.t_quantile(k - 1, 0.6)) / common.t_quantile(k - 1)


def seeds_for(sd: float, target: float = MDE_TARGET) -> int:
    """The fewest seeds whose paired MDE would be <= ``target`` at standard deviation ``sd`` (the pilot's)."""
    for k in range(2, 1000):
        if mde(common.t_quantile(k - 1) * sd / math.sqrt(k), k) <= target:  # the half-width k seeds would give
            return k
    return 1000


def llm_cell(runs: dict, shares: dict, n: int, delta: float, cond: str, reference: str = "sat-regenerate") -> dict:
    """One (n, delta, condition)'s statistics over seeds."""
    by_seed = runs[(n, delta, cond)]
    seeds = sorted(by_seed)
    gains = {s: common.gain(by_seed[s]) for s in seeds}
    ref = {s: common.gain(runs[(n, delta, reference)][s]) for s in seeds}
    diffs = common.paired_differences(gains, ref)
    d_mean, d_half = common.mean_ci(diffs) if cond != reference else (float("nan"), float("nan"))
    return {"seeds": seeds, "gain": common.mean_ci(list(gains.values())), "diff": (d_mean, d_half),
            "mde": mde(d_half, len(diffs)) if cond != reference and len(diffs) > 1 else float("nan"),
            "need": seeds_for(statistics.stdev(diffs)) if cond != reference and len(diffs) > 1 else None,
            "backtracked": statistics.mean(backtrack_share(by_seed[s]) for s in seeds),
            "kl_over_delta": statistics.mean(common.mean_kl_quantile(common.trained(by_seed[s])) for s in seeds)
            / delta,
            "falls": statistics.mean(statistics.mean(bool(r["certified_fall"]) for r in common.trained(by_seed[s]))
                                     for s in seeds),
            "j0": statistics.mean(by_seed[s][0]["eval_accuracy"] for s in seeds),
            "one_start": statistics.mean(shares[(n, s)] for s in seeds),
            "one_end": statistics.mean(shares[(n, delta, cond, s)] for s in seeds)}


def cell_verdict(joint: dict, regen_falls: float, effect: float = MDE_TARGET) -> str:
    """One binding (n, delta)'s verdict by the module docstring's criterion: holds, underpowered, refuted or
    inconclusive. ``joint`` is joint's llm_cell (its paired difference to sat-regenerate, MDE and certified-fall
    rate); ``effect`` is the loss the criterion names. A null result counts against the claim only when the MDE
    is within ``effect``."""
    (d, h), floor = joint["diff"], -joint["mde"]
    if d + h < 0 and joint["falls"] > regen_falls:
        return "holds"
    if not joint["mde"] <= effect:  # a NaN MDE (one seed) has no power either
        return "underpowered"
    return "refuted" if d - h > floor else "inconclusive"


def overall_verdict(holds: dict[int, bool], judged: list[str]) -> str:
    """Claim 1 over the cells: holds at a binding delta for every n, else refuted (or underpowered) when every
    judged cell is, else not established."""
    if all(holds.values()):
        return "holds"
    for verdict in ("refuted", "underpowered"):
        if judged and all(v == verdict for v in judged):
            return verdict
    return "not established"


def llm_verdict(cells: dict, ns: list[int], deltas: list[float]) -> list[str]:
    """The criterion of the module docstring, applied cell by cell, then overall."""
    lines, holds, judged = [], {n: False for n in ns}, []
    for n in ns:
        for delta in deltas:
            group = {c: cells[(n, delta, c)] for c in LLM_CONDITIONS}
            if min(c["backtracked"] for c in group.values()) < 0.5:
                lines.append(f"n={n} delta={delta:g}: the trust region does not bind (a condition backtracked in "
                             "under half its steps): not judged")
                continue
            j = group["joint"]
            d, h = j["diff"]
            verdict = cell_verdict(j, group["sat-regenerate"]["falls"])
            holds[n] = holds[n] or verdict == "holds"
            judged.append(verdict)
            lines.append(f"n={n} delta={delta:g}: joint - sat-regenerate {common.fmt_ci(d, h)} (MDE {j['mde']:.3f}), "
                         f"certified-fall rate joint {j['falls']:.3f} vs sat-regenerate "
                         f"{group['sat-regenerate']['falls']:.3f}: {verdict}")
    return lines + [f"claim 1 in the LLM role-selection game: {overall_verdict(holds, judged)}"]


LLM_HEADER = ["n", "delta", "condition", "seeds", "steps backtracked (at the KL limit)", "kept KL q / delta",
              "J at stage 0", "gain (95% CI)", "- sat-regenerate (paired)", "MDE", "seeds for MDE 0.03",
              "certified-fall rate", "P(exactly one answers): stage 0 -> last", "exact game: J after S stages (falls)"]


def llm_rows(cells: dict, exact: dict) -> list[list[str]]:
    rows = []
    for (n, delta, cond), c in cells.items():
        e = exact[(n, delta)]["runs"][cond.replace("sat-", "")]
        rows.append([str(n), f"{delta:g}", cond, str(len(c["seeds"])), f"{c['backtracked']:.2f}",
                     f"{c['kl_over_delta']:.2f}", f"{c['j0']:.3f}", common.fmt_ci(*c["gain"]),
                     common.fmt_ci(*c["diff"]), "-" if math.isnan(c["mde"]) else f"{c['mde']:.3f}",
                     str(c["need"] or "-"), f"{c['falls']:.3f}", f"{c['one_start']:.3f} -> {c['one_end']:.3f}",
                     f"{e[-1].j_after:.3f} ({stage_falls(e)})"])
    return rows


def llm_main(args: argparse.Namespace, argv: list[str]) -> str:
    """Run (or find finished) every run, then the table, the exact predictions beside it and the verdict."""
    t0 = time.perf_counter()
    runs, shares = llm_runs(args)
    seconds = time.perf_counter() - t0
    cells = {(n, d, c): llm_cell(runs, shares, n, d, c) for n in args.n for d in args.deltas for c in LLM_CONDITIONS}
    p_answer = statistics.mean(shares[s]["answered"] for s in args.seeds)
    p_right = statistics.mean(shares[s]["right"] for s in args.seeds)
    start = [1 - p_answer, p_right, p_answer - p_right]
    exact = {(n, d): exact_cell(n, d, args.stages, start) for n in args.n for d in args.deltas}
    common.plot_curves(Path(args.out) / "plot.png", {
        f"n={n}, delta={d:g}": {c: list(runs[(n, d, c)].values()) for c in LLM_CONDITIONS}
        for n in args.n for d in args.deltas})
    run_seconds = sum(common.seconds(rows) for by_seed in runs.values() for rows in by_seed.values())
    text = "\n".join([
        "# Role selection with tiny LLM agents (claim 1)", "",
        common.markdown_table(LLM_HEADER, llm_rows(cells, exact)), "",
        f"Seeds {', '.join(map(str, args.seeds))}; {args.stages} stages; lr {args.lr:g}; sat.py options "
        f"{' '.join(GAME_OPTIONS[:-2] + args.sat_options)}. Start (warm agent alone, held-out, 8 samples a "
        "problem, mean over seeds): "
        f"P(answer) {p_answer:.3f}, P(right) {p_right:.3f}. J is the held-out team reward (73 problems x 8 "
        "samples, common random numbers across conditions); gains are the last stage minus stage 0, mean ± 95% t "
        "half-width over seeds; the paired column is each seed's gain minus sat-regenerate's. Steps backtracked: "
        "the share of agent steps whose line search shrank the step to meet delta. Certified-fall rate: the share "
        "of stages whose held-out paired upper bound on the change since the previous stage is below 0. "
        "P(exactly one answers): eval_aime.py with one_answer_reward, 8 samples a problem. Exact game: the "
        "tabular game of `exact` from the measured start (PASS, RIGHT, WRONG) = "
        f"({', '.join(f'{p:.3f}' for p in start)}), same delta and stages; falls = stages whose J fell.", "",
        *[f"- {line}" for line in llm_verdict(cells, args.n, args.deltas)], "",
        f"Command: `python experiments/role_selection.py {' '.join(argv)}`; this invocation {seconds:.0f} s "
        f"(runs found finished cost nothing); the runs' recorded stage time {run_seconds:.0f} s; "
        f"plot: {Path(args.out) / 'plot.png'}.",
    ])
    print(text)
    return text


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("exact", help="the enumerated game with exact trust-region steps (no sampling)")
    ex.add_argument("--n", default="2,3,5", type=lambda s: et.parse_list(s, int, "--n", "2,3,5"), help="team sizes")
    ex.add_argument("--deltas", default="0.01,0.05,0.2,1.0",
                    type=lambda s: et.parse_list(s, float, "--deltas", "0.01,0.05"),
                    help="trust-region radii")
    ex.add_argument("--stages", default=10, type=int, help="stages per run (default 10)")
    ex.add_argument("--p-answer", default=0.5, type=float, help="every agent's starting P(answer) (0.5)")
    ex.add_argument("--p-correct", default=0.7, type=float, help="starting P(right | answer) (0.7)")
    ex.add_argument("--out", default=None, help="also write the table, verdicts and command to this markdown file")
    ex.add_argument("--threads", default=1, type=int,
                    help="torch CPU threads (default 1: the tensors are tiny; more threads only wait on each other)")
    llm = sub.add_parser("llm", help="the game played by tiny LLM agents through sat.py (--reward, --data)")
    llm.add_argument("--seeds", default="0,1,2", type=common.parse_seeds, help="comma-separated seeds (0,1,2)")
    llm.add_argument("--n", default="2,3", type=lambda s: et.parse_list(s, int, "--n", "2,3"), help="team sizes")
    llm.add_argument("--deltas", default=",".join(map(str, LLM_DELTAS)),
                     type=lambda s: et.parse_list(s, float, "--deltas", "0.05,0.5"), help="trust-region radii")
    llm.add_argument("--stages", default=8, type=int, help="SAT stages per run (default 8)")
    llm.add_argument("--lr", default=1e-3, type=float, help="learning rate (1e-3: the pilot's, every step binds)")
    llm.add_argument("--out", default="runs/experiments/role_selection", help="run folders, table.md and plot.png")
    llm.add_argument("--quiet", action="store_true", help="no per-stage console lines from the runs")
    llm.add_argument("--threads", default=1, type=int, help="torch CPU threads per run (default 1)")
    llm.add_argument("--warmup-steps", default=600, type=int, help="the one warm agent's supervised steps (600)")
    args, args.sat_options = p.parse_known_args(argv)  # llm: any other option goes to every sat.py run
    if args.sat_options and args.command != "llm":
        p.error(f"unrecognized arguments: {' '.join(args.sat_options)}")
    if args.stages < 1:
        p.error(f"--stages must be >= 1, got {args.stages}")
    if args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.command == "exact":
        try:
            args.start = start_policy(args.p_answer, args.p_correct)
        except ValueError as err:
            p.error(str(err))
    elif min(args.n) < 2:
        p.error(f"--n {','.join(map(str, args.n))}: the game needs teams of at least 2 agents")
    return args


def exact_main(args: argparse.Namespace, argv: list[str]) -> str:
    """Run every (n, delta) cell, print the table and the verdicts; the markdown text is returned."""
    t0 = time.perf_counter()
    cells = [exact_cell(n, d, args.stages, args.start) for n in args.n for d in args.deltas]
    seconds = time.perf_counter() - t0
    start = ", ".join(f"{p:g}" for p in args.start)
    text = "\n".join([
        "# Role selection, exact (claim 1)", "",
        et.markdown(EXACT_HEADER, exact_rows(cells)), "",
        f"Start: every agent at (PASS, RIGHT, WRONG) = ({start}); {args.stages} stages; static order 1..n; "
        "J after the last stage, with the number of stages and of steps (one agent's update; a joint stage is "
        "one step) whose J fell by more than 1e-12. Predictions P1-P4 and the criterion: the docstring of "
        "experiments/role_selection.py, fixed before this run.", "",
        *[f"- {line}" for line in verdicts(cells)], "",
        f"Command: `python experiments/role_selection.py {' '.join(argv)}`; "
        f"{seconds:.1f} s on {torch.get_num_threads()} CPU thread(s).",
    ])
    print(text)
    return text


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.command == "llm":
        text = llm_main(args, argv)
        Path(args.out, "table.md").write_text(text + "\n")
        return 0
    text = exact_main(args, argv)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
