"""Side-by-side runs on tiny agents: what SAT's design choices buy, over seeds.

    python bench/compare.py updates  --seeds 0 1 2 --stages 15   # sequential vs joint, 3 agents vs 1, both protocols
    python bench/compare.py upgrades --seeds 0 1 2 --stages 6    # plug-and-play: continue / stronger / weaker

Every arm of one seed starts from the same warm-started checkpoint (made once,
then ``--resume``d), so arms differ only in what is being compared. Prints a
markdown table of held-out team accuracy (mean and per seed) and, for
upgrades, the first-stage violation rate (a stage whose held-out team
accuracy fell beyond 2 standard errors). Raw runs stay in --out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sat  # noqa: E402
from records import read_metrics  # noqa: E402

QUIET = dict(log=lambda *_: None)


def base_run(out: Path, seed: int, agents: str, protocol: str, stages: int = 0) -> Path:
    """Warm start (and optionally a few SAT stages) once; arms resume from it."""
    run_dir = out / f"base-{agents.replace(' ', '')}-{protocol}-s{seed}-st{stages}"
    if not (run_dir / "latest.json").exists():
        sat.run(sat.Config(agents=agents, protocol=protocol, seed=seed, stages=stages, out=str(run_dir), overwrite=True), **QUIET)
    return run_dir


def arm(base: Path, out: Path, name: str, total_stages: int, extra: list[str]) -> list[dict]:
    run_dir = out / name
    if (run_dir / "metrics.jsonl").exists() and read_metrics(run_dir)[-1]["stage"] >= total_stages:
        return read_metrics(run_dir)
    argv = ["--resume", str(base), "--out", str(run_dir), "--stages", str(total_stages), "--overwrite"] + extra  # redo a partial arm
    return sat.run(sat.parse_args(argv), **QUIET)


def updates(args) -> None:
    rows = {}
    for protocol in args.protocols:
        for seed in args.seeds:
            base3 = base_run(args.out, seed, "tiny x3", protocol)
            base1 = base_run(args.out, seed, "tiny", protocol)
            for label, base, extra in (("3 agents, sequential (SAT)", base3, ["--update", "sequential"]),
                                       ("3 agents, joint", base3, ["--update", "joint"]),
                                       ("1 agent", base1, [])):
                recs = arm(base, args.out, f"{protocol}-{label.split(',')[0].replace(' ', '')}-{extra[1] if extra else 'single'}-s{seed}",
                           args.stages, extra)
                rows.setdefault((protocol, label), []).append((recs[0]["eval_accuracy"], recs[-1]["eval_accuracy"]))
                print(f"{protocol:11s} {label:28s} seed {seed}: {recs[0]['eval_accuracy']:.3f} -> {recs[-1]['eval_accuracy']:.3f}", flush=True)
    print(f"\nheld-out team accuracy after {args.stages} SAT stages (same seeds, same warm start per arm)\n")
    print("| protocol | arm | before (mean) | after (mean) | after per seed |")
    print("|---|---|---|---|---|")
    for (protocol, label), vals in rows.items():
        print(f"| {protocol} | {label} | {statistics.mean(v[0] for v in vals):.3f} | {statistics.mean(v[1] for v in vals):.3f} | "
              f"{', '.join(f'{v[1]:.3f}' for v in vals)} |")


def upgrades(args) -> None:
    rows = {}
    for seed in args.seeds:
        trained = base_run(args.out, seed, "tiny x3", "independent", stages=args.train_stages)
        total = args.train_stages + args.stages
        for label, extra in (("continue unchanged", []),
                             ("upgrade slot 2 -> stronger (tiny-6L, 2x warm start)", ["--upgrade", "2=tiny-6L", "--upgrade-warmup-steps", str(2 * 300)]),
                             ("upgrade slot 2 -> weaker (tiny-2L, short warm start)", ["--upgrade", "2=tiny-2L", "--upgrade-warmup-steps", "60"])):
            name = f"upgrade-{label.split(' ')[0]}-{label.split('(')[-1].split(',')[0] if '(' in label else 'none'}-s{seed}"
            recs = arm(trained, args.out, name, total, extra)
            after = [r for r in recs if r["stage"] > args.train_stages]
            first_violation = after[0]["violation"] if after else None
            rows.setdefault(label, []).append((recs[-1]["eval_accuracy"], first_violation, after[0].get("upgrades")))
            print(f"{label:55s} seed {seed}: final {recs[-1]['eval_accuracy']:.3f}, first stage violation {first_violation}", flush=True)
    print(f"\nheld-out team accuracy after {args.train_stages} SAT stages + {args.stages} more (3 seeds)\n")
    print("| arm | final accuracy (mean) | per seed | first-stage violation rate | Stage-0 KL quantile before -> after |")
    print("|---|---|---|---|---|")
    for label, vals in rows.items():
        s0 = [u[0]["stage0"] for _, _, u in vals if u]
        s0_text = ", ".join(f"{s['kl_quantile_before']:.3f}->{s['kl_quantile']:.4f}" for s in s0) or "-"
        print(f"| {label} | {statistics.mean(v[0] for v in vals):.3f} | {', '.join(f'{v[0]:.3f}' for v in vals)} | "
              f"{sum(bool(v[1]) for v in vals)}/{len(vals)} | {s0_text} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["updates", "upgrades"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--protocols", nargs="+", default=["independent", "chain"], choices=["independent", "chain"])
    ap.add_argument("--stages", type=int, default=12, help="SAT stages per arm")
    ap.add_argument("--train-stages", type=int, default=10, help="upgrades: stages before the upgrade")
    ap.add_argument("--out", type=Path, default=Path("runs/compare"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "args.json").write_text(json.dumps({k: str(v) for k, v in vars(args).items()}))
    {"updates": updates, "upgrades": upgrades}[args.what](args)


if __name__ == "__main__":
    main()
