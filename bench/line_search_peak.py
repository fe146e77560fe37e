"""Peak memory of the trust-region check (``sat.trust_region_step``) with and without a copy of pi_j,cur.

The line search backtracks from the proposal toward its anchor, pi_j,cur. It reads the frozen reference's
parameters in place (``read``); handing it a copy of them (``copy``, one more full copy of the agent at the
training peak) is the alternative this script measures it against. Each case runs in a fresh process, the two
alternating: an agent, a small seeded rollout, one update, then the check, during which resident memory is
sampled every 2 ms (/proc/self/statm). The figure is the peak during the check minus the memory just before it.

    OMP_NUM_THREADS=1 python bench/line_search_peak.py --agents SmolLM2-135M     # the real model, float32
    OMP_NUM_THREADS=1 python bench/line_search_peak.py --agents tiny --repeats 1  # smoke test
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def peak_during(call) -> tuple[int, object]:
    """(the peak resident bytes above the level before ``call``, its result), sampled every 2 ms."""
    base, peak, done = resident_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], resident_bytes())
            time.sleep(0.002)

    watcher = threading.Thread(target=sample)
    watcher.start()
    try:
        result = call()
    finally:
        done.set()
        watcher.join()
    return max(peak[0], resident_bytes()) - base, result


def one_case(agents: str, case: str) -> dict:
    """Load, roll out, update, then measure the check: its peak, its seconds, the agent's parameter bytes."""
    import torch

    import advantage
    import sat
    from harness.config import Config
    from harness.loading import load_agent
    from harness.math_grading import math_team_config
    from harness.run import trust_regions_for
    from harness.tasks import arithmetic_problems, chat_arithmetic_problems
    from rollout import SamplingConfig, rollout
    from scale.rollout_hf import HF
    from team import Team
    from update import train_agents

    torch.manual_seed(0)
    team = Team([load_agent(agents, seed=0)], math_team_config())
    tiny = team.agents[0].spec.kind == "tiny"
    cfg = Config(agents=agents, device="cpu", batch_size=8, group_size=4, max_new_tokens=16,
                 warmup_steps=0, lr=1e-5).apply_preset()
    problems = (arithmetic_problems if tiny else chat_arithmetic_problems)(2, seed=0)
    batch = rollout(team, problems, cfg.group_size, SamplingConfig(temperature=cfg.temperature, max_new_tokens=16,
                                                                   token_budget=cfg.token_budget), HF)
    inputs = advantage.build_inputs(batch, 0, [], cfg.core(), team.agents[0].model, None)
    reference = team.procs.frozen_copy(team.agents[0].model)
    region = trust_regions_for(cfg, 1)[0]
    stats = train_agents(team, [0], {0: inputs}, cfg.core(), {0: region}, {}, {0: reference})[0]

    def check():
        if case == "copy":
            stats.anchor = [p.detach().clone() for p in reference.parameters()]
        return sat.trust_region_step(team, 0, reference, inputs, stats, cfg.core(), region, batch)[0]

    t0 = time.time()
    peak, step = peak_during(check)
    size = sum(p.numel() * p.element_size() for p in reference.parameters())
    return {"case": case, "peak_mib": peak / 2**20, "seconds": time.time() - t0, "param_mib": size / 2**20,
            "backtracks": step.backtracks}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", default="SmolLM2-135M", help="one agent, as sat.py's --agents names it")
    p.add_argument("--repeats", type=int, default=2, help="processes per case, alternating (default 2)")
    p.add_argument("--case", choices=("read", "copy"), help=argparse.SUPPRESS)  # a child process's case
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(one_case(args.agents, args.case)))
        return 0
    results = {"read": [], "copy": []}
    for _ in range(args.repeats):
        for case in results:
            out = subprocess.run([sys.executable, __file__, "--agents", args.agents, "--case", case],
                                 capture_output=True, text=True, check=True)
            results[case].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{args.agents}: parameters {results['read'][0]['param_mib']:.0f} MiB; peak resident memory of the "
          f"trust-region check above its start, median of {args.repeats} processes each")
    for case, runs in results.items():
        print(f"  {case:5s} {statistics.median(r['peak_mib'] for r in runs):8.0f} MiB   "
              f"{statistics.median(r['seconds'] for r in runs):6.1f} s   backtracks {[r['backtracks'] for r in runs]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
