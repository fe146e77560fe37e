"""The rollout backends side by side on one team: Hugging Face (``scale.rollout_hf.decode``) against CPU (or GPU) vLLM,
and against HF ``generate``, which forwards every row of a batch until its last row ends (``hf-generate``: the
path of a model whose forwards are collectives, ``scale.rollout_hf.generate_hf``).

The same agents, the same problems, the same sampler (the tempered softmax, nothing else); each backend draws
the agents' turns of one joint rollout (``rollout.rollout`` with ``score=False``: generation only), repeated,
alternating the backends so that a busy machine slows both alike. The start (vLLM: the engines, which start at
the first rollout) is one warm-up rollout of one prompt, timed apart.

    python bench/backends.py                                          # SmolLM2-135M x3, 64 prompts, 48 tokens
    python bench/backends.py --prompts 128 --dtype bfloat16           # a larger batch, bf16 weights
    python bench/backends.py --agents "tiny x2" --prompts 4 --max-new-tokens 4 --repeats 1 --backends hf  # CI

    python bench/backends.py --agents "SmolLM2-135M x1" --backends hf-generate,hf --threads 1  # ended rows dropped

Prints per backend: generated tokens, seconds (median of the repeats) and tokens/s, then the ratio. The two HF
paths draw the same tokens (one ``SeededSampler``), so their token counts agree up to float rounding.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness.run
from harness.config import Config  # noqa: E402
from harness.processes import OneProcess  # noqa: E402
from harness.tasks import load_task  # noqa: E402
from rollout import SamplingConfig, rollout  # noqa: E402
from scale.rollout_hf import HFBackend  # noqa: E402
from scale.rollout_vllm import make_backend  # noqa: E402


class EveryRowForwarded(OneProcess):
    """One process whose forwards ``generate_hf`` treats as collectives: it samples through HF ``generate``."""

    def synced_forwards(self, model) -> bool:
        return True


class HFGenerate(HFBackend):
    """``hf-generate``: the HF backend sampling through ``generate`` (every row forwarded to the batch's end)."""

    name = "hf-generate"

    def generate(self, agent, contexts, sampling, seeds):
        saved, agent.procs = agent.procs, EveryRowForwarded()
        try:
            return super().generate(agent, contexts, sampling, seeds)
        finally:
            agent.procs = saved


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", default="SmolLM2-135M x3")
    p.add_argument("--prompts", type=int, default=64, help="joint trajectories per rollout (group size 1)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backends", default="hf,vllm")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = Config(agents=args.agents, device="cpu" if not torch.cuda.is_available() else "cuda", dtype=args.dtype,
                 warmup_steps=0, stages=0).apply_preset()
    train, _, instruction = load_task(cfg)
    team = harness.run.build_team(harness.run.run_inputs(cfg), instruction)
    problems = train[: args.prompts]
    sampling = SamplingConfig(temperature=args.temperature, top_p=1.0, max_new_tokens=args.max_new_tokens,
                              token_budget=cfg.token_budget)
    names = args.backends.split(",")
    backends, started = {}, {}
    for name in names:
        t0 = time.perf_counter()
        backends[name] = HFGenerate() if name == "hf-generate" else make_backend(name, len(team), seed=0, health=False)
        for agent in team.agents:
            backends[name].sync(agent)
        rollout(team, problems[:1], 1, sampling, backend=backends[name], score=False)  # vLLM: the engines start here
        started[name] = time.perf_counter() - t0
    seconds, tokens = {n: [] for n in names}, {n: 0 for n in names}
    try:
        for _ in range(args.repeats):
            for name in names:
                torch.manual_seed(0)
                t0 = time.perf_counter()
                batch = rollout(team, problems, 1, sampling, backend=backends[name], score=False)
                seconds[name].append(time.perf_counter() - t0)
                tokens[name] = batch.num_tokens
    finally:
        for b in backends.values():
            b.close()
    print(f"\n{args.agents}, {args.prompts} prompts x {len(team)} turns, max {args.max_new_tokens} new tokens, "
          f"{args.dtype}, {args.threads} threads, median of {args.repeats}")
    print(f"{'backend':<11} {'start s':>8} {'tokens':>7} {'seconds':>8} {'tokens/s':>9}")
    speed = {}
    for name in names:
        med = statistics.median(seconds[name])
        speed[name] = tokens[name] / med
        print(f"{name:<11} {started[name]:>8.1f} {tokens[name]:>7} {med:>8.2f} {speed[name]:>9.1f}")
    if len(names) == 2:
        print(f"ratio {names[1]}/{names[0]} tokens/s: {speed[names[1]] / speed[names[0]]:.2f}")


if __name__ == "__main__":
    main()
