"""Claim 2 exact over n: stale rollouts in the chain protocol (SAT, arXiv 2605.05216, Algorithm 1 and Theorem 4.2;
TeamTR, arXiv 2605.15207).

The game. n agents in a chain (SAT.md section 2): agent k sees the answers of agents 1..k-1 and gives one of K = 3
answers; the team earns 1 iff the last answer is answer 0. Each agent is a table over its K^(k-1) contexts,
started at random full-support logits (N(0, 1), one team per seed). Everything is enumerated
(experiments/exact_team.py): J, the advantages, the exact trust-region step per context, and the gain each
estimator claims for a step.

Conditions: ``regenerate`` (fresh advantages after each promotion), ``weights`` (the stage start's rollouts with
the truncated weights prod min(1, rho) of the agents already promoted, Algorithm 1, infinitely many rollouts) and
``joint``; the sequential ones in the chain's order (``static``, 1..n) and in the ``reverse`` order (n..1). The
gap of a step is the gain its estimator claimed minus the true change of J; a stage's gap is the sum of its steps'
absolute gaps (a joint stage is one step).

Predictions and criterion, fixed before the table was run (n in {2, 3, 4, 5}, delta in {0.01, 0.05, 0.2, 1.0},
10 stages, seeds 0-9). Tolerances 1e-12 on J and gains, 1e-9 between runs.

- Q1: ``regenerate`` claims exactly the true change (every step's |gap| <= 1e-12) and no step lowers J, in both
  orders. Why: only agent k moves and the law of its contexts is unchanged.
- Q2: in the static order, ``weights`` makes the same steps as ``regenerate`` (J after every stage equal to
  1e-9) and claims no more than the true change (gap <= 1e-12 at every step). Why: in chain order its weights
  depend only on agent k's context, so they scale each context's objective by a positive number, which does not
  move a per-context maximiser; and the claimed gain is sum_c prod_m min(pi_m, pi_m') (c) g(c) against the true
  sum_c prod_m pi_m'(c) g(c) with every context's gain g(c) >= 0. So in this exact limit stale contexts show in the
  claimed gain (the certificate), not in J.
- Q3 (TeamTR): in the static order the seed-mean stage-1 gap of ``weights`` grows quadratically in n: at every
  delta the model a * n (n - 1) / 2 (one term per pair of a promoted agent and a later step) fits n = 2..5 with a
  smaller sum of squared residuals than the linear a * (n - 1) (one term per step after the first). The free
  log-log slope is reported beside it.
- ``joint`` and the reverse order: no prediction; reported.

A prediction holds if it holds in every cell; otherwise the cells where it fails are printed.

    python experiments/stale_rollouts_exact.py --out docs/claims/stale_over_n_exact.md
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # exact_team.py beside this file

import exact_team as et  # noqa: E402

ORDERS = ("static", "reverse")
J_TOL, RUN_TOL = 1e-12, 1e-9


def chain_game(n: int, k_answers: int = 3) -> et.Game:
    """Chain protocol, reward 1 iff the last agent's answer is answer 0."""
    if n < 1 or k_answers < 2:
        raise ValueError(f"the chain game needs n >= 1 agents and K >= 2 answers, got n={n}, K={k_answers}")
    reward = torch.zeros([k_answers] * n, dtype=et.DTYPE)  # [K]*n
    reward[(slice(None),) * (n - 1) + (0,)] = 1.0
    return et.Game("chain", reward)


def order_of(name: str, n: int) -> list[int]:
    if name not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {name!r}")
    return list(range(n)) if name == "static" else list(range(n - 1, -1, -1))


def stage_gap(stage: et.Stage) -> float:
    """sum over the stage's steps of |claimed gain - true change|."""
    return sum(abs(st.gap) for st in stage.steps)


def seed_runs(n: int, delta: float, seed: int, stages: int) -> dict:
    """{(condition, order): [Stage]} for one random chain team; joint once (it has no order)."""
    game = chain_game(n)
    team = et.random_team(game, seed)
    runs = {("joint", "-"): et.run(game, team, delta, stages, "joint")}
    for reuse in et.REUSE:
        for name in ORDERS:
            runs[(reuse, name)] = et.run(game, team, delta, stages, reuse, order_of(name, n))
    return runs


# -- Predictions -----------------------------------------------------------------------------------------------------
def q1(seeds: list[dict]) -> bool:
    """regenerate: every step's claimed gain is its true change, and no step lowers J."""
    return all(abs(st.gap) <= J_TOL and st.j_after >= st.j_before - J_TOL
               for runs in seeds for name in ORDERS for s in runs[("regenerate", name)] for st in s.steps)


def q2(seeds: list[dict]) -> bool:
    """static order: weights' J equals regenerate's after every stage, and it never over-claims."""
    for runs in seeds:
        regen, weights = runs[("regenerate", "static")], runs[("weights", "static")]
        if any(abs(a.j_after - b.j_after) > RUN_TOL for a, b in zip(regen, weights)):
            return False
        if any(st.gap > J_TOL for s in weights for st in s.steps):
            return False
    return True


def fit(ns: list[int], gaps: list[float]) -> dict:
    """Least-squares a for a * (n - 1) and for a * n (n - 1) / 2, their sums of squared residuals, and the free
    log-log slope b of gap = c * n^b."""
    out = {}
    for name, basis in (("linear", [n - 1 for n in ns]), ("quadratic", [n * (n - 1) / 2 for n in ns])):
        a = sum(x * g for x, g in zip(basis, gaps)) / sum(x * x for x in basis)
        out[name] = (a, sum((g - a * x) ** 2 for x, g in zip(basis, gaps)))
    logs = [(math.log(n), math.log(g)) for n, g in zip(ns, gaps) if g > 0]
    if len(logs) >= 2:
        mx, my = statistics.fmean(x for x, _ in logs), statistics.fmean(y for _, y in logs)
        out["slope"] = sum((x - mx) * (y - my) for x, y in logs) / sum((x - mx) ** 2 for x, _ in logs)
    else:
        out["slope"] = float("nan")
    return out


def mean_stage1_gap(seeds: list[dict], key: tuple[str, str]) -> float:
    return statistics.fmean(stage_gap(runs[key][0]) for runs in seeds)


def q3_fits(cells: dict, key: tuple[str, str]) -> dict[float, dict]:
    """delta -> fit of the seed-mean stage-1 gap of ``key`` over n."""
    out = {}
    for delta in sorted({d for _, d in cells}):
        ns = sorted(n for n, d in cells if d == delta)
        out[delta] = fit(ns, [mean_stage1_gap(cells[(n, delta)], key) for n in ns])
    return out


# -- Tables ----------------------------------------------------------------------------------------------------------
def keys(order: str) -> list[tuple[str, str]]:
    return [("regenerate", order), ("weights", order), ("joint", "-")]


def summary_rows(cells: dict, order: str) -> list[list[str]]:
    """Per (n, delta), seed means: stage-1 change of J, J after the last stage, stages that fell (count over all
    seeds and stages), stage-1 gap, and weights' signed stage-1 gap (sum over steps of claimed - true)."""
    rows = []
    for (n, delta), seeds in sorted(cells.items()):
        cols = {"dj": [], "j": [], "fell": [], "gap": []}
        for key in keys(order):
            cols["dj"].append(statistics.fmean(r[key][0].j_after - r[key][0].j_before for r in seeds))
            cols["j"].append(statistics.fmean(r[key][-1].j_after for r in seeds))
            cols["fell"].append(sum(s.j_after < s.j_before - J_TOL for r in seeds for s in r[key]))
            cols["gap"].append(mean_stage1_gap(seeds, key))
        signed = statistics.fmean(sum(st.gap for st in r[("weights", order)][0].steps) for r in seeds)
        rows.append([str(n), f"{delta:g}", " / ".join(f"{x:+.4f}" for x in cols["dj"]),
                     " / ".join(f"{x:.4f}" for x in cols["j"]), " / ".join(str(x) for x in cols["fell"]),
                     " / ".join(f"{x:.2e}" for x in cols["gap"]), f"{signed:+.2e}"])
    return rows


SUMMARY_HEADER = ["n", "delta", "stage-1 change of J: regenerate / weights / joint", "J after the last stage",
                  "stages that fell (all seeds)", "stage-1 gap sum_i |claimed - true|", "weights: signed stage-1 gap"]


def per_step_rows(cells: dict, n: int, order: str) -> list[list[str]]:
    """For the team of n: per delta, the seed-mean |claimed - true| of weights' stage-1 steps, step by step."""
    rows = []
    for delta in sorted(d for m, d in cells if m == n):
        seeds = cells[(n, delta)]
        per_step = [statistics.fmean(abs(r[("weights", order)][0].steps[i].gap) for r in seeds) for i in range(n)]
        rows.append([f"{delta:g}"] + [f"{g:.2e}" for g in per_step])
    return rows


def fit_rows(cells: dict) -> list[list[str]]:
    rows = []
    for key in (("weights", "static"), ("weights", "reverse"), ("joint", "-")):
        for delta, f in q3_fits(cells, key).items():
            better = "quadratic" if f["quadratic"][1] < f["linear"][1] else "linear"
            rows.append([" ".join(k for k in key if k != "-"), f"{delta:g}", f"{f['linear'][0]:.2e}",
                         f"{f['linear'][1]:.2e}", f"{f['quadratic'][0]:.2e}", f"{f['quadratic'][1]:.2e}",
                         f"{f['slope']:.2f}", better])
    return rows


FIT_HEADER = ["condition", "delta", "a, a (n-1)", "SSE", "a, a n(n-1)/2", "SSE", "log-log slope", "fits better"]


def verdicts(cells: dict) -> list[str]:
    lines = []
    for key, check in (("Q1", q1), ("Q2", q2)):
        failed = [f"n={n} delta={d:g}" for (n, d), seeds in sorted(cells.items()) if not check(seeds)]
        lines.append(f"{key}: " + ("held in every cell" if not failed else "FAILED in " + ", ".join(failed)))
    fits = q3_fits(cells, ("weights", "static"))
    failed = [f"delta={d:g}" for d, f in fits.items() if not f["quadratic"][1] < f["linear"][1]]
    lines.append("Q3: " + ("held at every delta" if not failed else "FAILED at " + ", ".join(failed)))
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", default="2,3,4,5", type=lambda s: et.parse_list(s, int, "--n", "2,3,4,5"),
                   help="team sizes (>= 2)")
    p.add_argument("--deltas", default="0.01,0.05,0.2,1.0",
                   type=lambda s: et.parse_list(s, float, "--deltas", "0.01,0.05"),
                   help="trust-region radii")
    p.add_argument("--seeds", default="0,1,2,3,4,5,6,7,8,9",
                   type=lambda s: et.parse_list(s, int, "--seeds", "0,1,2", zero_ok=True),
                   help="one random chain team per seed")
    p.add_argument("--stages", default=10, type=int, help="stages per run (default 10)")
    p.add_argument("--out", default=None, help="also write the tables, verdicts and command to this markdown file")
    p.add_argument("--threads", default=1, type=int,
                   help="torch CPU threads (default 1: the tensors are tiny; more threads only wait on each other)")
    args = p.parse_args(argv)
    if args.stages < 1:
        p.error(f"--stages must be >= 1, got {args.stages}")
    if args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if min(args.n) < 2 or len(set(args.n)) < 2:
        p.error(f"--n {args.n}: give at least two distinct team sizes >= 2, so that a growth in n can be fitted")
    return args


def report(cells: dict, args: argparse.Namespace, argv: list[str], seconds: float) -> str:
    n_max = max(args.n)
    parts = ["# Stale rollouts over n in the chain protocol, exact (claim 2)", ""]
    for order in ORDERS:
        parts += [f"## Sequential order: {order}", "", et.markdown(SUMMARY_HEADER, summary_rows(cells, order)), "",
                  f"weights, {order} order, n = {n_max}: seed-mean |claimed - true| of each stage-1 step", "",
                  et.markdown(["delta"] + [f"step {i + 1}" for i in range(n_max)], per_step_rows(cells, n_max, order)),
                  ""]
    parts += ["## Growth of the stage-1 gap with n (seed means)", "", et.markdown(FIT_HEADER, fit_rows(cells)), "",
              f"Seeds {','.join(map(str, args.seeds))} (one random chain team each, K = 3 answers); {args.stages} "
              "stages; means over seeds; a stage fell when its J ended more than 1e-12 below its start. Predictions "
              "Q1-Q3 and the criterion: the docstring of experiments/stale_rollouts_exact.py, fixed before this run.",
              "", *[f"- {line}" for line in verdicts(cells)], "",
              f"Command: `python experiments/stale_rollouts_exact.py {' '.join(argv)}`; "
              f"{seconds:.1f} s on {torch.get_num_threads()} CPU thread(s)."]
    return "\n".join(parts)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    cells = {(n, d): [seed_runs(n, d, s, args.stages) for s in args.seeds] for n in args.n for d in args.deltas}
    text = report(cells, args, argv, time.perf_counter() - t0)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
