"""A team that acts, observes and acts again: ``--env FILE.py:NAME`` / ``package.module:NAME``, or a built-in
``--task env:NAME``, loaded, checked and probed.

The contract (built like TRL's ``environment_factory``: no constructor arguments, ``reset(**row)``; unlike it, no
tools: ``step`` takes every agent's whole response of a round, docs/own_task.md says what else differs):

    class MyEnv:
        max_rounds = 4                 # T, the most rounds an episode runs (or --max-rounds T)
        reward_range = (0.0, 1.0)      # optional; [0, 1] otherwise: feeds every bound, as --reward's does
        def __init__(self): ...        # no arguments: one object per joint trajectory
        def reset(self, **row) -> str: ...                           # the opening observation
        def step(self, responses: list[str]) -> tuple[str, bool]: ... # the round's responses, one per agent
        def get_reward(self) -> float: ...                           # read once the episode ends

``row`` holds the data row's columns (``problem`` and ``answer`` when the data has them; neither is required). An
episode that has not ended after T rounds ends there. The environment must be deterministic: a function of its row
and the responses so far, because the paired certificates replay episodes under common random numbers
(``probe_environment`` checks it before any model loads, in this process and in a second one under another hash
seed). Every fault is one ``EnvironmentFault`` line naming the environment, the row and the value.
"""
from __future__ import annotations

import inspect
import math
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from harness.config import ENV_TASK_PREFIX
from harness.env_games import GAME_OPTIONS, GAMES, game_rows
from harness.env_replay import PROBE_REPLY, asks_responder  # the probe's scripted reply; whether a class asks
from harness.episodes import episode_rollout
from harness.user_reward import CheckedReward, RewardError, describe, import_file, import_module, range_of, short
from team import Problem

BUILTIN_PREFIX = ENV_TASK_PREFIX  # --task env:NAME
PROBE_ROWS = 3  # data rows the environment is probed on before any model loads
# Scripted replies of the probe's episodes (``probe_scripts`` varies them across agents and rounds): silence,
# numbers, the built-in games' moves and plain words.
PROBE_RESPONSES = ("", "1234", "pick up the red block", "7", "stack the blue block on top of the red block",
                   "I do not know.")
PROBE_TIMEOUT = 120  # seconds the probe's second process may take


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

    def play(self, team, flat: list, group_ids, sampling, backend, score: bool, seed: int):
        """ROLLOUT over rounds in this environment (``harness.episodes.episode_rollout``), a ``rollout.TeamBatch``:
        what ``rollout.rollout`` and ``rollout.regenerate`` call for a team handed an environment."""
        return episode_rollout(team, flat, group_ids, sampling, backend, score, seed)

    @property
    def asks(self) -> bool:
        """Whether the class can ask a responder model questions (it defines ``ask``)."""
        return asks_responder(self.factory)

    def ask(self, episode, problem, responses: list[str]) -> list[list[dict]]:
        """The chats this round's responses put to the responder model, checked: a list of chats, each a list of
        {"role", "content"} messages ([] for an environment without ``ask``)."""
        if not self.asks:
            return []
        where = f"environment {self.name}, row {problem.id!r}"
        try:
            chats = episode.ask(list(responses))
        except Exception as e:
            raise EnvironmentFault(f"{where}: ask raised {describe(e)}") from None
        if not (isinstance(chats, list) and all(isinstance(c, list) and c and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in c) for c in chats)):
            raise EnvironmentFault(f"{where}: ask returned {short(chats)}; return a list of chats, each a non-empty "
                                   'list of {"role": str, "content": str} messages')
        return chats

    def step(self, episode, problem, responses: list[str], replies: list[str] | None = None) -> tuple[str, bool]:
        """The environment's answer to one round: (observation, whether the episode ended); ``replies`` are the
        responder's answers to the round's ``ask`` chats, in order (passed to an environment that asks)."""
        where = f"environment {self.name}, row {problem.id!r}"
        try:
            out = episode.step(list(responses)) if not self.asks else episode.step(list(responses), list(replies or []))
        except Exception as e:
            raise EnvironmentFault(f"{where}: step raised {describe(e)}") from None
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], str)
                and isinstance(out[1], (bool, int))):
            raise EnvironmentFault(f"{where}: step returned {short(out)}; return (observation: str, done: bool)")
        return out[0], bool(out[1])

    def turn_score(self, episode, problem) -> float | None:
        """The environment's own score of the round just played (an optional ``turn_score()``, as verl's
        turn_scores): logged per round, never trained on; None for a class without one."""
        if not callable(getattr(self.factory, "turn_score", None)):
            return None
        where = f"environment {self.name}, row {problem.id!r}"
        try:
            value = episode.turn_score()
        except Exception as e:
            raise EnvironmentFault(f"{where}: turn_score raised {describe(e)}") from None
        if isinstance(value, (bool, str, bytes)) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise EnvironmentFault(f"{where}: turn_score returned {short(value)}; return a finite number")
        return float(value)

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
        asked = env.ask(episode, problem, responses)  # a scripted responder: one fixed reply per question
        observation, done = env.step(episode, problem, responses, [PROBE_REPLY] * len(asked))
        seen.append(observation)
        if done:
            break
    return seen, env.reward(episode, problem)


def opening_line(env: Environment, problem) -> str:
    """What the agents see at the start, said once per run: the first row's opening observation, whole (each
    episode's transcript begins with its own)."""
    _, opening = env.start(problem)
    return f"environment {env.name}: row {problem.id!r} opens with (each row's reset gives its own):\n{opening}"


def probe_scripts(n_agents: int, rounds: int) -> list[list[list[str]]]:
    """The probe's scripted episodes: one per PROBE_RESPONSES entry, each agent and round of it replying with
    another entry, so the replies vary across agents, rounds and episodes (randomness drawn from a reply's
    content shows)."""
    m = len(PROBE_RESPONSES)
    return [[[PROBE_RESPONSES[(s + r * n_agents + k) % m] for k in range(n_agents)] for r in range(rounds)]
            for s in range(m)]


def replay(env: Environment, problems: list, scripts: list) -> list[tuple[list[str], float]]:
    """Every scripted episode of every row: ``play``'s (observations, reward), row by row."""
    return [play(env, p, replies) for p in problems for replies in scripts]


def probe_environment(env: Environment, problems: list, n_agents: int) -> None:
    """The contract on the data's first PROBE_ROWS rows, before any model loads: each row's scripted episodes
    (``probe_scripts``) give the same observations and reward when played again in this process and when replayed
    in a second process under another PYTHONHASHSEED (``replay_elsewhere``), so neither randomness drawn while
    playing nor ``hash()`` of a string passes (the paired certificates replay episodes). A difference is one line
    naming the environment, the row and the value."""
    rows, scripts = problems[:PROBE_ROWS], probe_scripts(n_agents, env.max_rounds)
    first, again = replay(env, rows, scripts), replay(env, rows, scripts)
    compare(env, rows, len(scripts), first, again, "then")
    seed, elsewhere = replay_elsewhere(env, rows, scripts)
    compare(env, rows, len(scripts), first, elsewhere, f"then in a second process (PYTHONHASHSEED={seed})")


def compare(env: Environment, rows: list, per_row: int, first: list, second: list, how: str) -> None:
    """The first difference between two replays of the same episodes, as one ``EnvironmentFault`` line."""
    for index, (a, b) in enumerate(zip(first, second)):
        if a == b:
            continue
        i = next((i for i, (x, y) in enumerate(zip(a[0], b[0])) if x != y), None)
        what = (f"observation {i} was {short(a[0][i])}, {how} {short(b[0][i])}" if i is not None
                else f"the reward was {a[1]}, {how} {b[1]}")
        raise EnvironmentFault(f"environment {env.name} is not deterministic: row {rows[index // per_row].id!r}: "
                               f"{what} for the same replies; seed any randomness from the row, and never from "
                               "hash() of a str, which differs between processes (the paired certificates replay "
                               "episodes)")


def replay_elsewhere(env: Environment, rows: list, scripts: list) -> tuple[str, list]:
    """(the hash seed, ``replay``'s result) of the same episodes in a fresh Python process (``python -m
    harness.env_replay``: the rows' ids and ``reset`` keywords and the scripts pickled over its stdin) whose
    PYTHONHASHSEED differs from this one's; it loads the environment from its spec, as this process did, on this
    process's import path."""
    seed = "1" if os.environ.get("PYTHONHASHSEED") == "0" else "0"
    root = str(Path(__file__).resolve().parents[1])  # the project, importable there as it is here
    path = os.pathsep.join([root] + [entry or os.getcwd() for entry in sys.path])
    job = pickle.dumps((env.name, env.max_rounds, [(p.id, row_of(p)) for p in rows], scripts))
    try:
        done = subprocess.run([sys.executable, "-m", "harness.env_replay"], input=job, capture_output=True,
                              env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": path}, timeout=PROBE_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise EnvironmentFault(f"environment {env.name}: its determinism probe's second process took over "
                               f"{PROBE_TIMEOUT} s to replay {len(rows) * len(scripts)} scripted episodes; make "
                               "reset and step fast") from None
    if done.returncode != 0:
        last = (done.stderr.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
        raise EnvironmentFault(f"environment {env.name}: its determinism probe could not replay it in a second "
                               f"process (python -m harness.env_replay): {last[:200]}; make the class importable "
                               "from its spec, and deterministic")
    return seed, pickle.loads(done.stdout)


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
    """The columns an episode adds to the reward's (``harness.episodes.score_episodes``), with a value to probe it
    on."""
    return None if env is None else {"env_reward": env.range[0], "transcript": ""}


def game_options(name: str, task_option: list[str], env_model: str | None) -> dict:
    """A built-in game's row options from --task-option KEY=VALUE, with --env-model as its ``responder``."""
    options = dict(o.split("=", 1) for o in task_option)
    if env_model and "responder" in GAME_OPTIONS[name]:
        options.setdefault("responder", env_model)
    return options


def responder_spec(env: Environment | None, options: dict, env_model: str | None) -> str | None:
    """The model an environment asks (``--env-model NAME``, or a built-in game's ``--task-option responder=NAME``),
    any spec --agents takes; None for none (a built-in game's rules responder). An environment without ``ask``
    given one is refused, as is a game whose two flags disagree."""
    option = options.get("responder")
    option = None if option in (None, "rules") else option
    if env_model and option and env_model != option:
        raise ValueError(f"--env-model {env_model} and --task-option responder={option} name two responders; give one")
    spec = env_model or option
    if spec and env is None:
        raise ValueError(f"--env-model {spec}: there is no environment to ask it questions; add --env FILE.py:NAME "
                         "or --task env:detective-cases (or env:situation-puzzles), or drop the option")
    if spec and not env.asks:
        raise ValueError(f"--env-model {spec}: environment {env.name} asks a responder no questions (its class has no "
                         "ask); drop --env-model, or give the class ask(responses)")
    return spec
