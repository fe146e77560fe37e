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

and, when --branches names them, the acceptance rules of sat.py's --upgrade-accept:

    strong-certified, weak-certified   --upgrade-accept certified: Stage-0 at delta_0 in {0.01, ..., 1} and the raw
                 swap, the best paired lower bound on a selection split of training problems swapped in only if its
                 paired lower bound on a disjoint certification split is > 0 (else the incumbent stays)
    strong-raw-accept, weak-raw        --upgrade-accept raw: the replacement as loaded, no Stage-0 at all

Table 3's columns per branch: held-out team accuracy before the swap (the base's last stage), right after the
swap before Stage-0 (the raw replacement in the team), after Stage-0, after k more stages, the gain over before,
the share of seeds whose first stage after the swap is a violation (a fall beyond 2 standard errors from the
accuracy after Stage-0), and the cost (Stage-0's seconds plus the k stages').

    python experiments/plug_and_play.py --seeds 0,1,2 --stages 6 --more-stages 3 --out /tmp/pnp
    python experiments/plug_and_play.py --seeds 0,1,2 --stages 6 --more-stages 3 --out /tmp/pnp \\
        --branches continue,strong,strong-raw,strong-certified,weak-certified

With --table3 BENCH, a third table (table3.md) holds the paper's own columns: the composite of the eval_aime.py
benchmarks BENCH before the swap and after the k stages, the gain, each benchmark's change and Viol.% (the share
of the stages after the swap flagged as violations); experiments/table3.py. The paper's Table 3 on a GPU node:

    python experiments/plug_and_play.py --agents "Qwen3-4B x3" --strong Qwen3-8B --weak Qwen3-1.7B --seeds 0,1,2 \\
        --stages 10 --more-stages 3 --table3 aime24,aime25,env:detective-cases \\
        --table3-options "--k 64 --env-model Qwen2.5-32B-Instruct" --out runs/table3

A second table (acceptance.md) holds what the certified branches chose: the share of seeds swapped, the candidates
picked, the certification bound, the held-out change the swap made (paired with the base's last evaluation) and
how often a swap fell on the held-out rows, and the share of the raw swap's change each rule kept.

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
import table3  # noqa: E402

BRANCHES = ("strong", "weak", "continue", "strong-raw")  # the default set
ACCEPT_BRANCHES = ("strong-certified", "weak-certified", "strong-raw-accept", "weak-raw")  # on request
RAW_STAGE0_DELTA = "1e9"  # Stage-0 radius no state reaches: the projection leaves the replacement as it is


def parse_args(argv=None):
    p = common.base_parser(__doc__, "runs/experiments/plug_and_play")
    p.add_argument("--more-stages", type=common.positive_int, default=3, help="k stages after the swap (default 3)")
    p.add_argument("--slot", type=common.positive_int, default=2, help="the 1-based slot replaced (default 2)")
    p.add_argument("--strong", default="tiny-6L", help="the stronger replacement (default tiny-6L)")
    p.add_argument("--weak", default="tiny", help="the weaker replacement (default tiny, untrained)")
    p.add_argument("--weak-warmup-steps", type=int, default=0,
                   help="warm start of a tiny weak replacement (default 0: untrained)")
    p.add_argument("--branches", default=",".join(BRANCHES),
                   help=f"any of {', '.join(BRANCHES + ACCEPT_BRANCHES)} (default: the first four)")
    p.add_argument("--table3", default=None, metavar="BENCH",
                   help="also report the paper's Table 3 columns (experiments/table3.py): the composite of these "
                        "eval_aime.py --bench names before the swap and after the k stages, e.g. "
                        "aime24,aime25,env:detective-cases (default: none)")
    p.add_argument("--table3-options", default="", metavar="OPTIONS",
                   help="eval_aime.py options of every Table 3 evaluation, one quoted string, e.g. "
                        "'--k 64 --env-model Qwen2.5-32B-Instruct'")
    args, rest = common.parse(p, argv)
    if args.table3:
        table3.check_options(args.table3, args.table3_options)
    elif args.table3_options:
        p.error("--table3-options needs --table3 BENCH")
    args.branches = common.parse_list(args.branches, BRANCHES + ACCEPT_BRANCHES, "--branches")
    n = len(common.parse_agents(args.agents))
    if args.slot > n:
        p.error(f"--slot {args.slot} is out of range: the team '{args.agents}' has agents 1..{n}")
    return args, rest


def branch_options(args, branch: str) -> list[str]:
    """The sat.py options of one branch (besides --resume and the pass-through ones)."""
    weak_tiny = common.parse_agents(args.weak)[0].kind == "tiny"
    strong = ["--upgrade", f"{args.slot}={args.strong}"]
    weak = (["--upgrade", f"{args.slot}={args.weak}"]
            + (["--upgrade-warmup-steps", str(args.weak_warmup_steps)] if weak_tiny else []))
    return {"strong": strong, "weak": weak, "continue": [],
            "strong-raw": strong + ["--stage0-delta", RAW_STAGE0_DELTA],
            "strong-certified": strong + ["--upgrade-accept", "certified"],
            "weak-certified": weak + ["--upgrade-accept", "certified"],
            "strong-raw-accept": strong + ["--upgrade-accept", "raw"],
            "weak-raw": weak + ["--upgrade-accept", "raw"]}[branch]


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
    raw_alone = [e["before_stage0"]["eval_agent_reward"][e["slot"] - 1] for e in events] if swapped else []
    after0 = [e["eval_accuracy_after_stage0"] for e in events] if swapped else []
    end = [runs[s][-1]["eval_accuracy"] for s in seeds]
    first = [common.row_at(runs[s], stage + 1) for s in seeds]
    stage0_s = [e["seconds"] for e in events] if swapped else [0.0] * len(seeds)
    cost = [s0 + common.seconds(common.trained(runs[s], stage)) for s0, s in zip(stage0_s, seeds)]
    kl_q = [e["stage0"]["kl_quantile"] for e in events if "stage0" in e] if swapped else []
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


def raw_reference(branch: str) -> str:
    """The raw-swap branch a rule's branch is measured against (the same replacement, no projection)."""
    return "strong-raw" if branch.startswith("strong") else "weak-raw"


def share(part: list[float], whole: list[float]) -> str:
    """mean(part) / mean(whole): the share of the raw swap's gain a rule kept (a ratio of means over the
    seeds both have, so seeds with a near-0 raw change do not blow it up); none where the raw swap did not gain."""
    if not part or not whole or sum(whole) <= 0:
        return "- (raw did not gain)" if whole else "-"
    return f"{sum(part) / sum(whole):.0%}"


def acceptance_row(branch: str, branches: dict[str, dict[int, list[dict]]], stage: int) -> list[str]:
    """What an --upgrade-accept branch did over its seeds (``ACCEPT_HEADER``)."""
    runs = branches[branch]
    seeds = sorted(runs)
    before = {s: common.row_at(runs[s], stage)["eval_accuracy"] for s in seeds}
    events = {s: upgrade_event(runs[s], stage) for s in seeds}
    accept = {s: e["accept"] for s, e in events.items()}
    swapped = [s for s in seeds if accept[s]["swapped"]]
    chosen = [accept[s].get("chosen", "raw") for s in seeds]
    certs = [accept[s]["certification"]["lower_bound"] for s in seeds if "certification" in accept[s]]
    change = {s: events[s]["heldout_change"] for s in seeds}
    raw_lift = {s: events[s]["before_stage0"]["eval_accuracy"] - before[s] for s in seeds}
    cont, raw_runs = branches.get("continue", {}), branches.get(raw_reference(branch), {})
    both = [s for s in seeds if s in cont and s in raw_runs]
    gain = lambda rows: common.gain(rows, stage)  # noqa: E731
    after_k = [gain(runs[s]) - gain(cont[s]) for s in both]
    raw_k = [gain(raw_runs[s]) - gain(cont[s]) for s in both]
    falls = sum(r["certified_fall"] for s in seeds for r in common.trained(runs[s], stage))
    stages = sum(len(common.trained(runs[s], stage)) for s in seeds)
    return [branch, len(seeds), f"{len(swapped)}/{len(seeds)}",
            ", ".join(f"{c} x{chosen.count(c)}" for c in sorted(set(chosen))),
            common.fmt_ci(*common.mean_ci(certs)) if certs else "-",
            common.fmt_ci(*common.mean_ci([change[s]["mean_change"] for s in seeds])),
            common.fmt_ci(*common.mean_ci(list(raw_lift.values()))),
            share([change[s]["mean_change"] for s in seeds], list(raw_lift.values())),
            f"{sum(change[s]['mean_change'] < 0 for s in swapped)}/{len(swapped)}",
            f"{sum(change[s]['upper_bound'] < 0 for s in swapped)}/{len(swapped)}",
            common.fmt_ci(*common.mean_ci(after_k)) if both else "-",
            f"{share(after_k, raw_k)} ({len(both)} seeds)" if both else "-", f"{falls}/{stages}"]


def candidate_rows(branch: str, runs: dict[int, list[dict]], stage: int) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of every candidate a certified branch tried, a column per seed: its gain over the incumbent
    on the selection split / that paired lower bound (Stage-0's kept KL quantile, or why it was dropped); the
    last row is the pick's certification."""
    seeds = sorted(runs)
    accept = {s: upgrade_event(runs[s], stage)["accept"] for s in seeds}
    names = [c["candidate"] for c in accept[seeds[0]]["candidates"]]

    def cell(c: dict) -> str:
        if "error" in c:
            return "dropped: Stage-0 did not fit"
        kl = f" (KL q {c['stage0']['kl_quantile']:.3f})" if "stage0" in c else ""
        return f"{c['selection']['mean_change']:+.4f} / {c['selection']['lower_bound']:+.4f}{kl}"

    rows = [[name] + [cell(next(c for c in accept[s]["candidates"] if c["candidate"] == name)) for s in seeds]
            for name in names]
    rows.append([f"**certification of the pick** ({branch})"]
                + [f"{accept[s]['chosen']}: {accept[s]['certification']['mean_change']:+.4f} / "
                   f"**{accept[s]['certification']['lower_bound']:+.4f}** -> "
                   f"{'swapped' if accept[s]['swapped'] else 'incumbent kept'}" for s in seeds])
    return ["candidate"] + [f"seed {s}: selection gain / lower bound" for s in seeds], rows


ACCEPT_HEADER = ["branch", "seeds", "swapped", "chosen", "certification lower bound", "held-out change at the swap",
                 "raw swap's change at the swap", "share of raw kept at the swap", "swaps that fell (measured)",
                 "swaps that fell (certified, held-out)", "gain - continue after k (paired)",
                 "share of raw's gain - continue kept after k", "certified-fall stages after the swap"]
ACCEPT_NOTES = ("The --upgrade-accept branches. 'chosen': the candidate each seed's rule picked on the selection split "
                "(raw for --upgrade-accept raw). 'certification lower bound': its paired lower bound at --delta-conf "
                "on the certification split (swapped only if > 0). 'held-out change at the swap': the team after the "
                "upgrade against the base's last evaluation, paired on the same held-out rows and seeds (0 where the "
                "incumbent stayed); 'raw swap's change': the raw replacement in the team against the same. A swap that "
                "fell: held-out change < 0 (measured), or its paired upper bound < 0 (a certified fall). Shares are "
                "ratios of means over seeds: the branch's change over the raw swap's ('after k': each minus no swap, "
                "paired by seed with continue and the raw branch, strong-raw or weak-raw). Certified-fall stages: "
                "stages after the swap whose held-out paired upper bound on the change since the previous row is < 0.")

CANDIDATE_NOTES = ("Every candidate: the team with the candidate in the slot against the incumbent team on the "
                   "selection split, mean change / its paired lower bound at --delta-conf (the rule picks the "
                   "largest bound); the last row is the pick on the disjoint certification split, swapped only if "
                   "its bound is > 0.")


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
    accepting = [b for b, runs in branches.items() if b in ACCEPT_BRANCHES and runs]
    if accepting:
        table = common.markdown_table(ACCEPT_HEADER, [acceptance_row(b, branches, args.stages) for b in accepting])
        for branch in (b for b in accepting if b.endswith("-certified")):
            header, cand = candidate_rows(branch, branches[branch], args.stages)
            table += f"\n\nEvery candidate of {branch}:\n\n" + common.markdown_table(header, cand)
        common.write_table(args.out, "Plug-and-play: how the replacement entered (--upgrade-accept)", table,
                           [ACCEPT_NOTES, CANDIDATE_NOTES], name="acceptance.md")
    if args.table3:
        before, after = table3.evaluate_teams(args, args.seeds, {b: r for b, r in branches.items() if r})
        table3.write(args, before, after, branches)
    curves = {"base": bases, **{b: list(r.values()) for b, r in branches.items() if r}}
    common.plot_curves(Path(args.out) / "plot.png", {f"slot {args.slot} swapped after stage {args.stages}": curves})
    print(f"plot: {Path(args.out) / 'plot.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
