"""Where a real team's stage spends its time: one ``sat.py`` stage, seconds per phase.

The run is ``harness.run.run`` itself (rollout, the turns redrawn after each promotion, each agent's update, the
trust-region check with its exact-KL forwards, the held-out evaluation, the checkpoint), with timers around
the functions each phase calls; nothing else changes. Any ``sat.py`` option can be given; the defaults are a
real pretrained team on this machine:

    python bench/real_stage.py                                 # SmolLM2-135M x3, its CPU preset, HF backend
    python bench/real_stage.py --backend vllm                  # the same stage, rollouts from CPU vLLM engines
    python bench/real_stage.py --agents "tiny x2" --batch-size 8 --eval-size 4 --warmup-steps 0   # CI size

Prints the phase table (seconds, share of the stage, calls) and the generated tokens/s of the rollout.
"""
from __future__ import annotations

import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_stage import PhaseMeter, timed  # noqa: E402

import harness.cli
import harness.run
import rollout as rollout_mod  # noqa: E402
import sat  # noqa: E402
from harness import run_folder  # noqa: E402
from scale.rollout_hf import HFBackend  # noqa: E402
from scale.rollout_vllm import VLLMBackend  # noqa: E402


@contextmanager
def phases(meter: PhaseMeter, counters: dict):
    """Timers around the functions a run calls, restored afterwards."""
    def count(responses):
        counters["generated_tokens"] += sum(len(r) for r in responses)

    def named(name, after=None):
        return lambda fn: timed(meter, fn, lambda *a, **k: name, after)

    patches = [
        (sat, "team_rollout", named("team rollouts (the stage's and the evaluations')")),
        (sat, "redraw", named("redraw (regenerate, step bounds)")),
        (HFBackend, "generate", named("  generation", count)),
        (VLLMBackend, "generate", named("  generation", count)),
        (VLLMBackend, "sync", named("weight push to the engine")),
        (rollout_mod, "behaviour_logprobs", named("  behaviour log-probs")),
        (sat, "build_inputs", named("advantages and weights")),
        (sat, "train_agents", named("update (optimiser steps)")),
        (sat, "trust_region_step", named("trust-region check")),
        (sat, "measure_kl", named("  exact KL forwards")),
        (sat, "evaluate", named("held-out evaluation")),
        (run_folder, "save_checkpoint", named("checkpoint")),
    ]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    try:
        for owner, name, wrap in patches:
            setattr(owner, name, wrap(owner.__dict__[name]))
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    defaults = {"--agents": "SmolLM2-135M x3", "--stages": "1"}
    for flag, value in defaults.items():
        if flag not in argv:
            argv += [flag, value]
    with tempfile.TemporaryDirectory() as tmp:
        if "--out" not in argv:
            argv += ["--out", str(Path(tmp) / "run")]
        resolved = harness.run.resolve(harness.cli.parse_args(argv))
        cfg = resolved.cfg
        meter, counters = PhaseMeter(torch.device(cfg.device)), defaultdict(int)
        t0 = time.perf_counter()
        with phases(meter, counters), meter.phase("run (load, stage 0 evaluation, stage 1)"):
            rows = harness.run.run_resolved(resolved, log=lambda *_: None)
        wall = time.perf_counter() - t0
    rec = rows[-1]
    print(f"\n{cfg.agents}, backend {cfg.backend}, {cfg.batch_size} joint trajectories, max {cfg.max_new_tokens} new "
          f"tokens, {cfg.threads} threads: mean response {rec['mean_response_tokens']:.1f} tokens, truncated "
          f"{rec['truncated_fraction']:.0%}, team reward {rec['team_reward']:.3f}")
    print(f"{'phase':<42} {'calls':>5} {'seconds':>8} {'share':>6}")
    stage = rec["seconds"]
    for name in meter.order:
        r = meter.records[name]
        print(f"{name:<42} {r['calls']:>5} {r['seconds']:>8.1f} {r['seconds'] / max(wall, 1e-9):>6.0%}")
    gen = meter.records["  generation"]["seconds"]
    print(f"stage 1 (sat_stage) {stage:.1f} s of {wall:.1f} s; generated {counters['generated_tokens']} tokens in "
          f"{gen:.1f} s = {counters['generated_tokens'] / max(gen, 1e-9):.1f} tokens/s")


if __name__ == "__main__":
    main()
