"""Batched rollout vs the one-sample-at-a-time structure of the authors' release.

Same tiny team, same problems, same joint trajectories (16 prompts x G=4 by default),
measured side by side in one run:

- batched: ``rollout.rollout`` (one left-padded generate per agent turn,
  one batched teacher-forced forward for the behaviour log-probabilities);
- loop: for each joint trajectory and each agent, ``generate`` one sample,
  then score it with one forward of that single sequence.

    python bench/rollout.py [--protocol chain] [--max-new-tokens 16] [--repeats 3]
    python bench/rollout.py --prompts 4 --max-new-tokens 4 --repeats 1     # the CI size (tests/test_bench.py)

Prints tokens/s of each and the ratio. Response tokens are counted the same
way for both (generated tokens up to and including eos).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.loading import load_agent
from harness.math_grading import math_team_config  # noqa: E402
from harness.tasks import arithmetic_problems  # noqa: E402
from logprobs import TurnTensors, turn_forward  # noqa: E402
from rollout import SamplingConfig, draw_seed, rollout  # noqa: E402
from scale.rollout_hf import HF  # noqa: E402
from team import Team  # noqa: E402


def loop_rollout(team: Team, problems, group_size: int, sampling: SamplingConfig) -> int:
    """The release's structure: one sample, then one sequence scored, at a time."""
    tokens = 0
    for p in problems:
        for _ in range(group_size):
            answers = []
            for k, agent in enumerate(team.agents):
                ctx = team.prompt_ids(k, p, answers if team.protocol == "chain" else [])
                resp = HF.generate(agent, [ctx], sampling, [draw_seed()])[0]
                c, r = torch.tensor([ctx]), torch.tensor([resp])
                with torch.no_grad():
                    turn_forward(agent.model, TurnTensors(c, torch.ones_like(c), r, torch.ones_like(r)), slice(None),
                                 sampling.temperature)
                answers.append(team.extract(agent.tokenizer.decode(resp, skip_special_tokens=True)))
                tokens += len(resp)
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--protocol", default="independent", choices=["independent", "chain"])
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16, help="problems, each with G = 4 joint trajectories")
    args = ap.parse_args()

    team = Team([load_agent("tiny", seed=k) for k in range(3)], math_team_config(protocol=args.protocol))
    problems = arithmetic_problems(args.prompts, seed=0)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens)
    print(f"tiny team x3, {args.protocol}, {args.prompts} prompts x G=4 = {4 * args.prompts} joint trajectories, "
          f"max_new_tokens={args.max_new_tokens}, torch threads={torch.get_num_threads()}")
    rows = []
    for rep in range(args.repeats):
        torch.manual_seed(rep)
        t0 = time.perf_counter()
        batch = rollout(team, problems, 4, sampling, HF)
        t_batched = time.perf_counter() - t0
        torch.manual_seed(rep)
        t0 = time.perf_counter()
        loop_tokens = loop_rollout(team, problems, 4, sampling)
        t_loop = time.perf_counter() - t0
        rows.append((batch.num_tokens / t_batched, loop_tokens / t_loop))
        print(f"repeat {rep}: batched {batch.num_tokens} tok in {t_batched:.2f}s = {rows[-1][0]:.0f} tok/s | "
              f"loop {loop_tokens} tok in {t_loop:.2f}s = {rows[-1][1]:.0f} tok/s | "
              f"ratio {rows[-1][0] / rows[-1][1]:.1f}x")
    med = sorted(r[0] / r[1] for r in rows)[len(rows) // 2]
    print(f"median speed-up of the batched rollout: {med:.1f}x")


if __name__ == "__main__":
    main()
