"""Claim 3 (docs/claims.md; the paper's Sec. 4.3 and 5, Table 3): plug-and-play. A stronger replacement, brought
inside the incumbent's KL ball by Stage-0, raises the team; a weaker one lowers it; and the first stage after a
swap rarely violates monotonicity (the paper's Viol.% 2.5-4.7).

Per seed: a base team trained for --stages stages (OUT/base/seed<S>), then four branches from its final
checkpoint, each --more-stages k further stages into a folder of its own (OUT/<branch>/seed<S>):

    strong       --upgrade SLOT=STRONG  after Stage-0 (tiny: tiny-6L, warm-started twice as long as the team)
    weak         --upgrade SLOT=WEAK    after Stage-0 (tiny: an untrained tiny agent, --upgrade-warmup-steps 0)
    continue     no swap
    strong-raw   STRONG swapped in without the projection: --stage0-delta 1e9 makes Eq. (7)'s lambda 0 at every
                 state, so Stage-0's fit starts at its target and stops at pass 0 (the raw model, unchanged)

Table 3's columns per branch: held-out team accuracy before the swap (the base's last stage), right after the
swap before Stage-0 (the raw replacement in the team), after Stage-0, after k more stages, the gain over before,
the share of seeds whose first stage after the swap is a violation (a fall beyond 2 standard errors from the
accuracy after Stage-0), and the cost (Stage-0's seconds plus the k stages').

    python experiments/plug_and_play.py --seeds 0,1,2 --stages 6 --more-stages 3 --out /tmp/pnp

Paper scale (--agents "Qwen3-4B x3" --strong Qwen3-8B --weak Qwen3-1.7B), a rough estimate on H100s: the base
run is ~10-15 GPU-hours (10 stages of 512 x 32k-token joint trajectories; see sequential_vs_joint.py). Stage-0 of
an 8B replacement fits on the incumbent's states of 128 prompts x G 4 at ~8k tokens (4M tokens): a pass is a
forward and backward of the 8B and forwards of the frozen pi_pre and incumbent, ~1.5e17 FLOPs, ~10 min at 40% of
an H100, and the fit takes 10-50 passes: 2-8 GPU-hours. Each branch's k = 3 stages is ~3-5 GPU-hours (the 8B's
update twice a 4B's). Per seed: ~15 + 4 x 5 + 2 x 5 = ~45 GPU-hours; 5 seeds ~220 GPU-hours.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # common.py; the core modules come first

import common  # noqa: E402

BRANCHES = ("strong", "weak", "continue", "strong-raw")
RAW_STAGE0_DELTA = "1e9"  # Stage-0 radius no state reaches: the projection leaves the replacement as it is


def parse_args(argv=None):
    p = common.base_parser(__doc__, "runs/experiments/plug_and_play")
    p.add_argument("--more-stages", type=common.positive_int, default=3, help="k stages after the swap (default 3)")
    p.add_argument("--slot", type=common.positive_int, default=2, help="the 1-based slot replaced (default 2)")
    p.add_argument("--strong", default="tiny-6L", help="the stronger replacement (default tiny-6L)")
    p.add_argument("--weak", default="tiny", help="the weaker replacement (default tiny, untrained)")
    p.add_argument("--weak-warmup-steps", type=int, default=0,
                   help="warm start of a tiny weak replacement (default 0: untrained)")
    p.add_argument("--branches", default=",".join(BRANCHES), help=f"any of {', '.join(BRANCHES)}")
    args, rest = common.parse(p, argv)
    args.branches = common.parse_list(args.branches, BRANCHES, "--branches")
    n = len(common.parse_agents(args.agents))
    if args.slot > n:
        p.error(f"--slot {args.slot} is out of range: the team '{args.agents}' has agents 1..{n}")
    return args, rest


def branch_options(args, branch: str) -> list[str]:
    """The sat.py options of one branch (besides --resume and the pass-through ones)."""
    weak_tiny = common.parse_agents(args.weak)[0].kind == "tiny"
    return {"strong": ["--upgrade", f"{args.slot}={args.strong}"],
            "weak": ["--upgrade", f"{args.slot}={args.weak}"]
                    + (["--upgrade-warmup-steps", str(args.weak_warmup_steps)] if weak_tiny else []),
            "continue": [],
            "strong-raw": ["--upgrade", f"{args.slot}={args.strong}", "--stage0-delta", RAW_STAGE0_DELTA]}[branch]


def run_seed(args, rest: list[str], seed: int) -> tuple[list[dict], dict[str, list[dict] | str]]:
    """The base run and every branch of one seed: (base rows, {branch: rows, or the error that stopped it})."""
    base = common.run_folder(args.out, "", "base", seed)
    base_rows = common.ensure_run(base, ["--agents", args.agents, "--seed", str(seed)] + rest, args.stages,
                                  args.quiet)
    start = base / "checkpoints" / f"stage_{args.stages:04d}"
    out = {}
    for branch in args.branches:
        folder = common.run_folder(args.out, "", branch, seed)
        try:
            out[branch] = common.ensure_run(folder, ["--resume", str(start)] + rest + branch_options(args, branch),
                                            args.stages + args.more_stages, args.quiet, min_stage=args.stages)
        except (RuntimeError, ValueError) as err:  # e.g. Stage-0 cannot bring the replacement inside delta_0
            print(f"[experiments] {folder}: failed: {err}", flush=True)
            out[branch] = f"failed: {' '.join(str(err).split())}"
    return base_rows, out


def upgrade_event(rows: list[dict], stage: int) -> dict | None:
    """The plug-and-play event recorded in the first row after the swap (None: no swap)."""
    ups = common.row_at(rows, stage + 1).get("upgrades") or []
    return ups[0] if ups else None


def branch_row(branch: str, runs: dict[int, list[dict]], stage: int, reference: dict[int, list[dict]]) -> list[str]:
    """Table 3's columns for one branch over the seeds that finished it (and its gain minus the no-swap
    branch's, ``reference``, paired by seed)."""
    seeds = sorted(runs)
    before = [common.row_at(runs[s], stage)["eval_accuracy"] for s in seeds]
    events = [upgrade_event(runs[s], stage) for s in seeds]
    swapped = all(e is not None for e in events)
    raw = [e["before_stage0"]["eval_accuracy"] for e in events] if swapped else []
    raw_alone = [e["before_stage0"]["eval_agent_accuracy"][e["slot"] - 1] for e in events] if swapped else []
    after0 = [e["eval_accuracy_after_stage0"] for e in events] if swapped else []
    end = [runs[s][-1]["eval_accuracy"] for s in seeds]
    first = [common.row_at(runs[s], stage + 1) for s in seeds]
    stage0_s = [e["seconds"] for e in events] if swapped else [0.0] * len(seeds)
    cost = [s0 + common.seconds(common.trained(runs[s], stage)) for s0, s in zip(stage0_s, seeds)]
    kl_q = [e["stage0"]["kl_quantile"] for e in events] if swapped else []
    f = lambda xs: common.fmt_ci(*common.mean_ci(xs), sign=False) if xs else "-"  # noqa: E731
    return [branch, len(seeds), f(before), f(raw), f(raw_alone), f(after0), f(kl_q), f(end),
            common.fmt_ci(*common.mean_ci([e - b for e, b in zip(end, before)])),
            "-" if branch == "continue" or not reference else common.fmt_ci(*common.mean_ci(
                common.paired_differences({s: common.gain(runs[s], stage) for s in seeds},
                                          {s: common.gain(r, stage) for s, r in reference.items()}))),
            f"{sum(bool(r['violation']) for r in first)}/{len(first)}",
            f"{common.mean_ci(cost)[0]:.0f} ({common.mean_ci(stage0_s)[0]:.0f})"]


HEADER = ["branch", "seeds", "before swap", "right after swap (raw, before Stage-0)", "new agent alone (raw)",
          "after Stage-0", "Stage-0 KL q", "after k stages", "gain vs before (95% CI)", "gain - continue (paired)",
          "first-stage violations", "cost s (Stage-0 s)"]


def main(argv=None) -> int:
    args, rest = parse_args(argv)
    bases, branches, failures = [], {b: {} for b in args.branches}, []
    for seed in args.seeds:
        base_rows, out = run_seed(args, rest, seed)
        bases.append(base_rows)
        for branch, rows in out.items():
            if isinstance(rows, str):
                failures.append(f"- {branch}, seed {seed}: {rows}")
            else:
                branches[branch][seed] = rows
    rows = [branch_row(b, runs, args.stages, branches.get("continue", {})) for b, runs in branches.items() if runs]
    rows += [[b, 0] + ["-"] * (len(HEADER) - 2) for b, runs in branches.items() if not runs]
    notes = [f"{len(args.seeds)} seeds ({', '.join(map(str, args.seeds))}); base '{args.agents}' trained "
             f"{args.stages} stages, then k = {args.more_stages} stages per branch; slot {args.slot}: strong "
             f"'{args.strong}', weak '{args.weak}' (warm start {args.weak_warmup_steps} steps if tiny); "
             f"sat.py options: {' '.join(rest) or '(defaults)'}.",
             "Held-out team accuracy: mean ± half-width of the 95% t interval over seeds (each evaluation a fresh "
             "draw). 'new agent alone (raw)': the replacement's own held-out accuracy inside the team, before "
             "Stage-0. 'Stage-0 KL q': the kept per-state KL quantile to the incumbent after Stage-0 (strong-raw: "
             f"unprojected, --stage0-delta {RAW_STAGE0_DELTA}). First-stage violations: seeds whose first stage "
             "after the swap fell beyond 2 standard errors from the accuracy after Stage-0 (continue: from the "
             "base's last stage). Cost: Stage-0's seconds plus the k stages' (the replacement's warm start, "
             "standing in for pretraining, not counted)."] + (["Failed runs:"] + failures if failures else [])
    common.write_table(args.out, "Plug-and-play (claim 3, paper Table 3)", common.markdown_table(HEADER, rows), notes)
    curves = {"base": bases, **{b: list(r.values()) for b, r in branches.items() if r}}
    common.plot_curves(Path(args.out) / "plot.png", {f"slot {args.slot} swapped after stage {args.stages}": curves})
    print(f"plot: {Path(args.out) / 'plot.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
