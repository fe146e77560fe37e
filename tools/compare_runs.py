"""Several sat.py runs side by side (seeds, settings): held-out accuracy at the start and the end, and one plot.

    python tools/compare_runs.py runs/s0 runs/s1 runs/s2 --plot docs/seeds.png

Per run (its metrics.jsonl): stages trained, held-out team accuracy at stage 0 and at the last stage with their
standard errors, the change and its standard error (paired, from the run certificate, where the run has one; else
as if the two evaluations drew independently), the run's certified gain (its ``run_certificate``'s lower bound at
1 - delta_conf, or ``-`` for a run without one), each agent's own
accuracy at the start and the end, and the run's wall time in the stages (the sum of their ``seconds``). Then the
mean change over the runs with the standard error of that mean (between runs; runs of different lengths are
pooled as they are, so say so when reporting it). ``--plot`` draws held-out team accuracy per stage, one line per
run, with +-1 standard error bands.

``--stages`` adds a table per run, one line per stage: held-out accuracy, the paired change since the previous
row with its standard error and the share of rows that changed, the stage's paired lower bound beside the
unpaired Hoeffding bound on the same draws, the run certificate (since stage 0) beside its unpaired figure,
the violation flags, and the seconds of the stage's training and of its evaluation.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.run_folder import read_metrics  # noqa: E402


def summary(run: Path) -> dict:
    """Start and end of one run's held-out evaluation (metrics.jsonl row 0 and the last evaluated row: with
    --eval-every N some stages have none)."""
    rows = read_metrics(run)
    if not rows or rows[0]["stage"] != 0:
        raise ValueError(f"{run}: no metrics.jsonl with a stage-0 row; pass a sat.py run folder")
    seconds = sum(r["seconds"] for r in rows)
    rows = [r for r in rows if "eval_accuracy" in r]
    first, last = rows[0], rows[-1]
    cert = last.get("run_certificate")
    ses = (first["eval_stderr"], last["eval_stderr"])  # None for an evaluation of one value
    change_se = cert["stderr"] if cert else (None if None in ses else math.hypot(*ses))
    return {"run": str(run), "stages": last["stage"], "start": first["eval_accuracy"], "start_se": first["eval_stderr"],
            "end": last["eval_accuracy"], "end_se": last["eval_stderr"], "change": last["eval_accuracy"] -
            first["eval_accuracy"], "change_se": change_se, "certified": cert["lower_bound"] if cert else None,
            "agents_start": first["eval_agent_reward"], "agents_end": last["eval_agent_reward"],
            "seconds": seconds, "rows": rows}


def stage_table(s: dict) -> list[str]:
    """``--stages``: one line per trained stage of a run (rows with certificates)."""
    lines = [f"{Path(s['run']).name}: {'stage':>5} {'eval':>6} {'change':>15} {'rows chg':>8} {'bound':>7} "
             f"{'unpaired':>8} {'run>=':>7} {'unpaired':>8} {'viol':>4} {'fall':>4} {'train s':>7} {'eval s':>6}"]
    for r in s["rows"][1:]:
        c, rc = r.get("certificate"), r.get("run_certificate")
        if c is None or rc is None:
            continue
        lines.append(f"{'':>{len(Path(s['run']).name) + 1}} {r['stage']:>5} {r['eval_accuracy']:>6.3f} "
                     f"{c['mean_change']:>+7.3f}+-{c['stderr']:.3f} {c['nonzero']:>8.0%} {c['lower_bound']:>+7.3f} "
                     f"{c['unpaired_lower_bound']:>+8.3f} {rc['lower_bound']:>+7.3f} "
                     f"{rc['unpaired_lower_bound']:>+8.3f} "
                     f"{'yes' if r['violation'] else 'no':>4} {'yes' if r['certified_fall'] else 'no':>4} "
                     f"{r['seconds']:>7.0f} {r.get('eval_seconds', float('nan')):>6.0f}")
    return lines


def pm(value: float, se: float | None, spec: str) -> str:
    """``value+-se`` (value in format ``spec``), with ``-`` for a standard error that one held-out value cannot give."""
    return f"{value:{spec}}+-" + ("-" if se is None else f"{se:.3f}")


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for s in runs:
        stage = [r["stage"] for r in s["rows"]]
        acc = [r["eval_accuracy"] for r in s["rows"]]
        se = [r["eval_stderr"] or 0.0 for r in s["rows"]]  # no band where one value gave no error
        line, = ax.plot(stage, acc, "o-", label=Path(s["run"]).name)
        ax.fill_between(stage, [a - e for a, e in zip(acc, se)], [a + e for a, e in zip(acc, se)],
                        color=line.get_color(), alpha=0.15)
    ax.set_xlabel("stage")
    ax.set_ylabel("held-out team accuracy (+-1 se)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="sat.py run folders")
    p.add_argument("--plot", type=Path, help="write the accuracy curves here (.png)")
    p.add_argument("--stages", action="store_true", help="also a line per stage of each run (certificates, seconds)")
    args = p.parse_args(argv)
    runs = [summary(r) for r in args.runs]
    fmt = lambda xs: "/".join(f"{x:.2f}" for x in xs)  # noqa: E731
    print(f"{'run':<24} {'stages':>6} {'start':>13} {'end':>13} {'change':>14} {'certified':>9} "
          f"{'agents start -> end':>30} {'stage min':>9}")
    for s in runs:
        certified = "-" if s["certified"] is None else f"{s['certified']:+.3f}"
        print(f"{Path(s['run']).name:<24} {s['stages']:>6} {pm(s['start'], s['start_se'], '>7.3f')} "
              f"{pm(s['end'], s['end_se'], '>7.3f')} {pm(s['change'], s['change_se'], '>+8.3f')} {certified:>9} "
              f"{fmt(s['agents_start']) + ' -> ' + fmt(s['agents_end']):>30} {s['seconds'] / 60:>9.1f}")
    changes = [s["change"] for s in runs]
    spread = statistics.stdev(changes) / math.sqrt(len(changes)) if len(changes) > 1 else float("nan")
    print(f"mean change over {len(runs)} runs: {statistics.mean(changes):+.3f} (se between runs {spread:.3f})")
    if args.stages:
        for s in runs:
            print("\n".join(stage_table(s)))
    if args.plot:
        plot(runs, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
