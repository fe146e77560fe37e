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
after that goes through ``call_reward``'s checks (``CheckedReward``). Every failure is a ``RewardError``: one line
naming the function, the row and the value.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import sys
import traceback
from pathlib import Path
from typing import Callable

from reward import DEFAULT_RANGE, Reward, columns_of

PROBE_ROWS = 4  # data rows the reward is probed on before any training
SIGNATURE = "def NAME(prompts, completions, **columns) -> list[float]"


class RewardError(ValueError):
    """A reward function failed its contract: one line naming the function, the row and the value."""


class CheckedReward(Reward):
    """A reward whose every call is checked (``call_reward``): a user's function, a task's scorer, the built-in one.
    Its values are the function's; a broken contract is a ``RewardError`` instead of a wrong number."""

    def values(self, prompts: list[str], completions: list[list[str]], columns: dict,
               ids: list[str] | None = None) -> list[float]:
        return call_reward(self, prompts, completions, columns, ids)


# -- Loading ---------------------------------------------------------------------------------------------
def load_reward(spec: str) -> CheckedReward:
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
    return CheckedReward(fn, spec, range_of(fn, spec))


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


def range_of(fn: Callable, name: str, option: str = "--reward") -> tuple[float, float]:
    """(R_min, R_max): the ``reward_range`` attribute of a reward function (or an environment class, ``option``
    --env), else [0, 1]."""
    value = getattr(fn, "reward_range", DEFAULT_RANGE)
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        lo = hi = math.nan
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise RewardError(f"{option} {name}: reward_range must be (lo, hi) with finite lo < hi, got {value!r}")
    return lo, hi


# -- The contract, checked on every call ---------------------------------------------------------------
def call_reward(reward: Reward, prompts: list[str], completions: list[list[str]], columns: dict,
                ids: list[str] | None = None) -> list[float]:
    """``reward`` on the rows, its values checked: a list of one finite number per row inside its range.
    Each call gets its own copies of the lists, so a function that edits its inputs changes no batch."""
    copies = take(columns, list(range(len(prompts))))
    try:
        inspect.signature(reward.fn).bind([], [], **copies)
    except TypeError as e:
        raise RewardError(f"reward {reward.name}: wrong arguments ({e}); write {SIGNATURE} (this call passes "
                          f"{', '.join(columns)})") from None
    except ValueError:  # no signature to check
        pass
    try:
        values = reward.fn(list(prompts), [list(c) for c in completions], **copies)
    except Exception as e:
        raise RewardError(failing_row(reward, prompts, completions, columns, ids, e)) from None
    return check_values(reward, values, len(prompts), ids)


def take(columns: dict, rows: list[int]) -> dict:
    """The columns of ``rows`` only (per-row lists sliced; ``protocol``, one string, kept)."""
    return {k: v if k == "protocol" else [v[i] for i in rows] for k, v in columns.items()}


def row_name(i: int, ids: list[str] | None) -> str:
    return f"row {i} (id {ids[i]!r})" if ids else f"row {i}"


def failing_row(reward: Reward, prompts, completions, columns: dict, ids, err: Exception) -> str:
    """The one line for a function that raised on a batch: the first row that raises alone, and its error."""
    for i in range(len(prompts)):
        try:
            reward.fn([prompts[i]], [list(completions[i])], **take(columns, [i]))
        except Exception as e:
            return f"reward {reward.name} raised on {row_name(i, ids)}: {describe(e)}"
    return (f"reward {reward.name} raised on a batch of {len(prompts)} rows (on no row alone): {describe(err)}; "
            "score each row on its own")


def check_values(reward: Reward, values, n: int, ids: list[str] | None) -> list[float]:
    """The values as floats, or one line: not a list, a wrong count, not a number, not finite, out of range."""
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
        raise RewardError(f"reward {reward.name} returned {type(values).__name__} {short(values)}, not a list of "
                          f"{n} numbers (one per row)")
    if len(values) != n:
        raise RewardError(f"reward {reward.name} returned {len(values)} values for {n} rows; return one number "
                          "per row (completions[i])")
    lo, hi = reward.range
    out = []
    for i, v in enumerate(values):
        where = f"reward {reward.name}, {row_name(i, ids)}"
        try:
            x = float(v) if not isinstance(v, (str, bytes)) else None
        except (TypeError, ValueError):
            x = None
        if x is None:
            raise RewardError(f"{where}: value {short(v)} is not a number")
        if not math.isfinite(x):
            raise RewardError(f"{where}: value {x} is not finite; return a number in [{lo}, {hi}]")
        if not lo <= x <= hi:
            raise RewardError(f"{where}: value {x} is outside its range [{lo}, {hi}]; return values in "
                              f"[{lo}, {hi}], or give the function reward_range = (lo, hi)")
        out.append(x)
    return out


def describe(err: BaseException) -> str:
    """``Type: message (file:line)`` of an exception, the line where it was raised, in one line."""
    frames = traceback.extract_tb(err.__traceback__)
    if isinstance(err, SyntaxError) and err.filename:
        at = f" ({Path(err.filename).name}:{err.lineno})"
    else:
        at = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    message = (str(err).strip().splitlines() or [""])[0][:200]
    return f"{type(err).__name__}: {message}{at}" if message else f"{type(err).__name__}{at}"


def short(value, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


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
