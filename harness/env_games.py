"""Two built-in environments (``--task env:NAME``): the interactive domains of AR-Bench and PlanBench.

Each is a class in the contract of ``harness.environments`` (TRL's ``environment_factory`` shape): a no-argument
constructor, ``reset(**row) -> str``, ``step(responses) -> (observation, done)``, ``get_reward() -> float`` in
``reward_range``, ``max_rounds``. Both are pure functions of their row and the responses so far.

- ``GuessNumbers``: AR-Bench's guessing numbers (GN): a secret of distinct digits; each guess is answered with how
  many digits are right and in place and how many are in the secret but elsewhere. As AR-Bench scores it, the team
  plays every round of its budget and the final guess is the answer.
- ``Blocksworld``: PlanBench's blocksworld (``harness.planbench``): its STRIPS domain, its words, and either a
  procedural problem drawn from the row's seed or one of PlanBench's own problem files.

Partial credit pays only for progress toward the goal, so that doing nothing or acting at random earns about 0 in
expectation (``bench/game_baselines.py`` measures it, ``tests/test_env_games.py`` bounds it); an episode is solved
exactly when its reward is 1, the top of the range, which is how a run and ``eval_aime.py`` count success.
"""
from __future__ import annotations

import itertools
import json
import math
import random
import re
from pathlib import Path

from harness import planbench as pb
from harness.env_detective import DetectiveCases
from harness.env_puzzles import SituationPuzzles

# -- AR-Bench guessing numbers (GN) -------------------------------------------------------------------------------
GN_RULES = (
    "Let's play a game of guessing numbers. I have a {digits}-digit secret number in mind; its digits are all "
    "different (each of 0-9 at most once, a leading 0 is allowed). After each guess I tell you how many digits are "
    "in the secret and in the right position, and how many are in the secret but in a different position. You "
    "have {rounds} rounds; every agent guesses in every round. The last guess of round {rounds} is your final "
    "answer, and only it is scored. Answer each round with one guess of {digits} different digits, e.g. "
    "\\boxed{{{example}}}."
)
GN_PARTIAL = 0.5  # the most an unsolved episode earns: the share of the secret's uncertainty its feedback removed


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


def gn_consistent(candidate: str, history: list[tuple[str, tuple[int, int]]]) -> bool:
    """Whether ``candidate`` could be the secret given every (guess, feedback) so far."""
    return all(gn_feedback(candidate, guess) == fb for guess, fb in history)


def gn_information(history: list[tuple[str, tuple[int, int]]], digits: int) -> float:
    """The share of the secret's uncertainty the feedback removed: log(N0 / N) / log(N0), where N0 counts every
    secret of ``digits`` distinct digits and N those the feedback leaves possible."""
    total = math.perm(10, digits)
    left = sum(gn_consistent("".join(c), history) for c in itertools.permutations("0123456789", digits))
    return math.log(total / left) / math.log(total)


class GuessNumbers:
    """AR-Bench GN. Row columns: ``seed`` (the secret is drawn from it) and ``digits`` (4, AR-Bench's), or
    ``secret`` (one of AR-Bench's data/gn/*.json strings). Every agent's response in a round is one guess; the
    round's observation answers each. The episode runs its whole budget (``rounds``, else ``max_rounds``)."""

    max_rounds = 8
    reward_range = (0.0, 1.0)

    def reset(self, seed: int | None = None, digits: int = 4, rounds: int | None = None, secret: str | None = None,
              **_) -> str:
        self.digits = len(secret) if secret is not None else int(digits)
        if not 1 <= self.digits <= 6:
            raise ValueError(f"digits must be 1 to 6, got {self.digits}")
        self.secret = str(secret) if secret is not None else gn_secret(int(seed), self.digits)
        self.rounds = int(rounds or self.max_rounds)
        self.history: list[list[tuple[str, tuple[int, int]]]] = []  # per round: (guess, feedback) per well-formed guess
        example = "".join(str(d) for d in range(self.digits))
        return GN_RULES.format(digits=self.digits, rounds=self.rounds, example=example)

    def step(self, responses: list[str]) -> tuple[str, bool]:
        lines, answered = [], []
        for k, text in enumerate(responses):
            guess = gn_guess(text, self.digits)
            if guess is None:
                lines.append(f"Agent {k + 1}: no guess found; reply with {self.digits} different digits.")
                continue
            right, elsewhere = gn_feedback(self.secret, guess)
            answered.append((guess, (right, elsewhere)))
            lines.append(f"Agent {k + 1} guessed {guess}: {right} right and in place, {elsewhere} in the secret "
                         "but elsewhere.")
        self.history.append(answered)
        done = len(self.history) >= self.rounds
        if done:
            final = self.final_guess()
            lines.append(f"Final answer {final or '(none)'}: " + ("that is the secret number." if final == self.secret
                                                                else f"the secret was {self.secret}."))
        else:
            lines.append(f"Round {len(self.history)} of {self.rounds} done.")
        return "\n".join(lines), done

    def final_guess(self) -> str | None:
        """The team's answer: the last well-formed guess of the last round played (the latest agent's)."""
        return self.history[-1][-1][0] if self.history and self.history[-1] else None

    def get_reward(self) -> float:
        """1 when the final guess is the secret. Otherwise, when the final guess could still be the secret given the
        feedback of the earlier rounds (its digits distinct, each earlier guess's feedback the same against it),
        GN_PARTIAL times the share of the uncertainty that feedback removed (``gn_information``); else 0. A final
        guess of distinct digits drawn without reading the feedback is consistent with probability N / N0, so it
        earns at most GN_PARTIAL * max_x x log(1/x) / log N0 = GN_PARTIAL / (e ln N0) in expectation (0.022 at 4
        digits), and nothing without feedback."""
        final = self.final_guess()
        if final is None:
            return 0.0
        if final == self.secret:
            return 1.0
        earlier = [pair for answered in self.history[:-1] for pair in answered]
        if len(set(final)) < self.digits or not gn_consistent(final, earlier):  # never the secret: no credit
            return 0.0
        return GN_PARTIAL * gn_information(earlier, self.digits)


# -- PlanBench blocksworld ------------------------------------------------------------------------------------------
BW_PROCEDURE = (
    "\n\n[STATEMENT]\nAs initial conditions I have that, {state}.\nMy goal is to have that {goal}.\n\n"
    "We act over {rounds} rounds. In each round, write the actions to take, one per line, in the words above, e.g. "
    "\"pick up the red block\", \"put down the red block\", \"stack the red block on top of the blue block\", "
    "\"unstack the red block from on top of the blue block\". After each round I apply every agent's actions in "
    "order, stop an agent's list at its first action that cannot be done, and tell you the state."
)
BW_PARTIAL = 0.5  # the most an unsolved episode earns: the share of the shortest plan's length the team closed


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


def tower_facts(towers: list[list[str]]) -> frozenset:
    """The state of ``towers`` with the hand empty."""
    facts = {("handempty",)}
    for t in towers:
        facts |= {("ontable", t[0]), ("clear", t[-1])} | {("on", a, b) for b, a in zip(t, t[1:])}
    return frozenset(facts)


def bw_problem(seed: int, blocks: int) -> tuple[list[str], frozenset, frozenset]:
    """(objects, initial state, goal) of a procedural problem: random towers, and as goal the stacking facts of other
    random towers, redrawn until at least one of them does not hold at the start."""
    if not 3 <= blocks <= 5:
        raise ValueError(f"blocks must be 3 to 5, got {blocks}")
    rng = random.Random(f"blocksworld {seed}")
    objects = list(pb.COLOURS)[:blocks]
    init = tower_facts(bw_towers(objects, rng))
    while True:
        goal = frozenset(f for f in tower_facts(bw_towers(objects, rng)) if f[0] == "on")
        if goal - init:
            return objects, init, goal


class Blocksworld:
    """PlanBench blocksworld. Row columns: ``seed`` and ``blocks`` (3 to 5) for a procedural problem, or ``objects``,
    ``init`` and ``goal`` (one of PlanBench's problems, as ``planbench.parse_problem`` reads it). Each round every
    agent's actions are applied in order, an agent's list stopping at its first action whose preconditions fail
    (the observation says which); solved, and ended, when every goal fact holds."""

    max_rounds = 6
    reward_range = (-BW_PARTIAL, 1.0)

    def reset(self, seed: int | None = None, blocks: int = 3, rounds: int | None = None, objects=None, init=None,
              goal=None, **_) -> str:
        if objects is None:
            self.objects, self.state, self.goal = bw_problem(int(seed), int(blocks))
        else:
            self.objects = list(objects)
            self.state, self.goal = frozenset(map(tuple, init)), frozenset(map(tuple, goal))
        self.names = {pb.COLOURS[o]: o for o in self.objects}
        self.start_distance = pb.plan_length(self.state, self.goal, self.objects)
        if self.start_distance == 0:
            raise ValueError("the goal already holds in the initial state; give a problem with something to do")
        self.plan: list[tuple[str, tuple[str, ...]]] = []  # every applied action, in order (VAL's plan)
        return pb.DOMAIN_INTRO + BW_PROCEDURE.format(state=pb.facts_text(self.state), goal=pb.facts_text(self.goal),
                                                     rounds=rounds or self.max_rounds)

    def solved(self) -> bool:
        return self.goal <= self.state

    def act(self, verb: str, colours: tuple[str, ...], words: str) -> str | None:
        """Apply one named action; None when it was applied, else why not."""
        unknown = [c for c in colours if c not in self.names]
        if unknown:
            return f"there is no {unknown[0]} block"
        if len(colours) != len(pb.ACTIONS[verb][0]):
            return "it needs the block to stack on or unstack from"
        args = tuple(self.names[c] for c in colours)
        after = pb.apply(self.state, verb, args)
        if not isinstance(after, frozenset):
            return f"it needs that {pb.fact_text(after)}"
        self.state = after
        self.plan.append((verb, args))
        return None

    def step(self, responses: list[str]) -> tuple[str, bool]:
        lines = []
        for k, text in enumerate(responses):
            for verb, colours, words in pb.actions_in(text):
                why = self.act(verb, colours, words)
                if why is not None:
                    lines.append(f"Agent {k + 1}: cannot {words.lower()}: {why}.")
                    break
                if self.solved():
                    break
            if self.solved():
                break
        state = "The goal holds: solved." if self.solved() else f"Now: {pb.facts_text(self.state)}."
        return "\n".join([*lines, state]), self.solved()

    def get_reward(self) -> float:
        """1 when every goal fact holds. Otherwise BW_PARTIAL times the share of the shortest plan's length the team
        closed, (d0 - d) / d0 with d0 the fewest actions from the start to the goal and d those from the end state:
        0 for doing nothing or for undoing what was done, below 0 for moving away from the goal."""
        if self.solved():
            return 1.0
        now = pb.plan_length(self.state, self.goal, self.objects)
        return BW_PARTIAL * (self.start_distance - now) / self.start_distance


GAMES = {"guess-numbers": GuessNumbers, "blocksworld": Blocksworld, "detective-cases": DetectiveCases,
         "situation-puzzles": SituationPuzzles}
GAME_OPTIONS = {"guess-numbers": {"digits": 4, "secrets": None},  # the --task-option keys and their defaults
                "blocksworld": {"blocks": 3, "instances": None},
                "detective-cases": {"turns": 25, "responder": "rules"},
                "situation-puzzles": {"turns": 25, "responder": "rules"}}
SOURCES = ("instances", "secrets")  # the options that name a benchmark's own list of rows


# -- Rows ---------------------------------------------------------------------------------------------------------
def game_rows(name: str, options: dict, n: int, seed: int, split: str, rounds: int | None = None) -> list:
    """(id, row) of ``n`` episodes of a built-in game. Procedural rows take one seed each, the held-out split on odd
    seeds and training on even ones, so the two never share an episode whatever the run's seed. With
    ``instances=FOLDER|planbench`` (blocksworld) or ``secrets=FILE.json`` (guess-numbers) the rows are a benchmark's
    own: training takes the even positions of its sorted list and held-out the odd ones, shuffled by the run's seed;
    at most ``n`` of them. ``rounds`` (T, when --max-rounds sets it) goes in each row, for the opening's words."""
    unknown = sorted(set(options) - set(GAME_OPTIONS[name]))
    if unknown:
        raise ValueError(f"--task-option {unknown[0]}: env:{name} takes {', '.join(GAME_OPTIONS[name])}")
    extra = {"rounds": rounds} if rounds else {}
    source = options.get("instances") or options.get("secrets")
    if source:
        listed = benchmark_rows(name, source, options)
        mine = listed[split == "heldout"::2]
        random.Random(f"{name} {source} {seed} {split}").shuffle(mine)
        return [(key, {**row, **extra}) for key, row in mine[:n]]
    values = {k: int(v) if isinstance(default, int) else v for k, default in GAME_OPTIONS[name].items()
              if k not in SOURCES for v in [options.get(k, default)]}
    base = 2 * (seed * 100_003) + (split == "heldout")
    return [(str(base + 2 * i), {**values, **extra, "seed": base + 2 * i}) for i in range(n)]


def benchmark_rows(name: str, source: str, options: dict) -> list[tuple[str, dict]]:
    """(id, row) of every problem of a benchmark's own list, in its order."""
    if name == "blocksworld":
        if "blocks" in options:
            raise ValueError("--task-option blocks sizes the procedural problems; drop it with instances=")
        listed = pb.shipped_instances() if source == "planbench" else pb.read_folder(source)
        return [(r["instance"], {k: r[k] for k in ("objects", "init", "goal")}) for r in listed]
    if "digits" in options:
        raise ValueError("--task-option digits sizes the drawn secrets; drop it with secrets= (the file's set it)")
    return [(f"{Path(source).stem}-{i}", {"secret": s}) for i, s in enumerate(gn_secrets(source))]


def gn_secrets(path: str) -> list[str]:
    """AR-Bench's data/gn/*.json: a JSON list of secrets, each a string of distinct digits, all of one length."""
    where = f"--task-option secrets={path}"
    try:
        secrets = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: cannot read it as JSON ({type(e).__name__}); give AR-Bench's data/gn/test.json "
                         "or a file like it (a list of 4-digit strings)") from None
    if not isinstance(secrets, list) or not secrets:
        raise ValueError(f"{where}: not a non-empty JSON list; AR-Bench's data/gn files are lists of 4-digit strings")
    for i, s in enumerate(secrets):
        well_formed = isinstance(s, str) and re.fullmatch("[0-9]+", s) and len(set(s)) == len(s)
        if not (well_formed and len(s) == len(str(secrets[0])) and len(s) <= 6):
            raise ValueError(f"{where}: item {i} is {s!r}; each secret is a string of distinct digits, all of one "
                             "length (at most 6)")
    return secrets
