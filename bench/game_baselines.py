"""What the built-in games pay a team that does not play: scripted policies over many held-out episodes.

    python bench/game_baselines.py                 # 400 episodes a cell: guess-numbers and blocksworld 3/4/5 blocks
    python bench/game_baselines.py --episodes 100  # quicker

Each game is played as a run's held-out split plays it (``sat.py --seed 0``: procedural rows on the odd seeds 1, 3,
5, ...; PlanBench's instances at the odd positions, 250 of them; 3 agents; the class's round budget), through the
environment class alone (reset, step, get_reward). The policies:

- ``idle``: every agent replies with the empty string every round.
- ``random``: guess-numbers: each agent guesses a uniformly random string of distinct digits; blocksworld: each agent
  names one action drawn uniformly from every action over the episode's blocks (most are refused).
- ``random-valid`` (blocksworld): each agent names one action drawn uniformly from those applicable in the state the
  last observation reported, so the team wanders the state space without a goal.
- ``lift-and-replace`` (blocksworld): agent 1 lifts a clear block and puts it back where it was, every round; the
  others are silent.

It prints, per game and policy, the mean reward (with its standard error), the share of episodes solved (reward at
the top of the range) and the share solved at reset (the goal already holds before any action). The policies read
only the observations, so the same script measures any version of the games.
"""
from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.env_games import GAMES, game_rows  # noqa: E402

AGENTS = 3
FACT = re.compile(r"the (\w+) block is (clear|on the table|on top of the (\w+) block)|"
                  r"(?:I am|the hand is currently) holding the (\w+)(?: block)?|the hand is empty")


def parse_state(text: str) -> tuple[dict[str, str], str | None]:
    """(block -> what it sits on, the held block or None) from the last state an observation describes."""
    start = max(text.rfind("Now:"), text.rfind("initial conditions"))
    part = text[start:].split("\n")[0] if start >= 0 else text
    on, held = {}, None
    for m in FACT.finditer(part):
        block, what, below, holding = m.groups()
        if holding:
            held = holding
        elif what == "on the table":
            on[block] = "table"
        elif below:
            on[block] = below
    return on, held


def valid_actions(on: dict[str, str], held: str | None, blocks: list[str]) -> list[str]:
    """Every action applicable in the state, in the games' words."""
    clear = [b for b in blocks if b not in on.values() and b != held]
    if held is not None:
        return [f"put down the {held} block"] + [f"stack the {held} block on top of the {y} block"
                                                  for y in clear if y != held]
    return [f"pick up the {b} block" if on.get(b) == "table" else
            f"unstack the {b} block from on top of the {on[b]} block" for b in clear if b in on]


def all_actions(blocks: list[str]) -> list[str]:
    return ([f"{v} the {b} block" for v in ("pick up", "put down") for b in blocks]
            + [f"stack the {x} block on top of the {y} block" for x in blocks for y in blocks if x != y]
            + [f"unstack the {x} block from on top of the {y} block" for x in blocks for y in blocks if x != y])


def lift_and_replace(on: dict[str, str], held: str | None, blocks: list[str]) -> str:
    """Lift the first clear block and put it back where it sat (two actions, one reply)."""
    clear = [b for b in blocks if b not in on.values() and b in on]
    if held is not None or not clear:
        return ""
    b = clear[0]
    if on[b] == "table":
        return f"pick up the {b} block\nput down the {b} block"
    return (f"unstack the {b} block from on top of the {on[b]} block\n"
            f"stack the {b} block on top of the {on[b]} block")


def replies(game: str, policy: str, seen: str, digits: int, rng: random.Random) -> list[str]:
    """The team's replies to the last observation (``seen``: the opening and every observation so far)."""
    if policy == "idle":
        return [""] * AGENTS
    if game == "guess-numbers":
        return ["".join(rng.sample("0123456789", digits)) for _ in range(AGENTS)]
    on, held = parse_state(seen)
    blocks = sorted(set(on) | ({held} if held else set()))
    if policy == "random":
        return [rng.choice(all_actions(blocks)) for _ in range(AGENTS)]
    if policy == "random-valid":
        out = []
        for _ in range(AGENTS):  # each agent acts on the state the observation reported
            options = valid_actions(on, held, blocks)
            out.append(rng.choice(options) if options else "")
        return out
    return [lift_and_replace(on, held, blocks)] + [""] * (AGENTS - 1)


def play(game: str, row: dict, policy: str, rng: random.Random) -> tuple[float, bool, bool]:
    """(reward, solved, solved at reset) of one episode."""
    cls = GAMES[game]
    env = cls()
    seen = env.reset(**row)
    top = cls.reward_range[1]
    at_reset = env.get_reward() >= top
    for _ in range(cls.max_rounds):
        observation, done = env.step(replies(game, policy, seen, row.get("digits", 4), rng))
        seen += "\n" + observation
        if done:
            break
    reward = env.get_reward()
    return reward, reward >= top, at_reset


def cells() -> list[tuple[str, dict, list[str]]]:
    """(game, --task-option values, policies) of the table."""
    walks = ["idle", "random", "random-valid", "lift-and-replace"]
    return ([("guess-numbers", {"digits": 4}, ["idle", "random"])]
            + [("blocksworld", {"blocks": blocks}, walks) for blocks in (3, 4, 5)]
            + [("blocksworld", {"instances": "planbench"}, walks)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=400, help="held-out episodes a cell")
    args = ap.parse_args(argv)
    print("| game | policy | episodes | mean reward (s.e.) | solved | solved at reset |")
    print("|---|---|---|---|---|---|")
    for game, options, policies in cells():
        label = game + "".join(f", {k} {v}" for k, v in options.items())
        for policy in policies:
            rng = random.Random(f"{game} {policy}")
            rows = [row for _, row in game_rows(game, options, args.episodes, 0, "heldout")]
            results = [play(game, row, policy, rng) for row in rows]
            rewards = [r for r, _, _ in results]
            se = statistics.stdev(rewards) / len(rewards) ** 0.5
            solved = sum(s for _, s, _ in results) / len(results)
            at_reset = sum(a for _, _, a in results) / len(results)
            print(f"| {label} | {policy} | {len(results)} | {statistics.mean(rewards):+.3f} ({se:.3f}) | "
                  f"{100 * solved:.1f}% | {100 * at_reset:.1f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
