"""Sequence-aware weights on long responses: ESS/N against response length, and
`--reuse regenerate` against `--reuse weights` (paper, Section 5; Algorithm 1).

With `--reuse weights` (the paper's estimator) agent sigma(i) is trained on the
stage's one rollout, reweighted by w = prod min(1, rho_t) over the tokens of the
agents already promoted; log w is a sum over their tokens, so it falls roughly
linearly with response length and the later agents' effective sample size
collapses. `--reuse regenerate` redraws the promoted agent's turn instead
(`rollout.regenerate`), so every agent trains on an on-policy batch (w = 1).

The check runs one real SAT stage (``sat.sat_stage``) per (length, mode) on three
randomly initialised tiny agents whose LM head has a -1e4 bias on eos, so every
response is exactly L tokens long. The arithmetic task's reward is ~0 for random
agents, so the bench swaps in a synthetic, learnable team reward: the fraction
of digits in the three responses (rescored after every regeneration). Printed
per agent, in update order: ESS/N of its weights and the mean per-token KL of
its accepted update (the update's size; AdamW normalises the gradient's scale,
so small weights alone do not shrink it: the later agents then move on a
handful of rows), and its own gain in the synthetic objective (a fresh rollout
of the final team against the stage's rollout), plus the stage's generations
and the seconds spent generating.

    python bench/long_responses.py                        # L = 16, 64, 256
    python bench/long_responses.py --lengths 16 64 256 512 --batch-size 64
    python bench/long_responses.py --lengths 4 --batch-size 8   # the CI size (tests/test_bench.py)
"""
from __future__ import annotations

import argparse
import random
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rollout as rollout_mod  # noqa: E402
import sat  # noqa: E402
from harness.config import Config  # noqa: E402
from harness.loading import load_agent
from harness.math_grading import math_team_config  # noqa: E402
from harness.run import trust_regions_for  # noqa: E402
from harness.tasks import arithmetic_problems  # noqa: E402
from rollout import SamplingConfig  # noqa: E402
from scale.rollout_hf import HF  # noqa: E402
from team import Agent, Team  # noqa: E402


def digit_fractions(turns) -> torch.Tensor:
    """[n_agents, N] fraction of digit characters in each agent's response."""
    return torch.tensor([[sum(c.isdigit() for c in text) / max(len(text), 1) for text in t.texts] for t in turns])


def digit_score(score_team, seen: list):
    """rollout.score_team with a synthetic team reward in [0, 1]: the fraction of digit characters over the
    agents' responses (a sum over agents, so agent k's contribution to J is its own mean digit fraction / 3).
    Each call's digit fractions are appended to ``seen`` (the first: the stage's rollout)."""
    def wrapper(team, flat, turns, group_ids):
        answers, _, agent_reward, _ = score_team(team, flat, turns, group_ids)
        seen.append(digit_fractions(turns))
        return answers, seen[-1].mean(0).float(), agent_reward, None  # group mean baselines (Eq. (2))
    return wrapper


def never_stop(agent: Agent) -> None:
    """An LM head with a -1e4 bias on eos (weights still tied): every response runs to max_new_tokens.
    Generation and the teacher-forced log-probabilities both go through this head."""
    old = agent.model.get_output_embeddings()
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    head.weight = old.weight
    with torch.no_grad():
        head.bias.zero_()
        head.bias[agent.tokenizer.eos_token_id] = -1e4
    agent.model.set_output_embeddings(head)


def one_stage(length: int, reuse: str, args) -> dict:
    torch.manual_seed(args.seed)
    agents = [load_agent("tiny", seed=args.seed * 100 + k) for k in range(3)]
    for a in agents:
        never_stop(a)
    team = Team(agents, math_team_config(protocol="independent"))
    cfg = Config(agents="tiny x3", stages=1, batch_size=args.batch_size, group_size=4, max_new_tokens=length,
                 temperature=1.0, epochs=args.epochs, minibatch_size=args.batch_size // 2, lr=args.lr, delta=1e3,
                 beta=0.0, kl_check_every=0, warmup_steps=0, reuse=reuse, device="cpu").apply_preset()
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=length, token_budget=cfg.token_budget)
    problems = arithmetic_problems(cfg.batch_size // cfg.group_size, seed=args.seed)
    score_team, seen = rollout_mod.score_team, []
    rollout_mod.score_team = digit_score(score_team, seen)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.time()
            run = sat.RunState(team, trust_regions_for(cfg, 3), {}, random.Random(args.seed), HF)
            rec = sat.sat_stage(run, problems, cfg.core(), sampling)[0].row()
            rec["wall"] = time.time() - t0
            # what each agent's update bought: its own digit fraction, before (the stage's rollout) and
            # after (a fresh rollout of the final team on the same problems, 2N trajectories)
            rollout_mod.rollout(team, problems, 2 * cfg.group_size, sampling, HF, score=False)
    finally:
        rollout_mod.score_team = score_team
    rec["gain"] = (seen[-1].mean(1) - seen[0].mean(1)).tolist()  # [n_agents]
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--modes", nargs="+", default=["weights", "regenerate"], choices=["weights", "regenerate"])
    p.add_argument("--batch-size", type=int, default=64, help="joint trajectories (16 prompts x G = 4)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"3 random tiny agents, independent protocol, N = {args.batch_size}, every response exactly L tokens, "
          f"synthetic digit-fraction reward, lr {args.lr}, {args.epochs} epochs")
    print(f"{'L':>5} {'reuse':>10} | {'ESS/N agent 1/2/3':>20} | {'token KL of the update 1/2/3':>30} | "
          f"{'later/first':>11} | {'digit-fraction gain 1/2/3':>25} | {'generations':>11} {'gen s':>6} {'stage s':>7}")
    for length in args.lengths:
        for reuse in args.modes:
            rec = one_stage(length, reuse, args)
            ag = rec["agents"]  # static order: agent k is updated k-th
            ess = "/".join(f"{a['ess_ratio']:.3f}" for a in ag)
            kl = "/".join(f"{a['kl_mean']:.2e}" for a in ag)
            later = min(ag[1]["kl_mean"], ag[2]["kl_mean"]) / max(ag[0]["kl_mean"], 1e-30)
            gain = "/".join(f"{g:+.3f}" for g in rec["gain"])
            print(f"{length:>5} {reuse:>10} | {ess:>20} | {kl:>30} | {later:>11.2f} | {gain:>25} | "
                  f"{rec['generations']:>11} {rec['generation_seconds']:>6.1f} {rec['wall']:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
