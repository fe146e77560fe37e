"""A user's team reward: ``--reward FILE.py:NAME`` or ``package.module:NAME``, loaded and its contract probed.

The contract, in TRL's shape:

    def reward(prompts: list[str], completions: list[list[str]], **columns) -> list[float]

``prompts[i]`` is row i's problem text, ``completions[i][k]`` agent k's response in joint trajectory i. The
columns: ``answer`` (the gold answer at --answer-key), every other column of the row's dataset, ``agent_answers``
(``agent_answers[i][k]``: the answer extracted from agent k's response, or None) and ``protocol`` (one string:
independent or chain). Values lie in [0, 1] unless the function has a ``reward_range = (lo, hi)`` attribute; that
range is the (R_min, R_max) every bound and certificate uses (``bounds``). The function must be deterministic in
its row: the counterfactual baseline and the paired certificates call it again on swapped and redrawn outputs, in
other batches. ``check_reward`` probes all of it on the data's first rows before any model is loaded; every call
after that goes through ``reward.score``'s checks. Every failure is a ``reward.RewardError``: one line naming the
function, the row and the value.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import sys
from pathlib import Path
from typing import Callable

from reward import DEFAULT_RANGE, SIGNATURE, Reward, RewardError, call_reward, columns_of, describe, row_name, take

PROBE_ROWS = 4  # data rows the reward is probed on before any training


# -- Loading ---------------------------------------------------------------------------------------------
def load_reward(spec: str) -> Reward:
    """The function at ``FILE.py:NAME`` or ``package.module:NAME``, its signature and range checked."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise RewardError(f"--reward {spec}: write FILE.py:NAME or package.module:NAME, e.g. "
                          "--reward examples/addition_reward.py:reward")
    module = import_file(spec, where) if where.endswith(".py") else import_module(spec, where)
    if not hasattr(module, name):
        defined = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                   and getattr(v, "__module__", None) == module.__name__]
        raise RewardError(f"--reward {spec}: {where} has no {name!r}; it defines: {', '.join(defined) or 'nothing'}")
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardError(f"--reward {spec}: {name} is a {type(fn).__name__}, not a function; {SIGNATURE}")
    check_signature(fn, spec)
    return Reward(fn, spec, range_of(fn, spec))


def import_file(spec: str, path: str):
    """The module of a Python file, imported under a name of its own; its import errors as one line."""
    file = Path(path)
    if not file.is_file():
        raise RewardError(f"--reward {spec}: no such file {path}; pass FILE.py:NAME with the path of your "
                          "reward file, or package.module:NAME")
    module_name = f"sat_reward_{file.stem}"
    loader = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(loader)
    sys.modules[module_name] = module  # dataclasses and pickling in the file look themselves up here
    try:
        loader.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(module_name, None)
        raise RewardError(f"--reward {spec}: importing {path} raised {describe(e)}") from e
    return module


def import_module(spec: str, dotted: str):
    """An importable module by its dotted name; a missing one or its import error as one line."""
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError as e:
        if e.name and dotted != e.name and not dotted.startswith(e.name + "."):  # a module it imports is missing
            raise RewardError(f"--reward {spec}: importing {dotted} raised {describe(e)}") from e
        raise RewardError(f"--reward {spec}: no module {dotted!r} ({e}); pass FILE.py:NAME, or install the package "
                          "that holds it") from e
    except Exception as e:
        raise RewardError(f"--reward {spec}: importing {dotted} raised {describe(e)}") from e


def check_signature(fn: Callable, name: str) -> None:
    """Refuse a function that cannot take (prompts, completions) positionally and any column by keyword (a column
    it names but the data lacks is caught by the first call)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: the first call checks it
        return
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    two = len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)
    if not two or not any(p.kind == p.VAR_KEYWORD for p in params):
        raise RewardError(f"--reward {name}: wrong arguments {sig}; write {SIGNATURE} (the columns come as "
                          "keywords: answer, agent_answers, protocol and the dataset's own)")


def range_of(fn: Callable, name: str) -> tuple[float, float]:
    """(R_min, R_max): the function's ``reward_range`` attribute, else [0, 1]."""
    value = getattr(fn, "reward_range", DEFAULT_RANGE)
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        lo = hi = math.nan
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise RewardError(f"--reward {name}: reward_range must be (lo, hi) with finite lo < hi, got {value!r}")
    return lo, hi



# -- The contract, probed ---------------------------------------------------------------------------
def probe(reward: Reward, prompts: list[str], completions: list[list[str]], columns: dict,
          ids: list[str] | None = None) -> list[float]:
    """The checked values of a first batch, called three times before any training: twice as it is (the same
    row must get the same value) and once in reverse order (a row's value must not depend on the other rows):
    the counterfactual baseline and the paired certificates call the function again on swapped and redrawn
    outputs, in other batches."""
    first = call_reward(reward, prompts, completions, columns, ids)
    again = call_reward(reward, prompts, completions, columns, ids)
    back = list(range(len(prompts)))[::-1]
    reverse = call_reward(reward, [prompts[i] for i in back], [completions[i] for i in back], take(columns, back),
                          [ids[i] for i in back] if ids else None)[::-1]
    for label, values in (("on the same input", again), ("with the rows in reverse order", reverse)):
        for i, (a, b) in enumerate(zip(first, values)):
            if a != b:
                raise RewardError(f"reward {reward.name} is not deterministic: {row_name(i, ids)} got {a}, then {b} "
                                  f"{label}; SAT calls it again on swapped and redrawn outputs, so return the same "
                                  "value for the same row whatever the batch (seed any randomness)")
    return first


def check_reward(reward: Reward, problems: list, n_agents: int, protocol: str, extra: dict | None = None) -> None:
    """The reward's contract on the data's first rows, before any model is loaded (a typo costs seconds): each row
    answered by every agent with its gold answer, then with an empty response (no answer), through ``probe``.
    ``extra``: a value for each further column every row gets (an episode's ``env_reward`` and ``transcript``)."""
    rows = [p for p in problems[:PROBE_ROWS] for _ in range(2)]
    texts = [[p.answer if i % 2 == 0 else ""] * n_agents for i, p in enumerate(rows)]
    answers = [[p.answer if i % 2 == 0 else None] * n_agents for i, p in enumerate(rows)]
    columns = {**columns_of(rows, answers, protocol), **{k: [v] * len(rows) for k, v in (extra or {}).items()}}
    probe(reward, [p.problem for p in rows], texts, columns, [p.id for p in rows])
