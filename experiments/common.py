"""What the experiments/ scripts share (CleanRL ``benchmark/`` style): seeds as a flag, one run folder per
condition and seed, finished runs skipped and killed ones resumed, metrics.jsonl read back, the mean and its
95% t interval over seeds, paired-by-seed differences, a markdown table and one plot.

Every run is ``harness.run.run(harness.cli.parse_args([...]))``: a script builds sat.py options, never a stage
loop of its own.
A run folder is ``OUT/<setting>/<condition>/seed<S>``; options a script does not know are handed to sat.py
unchanged for every run (e.g. ``--batch-size 64 --eval-size 32``).
"""
from __future__ import annotations

import argparse
import math
import shutil
import statistics
import sys
from pathlib import Path

# the repository first: its core modules (sat, plug_and_play, ...) before the scripts of the same name here
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


import harness.cli
import harness.run
from harness.config import parse_agents  # noqa: E402
from harness.run_folder import latest_checkpoint, read_metrics  # noqa: E402


# -- Flags -----------------------------------------------------------------------------------------------
def base_parser(doc: str, default_out: str) -> argparse.ArgumentParser:
    """The flags every script has; its own are added by the script."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False,  # a prefix must not swallow a sat.py option
                                epilog="Any other option is passed to every sat.py run (e.g. --batch-size 64).")
    p.add_argument("--agents", default="tiny x3", help='the team, as sat.py writes it (default "tiny x3")')
    p.add_argument("--seeds", default="0,1,2,3,4", type=parse_seeds, help="comma-separated seeds, e.g. 0,1,2")
    p.add_argument("--stages", default=8, type=positive_int, help="SAT stages per run (default 8)")
    p.add_argument("--out", default=default_out, help=f"where the runs, table.md and plot.png go ({default_out})")
    p.add_argument("--quiet", action="store_true", help="no per-stage console lines from the runs")
    return p


def parse(p: argparse.ArgumentParser, argv=None) -> tuple[argparse.Namespace, list[str]]:
    """(the script's flags, the rest for sat.py); a bad pass-through option fails here in one line, not
    after an hour of runs."""
    args, rest = p.parse_known_args(argv)
    owned = [tok for tok in rest if tok.split("=")[0] in ("--seed", "--resume", "--overwrite")]
    if owned:
        p.error(f"{owned[0].split('=')[0]} is set by the script for each run; use --seeds / --out")
    cfg = harness.cli.parse_args(rest + ["--agents", args.agents])  # sat.py's own one-line error for an unknown option
    try:
        cfg.apply_preset().validate()
    except ValueError as err:
        p.error(str(err))
    return args, rest


def parse_seeds(text: str) -> list[int]:
    """"0,1,2" -> [0, 1, 2]; distinct non-negative integers."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds {text!r}: write comma-separated integers, e.g. 0,1,2") from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"--seeds {text!r}: give distinct non-negative integers, e.g. 0,1,2")
    return seeds


def parse_list(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    """A comma-separated choice list; an unknown item is one clear error."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise SystemExit(f"error: {flag} {text!r}: unknown {', '.join(bad) or 'empty list'}; "
                         f"choose from {', '.join(allowed)}")
    return items


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def team_of(agents: str, n: int) -> str:
    """The n-agent team of the one model kind in ``agents`` ("tiny x3", 2 -> "tiny x2")."""
    names = {s.name for s in parse_agents(agents)}
    if len(names) != 1:
        raise SystemExit(f"error: --agents {agents!r} mixes models; a team size flag needs one kind, e.g. 'tiny x3'")
    return f"{names.pop()} x{n}"


# -- Runs: skip, resume, branch ---------------------------------------------------------------------------
def run_folder(out: Path, setting: str, condition: str, seed: int) -> Path:
    return Path(out) / setting / condition / f"seed{seed}"


def run_state(folder: Path, last_stage: int) -> str:
    """"done" (metrics.jsonl reaches ``last_stage``), "partial" (a checkpoint and metrics to resume from),
    or "new" (nothing usable: empty, or debris of a run killed before its first checkpoint)."""
    rows = read_metrics(folder)
    if rows and rows[-1]["stage"] >= last_stage:
        return "done"
    if rows and (folder / "latest.json").exists():
        return "partial"
    return "new"


def ensure_run(folder: Path, argv: list[str], last_stage: int, quiet: bool = False,
               min_stage: int = 0) -> list[dict]:
    """The metrics of the sat.py run ``argv`` in ``folder`` up to ``last_stage``: skipped if finished
    (a run trained further reads as its first ``last_stage`` stages), resumed from its checkpoint if killed
    (only past ``min_stage``: a branch's rows up to it are its base's), else started (``--overwrite`` clears
    the debris of a run killed before its first checkpoint). A run it finishes keeps only its last checkpoint."""
    folder = Path(folder)
    state = run_state(folder, last_stage)
    if state == "partial" and read_metrics(folder)[-1]["stage"] <= min_stage:
        state = "new"
    print(f"[experiments] {folder}: {'skipped (finished)' if state == 'done' else state}", flush=True)
    if state == "done":
        return [r for r in read_metrics(folder) if r["stage"] <= last_stage]
    if state == "partial":
        options = ["--resume", str(folder), "--stages", str(last_stage)]
    else:
        options = argv + ["--out", str(folder), "--stages", str(last_stage), "--overwrite"]
    log = (lambda *_: None) if quiet else None
    rows = harness.run.run(harness.cli.parse_args(options), log=log)
    keep_last_checkpoint(folder)
    return rows


def keep_last_checkpoint(folder: Path) -> None:
    """Remove every checkpoint of a finished run but the one latest.json names. sat.py keeps the one before too, so
    that a crash while writing leaves a whole one; a driver reads only the metrics and branches from the last
    stage, and the one before is a whole team more on disk (about 3 GB for SmolLM2-135M x3)."""
    last = latest_checkpoint(folder)
    for old in (folder / "checkpoints").glob("stage_*"):
        if old.is_dir() and old != last:
            shutil.rmtree(old)


# -- Statistics over seeds ------------------------------------------------------------------------------
def t_quantile(df: int, level: float = 0.95) -> float:
    """The two-sided Student t quantile (scipy)."""
    from scipy.stats import t

    return float(t.ppf(0.5 + level / 2, df))


def mean_ci(xs: list[float], level: float = 0.95) -> tuple[float, float]:
    """(mean, half-width of its t interval over seeds); half-width nan with one value."""
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return float("nan"), float("nan")
    if len(xs) == 1:
        return xs[0], float("nan")
    return statistics.mean(xs), t_quantile(len(xs) - 1, level) * statistics.stdev(xs) / math.sqrt(len(xs))


def paired_differences(a: dict, b: dict) -> list[float]:
    """a[key] - b[key] over the keys both have: seeds (same seed: same initial team, same held-out problems),
    or one seed's held-out problems."""
    return [a[s] - b[s] for s in sorted(set(a) & set(b))]


def fmt_ci(mean: float, half: float, digits: int = 3, sign: bool = True) -> str:
    """"+0.031 ± 0.020" (or the mean alone when there is no interval)."""
    if mean is None or math.isnan(mean):
        return "-"
    head = f"{mean:+.{digits}f}" if sign else f"{mean:.{digits}f}"
    return head if math.isnan(half) else f"{head} ± {half:.{digits}f}"


# -- What a run's metrics say ---------------------------------------------------------------------------
def gain(rows: list[dict], start: int = 0) -> float:
    """Held-out team accuracy at the last stage minus at stage ``start``."""
    return rows[-1]["eval_accuracy"] - row_at(rows, start)["eval_accuracy"]


def row_at(rows: list[dict], stage: int) -> dict:
    return next(r for r in rows if r["stage"] == stage)


def trained(rows: list[dict], after: int = 0) -> list[dict]:
    """The rows of the stages trained after stage ``after``."""
    return [r for r in rows if r["stage"] > after]


def violation_rate(rows: list[dict]) -> float:
    """Share of the stages flagged ``violation`` (a fall beyond 2 standard errors)."""
    return statistics.mean(bool(r["violation"]) for r in rows) if rows else float("nan")


def mean_kl_quantile(rows: list[dict]) -> float:
    """Mean over stages and agents of the kept per-state KL quantile."""
    values = [a["kl_quantile"] for r in rows for a in r["agents"] if a.get("kl_quantile") is not None]
    return statistics.mean(values) if values else float("nan")


def seconds(rows: list[dict]) -> float:
    """Wall time of the stages (their ``seconds``; warm start and evaluation at stage 0 not included)."""
    return sum(r["seconds"] for r in rows)


def min_agent_value(rows: list[dict], key: str) -> float:
    """The smallest per-agent ``key`` (e.g. ess_ratio) over the stages' agent records."""
    values = [a[key] for r in rows for a in r["agents"] if a.get(key) is not None]
    return min(values) if values else float("nan")


def median_stage_seconds(rows: list[dict]) -> float:
    """The median stage's wall time (robust to a few stages slowed by other work on the machine)."""
    return statistics.median(r["seconds"] for r in rows) if rows else float("nan")


def run_lower_bound(rows: list[dict]) -> float | None:
    """The run certificate's lower bound, where the metrics carry one (``run_certificate``), else None."""
    for r in reversed(rows):
        cert = r.get("run_certificate")
        if isinstance(cert, dict) and cert.get("lower_bound") is not None:
            return cert["lower_bound"]
    return None


def training_tokens(rows: list[dict]) -> float:
    """Tokens the stages' rollouts generated: generations x mean response length (sat.py counts the
    first rollout's tokens; with --reuse weights that is every generation)."""
    return sum(r["generations"] * r["mean_response_tokens"] for r in rows)


# -- Outputs ----------------------------------------------------------------------------------------------
def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_table(out: Path, title: str, table: str, notes: list[str], name: str = "table.md") -> Path:
    """OUT/``name``: a title, the table and the notes under it; printed too."""
    text = f"# {title}\n\n{table}\n\n" + "".join(f"{n}\n" for n in notes)
    path = Path(out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text, flush=True)
    return path


def plot_curves(path: Path, panels: dict[str, dict[str, list[list[dict]]]], x: str = "stage") -> Path:
    """One figure: a panel per setting, a line per condition: the mean over seeds of eval_accuracy per stage
    with its 95% t band; ``x`` "stage", or "tokens" (the mean over seeds of the generated tokens so far)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels) + 1, 3.6), squeeze=False)
    for ax, (title, conditions) in zip(axes[0], panels.items()):
        for label, runs in conditions.items():
            stages = sorted({r["stage"] for rows in runs for r in rows})
            at = [[row_at(rows, s) for rows in runs if any(r["stage"] == s for r in rows)] for s in stages]
            stats = [mean_ci([r["eval_accuracy"] for r in rs]) for rs in at]
            xs = stages if x == "stage" else [statistics.mean(
                training_tokens([r for r in rows if 0 < r["stage"] <= s]) for rows in runs) for s in stages]
            mean = [m for m, _ in stats]
            half = [0.0 if math.isnan(h) else h for _, h in stats]
            line, = ax.plot(xs, mean, "o-", ms=3, label=f"{label} ({len(runs)} seeds)")
            ax.fill_between(xs, [m - h for m, h in zip(mean, half)], [m + h for m, h in zip(mean, half)],
                            color=line.get_color(), alpha=0.15)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("stage" if x == "stage" else "generated training tokens")
        ax.set_ylabel("held-out team accuracy (95% t band)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
