"""The files one checkpoint writes for a team, and the process's peak RSS, whole models against --lora (no
training: the sizes do not depend on it). The team is loaded as ``sat.py`` loads it (``harness.loading.load_agents``)
and written as a checkpoint writes it (``save_team``, ``training_state.save``):

    python bench/lora_checkpoint.py full /tmp/ckpt_full                  # SmolLM2-135M x3, whole models
    python bench/lora_checkpoint.py lora /tmp/ckpt_lora --rank 16        # one shared base, an adapter each
    python bench/lora_checkpoint.py lora /tmp/ckpt_tiny --agents "tiny x3"   # CI size

Run each mode in its own process: the RSS is the process's peak.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapter import LoraSettings  # noqa: E402
from harness import training_state  # noqa: E402
from harness.config import parse_agents  # noqa: E402
from harness.loading import load_agents, save_team  # noqa: E402
from harness.math_grading import math_team_config  # noqa: E402
from team import Team  # noqa: E402


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="bench/lora_checkpoint.py", description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["full", "lora"])
    p.add_argument("out", type=Path)
    p.add_argument("--agents", default="SmolLM2-135M x3")
    p.add_argument("--rank", type=int, default=16)
    args = p.parse_args(argv)
    settings = LoraSettings(args.rank, 32.0, ("all-linear",)) if args.mode == "lora" else None
    specs = parse_agents(args.agents)
    start = time.time()
    team = Team(load_agents(specs, "cpu", torch.float32, list(range(len(specs))), settings),
                math_team_config(protocol="independent"))
    loaded = time.time() - start
    save_team(team, args.out / "team")
    training_state.save(args.out / "sharded", team)
    result = {"mode": args.mode, "load_s": round(loaded, 1), "team_bytes": folder_bytes(args.out / "team"),
              "sharded_bytes": folder_bytes(args.out / "sharded"),
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}
    print(f"{args.mode}: team {result['team_bytes']} bytes, sharded {result['sharded_bytes']} bytes, peak RSS "
          f"{result['peak_rss_mib']} MiB, loaded in {result['load_s']} s")
    return result


if __name__ == "__main__":
    main()
