"""Two built-in environments (``--task env:NAME``), procedural stand-ins for the paper's interactive domains.

Each is a class in the contract of ``harness.environments`` (TRL's ``environment_factory`` shape): a no-argument
constructor, ``reset(**row) -> str``, ``step(responses) -> (observation, done)``, ``get_reward() -> float`` in
``reward_range``, ``max_rounds``. Both are pure functions of their row and the responses so far.

- ``GuessNumbers``: ARBench's guessing-numbers game (GN) as AR-Bench defines it: a secret of distinct digits; each
  guess is answered with how many digits are right and in place, and how many are in the secret but elsewhere.
- ``Blocksworld``: PlanBench's blocksworld in its natural-language action form (pick up, put down, stack,
  unstack), each action applied with its preconditions checked, the state reported after each round.

Both give graded partial credit (documented on each ``get_reward``), so that a small team earns something before
it can solve an episode; an episode is solved exactly when its reward is 1, the top of the range, which is how a
run and ``eval_aime.py`` report success apart from the reward.
"""
from __future__ import annotations

import random
import re

from harness.env_detective import DetectiveCases
from harness.env_puzzles import SituationPuzzles

# -- ARBench guessing numbers (GN) --------------------------------------------------------------------------------
GN_RULES = (
    "Let's play a game of guessing numbers. I have a {digits}-digit secret number in mind; its digits are all "
    "different (each of 0-9 at most once, a leading 0 is allowed). After each guess I tell you how many digits are "
    "in the secret and in the right position, and how many are in the secret but in a different position. You "
    "have {rounds} rounds. Answer each round with one guess of {digits} different digits, e.g. \\boxed{{{example}}}."
)


def gn_secret(seed: int, digits: int) -> str:
    """The secret of a row: ``digits`` distinct digits drawn from ``seed`` alone."""
    return "".join(random.Random(f"guess-numbers {seed}").sample("0123456789", digits))


def gn_feedback(secret: str, guess: str) -> tuple[int, int]:
    """(digits right and in place, digits in the secret but elsewhere): AR-Bench's two numbers."""
    in_place = sum(a == b for a, b in zip(secret, guess))
    present = sum(min(secret.count(d), guess.count(d)) for d in set(guess))
    return in_place, present - in_place


def gn_guess(text: str, digits: int) -> str | None:
    """The last run of exactly ``digits`` digits in a response (a \\boxed{} one first), or None."""
    boxed = re.findall(r"\\boxed\{\s*(\d+)\s*\}", text)
    runs = [b for b in boxed if len(b) == digits] or re.findall(rf"(?<!\d)(\d{{{digits}}})(?!\d)", text)
    return runs[-1] if runs else None


class GuessNumbers:
    """ARBench GN. Row columns: ``seed`` (the secret is drawn from it) and ``digits`` (4, ARBench's; fewer for an
    easier game). Every agent's response in a round is one guess; the round's observation answers each."""

    max_rounds = 8
    reward_range = (0.0, 1.0)

    def reset(self, seed: int, digits: int = 4, rounds: int | None = None, **_) -> str:
        self.digits, self.secret = int(digits), gn_secret(int(seed), int(digits))
        self.best, self.solved = 0.0, False
        example = "".join(str(d) for d in range(self.digits))
        return GN_RULES.format(digits=self.digits, rounds=rounds or self.max_rounds, example=example)

    def step(self, responses: list[str]) -> tuple[str, bool]:
        lines = []
        for k, text in enumerate(responses):
            guess = gn_guess(text, self.digits)
            if guess is None:
                lines.append(f"Agent {k + 1}: no guess found; reply with {self.digits} different digits.")
                continue
            right, elsewhere = gn_feedback(self.secret, guess)
            self.best = max(self.best, (right + elsewhere / 2) / self.digits)
            self.solved = self.solved or guess == self.secret
            lines.append(f"Agent {k + 1} guessed {guess}: {right} right and in place, {elsewhere} in the secret "
                         "but elsewhere.")
        if self.solved:
            lines.append("Solved: that is the secret number.")
        return "\n".join(lines), self.solved

    def get_reward(self) -> float:
        """1 when a guess hit the secret; else half the best guess's score (in place + elsewhere / 2) / digits,
        so a well-formed guess earns about 0.12 at random."""
        return 1.0 if self.solved else 0.5 * self.best


# -- PlanBench blocksworld ----------------------------------------------------------------------------------------
COLOURS = ("red", "blue", "orange", "yellow", "white")
BW_RULES = (
    "I am playing with a set of blocks. I can: pick up a block (from the table, if it is clear and my hand is "
    "empty); unstack a block from on top of another block (if it is clear and my hand is empty); put down the "
    "block I hold on the table; stack the block I hold on top of a clear block. A block is clear when nothing is "
    "on it. Write one action per line, exactly as: pick up the red block / put down the red block / stack the red "
    "block on top of the blue block / unstack the red block from on top of the blue block.\n\n"
    "As initial conditions I have that: {state}\nMy goal is to have that {goal}.\nYou have {rounds} rounds; after "
    "each I apply your actions in order and tell you the state."
)
ACTION = re.compile(r"(pick up|put down|stack|unstack) the (\w+) block(?: (?:on top of|from on top of) the (\w+) "
                    r"block)?", re.I)


def bw_towers(blocks: list[str], rng: random.Random) -> list[list[str]]:
    """A random arrangement of ``blocks`` into towers (bottom first)."""
    order = rng.sample(blocks, len(blocks))
    towers: list[list[str]] = []
    for b in order:
        if towers and rng.random() < 0.5:
            rng.choice(towers).append(b)
        else:
            towers.append([b])
    return towers


def bw_on(towers: list[list[str]]) -> dict[str, str]:
    """block -> what it sits on ('table' or a block)."""
    return {b: ("table" if i == 0 else t[i - 1]) for t in towers for i, b in enumerate(t)}


def bw_describe(on: dict[str, str], holding: str | None) -> str:
    """The state in PlanBench's words: what is clear, the hand, what sits on what."""
    below = set(on.values())
    clear = [b for b in on if b not in below and b != holding]
    facts = [f"the {b} block is clear" for b in clear]
    facts.append("the hand is empty" if holding is None else f"I am holding the {holding} block")
    facts += [f"the {b} block is on the table" if s == "table" else f"the {b} block is on top of the {s} block"
              for b, s in on.items() if b != holding]
    return ", ".join(facts) + "."


def bw_apply(on: dict[str, str], holding: str | None, verb: str, x: str, y: str | None):
    """(new on, new holding) after one action, or (None, reason) when its preconditions fail."""
    verb, blocks = verb.lower(), set(on)
    if x not in blocks or (y is not None and y not in blocks):
        return None, f"there is no {x if x not in blocks else y} block"
    clear = lambda b: b not in on.values() and b != holding  # noqa: E731
    if verb in ("pick up", "unstack"):
        if holding is not None:
            return None, f"my hand is not empty (I hold the {holding} block)"
        if not clear(x):
            return None, f"the {x} block is not clear"
        if verb == "pick up" and on[x] != "table":
            return None, f"the {x} block is not on the table (unstack it)"
        if verb == "unstack" and (y is None or on[x] != y):
            return None, f"the {x} block is not on top of the {y} block"
        return {**on, x: "held"}, x
    if holding != x:
        return None, f"I am not holding the {x} block"
    if verb == "put down":
        return {**on, x: "table"}, None
    if y is None or y == x or not clear(y):
        return None, f"the {y} block is not clear" if y else "stack needs a block to stack on"
    return {**on, x: y}, None


class Blocksworld:
    """PlanBench blocksworld. Row columns: ``seed`` and ``blocks`` (3 to 5). Each round every agent's actions are
    applied in order, stopping at the first invalid one (the observation says why); solved when the goal holds."""

    max_rounds = 6
    reward_range = (0.0, 1.0)

    def reset(self, seed: int, blocks: int = 3, rounds: int | None = None, **_) -> str:
        if not 3 <= int(blocks) <= 5:
            raise ValueError(f"blocks must be 3 to 5, got {blocks}")
        rng = random.Random(f"blocksworld {seed}")
        names = list(COLOURS[: int(blocks)])
        self.on, self.holding = bw_on(bw_towers(names, rng)), None
        goal = bw_on(bw_towers(names, rng))
        while goal == self.on:
            goal = bw_on(bw_towers(names, rng))
        self.goal = {b: s for b, s in goal.items() if s != "table"} or goal  # PlanBench's goals name the stacks
        self.missing_at_start = self.unmet()
        self.valid = self.tried = 0
        goal_text = " and ".join(f"the {b} block is on top of the {s} block" if s != "table"
                                 else f"the {b} block is on the table" for b, s in self.goal.items())
        return BW_RULES.format(state=bw_describe(self.on, None), goal=goal_text, rounds=rounds or self.max_rounds)

    def unmet(self) -> int:
        return sum(self.on.get(b) != s for b, s in self.goal.items())

    def solved(self) -> bool:
        return self.holding is None and self.unmet() == 0

    def step(self, responses: list[str]) -> tuple[str, bool]:
        lines = []
        for k, text in enumerate(responses):
            for verb, x, y in ((m.group(1), m.group(2).lower(), m.group(3) and m.group(3).lower())
                               for m in ACTION.finditer(text)):
                self.tried += 1
                on, held = bw_apply(self.on, self.holding, verb, x, y)
                if on is None:
                    lines.append(f"Agent {k + 1}: cannot {verb.lower()} the {x} block: {held}.")
                    break
                self.on, self.holding, self.valid = on, held, self.valid + 1
                if self.solved():
                    break
            if self.solved():
                break
        state = "The goal holds: solved." if self.solved() else f"Now: {bw_describe(self.on, self.holding)}"
        return "\n".join([*lines, state]), self.solved()

    def get_reward(self) -> float:
        """1 when the goal holds; else a quarter for the share of valid actions among those tried and a quarter
        for the share of the goal's unmet facts that the team made true."""
        if self.solved():
            return 1.0
        valid = self.valid / self.tried if self.tried else 0.0
        progress = max(0, self.missing_at_start - self.unmet()) / max(self.missing_at_start, 1)
        return 0.25 * valid + 0.25 * progress


GAMES = {"guess-numbers": GuessNumbers, "blocksworld": Blocksworld, "detective-cases": DetectiveCases,
         "situation-puzzles": SituationPuzzles}
GAME_OPTIONS = {"guess-numbers": {"digits": 4}, "blocksworld": {"blocks": 3},
                "detective-cases": {"turns": 25, "responder": "rules"},
                "situation-puzzles": {"turns": 25, "responder": "rules"}}  # the row columns --task-option sets
