"""Claim 4 (docs/claims.md): a team against one model at equal compute. The paper (Sec. 6, Table 1) reports its
3 x 4B team beating a 32B model; DICE (arXiv 2606.08068) argues that teams often fail to beat one model with
best-of-N (majority of N samples) at equal compute.

Per seed, two sat.py runs from the same seed (agent 1 of the team and the single agent start from the same
weights and warm start): the n-agent team trained --stages stages, and one agent of the same kind
(``--agents "KIND x1"``) trained n x --stages stages with the same batch. Equal training compute: each stage
generates batch x n responses for the team and batch x 1 for the single agent, so n times the stages gives the
same number of generated tokens, and the same number of gradient steps and KL-bounded policy steps (n per team
stage, one per single-agent stage), each with exactly the team agents' update settings (a batch n times larger
would instead change the single agent's update: its minibatches, its KL check, its step size). The table checks
the generated-token counts from the metrics (generations x mean response length) agree within 10%.

Both are then evaluated by eval_aime.py on the same held-out problems (the runs' own held-out split, written to a
JSONL file, duplicates dropped) with K = n x --vote-groups samples per problem at the training temperature: the
team's vote accuracy (its avg@K: each sample is one joint trajectory, answered by majority vote) against the
single agent's avg@n (= its avg@K) and maj@n (the majority of n samples, averaged over the K / n disjoint groups
of n samples: the same n responses per answer as the team's vote). The paired column is team - single maj@n by
seed.

``--budget updates`` adds a second single agent trained --stages stages: as many KL-bounded policy steps as each
team agent gets (one a stage), on a third of the team's generated tokens: the comparison at equal updates, where
the equal-tokens single agent has n times the team agent's steps.

    python experiments/team_vs_single.py --seeds 0,1,2 --stages 6 --out /tmp/tvs --batch-size 256

Paper scale (--agents "Qwen3-4B x3" against one Qwen3-4B trained 3 x 10 stages; the paper's own comparison is
against an untrained 32B, which this script does not run), a rough estimate on H100s: the team run is ~10-15
GPU-hours (sequential_vs_joint.py), the single agent's 30 stages of 512 x 32k-token rollouts of one agent ~the
same (a third of the tokens per stage), and evaluating both on AIME24+25 with K = 3 x 8 = 24 samples of up to
32k tokens (60 problems x 24 x (3 + 1) responses x ~10k tokens = 58M tokens) ~1-2 GPU-hours: ~25-35 GPU-hours a
seed, ~150 for 5 seeds.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # common.py; the core modules come first

import common  # noqa: E402

import eval_aime  # noqa: E402
import harness.cli
import harness.eval_folder
import harness.run
from harness import evaluation  # noqa: E402

TOKEN_TOLERANCE = 0.10
SINGLE_STAGES = {"tokens": lambda n, stages: n * stages, "updates": lambda n, stages: stages}  # budget -> stages
SINGLE_FOLDER = {"tokens": "single", "updates": "single-updates"}


def parse_args(argv=None):
    p = common.base_parser(__doc__, "runs/experiments/team_vs_single")
    p.add_argument("--vote-groups", type=common.positive_int, default=8,
                   help="disjoint groups of n samples per problem in the evaluation (K = n x this; default 8)")
    p.add_argument("--budget", default="tokens",
                   help="tokens (the single agent trains n x --stages stages: equal generated tokens), updates "
                        "(--stages stages: equal policy steps per agent), or both: tokens,updates")
    args, rest = common.parse(p, argv)
    args.budget = common.parse_list(args.budget, tuple(SINGLE_STAGES), "--budget")
    args.n = len(common.parse_agents(args.agents))
    args.single = common.team_of(args.agents, 1)
    return args, rest


def heldout_file(run: Path, path: Path) -> tuple[Path, str, object]:
    """The run's held-out problems (duplicates dropped) as JSONL at ``path``; (path, instruction, run config)."""
    cfg = harness.cli.parse_args(["--resume", str(run)]).apply_preset()
    _, heldout, instruction = harness.run.load_problems(cfg)
    unique = list({(p.problem, p.answer): p for p in heldout}.values())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer}) + "\n"
                            for p in unique))
    return path, instruction, cfg


def evaluate(run: Path, data: Path, instruction: str, cfg, k: int, out: Path) -> list[dict]:
    """eval_aime.py on one run's last checkpoint (resumable); its predictions.jsonl rows."""
    ecfg = evaluation.parse_args(["--ckpt", str(run), "--data", str(data), "--k", str(k), "--instruction", instruction,
                                 "--temperature", str(cfg.temperature), "--max-new-tokens", str(cfg.max_new_tokens),
                                 "--seed", str(cfg.seed), "--device", cfg.device, "--backend", cfg.backend,
                                 "--out", str(out)])
    evaluation.evaluate_benchmarks(ecfg, log=lambda *_: None)
    return harness.eval_folder.read_predictions(out / "predictions.jsonl")


def per_problem(rows: list[dict], who: str, n: int | None = None) -> dict[str, float]:
    """{problem: score} of ``who``'s samples: their mean correctness (avg@K), or with ``n`` maj@n averaged over
    the disjoint groups of n consecutive samples."""
    by_problem: dict[str, dict[int, dict]] = {}
    for r in rows:
        if r["who"] == who:
            by_problem.setdefault(r["problem_id"], {})[r["sample"]] = r
    scores = {}
    for problem, samples in by_problem.items():
        ordered = [samples[s] for s in sorted(samples)]
        if n is None:
            scores[problem] = statistics.mean(bool(r["correct"]) for r in ordered)
        else:
            groups = [ordered[g * n:(g + 1) * n] for g in range(len(ordered) // n)]
            scores[problem] = statistics.mean(
                float(eval_aime.majority_correct([r["answer"] for r in g], g[0]["gold"])) for g in groups)
    return scores


def accuracy(rows: list[dict], who: str) -> float:
    """Mean correctness of ``who``'s samples (avg@K; every problem has K samples)."""
    return statistics.mean(per_problem(rows, who).values())


def paired_over_problems(a: dict[str, float], b: dict[str, float]) -> tuple[float, float]:
    """(mean, standard error) over the problems both score of a - b: one seed's comparison on the same problems."""
    d = common.paired_differences(a, b)
    return statistics.mean(d), (statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan"))


def run_seed(args, rest: list[str], seed: int) -> dict:
    """Train (or skip) the team and each budget's single agent of a seed, evaluate them; the seed's numbers."""
    team = common.run_folder(args.out, "", "team", seed)
    team_rows = common.ensure_run(team, ["--agents", args.agents, "--seed", str(seed)] + rest, args.stages, args.quiet)
    data, instruction, cfg = heldout_file(team, Path(args.out) / "heldout" / f"seed{seed}.jsonl")
    k = args.n * args.vote_groups
    team_eval = evaluate(team, data, instruction, cfg, k, Path(args.out) / "eval" / "team" / f"seed{seed}")
    vote = per_problem(team_eval, "team")
    out = {"team_rows": team_rows, "problems": len({r["problem_id"] for r in team_eval}),
           "team_vote": statistics.mean(vote.values()),
           "team_agents": statistics.mean(accuracy(team_eval, f"agent_{i + 1}") for i in range(args.n)),
           "tokens_team": common.training_tokens(common.trained(team_rows)),
           "seconds_team": common.seconds(team_rows), "singles": {}}
    for budget in args.budget:
        name = SINGLE_FOLDER[budget]
        single = common.run_folder(args.out, "", name, seed)
        rows = common.ensure_run(single, ["--agents", args.single, "--seed", str(seed)] + rest,
                                 SINGLE_STAGES[budget](args.n, args.stages), args.quiet)
        single_eval = evaluate(single, data, instruction, cfg, k, Path(args.out) / "eval" / name / f"seed{seed}")
        avg, maj = per_problem(single_eval, "agent_1"), per_problem(single_eval, "agent_1", args.n)
        out["singles"][budget] = {"rows": rows, "avg": statistics.mean(avg.values()),
                                  "maj": statistics.mean(maj.values()),
                                  "vote_minus_maj": paired_over_problems(vote, maj),
                                  "vote_minus_avg": paired_over_problems(vote, avg),
                                  "tokens": common.training_tokens(common.trained(rows)),
                                  "seconds": common.seconds(rows)}
    return out


def single_rows(args, per_seed: dict, budget: str) -> list[list[str]]:
    """The two table rows of one budget's single agent: maj@n and avg@n, each paired with the team vote."""
    n, k = args.n, args.n * args.vote_groups
    col = lambda key: [v["singles"][budget][key] for v in per_seed.values()]  # noqa: E731
    vote = dict(zip(per_seed, [v["team_vote"] for v in per_seed.values()]))
    ci = lambda xs, sign=False: common.fmt_ci(*common.mean_ci(xs), sign=sign)  # noqa: E731
    stages = SINGLE_STAGES[budget](n, args.stages)
    return [[f"single '{args.single}' ({stages} stages: equal {budget})", f"maj@{n}", ci(col("maj")),
             ci(common.paired_differences(vote, dict(zip(per_seed, col("maj")))), sign=True),
             f"{statistics.mean(col('tokens')):.0f}", f"{statistics.mean(col('seconds')):.0f}"],
            [f"single '{args.single}' ({stages} stages)", f"avg@{n} (= avg@{k})", ci(col("avg")),
             ci(common.paired_differences(vote, dict(zip(per_seed, col("avg")))), sign=True), "-", "-"]]


def main(argv=None) -> int:
    args, rest = parse_args(argv)
    per_seed = {seed: run_seed(args, rest, seed) for seed in args.seeds}
    n, k = args.n, args.n * args.vote_groups
    col = lambda key: [v[key] for v in per_seed.values()]  # noqa: E731
    ci = lambda xs: common.fmt_ci(*common.mean_ci(xs), sign=False)  # noqa: E731
    rows = [[f"team '{args.agents}' ({args.stages} stages)", "vote (avg@K of the team answer)", ci(col("team_vote")),
             "-", f"{statistics.mean(col('tokens_team')):.0f}", f"{statistics.mean(col('seconds_team')):.0f}"],
            ["team: its agents alone", f"avg@{k}, mean over agents", ci(col("team_agents")), "-", "-", "-"]]
    for budget in args.budget:
        rows += single_rows(args, per_seed, budget)
    header = ["system", "metric", "held-out accuracy (95% CI)", "team vote - this (paired)", "training tokens / run",
              "stage s / run"]
    notes = [f"{len(args.seeds)} seeds ({', '.join(map(str, args.seeds))}); eval_aime.py on the runs' held-out "
             f"problems ({statistics.mean(col('problems')):.0f} distinct), K = {k} samples each at the training "
             f"temperature; sat.py options: {' '.join(rest) or '(defaults)'}.",
             "Mean ± half-width of the 95% t interval over seeds; paired: by seed (same held-out problems, agent 1 "
             "and the single agent start from the same weights)."]
    for budget in args.budget:
        ratio = [v["singles"][budget]["tokens"] / v["tokens_team"] for v in per_seed.values()]
        off = [f"seed {s}: {r:.3f}" for s, r in zip(per_seed, ratio) if abs(r - 1) > TOKEN_TOLERANCE]
        check = "."
        if budget == "tokens":
            check = (f" (outside {TOKEN_TOLERANCE:.0%} for {', '.join(off)})." if off
                     else f" (within {TOKEN_TOLERANCE:.0%}: equal compute holds).")
        notes.append(f"Equal {budget}: generated training tokens single / team {min(ratio):.3f} to {max(ratio):.3f} "
                     f"over seeds{check} Per seed, paired over its held-out problems (mean ± standard error): "
                     + "; ".join(f"seed {s}: team vote - single maj@{n} "
                                 f"{v['singles'][budget]['vote_minus_maj'][0]:+.3f} ± "
                                 f"{v['singles'][budget]['vote_minus_maj'][1]:.3f}, - single avg@{n} "
                                 f"{v['singles'][budget]['vote_minus_avg'][0]:+.3f} ± "
                                 f"{v['singles'][budget]['vote_minus_avg'][1]:.3f}" for s, v in per_seed.items()) + ".")
    common.write_table(args.out, "Team vs one agent (claim 4)", common.markdown_table(header, rows), notes)
    curves = {f"team {args.agents}": col("team_rows")}
    curves.update({f"single {args.single}, equal {b}": [v["singles"][b]["rows"] for v in per_seed.values()]
                   for b in args.budget})
    common.plot_curves(Path(args.out) / "plot.png", {"held-out accuracy vs generated training tokens": curves},
                       x="tokens")
    print(f"plot: {Path(args.out) / 'plot.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
