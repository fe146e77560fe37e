"""A team reward over the joint output: ``--reward FILE.py:NAME`` or ``package.module:NAME``, called through checks.

The contract, in TRL's shape:

    def reward(prompts: list[str], completions: list[list[str]], **columns) -> list[float]

``prompts[i]`` is row i's problem text, ``completions[i][k]`` agent k's response in joint trajectory i. The
columns: ``answer`` (the gold answer at --answer-key), every other column of the row's dataset, ``agent_answers``
(``agent_answers[i][k]``: the answer extracted from agent k's response, or None) and ``protocol`` (one string:
independent or chain). Values lie in [0, 1] unless the function has a ``reward_range = (lo, hi)`` attribute; that
range is the (R_min, R_max) every bound and certificate uses (``bounds``). The function must be deterministic in
its row: the counterfactual baseline (``counterfactual_baselines``) and the paired certificates call it again on
swapped and redrawn outputs, in other batches. ``probe`` checks both on a first batch before any training.

The built-in reward (``DEFAULT_REWARD``: the vote's expected correctness, or the last agent's correctness in the
chain protocol, as grading.vote_reward and grading.answers_match give them) goes through the same calls.
Every failure is a ``RewardError``: one line naming the function, the row and the value.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from reward import answers_match, normalize_answer, tied_answers, vote_reward

DEFAULT_RANGE = (0.0, 1.0)
SIGNATURE = "def NAME(prompts, completions, **columns) -> list[float]"


class RewardError(ValueError):
    """A user's reward function failed its contract: one line naming the function, the row and the value."""


@dataclass(frozen=True)
class Reward:
    """A team reward function with the name the user gave it and its range (R_min, R_max)."""

    fn: Callable
    name: str
    range: tuple[float, float] = DEFAULT_RANGE


def team_correct(prompts: list[str], completions: list[list[str]], *, answer: list, agent_answers: list[list],
                 protocol: str, **columns) -> list[float]:
    """The built-in team reward (paper, Section 5): independent protocol, the expected correctness of the
    majority vote of the agents' answers under a uniform tie-break (``grading.vote_reward``); chain, whether the
    last agent's answer is right."""
    if protocol == "independent":
        return [vote_reward(list(answers), gold) for answers, gold in zip(agent_answers, answer)]
    return [float(answers_match(answers[-1], gold)) for answers, gold in zip(agent_answers, answer)]


DEFAULT_REWARD = Reward(team_correct, "the built-in team reward")


def vote_score(answers: list[str | None], score: Callable[[str], float], key: Callable[[str], str] = normalize_answer
               ) -> float:
    """The expected ``score`` of the majority answer under a uniform tie-break (answers equal under ``key``
    vote together; None and empty abstain; 0 if all do): ``reward.vote_reward`` for any per-answer score."""
    tied = tied_answers(answers, key)
    return sum(score(a) for a in tied) / len(tied) if tied else 0.0


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


def describe(err: BaseException) -> str:
    """``Type: message (file:line)`` of an exception, the line where it was raised, in one line."""
    frames = traceback.extract_tb(err.__traceback__)
    if isinstance(err, SyntaxError) and err.filename:
        at = f" ({Path(err.filename).name}:{err.lineno})"
    else:
        at = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    message = (str(err).strip().splitlines() or [""])[0][:200]
    return f"{type(err).__name__}: {message}{at}" if message else f"{type(err).__name__}{at}"


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


# -- The checked call ------------------------------------------------------------------------------------
def row_name(i: int, ids: list[str] | None) -> str:
    return f"row {i} (id {ids[i]!r})" if ids else f"row {i}"


def take(columns: dict, rows: list[int]) -> dict:
    """The columns of ``rows`` only (per-row lists sliced; ``protocol``, one string, kept)."""
    return {k: v if k == "protocol" else [v[i] for i in rows] for k, v in columns.items()}


def call_reward(reward: Reward, prompts: list[str], completions: list[list[str]], columns: dict,
                ids: list[str] | None = None) -> list[float]:
    """``reward`` on the rows, its values checked: a list of one finite number per row inside its range.
    Each call gets its own copies of the lists, so a function that edits its inputs changes no batch."""
    n = len(prompts)
    copies = take(columns, list(range(n)))
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
    return check_values(reward, values, n, ids)


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


def short(value, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


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


# -- Rows of a rollout -----------------------------------------------------------------------------------
def columns_of(problems: list, agent_answers: list[list[str | None]], protocol: str) -> dict:
    """The reward's keyword arguments for rows of ``problems``: ``answer`` (a Problem's gold text, or the raw
    value a data file holds), every other column the rows carry (None where a row lacks it), the agents'
    extracted answers and the protocol."""
    rows = [{"answer": p.answer, **getattr(p, "columns", {})} for p in problems]
    names = list(dict.fromkeys(k for row in rows for k in row))
    columns = {name: [row.get(name) for row in rows] for name in names}
    return {**columns, "agent_answers": [list(a) for a in agent_answers], "protocol": protocol}


def score_problems(reward: Reward, problems: list, completions: list[list[str]],
                   agent_answers: list[list[str | None]], protocol: str, check_determinism: bool = False
                   ) -> list[float]:
    """The team reward of joint trajectories ``completions[i]`` (one text per agent) on ``problems[i]``:
    the one path every reward takes, the built-in one included. ``check_determinism``: through ``probe``."""
    call = probe if check_determinism else call_reward
    return call(reward, [p.problem for p in problems], completions, columns_of(problems, agent_answers, protocol),
                [p.id for p in problems])


def counterfactual_baselines(reward: Reward, problems: list, completions: list[list[str]],
                             agent_answers: list[list[str | None]], protocol: str, group_ids: torch.Tensor
                             ) -> torch.Tensor:
    """b_k(tau) [n_agents, N]: the team reward of tau with agent k's response (text and answer) swapped for each
    of its other responses in the group, averaged (rollout.counterfactual_baselines for any reward). The swapped
    rows are scored in one call, each distinct row once (the reward is deterministic in its row)."""
    n_agents = len(completions[0])
    keys: dict[tuple, int] = {}
    rows: list[tuple] = []  # (row of the problem, texts, answers)
    plan: list[tuple[int, int, list[int]]] = []  # (k, t, indices of its swapped rows in ``rows``)
    for g in torch.unique(group_ids).tolist():
        idx = (group_ids == g).nonzero().flatten().tolist()
        if len(idx) < 2:  # no other response to swap in: b_k stays 0
            continue
        for k in range(n_agents):
            for t in idx:
                swaps = []
                for u in idx:
                    if u == t:
                        continue
                    row = (t, tuple(completions[t][:k]) + (completions[u][k],) + tuple(completions[t][k + 1:]),
                           tuple(agent_answers[t][:k]) + (agent_answers[u][k],) + tuple(agent_answers[t][k + 1:]))
                    key = (g,) + row[1:]
                    swaps.append(keys.setdefault(key, len(rows)))
                    if swaps[-1] == len(rows):
                        rows.append(row)
                plan.append((k, t, swaps))
    values = score_problems(reward, [problems[t] for t, _, _ in rows], [list(r[1]) for r in rows],
                            [list(r[2]) for r in rows], protocol) if rows else []
    out = torch.zeros(n_agents, len(problems))  # [n_agents, N]
    for k, t, swaps in plan:
        out[k, t] = sum(values[s] for s in swaps) / len(swaps)
    return out
