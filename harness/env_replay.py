"""The second process of the environment's determinism probe (``harness.environments.replay_elsewhere``):

    python -m harness.env_replay < job.pickle > result.pickle

It reads (spec, T, rows, scripts) pickled on stdin, where each row is (id, the keywords of ``reset``) and each
script one list of replies per round, loads the environment class from its spec (a built-in ``env:NAME``, a
``FILE.py:NAME`` or a ``package.module:NAME``), plays every script on every row, and writes the observations and
rewards, pickled, to stdout. It imports neither torch nor the rest of the project, so it starts in a fraction of a
second; the parent has already checked the class and these very episodes, and compares what comes back.
"""
from __future__ import annotations

import importlib
import importlib.util
import pickle
import sys
from pathlib import Path

from harness.env_games import GAMES

BUILTIN_PREFIX = "env:"  # harness.config.ENV_TASK_PREFIX (not imported: it would bring torch)
PROBE_REPLY = "I cannot say."  # the scripted responder's reply to each question of a probe's episodes


def environment_class(spec: str) -> type:
    """The class a spec names, imported as ``harness.environments.user_class`` does (without its checks)."""
    if spec.startswith(BUILTIN_PREFIX):
        return GAMES[spec[len(BUILTIN_PREFIX):]]
    where, _, name = spec.rpartition(":")
    if where.endswith(".py"):
        loader = importlib.util.spec_from_file_location(f"sat_env_{Path(where).stem}", where)
        module = importlib.util.module_from_spec(loader)
        sys.modules[loader.name] = module  # dataclasses and pickling in the file look themselves up here
        loader.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def asks_responder(cls: type) -> bool:
    """Whether an environment class can ask a responder model questions (it defines ``ask``)."""
    return callable(getattr(cls, "ask", None))


def play_episode(cls: type, row: dict, replies: list[list[str]], rounds: int) -> tuple[list[str], float]:
    """(observations, reward) of one scripted episode, as ``harness.environments.play`` records them: a class that
    asks a responder model (it defines ``ask``) gets PROBE_REPLY to each of a round's questions."""
    episode = cls()
    asks = asks_responder(cls)
    seen = [episode.reset(**row)]
    for responses in replies[:rounds]:
        if asks:
            observation, done = episode.step(list(responses), [PROBE_REPLY] * len(episode.ask(list(responses))))
        else:
            observation, done = episode.step(list(responses))
        seen.append(observation)
        if done:
            break
    return seen, float(episode.get_reward())


def main() -> None:
    spec, rounds, rows, scripts = pickle.loads(sys.stdin.buffer.read())
    cls = environment_class(spec)
    result = [play_episode(cls, row, replies, rounds) for _, row in rows for replies in scripts]
    sys.stdout.buffer.write(pickle.dumps(result))


if __name__ == "__main__":
    main()
