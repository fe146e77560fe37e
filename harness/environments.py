"""A team that acts, observes and acts again: ``--env FILE.py:NAME`` / ``package.module:NAME``, or a built-in
``--task env:NAME``, loaded, checked and probed.

The contract, in the shape of TRL's ``environment_factory``:

    class MyEnv:
        max_rounds = 4                 # T, the most rounds an episode runs (or --max-rounds T)
        reward_range = (0.0, 1.0)      # optional; [0, 1] otherwise: feeds every bound, as --reward's does
        def __init__(self): ...        # no arguments: one object per joint trajectory
        def reset(self, **row) -> str: ...                           # the opening observation
        def step(self, responses: list[str]) -> tuple[str, bool]: ... # the round's responses, one per agent
        def get_reward(self) -> float: ...                           # read once the episode ends

``row`` holds the data row's columns (``problem`` and ``answer`` when the data has them). An episode that has not
ended after T rounds ends there. The environment must be deterministic: a function of its row and the responses so
far, because the paired certificates replay episodes under common random numbers (``probe_environment`` checks it
before any model loads). Every fault is one ``EnvironmentFault`` line naming the environment, the row and the value.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

from harness.env_games import GAMES, game_rows
from harness.user_reward import CheckedReward, RewardError, describe, import_file, import_module, range_of, short
from team import Problem

BUILTIN_PREFIX = "env:"
PROBE_ROWS = 2  # data rows the environment is probed on before any model loads
PROBE_RESPONSES = ("", "1234", "pick up the red block")  # scripted replies of the probe's episodes


class EnvironmentFault(RewardError):
    """One line naming the environment, the row and the value."""


@dataclass(frozen=True)
class Environment:
    """A checked environment class: what the rollout calls (``start``, ``step``, ``reward``) and its T and range."""

    factory: type
    name: str
    max_rounds: int
    range: tuple[float, float]

    def start(self, problem) -> tuple[object, str]:
        """A fresh episode for ``problem`` (a ``team.Problem``) and its opening observation."""
        where = f"environment {self.name}, row {problem.id!r}"
        try:
            episode = self.factory()
            opening = episode.reset(**row_of(problem))
        except Exception as e:
            raise EnvironmentFault(f"{where}: reset raised {describe(e)}") from None
        if not isinstance(opening, str):
            raise EnvironmentFault(f"{where}: reset returned {type(opening).__name__} {short(opening)}; return the "
                                   "opening observation as a str")
        return episode, opening

    def step(self, episode, problem, responses: list[str]) -> tuple[str, bool]:
        """The environment's answer to one round: (observation, whether the episode ended)."""
        where = f"environment {self.name}, row {problem.id!r}"
        try:
            out = episode.step(list(responses))
        except Exception as e:
            raise EnvironmentFault(f"{where}: step raised {describe(e)}") from None
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], str)
                and isinstance(out[1], (bool, int))):
            raise EnvironmentFault(f"{where}: step returned {short(out)}; return (observation: str, done: bool)")
        return out[0], bool(out[1])

    def reward(self, episode, problem) -> float:
        """The ended episode's team reward, checked to be a finite number inside the range."""
        where = f"environment {self.name}, row {problem.id!r}"
        try:
            value = episode.get_reward()
        except Exception as e:
            raise EnvironmentFault(f"{where}: get_reward raised {describe(e)}") from None
        lo, hi = self.range
        if isinstance(value, (bool, str, bytes)) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise EnvironmentFault(f"{where}: get_reward returned {short(value)}; return a finite number in "
                                   f"[{lo}, {hi}]")
        if not lo <= value <= hi:
            raise EnvironmentFault(f"{where}: get_reward returned {value}, outside its range [{lo}, {hi}]; return "
                                   "values in the range, or give the class reward_range = (lo, hi)")
        return float(value)


def row_of(problem) -> dict:
    """The keywords of ``reset``: the row's columns, with ``problem`` and ``answer`` where the data has them."""
    base = {k: v for k, v in (("problem", problem.problem), ("answer", problem.answer)) if v not in ("", None)}
    return {**base, **problem.columns}


def load_environment(spec: str, max_rounds: int | None = None) -> Environment:
    """The class at ``FILE.py:NAME`` / ``package.module:NAME`` (or a built-in ``env:NAME``), its methods, T and
    range checked."""
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX):]
        if name not in GAMES:
            raise EnvironmentFault(f"--task {spec}: no built-in environment {name!r}; choose one of "
                                   f"{', '.join(BUILTIN_PREFIX + g for g in GAMES)}")
        cls = GAMES[name]
    else:
        cls = user_class(spec)
    return Environment(cls, spec, rounds_of(cls, spec, max_rounds), range_of(cls, spec, "--env"))


def user_class(spec: str) -> type:
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise EnvironmentFault(f"--env {spec}: write FILE.py:NAME or package.module:NAME, e.g. "
                               "--env examples/countdown_env.py:Countdown")
    try:
        module = import_file(spec, where) if where.endswith(".py") else import_module(spec, where)
    except RewardError as e:
        raise EnvironmentFault(str(e).replace("--reward", "--env", 1).replace("reward file", "environment file")) \
            from None
    cls = getattr(module, name, None)
    if not inspect.isclass(cls):
        raise EnvironmentFault(f"--env {spec}: {where} has no class {name!r}")
    missing = [m for m in ("reset", "step", "get_reward") if not callable(getattr(cls, m, None))]
    if missing:
        raise EnvironmentFault(f"--env {spec}: {name} has no {', '.join(missing)}; an environment class defines "
                               "reset(**row) -> str, step(responses) -> (str, bool) and get_reward() -> float")
    try:
        inspect.signature(cls).bind()
    except TypeError:
        raise EnvironmentFault(f"--env {spec}: {name}() needs arguments; give it a constructor with none (the row "
                               "reaches reset)") from None
    except ValueError:
        pass
    return cls


def rounds_of(cls: type, spec: str, max_rounds: int | None) -> int:
    """T: --max-rounds, else the class's ``max_rounds``."""
    value = max_rounds if max_rounds is not None else getattr(cls, "max_rounds", None)
    if value is None:
        raise EnvironmentFault(f"--env {spec}: no round limit; pass --max-rounds T or give the class max_rounds = T")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EnvironmentFault(f"--env {spec}: max_rounds must be a whole number >= 1, got {value!r}")
    return value


def play(env: Environment, problem, replies: list[list[str]]) -> tuple[list[str], float]:
    """The observations and reward of one episode under scripted replies (one list per round)."""
    episode, opening = env.start(problem)
    seen = [opening]
    for responses in replies[: env.max_rounds]:
        observation, done = env.step(episode, problem, responses)
        seen.append(observation)
        if done:
            break
    return seen, env.reward(episode, problem)


def probe_environment(env: Environment, problems: list, n_agents: int) -> None:
    """The contract on the data's first rows, before any model loads: each row played twice with the same scripted
    replies must give the same observations and reward (the paired certificates replay episodes)."""
    for p in problems[:PROBE_ROWS]:
        for reply in PROBE_RESPONSES:
            replies = [[reply] * n_agents] * env.max_rounds
            first, again = play(env, p, replies), play(env, p, replies)
            if first != again:
                i = next((i for i, (a, b) in enumerate(zip(first[0], again[0])) if a != b), None)
                what = (f"observation {i} was {short(first[0][i])}, then {short(again[0][i])}" if i is not None
                        else f"the reward was {first[1]}, then {again[1]}")
                raise EnvironmentFault(f"environment {env.name} is not deterministic: row {p.id!r}: {what} for the "
                                       "same replies; seed any randomness from the row (the paired certificates "
                                       "replay episodes)")


def game_problems(name: str, options: dict, n: int, seed: int, split: str, rounds: int | None = None) -> list:
    """Rows of a built-in game as problems (``env_games.game_rows``: seeds or a benchmark's own instances, the
    training and held-out splits apart); ``rounds`` (T, when --max-rounds sets it) goes in each row, so the opening
    tells the agents how many rounds they have."""
    try:
        rows = game_rows(name, options, n, seed, split, rounds)
    except ValueError as e:
        raise EnvironmentFault(str(e)) from None
    return [Problem(f"{name}-{key}", "", "", None, row) for key, row in rows]


def episode_reward(env: Environment) -> CheckedReward:
    """The team reward of an environment's episodes when no --reward is given: its ``get_reward``, in its range,
    through the one reward path (``reward.score``)."""
    def reward(prompts: list[str], completions: list[list[str]], *, env_reward: list[float], **columns) -> list[float]:
        return list(env_reward)

    return CheckedReward(reward, env.name, env.range)


def episode_columns(env: Environment | None) -> dict | None:
    """The columns an episode adds to the reward's (``rollout.score_episodes``), with a value to probe it on."""
    return None if env is None else {"env_reward": env.range[0], "transcript": ""}
