"""The step rule side by side: each --step-size rule over the same seeds, equal stages (issue: the trust region
sets the step).

    python experiments/step_rule.py --agents "SmolLM2-135M x3" --seeds 0,1,2 --stages 3 --eval-every 3 --threads 1
    python experiments/step_rule.py ... --task reasoning-gym:knights_knaves --max-new-tokens 96   # another task

A run with seed S under each rule starts from the same team and evaluates the same held-out rows under the same
seeds, so the rules pair row by row. Per rule (mean over seeds, 95% t interval): the held-out change since
stage 0, that change per wall-second (stages and evaluations), the kept KL quantile against delta, KL checks per
step after the first (halvings; under ``scaled`` also the stretched try), the share of violation-flagged stages
and the run certificate (its paired lower bound). Then, per seed, the last evaluation's paired difference between
the rules (the mean and a 95% normal interval over its rows), and over seeds the mean difference of the changes.
A figure, kl.png beside table.md, shows where each rule's kept steps land in the trust region. Runs resume where
they stopped (``common.ensure_run``); ``--summary`` reads whatever runs have finished and prints the table and the
figure without running anything.
"""
from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

RULES = ("fixed", "adaptive", "scaled")


def setting_name(rest: list[str]) -> str:
    """The folder of a task: its --task value (default: the preset's), with ':' made safe for a path."""
    task = rest[rest.index("--task") + 1] if "--task" in rest else "preset-task"
    return task.replace(":", "-")


def per_run(rows: list[dict]) -> dict:
    """What one run's metrics say (its stage-0 row and the trained stages)."""
    steps = [a for r in common.trained(rows) for a in r["agents"]]
    wall = common.seconds(rows) + sum(r.get("eval_seconds", 0.0) for r in rows)
    change = common.gain(rows)
    return {"change": change, "per_s": change / wall, "wall": wall, "kl_q": statistics.mean(a["kl_quantile"] for a in
            steps), "kl_q_max": max(a["kl_quantile"] for a in steps), "delta": steps[0]["delta"],
            "halvings": statistics.mean(a["backtracks"] for a in steps), "rejected": sum(not a["accepted"] for a in
            steps), "violations": common.violation_rate([r for r in common.trained(rows) if "violation" in r]),
            "certificate": common.run_lower_bound(rows), "lr_last": [a.get("lr_next") for a in steps[-3:]]}


def paired_rule_difference(a: list[dict], b: list[dict]) -> tuple[float, float]:
    """Mean and 95% normal half-width of a's last held-out rewards minus b's, row by row (same seeds)."""
    diffs = [x - y for x, y in zip(a[-1]["eval_rewards"], b[-1]["eval_rewards"])]
    if len(diffs) < 2:
        return float("nan"), float("nan")
    return statistics.mean(diffs), 1.96 * statistics.stdev(diffs) / math.sqrt(len(diffs))


def table(runs: dict[str, dict[int, list[dict]]]) -> str:
    """One line per rule (means over seeds), then the paired differences of each rule from ``fixed``."""
    lines = []
    for rule, by_seed in runs.items():
        stats = [per_run(rows) for rows in by_seed.values()]
        ci = {k: common.mean_ci([s[k] for s in stats]) for k in ("change", "per_s", "kl_q", "halvings", "violations")}
        certs = [s["certificate"] for s in stats]
        lines.append([rule, len(stats), common.fmt_ci(*ci["change"]), f"{ci['per_s'][0] * 3600:+.3f}",
                      f"{ci['kl_q'][0]:.4f} (max {max(s['kl_q_max'] for s in stats):.4f}) / {stats[0]['delta']}",
                      f"{ci['halvings'][0]:.2f}", sum(s["rejected"] for s in stats), f"{ci['violations'][0]:.2f}",
                      " / ".join("-" if c is None else f"{c:+.3f}" for c in certs),
                      f"{statistics.mean(s['wall'] for s in stats):.0f}"])
    out = common.markdown_table(["rule", "seeds", "held-out change (95% t over seeds)", "change per hour",
                                 "kept KL quantile / delta", "KL checks after the first, a step", "rejected steps",
                                 "violation rate", "run certificate per seed", "mean wall s"], lines)
    base = runs.get("fixed", {})
    for rule, by_seed in runs.items():
        if rule == "fixed":
            continue
        seeds = sorted(set(by_seed) & set(base))
        per_seed = [f"seed {s}: {common.fmt_ci(*paired_rule_difference(by_seed[s], base[s]))}" for s in seeds]
        over = common.mean_ci(common.paired_differences({s: common.gain(by_seed[s]) for s in seeds},
                                                        {s: common.gain(base[s]) for s in seeds}))
        out += (f"\n\n{rule} - fixed, last held-out evaluation, paired by row: {'; '.join(per_seed) or '-'}; "
                f"change over seeds: {common.fmt_ci(*over)}")
    return out


def plot_kept_kl(path: Path, runs: dict[str, dict[int, list[dict]]]) -> Path:
    """A histogram per rule of every kept step's KL quantile as a fraction of delta (all agents, stages and seeds):
    how much of the trust region the steps use. ``scaled`` aims at 0.7 (the dotted line); rejected steps keep
    pi_cur and are left out (the table counts them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 3.4))
    for rule, by_seed in runs.items():
        used = [min(1.0, a["kl_quantile"] / a["delta"]) for rows in by_seed.values() for r in common.trained(rows)
                for a in r["agents"] if a["accepted"]]
        ax.hist(used, bins=[i / 20 for i in range(21)], histtype="step", lw=1.6,
                label=f"{rule}: {len(used)} steps, {len(by_seed)} seeds")
    ax.axvline(0.7, ls=":", color="grey")
    ax.set_xlabel("kept KL quantile / delta")
    ax.set_ylabel("agent steps")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = common.base_parser(__doc__, "runs/step_rule")
    p.add_argument("--rules", default=",".join(RULES), type=lambda t: common.parse_list(t, RULES, "--rules"),
                   help="the --step-size rules to compare (default: all three)")
    p.add_argument("--summary", action="store_true", help="print the table of the finished runs; run nothing")
    args, rest = common.parse(p, argv)
    setting = setting_name(rest)
    runs: dict[str, dict[int, list[dict]]] = {rule: {} for rule in args.rules}
    for seed in args.seeds:
        for rule in args.rules:
            folder = common.run_folder(Path(args.out), setting, rule, seed)
            if args.summary:
                if common.run_state(folder, args.stages) == "done":
                    runs[rule][seed] = [r for r in common.read_metrics(folder) if r["stage"] <= args.stages]
                continue
            argv_run = rest + ["--agents", args.agents, "--seed", str(seed), "--step-size", rule]
            runs[rule][seed] = common.ensure_run(folder, argv_run, args.stages, quiet=args.quiet)
    runs = {rule: by_seed for rule, by_seed in runs.items() if by_seed}
    if runs:
        common.write_table(Path(args.out) / setting, f"--step-size on {args.agents}, {setting}, {args.stages} stages",
                           table(runs), [f"command: python experiments/step_rule.py {' '.join(sys.argv[1:])}"])
        plot_kept_kl(Path(args.out) / setting / "kl.png", runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
