"""What SmolLM2-135M-Instruct earns on reasoning-gym tasks before any training, per task and config.

    python bench/reasoning_gym_start.py                                   # the tasks below, 24 problems, T 0.4
    python bench/reasoning_gym_start.py --tasks "tower_of_hanoi:max_disks=3;knights_knaves" --team 3
    python bench/reasoning_gym_start.py --model tiny --n 2 --max-new-tokens 4   # CI size

A task earns its team nothing to learn from when every response scores 0, so the small-model runs need configs
where the start reward is above 0. The measurement goes through the run's own code: the agent loaded as
``--agents SmolLM2-135M`` loads it (team.load_agent), prompts rendered by harness.roles through the agent's chat
template (reasoning-gym's default system prompt, which asks for <answer> tags, and the question as the user
turn), responses sampled by scale.rollout_hf.HF.generate (the tempered full softmax, as in training), scored by the
dataset's own score_answer through harness.user_reward's checked call (harness.reasoning_gym_task.ReasoningGymReward).
Problems come from the training split (harness.reasoning_gym_task.reasoning_gym_problems).

Per task it prints: the team reward of ``--team`` agents (independent protocol: each agent one sample per
problem, the majority's expected score), the mean score of one agent's responses (both as the reward reads a
response: its <answer> tags, else the whole text), the same score counting tagged answers only ("tags": what a
reward strict about the format would give), the share of responses with tags, mean response tokens and the share
cut at --max-new-tokens.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.loading import load_agent
from harness.reasoning_gym_task import (  # noqa: E402
    ReasoningGymReward,
    parse_options,
    reasoning_gym_problems,
    response_answer,
    tagged_answer,
    task_roles,
)
from harness.roles import Role, Roles  # noqa: E402
from harness.user_reward import CheckedReward  # noqa: E402
from reward import score  # noqa: E402
from rollout import SamplingConfig, response_seeds  # noqa: E402
from scale.rollout_hf import HF  # noqa: E402
from team import Agent  # noqa: E402

TASKS = ("knights_knaves;propositional_logic;tower_of_hanoi;tower_of_hanoi:min_disks=1,max_disks=2,max_pegs=3;"
         "tower_of_hanoi:min_disks=2,max_disks=2,max_pegs=3;knights_knaves:n_people=2,depth_constraint=1;"
         "sokoban:min_w=4,max_w=4,min_h=4,max_h=4,min_boxes=1,max_boxes=1,max_depth=4")


def parse_task(item: str) -> tuple[str, dict]:
    """("name", options) of "name" or "name:key=value,key=value"."""
    name, _, opts = item.strip().partition(":")
    return name, parse_options([o for o in opts.split(",") if o.strip()])


def measure(agent: Agent, name: str, options: dict, args, sampling: SamplingConfig) -> dict:
    """One task's figures: --team agents (one sample each per problem, seeds per agent as in a rollout)."""
    problems = reasoning_gym_problems(name, options, args.n, args.seed, "train")
    roles = Roles((Role(None, "{problem}"),)) if args.system == "none" else task_roles(1, "independent", args.system)
    contexts = [agent.encode_prompt(roles.messages(0, p, [], [])) for p in problems]
    start, texts, tokens = time.perf_counter(), [], []
    for k in range(args.team):
        responses = HF.generate(agent, contexts, sampling, response_seeds(args.seed, len(contexts), k))
        texts.append([agent.tokenizer.decode(r, skip_special_tokens=True) for r in responses])
        tokens.append([(len(r), agent.tokenizer.eos_token_id not in r) for r in responses])
    seconds = time.perf_counter() - start
    fn = ReasoningGymReward(name, options)
    reward = CheckedReward(fn, fn.__name__, fn.reward_range)
    completions = [[texts[k][i] for k in range(args.team)] for i in range(len(problems))]
    answers = [[response_answer(t) for t in row] for row in completions]
    team = score(reward, problems, completions, answers, "independent")
    one = score(reward, problems, [[t] for t in texts[0]], [[a[0]] for a in answers], "chain")
    tags = [fn.dataset.score_answer(tagged_answer(t), {"question": p.problem, **p.columns})
            for t, p in zip(texts[0], problems)]
    flat = [t for row in tokens for t in row]
    return {"problems": len(problems), "team": sum(team) / len(team), "agent": sum(one) / len(one),
            "tags": sum(tags) / len(tags), "tagged": sum(tagged_answer(t) is not None for t in texts[0]) / len(tags),
            "tokens": sum(n for n, _ in flat) / len(flat), "truncated": sum(c for _, c in flat) / len(flat),
            "seconds": seconds, "example": texts[0][0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M", help="an --agents name: SmolLM2-135M, tiny, a folder, ...")
    ap.add_argument("--tasks", default=TASKS, help='";"-separated: name or name:key=value,key=value')
    ap.add_argument("--n", type=int, default=24, help="problems per task")
    ap.add_argument("--team", type=int, default=1, help="agents (samples per problem) for the team reward")
    ap.add_argument("--temperature", type=float, default=0.4)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--system", default="default",
                    help="the system turn: one of reasoning-gym's prompts (reasoning_gym.utils.SYSTEM_PROMPTS: "
                         "default thinks step by step, direct asks for the answer alone; both ask for <answer> "
                         "tags), or none (the question alone; the chat template may add its own default)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--examples", action="store_true", help="print each task's first response")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    agent = load_agent(args.model)
    sampling = SamplingConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    print(f"model {args.model}, {args.n} train problems a task, team of {args.team}, system {args.system}, "
          f"T {args.temperature}, "
          f"max_new_tokens {args.max_new_tokens}, {args.threads} threads")
    print(f"{'task':<72} {'n':>3} {'team':>6} {'agent':>6} {'tags':>6} {'tagged':>6} {'tokens':>6} "
          f"{'cut':>5} {'s':>6}")
    for item in args.tasks.split(";"):
        name, options = parse_task(item)
        r = measure(agent, name, options, args, sampling)
        print(f"{item.strip():<72} {r['problems']:3d} {r['team']:6.3f} {r['agent']:6.3f} {r['tags']:6.3f} "
              f"{r['tagged']:6.2f} {r['tokens']:6.1f} {r['truncated']:5.2f} {r['seconds']:6.0f}", flush=True)
        if args.examples:
            print(f"{'':4}e.g. {r['example'][:300]!r}")


if __name__ == "__main__":
    main()
