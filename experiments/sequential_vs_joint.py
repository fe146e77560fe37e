"""Claims 1 and 2 (docs/claims.md): sequential beats joint, and stale rollouts compound with the number of agents.

Claim 1 (the paper, Sections 3-4; Algorithm 1 of Section 5): updating one agent at a time inside its trust region
is more stable than updating all agents at once on one batch. Claim 2 (TeamTR, arXiv 2605.15207): reusing one
stage's rollouts with truncated importance weights degrades as the team grows; redrawing after each promotion does
not.

Conditions (each a sat.py run; the same seed starts every condition from the same warm-started team, the same
training stream and the same held-out problems, because each branches from one stage-0 checkpoint):

    sat-regenerate   --update sequential --reuse regenerate
    sat-weights      --update sequential --reuse weights     (the paper's)
    joint            --update joint

over --protocols (independent, chain) and --n-agents (team sizes). Per condition: held-out gain (last stage's
team accuracy minus stage 0's; mean and 95% t interval over seeds), its paired-by-seed difference to
sat-regenerate, the share of stages flagged as violations, the mean kept per-state KL quantile, the stages' wall
time and, where the metrics carry a run certificate, its mean lower bound.

    python experiments/sequential_vs_joint.py --seeds 0,1,2 --stages 8 --out /tmp/svj --batch-size 256

Paper scale (--agents "Qwen3-4B x3", PAPER_PRESET: 512 joint trajectories of up to 32k tokens a stage, 10
stages), a rough estimate on H100s: a stage's rollout is 512 x n responses; at a mean of ~8k tokens (the cap
32k) that is 12M tokens for n = 3, ~15 min of vLLM decoding of a 4B model on one H100 (~15k tokens/s batched);
each agent's update is a forward and backward over its 4M tokens (6 x 4e9 x 4M = 1e17 FLOPs, ~10 min at 40% of
an H100's 400 TFLOP/s) plus the exact-KL forwards (~5 min): about 1 GPU-hour a stage for sat-weights and joint,
about 1.5 for sat-regenerate (each agent's turn is drawn twice more: before its step for the bound, after it).
So a run is ~10-15 GPU-hours and the default matrix (3 conditions x 2 protocols x 2 sizes x 5 seeds) ~700
GPU-hours; one protocol and n = 3 with 3 seeds ~110 GPU-hours. Responses at the 32k cap would be ~4x that.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # common.py; the core modules come first

import common  # noqa: E402

CONDITIONS = {
    "sat-regenerate": ["--update", "sequential", "--reuse", "regenerate"],
    "sat-weights": ["--update", "sequential", "--reuse", "weights"],
    "joint": ["--update", "joint"],
}
REFERENCE = "sat-regenerate"
PROTOCOLS = ("independent", "chain")


def parse_args(argv=None):
    p = common.base_parser(__doc__, "runs/experiments/sequential_vs_joint")
    p.add_argument("--conditions", default=",".join(CONDITIONS), help=f"any of {', '.join(CONDITIONS)}")
    p.add_argument("--protocols", default="independent,chain", help="independent, chain or both")
    p.add_argument("--n-agents", default="2,3", help="team sizes, comma-separated (each a team of the --agents kind)")
    args, rest = common.parse(p, argv)
    args.conditions = common.parse_list(args.conditions, tuple(CONDITIONS), "--conditions")
    args.protocols = common.parse_list(args.protocols, PROTOCOLS, "--protocols")
    try:
        args.n_agents = [common.positive_int(s) for s in args.n_agents.split(",") if s.strip()]
    except Exception:
        p.error(f"--n-agents {args.n_agents!r}: write comma-separated team sizes, e.g. 2,3")
    if not args.n_agents:
        p.error("--n-agents: give at least one team size, e.g. 2,3")
    return args, rest


def run_setting(args, rest: list[str], protocol: str, n: int) -> dict[str, dict[int, list[dict]]]:
    """Every condition and seed of one (protocol, team size): {condition: {seed: metrics rows}}."""
    setting = f"{protocol}-n{n}"
    runs = {c: {} for c in args.conditions}
    for seed in args.seeds:
        base = common.run_folder(args.out, setting, "stage0", seed)  # the warm-started team, evaluated once
        common.ensure_run(base, ["--agents", common.team_of(args.agents, n), "--protocol", protocol,
                                 "--seed", str(seed)] + rest, 0, args.quiet)
        start = base / "checkpoints" / "stage_0000"
        for cond in args.conditions:
            folder = common.run_folder(args.out, setting, cond, seed)
            runs[cond][seed] = common.ensure_run(folder, ["--resume", str(start)] + rest + CONDITIONS[cond],
                                                 args.stages, args.quiet)
    return runs


def table_rows(setting: str, runs: dict[str, dict[int, list[dict]]]) -> list[list[str]]:
    """One table row per condition of a setting."""
    gains = {c: {s: common.gain(rows) for s, rows in by_seed.items()} for c, by_seed in runs.items()}
    out = []
    for cond, by_seed in runs.items():
        seeds = sorted(by_seed)
        stage_rows = {s: common.trained(by_seed[s]) for s in seeds}
        start = [by_seed[s][0]["eval_accuracy"] for s in seeds]
        end = [by_seed[s][-1]["eval_accuracy"] for s in seeds]
        diff = (common.fmt_ci(*common.mean_ci(common.paired_differences(gains[cond], gains[REFERENCE])))
                if REFERENCE in gains and cond != REFERENCE else "-")
        bounds = [common.run_lower_bound(by_seed[s]) for s in seeds]
        bound = common.fmt_ci(*common.mean_ci(bounds)) if all(b is not None for b in bounds) else "-"
        out.append([setting, cond, len(seeds),
                    common.fmt_ci(*common.mean_ci(start), sign=False), common.fmt_ci(*common.mean_ci(end), sign=False),
                    common.fmt_ci(*common.mean_ci(list(gains[cond].values()))), diff,
                    f"{common.mean_ci([common.violation_rate(stage_rows[s]) for s in seeds])[0]:.3f}",
                    f"{common.mean_ci([common.mean_kl_quantile(stage_rows[s]) for s in seeds])[0]:.3f}",
                    f"{common.min_agent_value([r for s in seeds for r in stage_rows[s]], 'ess_ratio'):.3f}",
                    f"{common.mean_ci([common.seconds(stage_rows[s]) for s in seeds])[0]:.0f}",
                    f"{common.median_stage_seconds([r for s in seeds for r in stage_rows[s]]):.1f}", bound])
    return out


HEADER = ["setting", "condition", "seeds", "stage-0 acc", "final acc", "gain (95% CI)",
          f"gain - {REFERENCE} (paired)", "violation rate", "mean kept KL q", "min ESS/N", "stage s / run",
          "median stage s", "run lower bound"]


def main(argv=None) -> int:
    args, rest = parse_args(argv)
    all_runs, rows = {}, []
    for protocol in args.protocols:
        for n in args.n_agents:
            runs = run_setting(args, rest, protocol, n)
            all_runs[f"{protocol}, n={n}"] = {c: list(v.values()) for c, v in runs.items()}
            rows += table_rows(f"{protocol}-n{n}", runs)
    notes = [f"{len(args.seeds)} seeds ({', '.join(map(str, args.seeds))}), {args.stages} stages, agents "
             f"'{args.agents}' (sized per setting), sat.py options: {' '.join(rest) or '(defaults)'}.",
             "Accuracies and gains: mean ± half-width of the 95% t interval over seeds. The paired column is the "
             f"mean over seeds of (gain - {REFERENCE}'s gain), same seed = same initial team and held-out problems.",
             "Violation rate: share of a run's stages whose held-out accuracy fell beyond 2 standard errors (mean "
             "over seeds). Min ESS/N: the smallest effective sample share of an agent's truncated weights in any "
             "stage (1: the batch was on-policy for it). Stage s / run: the sum of a run's stages' seconds (no warm "
             "start), mean over seeds; the median stage's seconds (every stage of every seed) is robust to a stage "
             "slowed by other load."]
    common.write_table(args.out, "Sequential vs joint; regenerate vs reuse (claims 1-2)",
                       common.markdown_table(HEADER, rows), notes)
    common.plot_curves(Path(args.out) / "plot.png", all_runs)
    print(f"plot: {Path(args.out) / 'plot.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
