"""Side-by-side runs on tiny agents: what SAT's design choices buy, over seeds.

    python bench/compare.py updates  --seeds 0 1 2 --stages 15   # sequential vs joint, 3 agents vs 1, both protocols
    python bench/compare.py upgrades --seeds 0 1 2 --train-stages 4 --stages 6 --stage0-problems 32   # plug-and-play
    python bench/compare.py stage0-states --seeds 1 --arms weaker --train-stages 4   # Stage-0 held-out KL vs states
    python bench/compare.py matched --release ../SAT-AAMAS --release-python ../venv-authors/bin/python --runs 3
                                       # whole-process wall time against the authors' release (4f6d2f8), alternating

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


UPGRADE_ARMS = (  # label, --upgrade spec, replacement warm-start steps, label noise of that warm start
    ("continue unchanged", None, None, None),
    ("stronger (tiny, 200 warm-start steps on 5%-noisy labels)", "tiny", 200, 0.05),
    ("weaker (tiny-2L, 40 warm-start steps on 80%-noisy labels)", "tiny-2L", 40, 0.8),
)


def upgrade_arm(base: Path, out: Path, name: str, total_stages: int, slot: int, spec, steps, p_wrong, args):
    """Resume the trained team, replace ``slot`` (Stage-0) and continue SAT. The
    replacement's warm start (a tiny stand-in for pretraining) runs on labels
    wrong with probability ``p_wrong``: that is what makes it stronger or weaker."""
    run_dir = out / name
    if (run_dir / "metrics.jsonl").exists() and read_metrics(run_dir)[-1]["stage"] >= total_stages:
        return read_metrics(run_dir), run_dir
    argv = ["--resume", str(base), "--out", str(run_dir), "--stages", str(total_stages), "--eval-size", str(args.eval_size)]
    if spec:
        argv += ["--upgrade", f"{slot}={spec}", "--upgrade-warmup-steps", str(steps), "--stage0-max-passes", str(args.stage0_max_passes),
                 "--stage0-problems", str(args.stage0_problems)]
    cfg = sat.parse_args(argv)
    if p_wrong is not None:
        cfg.warmup_p_wrong = p_wrong  # used only by the replacement's warm start (a resumed team is not warmed again)
    logf = open(out / f"{name}.log", "a")
    recs = sat.run(cfg, log=lambda msg: print(msg, file=logf, flush=True))
    logf.close()
    return recs, run_dir


def upgrade_base(args, seed: int) -> Path:
    """The trained team every upgrade arm of ``seed`` resumes (made once)."""
    run_dir = args.out / f"base-tinyx3-independent-s{seed}-st{args.train_stages}-e{args.eval_size}-b{args.batch_size}-w{args.warmup_steps}"
    if not (run_dir / "latest.json").exists():
        sat.run(sat.Config(agents="tiny x3", protocol="independent", seed=seed, stages=args.train_stages, eval_size=args.eval_size,
                           batch_size=args.batch_size, warmup_steps=args.warmup_steps, out=str(run_dir)), **QUIET)
    return run_dir


def upgrades(args) -> None:
    """Plug-and-play (paper, Table 3): does a stronger replacement raise the team
    and a weaker one lower it, after Stage-0 and continued SAT?"""
    rows = {}
    total = args.train_stages + args.stages
    for seed in args.seeds:
        run_dir = upgrade_base(args, seed)
        base_recs = read_metrics(run_dir)
        pre = base_recs[-1]
        for label, spec, steps, p_wrong in UPGRADE_ARMS:
            if label.split(" ")[0] not in args.arms:
                continue
            name = f"upgrade-{label.split(' ')[0]}-slot{args.slot}-p{args.stage0_problems}-s{seed}"
            try:
                recs, arm_dir = upgrade_arm(run_dir, args.out, name, total, args.slot, spec, steps, p_wrong, args)
            except RuntimeError as err:  # Stage-0 could not align: report it, keep the other arms
                print(f"seed {seed} {label}: FAILED: {err}", flush=True)
                continue
            after = [r for r in recs if r["stage"] > args.train_stages]
            events = json.loads((arm_dir / "upgrades.json").read_text()) if spec else []
            ev = events[-1] if events else {}
            s0 = ev.get("stage0", {})
            row = {"before": pre["eval_accuracy"], "incumbent_alone": pre["eval_agent_accuracy"][args.slot - 1],
                   "raw_team": ev.get("before_stage0", {}).get("eval_accuracy"),
                   "replacement_alone": ev.get("before_stage0", {}).get("eval_agent_accuracy", [None] * args.slot)[args.slot - 1],
                   "after_stage0": ev.get("eval_accuracy_after_stage0"), "final": recs[-1]["eval_accuracy"],
                   "final_se": recs[-1]["eval_stderr"], "violation": after[0]["violation"] if after else None,
                   "kl_in": s0.get("kl_quantile"), "kl_held": s0.get("heldout_kl_quantile"), "kl_before": s0.get("kl_quantile_before"),
                   "fit": s0.get("fit_mean"), "fit_tol": s0.get("fit_tol"), "passes": s0.get("passes"), "stage0_s": ev.get("seconds"),
                   "states": s0.get("states"), "heldout_states": s0.get("heldout_states"), "retargeted": s0.get("retargeted")}
            rows.setdefault(label, []).append(row)
            print(f"seed {seed} {label}: {json.dumps(row)}", flush=True)
    f = (lambda v, d=3: "-" if v is None else f"{v:.{d}f}")

    def mean_sd(vals):
        vals = [v for v in vals if v is not None]
        if not vals:
            return "-"
        return f"{statistics.mean(vals):.3f}" + (f" ± {statistics.stdev(vals) / len(vals) ** 0.5:.3f}" if len(vals) > 1 else "")
    print(f"\nslot {args.slot} replaced after {args.train_stages} SAT stages, then {args.stages} more; held-out team accuracy "
          f"on {args.eval_size} draws (one sample each, SE of one evaluation ~ {0.5 / args.eval_size ** 0.5:.3f}) per evaluation; "
          f"mean ± standard error over seeds {args.seeds}; Stage-0 on {args.stage0_problems} prompts (a quarter held out)\n")
    print("| arm | team before upgrade | incumbent alone | replacement alone (before Stage-0) | team with raw replacement | "
          "team after Stage-0 | team after continued stages | per seed (final ± SE) | first-stage violations | "
          "Stage-0 KL q0.99 before -> in-sample / held-out | passes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, vals in rows.items():
        per_seed = ", ".join(f"{v['final']:.3f}±{v['final_se']:.3f}" for v in vals)
        kl_text = ", ".join(f"{f(v['kl_before'], 2)} -> {f(v['kl_in'], 4)} / {f(v['kl_held'], 4)}" for v in vals) if vals[0]["kl_in"] is not None else "-"
        print(f"| {label} | {mean_sd([v['before'] for v in vals])} | {mean_sd([v['incumbent_alone'] for v in vals])} | "
              f"{mean_sd([v['replacement_alone'] for v in vals])} | {mean_sd([v['raw_team'] for v in vals])} | "
              f"{mean_sd([v['after_stage0'] for v in vals])} | {mean_sd([v['final'] for v in vals])} | "
              f"{per_seed} | "
              f"{sum(bool(v['violation']) for v in vals)}/{len(vals)} | {kl_text} | {', '.join(str(v['passes']) for v in vals)} |")


def stage0_states(args) -> None:
    """Stage-0 alone (Eqs. (6)-(7)), as the upgrades arm runs it, for several
    numbers of Stage-0 prompts: how far the in-sample fit carries to held-out
    states. No continued stages, no evaluation."""
    import os
    import time

    import torch

    import plug_and_play as pp
    from records import latest_checkpoint, load_checkpoint
    from rollout import SamplingConfig

    label, spec, steps, p_wrong = next(a for a in UPGRADE_ARMS if a[0].startswith(args.arms[-1]))
    if spec is None:
        raise SystemExit("stage0-states: --arms must name stronger or weaker (continue has no Stage-0)")
    print(f"{label}, base seed {args.seeds[0]}, slot {args.slot}, delta_0 0.01\n")
    print("| Stage-0 prompts | fit / held-out states | KL q0.99 in-sample | held-out q0.99 (mean) | passes | seconds | load (1 min) |")
    print("|---|---|---|---|---|---|---|")
    base = upgrade_base(args, args.seeds[0])
    for n in args.stage0_problems_list:
        cfg = sat.parse_args(["--resume", str(base), "--out", str(args.out / "stage0-states"), "--upgrade", f"{args.slot}={spec}",
                              "--upgrade-warmup-steps", str(steps), "--stage0-max-passes", str(args.stage0_max_passes)])
        cfg.warmup_p_wrong = p_wrong
        cfg.apply_preset()
        cfg.validate()
        train, _, _ = sat.load_task(cfg)
        team, _, rng, _ = load_checkpoint(latest_checkpoint(base), "cpu", torch.float32)  # the same prompt draw as the arm
        sampling = SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                                  token_budget=cfg.token_budget)
        new = pp.load_replacement(spec, cfg, team, train, args.slot - 1)
        prompts = [train[rng.randrange(len(train))] for _ in range(n)]
        t0 = time.time()
        try:
            s0 = pp.stage0_align(team, args.slot - 1, new, prompts, cfg, sampling, lr=cfg.lr, log=QUIET["log"])
        except RuntimeError as err:
            print(f"| {n} | - | FAILED: {err} | - | - | {time.time() - t0:.0f} | {os.getloadavg()[0]:.1f} |", flush=True)
            continue
        print(f"| {n} | {s0['states']} / {s0['heldout_states']} | {s0['kl_quantile']:.4f} | "
              f"{s0['heldout_kl_quantile']:.2f} ({s0['heldout_kl_mean']:.3f}) | {s0['passes']} | {time.time() - t0:.0f} | "
              f"{os.getloadavg()[0]:.1f} |", flush=True)


# The matched workload (issue 16): 3 stages of 16 prompts x G = 4 (192 responses a stage) of up to 32 new
# tokens, one 0.6 M-parameter tiny Qwen3 checkpoint as all three agents, against the authors' release.
MATCHED_OURS = ("--task arithmetic --stages 3 --batch-size 64 --group-size 4 --max-new-tokens 32 --epochs 1 "
                "--minibatch-size 16 --eval-size 64 --temperature 0.8 --lr 1e-5 --backend hf "
                "--no-gradient-checkpointing --reuse weights --overwrite")
MATCHED_RELEASE = {("data", "train_batch_size"): 192, ("data", "max_response_length"): 32, ("sat", "group_size"): 4,
                   ("training", "num_stages"): 3}  # on top of the release's configs/sat_demo.yaml


def matched_setup(args) -> tuple[list[str], list[str]]:
    """The checkpoint, the release's config and both command lines (made once in --out)."""
    import subprocess

    import yaml

    from team import Agent

    ckpt, release = args.out / "ckpt", args.release.resolve()
    if not (ckpt / "model.safetensors").exists():
        Agent.load("tiny", seed=0).save(ckpt)
        tok = json.loads((ckpt / "tokenizer_config.json").read_text())  # so that transformers 4 (the release's) loads it
        tok.update(tokenizer_class="PreTrainedTokenizerFast", model_input_names=["input_ids", "attention_mask"])
        (ckpt / "tokenizer_config.json").write_text(json.dumps(tok, indent=1))
    data = args.out / "data"
    if not (data / "demo" / "train.jsonl").exists():  # the release's own demo data
        subprocess.run([args.release_python, "scripts/prepare_data.py", "--dataset", "demo", "--out_dir", str(data.resolve())],
                       cwd=release, check=True, stdout=subprocess.DEVNULL)
    cfg = yaml.safe_load((release / "configs" / "sat_demo.yaml").read_text())
    for (section, key), value in MATCHED_RELEASE.items():
        cfg[section][key] = value
    cfg["sat"]["agents"] = [{"name": f"agent_{k + 1}", "path": str(ckpt.resolve())} for k in range(3)]
    cfg["logging"]["save_dir"] = str((args.out / "release_out").resolve())
    cfg["dataset"].update(train_path=str((data / "demo" / "train.jsonl").resolve()),
                          test_path=str((data / "demo" / "test.jsonl").resolve()))
    (args.out / "release_matched.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    agents = ",".join([str(ckpt.resolve())] * 3)
    ours = [[sys.executable, str(Path(src).resolve() / "sat.py"), "--agents", agents, *MATCHED_OURS.split(),
             "--out", str((args.out / f"ours{i}").resolve())] for i, src in enumerate(args.src)]
    theirs = [args.release_python, "scripts/train.py", "--config", str((args.out / "release_matched.yaml").resolve())]
    return ours, theirs


def matched(args) -> None:
    """Whole-process wall time of the matched workload, this code against the
    authors' release, alternating runs; prints the table and the ratio's
    median and range. Report ``uptime`` with it: the load changes both."""
    import os
    import subprocess
    import time

    ours, theirs = matched_setup(args)
    print(f"release ({args.release}, 4f6d2f8): cd {args.release} && {' '.join(theirs)}", flush=True)
    for src, cmd in zip(args.src, ours):
        print(f"this code ({src}): {' '.join(cmd)}", flush=True)
    names = [f"{Path(src).resolve().name} s" for src in args.src]
    print(f"\n| run | release s | {' | '.join(names)} | ratio (release / each) | load (1 min) before |", flush=True)
    print("|---|---|" + "---|" * len(names) + "---|---|", flush=True)
    ratios = [[] for _ in args.src]
    for i in range(args.runs):
        load = os.getloadavg()[0]
        times = []
        for cmd, cwd in [(theirs, args.release)] + [(c, None) for c in ours]:
            t0 = time.perf_counter()
            done = subprocess.run(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if done.returncode:  # its own error, not just an exit status
                tail = "\n".join(done.stderr.replace("\r", "\n").strip().splitlines()[-15:])
                raise SystemExit(f"compare.py matched: {' '.join(cmd)} failed (exit {done.returncode}):\n{tail}")
            times.append(time.perf_counter() - t0)
        for k, t in enumerate(times[1:]):
            ratios[k].append(times[0] / t)
        print(f"| {i + 1} | {times[0]:.1f} | {' | '.join(f'{t:.1f}' for t in times[1:])} | "
              f"{' / '.join(f'{times[0] / t:.1f}x' for t in times[1:])} | {load:.1f} |", flush=True)
    print(f"\nOMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, {len(ratios[0])} alternating runs")
    for name, r in zip(names, ratios):
        print(f"{name[:-2]}: release / this code, median {statistics.median(r):.1f}x (min {min(r):.1f}x, max {max(r):.1f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["updates", "upgrades", "stage0-states", "matched"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--protocols", nargs="+", default=["independent", "chain"], choices=["independent", "chain"])
    ap.add_argument("--stages", type=int, default=12, help="SAT stages per arm")
    ap.add_argument("--train-stages", type=int, default=10, help="upgrades: stages before the upgrade")
    ap.add_argument("--slot", type=int, default=1, help="upgrades: the slot replaced (1 decides the vote's ties)")
    ap.add_argument("--eval-size", type=int, default=1024, help="upgrades: held-out draws per evaluation (SE ~ 0.5/sqrt(n))")
    ap.add_argument("--batch-size", type=int, default=128, help="upgrades: joint trajectories per stage")
    ap.add_argument("--warmup-steps", type=int, default=150, help="upgrades: warm start of the base team")
    ap.add_argument("--stage0-max-passes", type=int, default=400, help="upgrades: Stage-0 passes before giving up")
    ap.add_argument("--stage0-problems", type=int, default=32, help="upgrades: Stage-0 prompts (a quarter held out)")
    ap.add_argument("--arms", nargs="+", default=["continue", "stronger", "weaker"], choices=["continue", "stronger", "weaker"],
                    help="upgrades: which arms to run (stage0-states: the last one named)")
    ap.add_argument("--stage0-problems-list", type=int, nargs="+", default=[16, 32, 128],
                    help="stage0-states: the numbers of Stage-0 prompts to try (on the first --seeds base)")
    ap.add_argument("--release", type=Path, default=Path("../SAT-AAMAS"), help="matched: a checkout of the authors' release (4f6d2f8)")
    ap.add_argument("--release-python", default="python", help="matched: the Python of the release's environment")
    ap.add_argument("--runs", type=int, default=3, help="matched: alternating runs of each")
    ap.add_argument("--src", nargs="+", default=[str(Path(__file__).resolve().parents[1])],
                    help="matched: checkouts of this code to time (default: this one)")
    ap.add_argument("--out", type=Path, default=Path("runs/compare"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "args.json").write_text(json.dumps({k: str(v) for k, v in vars(args).items()}))
    {"updates": updates, "upgrades": upgrades, "stage0-states": stage0_states, "matched": matched}[args.what](args)


if __name__ == "__main__":
    main()
