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
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # exact_team.py beside this file

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
    args = p.parse_args(argv)
    if args.stages < 1:
        p.error(f"--stages must be >= 1, got {args.stages}")
    if args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    try:
        args.start = start_policy(args.p_answer, args.p_correct)
    except ValueError as err:
        p.error(str(err))
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
    text = exact_main(args, argv)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
