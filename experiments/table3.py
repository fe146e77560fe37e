"""The paper's Table 3 columns for experiments/plug_and_play.py: each team evaluated on a composite of benchmarks
(the paper's: AIME24, AIME25 and ARBench-DC, their mean) before the swap and after the k stages that follow it.

    Before   the composite of the base team at its last stage (the incumbent team, before any swap)
    After    the composite of the branch's team after its k more stages
    Gain     After - Before, paired by seed (the same evaluation seeds and problems), 95% t interval over seeds
    d<B>     the change of benchmark B's team avg@K, After - Before, mean over seeds
    Viol.%   the share of the stages after the swap, over every seed, flagged ``violation`` in metrics.jsonl (a fall
             of the held-out accuracy beyond 2 standard errors from the stage before)

Each evaluation is ``harness.evaluation.evaluate`` (``--bench`` as eval_aime.py takes it, an env:NAME beside datasets
evaluated apart and averaged) on a run's checkpoint, into a folder of its own (OUT/table3/<team>/seed<S>), so a
rerun skips what it finished and resumes what it did not (eval_aime.py is resumable). Before and every After share
the evaluation's seed, so the samples of two teams are drawn under the same seeds (paired rows).
"""
from __future__ import annotations

import shlex
from pathlib import Path

import common

from harness import evaluation
from harness.eval_setting import EvalConfig

BEFORE = "before"  # the folder of the incumbent team's evaluations (OUT/table3/before/seed<S>)


def eval_config(bench: str, options: str, ckpt: Path, out: Path) -> EvalConfig:
    """eval_aime.py's options for one team: --bench, the user's --table3-options, the checkpoint and the folder."""
    return evaluation.parse_args(["--bench", bench, *shlex.split(options), "--ckpt", str(ckpt), "--out", str(out)])


def check_options(bench: str, options: str) -> None:
    """Refuse, before any run starts, --table3-options that eval_aime.py would refuse or that the script sets."""
    owned = [tok for tok in shlex.split(options) if tok.split("=")[0] in ("--ckpt", "--out", "--bench", "--agents")]
    if owned:
        raise SystemExit(f"error: --table3-options {owned[0].split('=')[0]} is set by the script for each team; "
                         "give the benchmarks with --table3")
    try:
        eval_config(bench, options, Path("ckpt"), Path("out")).validate()
    except SystemExit:
        raise SystemExit(f"error: --table3-options {options!r}: eval_aime.py cannot parse them "
                         "(see python eval_aime.py --help)") from None
    except ValueError as err:
        raise SystemExit(f"error: --table3-options: {err}") from None


def composite(bench: str, options: str, ckpt: Path, out: Path, quiet: bool) -> dict:
    """composite.json's content ({"benchmarks": {name: team avg@K}, "composite": their mean}) of the team in
    ``ckpt``, evaluated into ``out``; a single benchmark is its own composite."""
    cfg = eval_config(bench, options, ckpt, out)
    result = evaluation.evaluate(cfg, log=(lambda *_: None) if quiet else print)
    if "composite" in result:
        return result
    team = {name: b["metrics"]["team"][f"avg@{cfg.k}"]["value"] for name, b in result["benchmarks"].items()}
    return {"benchmarks": team, "composite": sum(team.values()) / len(team), "k": cfg.k}


def evaluate_teams(args, seeds: list[int], branches: dict[str, dict[int, list[dict]]]
                   ) -> tuple[dict[int, dict], dict[str, dict[int, dict]]]:
    """(Before per seed, {branch: After per seed}): the base's checkpoint at its last stage and every finished
    branch's last checkpoint, each on the composite of ``args.table3``."""
    root = Path(args.out) / "table3"
    ckpt = lambda folder: folder / "checkpoints" / f"stage_{args.stages:04d}"  # noqa: E731
    before = {s: composite(args.table3, args.table3_options, ckpt(common.run_folder(args.out, "", "base", s)),
                           common.run_folder(root, "", BEFORE, s), args.quiet) for s in seeds}
    after = {b: {s: composite(args.table3, args.table3_options, common.run_folder(args.out, "", b, s),
                              common.run_folder(root, "", b, s), args.quiet) for s in runs}
             for b, runs in branches.items()}
    return before, after


def header(names: list[str]) -> list[str]:
    """Table 3's columns: the composite before and after, the gain, each benchmark's change, Viol.%."""
    deltas = [f"d{n.removeprefix('env:')} (pp)" for n in names]
    return ["branch", "seeds", "Before %", "After %", "Gain (pp, 95% CI)"] + deltas + ["Viol.% (stages)"]


def row(branch: str, before: dict[int, dict], after: dict[int, dict], runs: dict[int, list[dict]],
        stage: int) -> list[str]:
    """One branch's Table 3 row over the seeds it finished (composites in percent; the gain paired by seed)."""
    seeds = sorted(after)
    pct = lambda xs: common.fmt_ci(*common.mean_ci([100 * x for x in xs]), digits=1, sign=False)  # noqa: E731
    gain = [100 * (after[s]["composite"] - before[s]["composite"]) for s in seeds]
    names = list(before[seeds[0]]["benchmarks"])
    deltas = [common.fmt_ci(common.mean_ci([100 * (after[s]["benchmarks"][n] - before[s]["benchmarks"][n])
                                            for s in seeds])[0], float("nan"), digits=1) for n in names]
    stages = [r for s in seeds for r in common.trained(runs[s], stage)]
    viol = sum(bool(r["violation"]) for r in stages)
    return ([branch, str(len(seeds)), pct([before[s]["composite"] for s in seeds]),
             pct([after[s]["composite"] for s in seeds]), common.fmt_ci(*common.mean_ci(gain), digits=1)]
            + deltas + [f"{100 * viol / len(stages):.1f} ({viol}/{len(stages)})" if stages else "-"])


def write(args, before: dict[int, dict], after: dict[str, dict[int, dict]],
          branches: dict[str, dict[int, list[dict]]]) -> Path:
    """OUT/table3.md: a row per branch that finished, with the notes that say what each column is."""
    names = list(next(iter(before.values()))["benchmarks"])
    rows = [row(b, before, after[b], branches[b], args.stages) for b in after if after[b]]
    notes = [f"Composite: the mean of the team's avg@K over {', '.join(names)} (eval_aime.py --bench {args.table3} "
             f"{args.table3_options}), in percent; Before: the base team at stage {args.stages}; After: each branch's "
             f"team after {args.more_stages} more stages. Gain: After - Before paired by seed, mean ± the 95% t "
             "interval over seeds (none with one seed); d<benchmark>: its change, mean over seeds. Viol.%: the "
             "share of the stages after the swap (all seeds) whose held-out accuracy fell beyond 2 standard errors."]
    return common.write_table(args.out, "Plug-and-play: the paper's Table 3 columns",
                              common.markdown_table(header(names), rows), notes, name="table3.md")
