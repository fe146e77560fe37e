"""The paper's logic and planning domains, offline: ``--task reasoning-gym:NAME`` (PyPI ``reasoning-gym``).

The paper trains and evaluates on ZebraLogic, AutoLogi, ARBench and PlanBench, none of which can be downloaded
here; reasoning-gym generates comparable problems procedurally, each dataset with its own verifier
(``score_answer``, partial credit included): ``zebra_puzzles`` for ZebraLogic, ``knights_knaves`` or
``propositional_logic`` for general logic, ``tower_of_hanoi`` or ``sokoban`` for planning. ``--task-option
key=value`` sets the dataset's config (puzzle size, number of disks).

A question's split is a hash of its text alone, as tasks.is_heldout_pair does for the synthetic task: a held-out
question is never a training question, whatever the seeds, sizes or options. Agents are asked to answer inside
<answer>...</answer> (reasoning-gym's own convention, asked for by its default system prompt); a response without
the tags is scored as written (``response_answer``): SmolLM2-135M almost never writes them, and a reward that is 0
on every response at the start teaches nothing. A scorer that reads anything it can from a text is then open to
prose: sokoban's plays every character of the answer as a key and ignores the rest, so untagged prose solved 46% of
one-box 4x4-5x5 puzzles at the start (docs/results.md); use the tasks whose scorers parse a strict format.
"""
from __future__ import annotations

import ast
import difflib
import hashlib
import importlib.util

from harness.config import REASONING_GYM_PREFIX as PREFIX
from harness.math_grading import vote_score
from harness.roles import Role, Roles
from harness.user_reward import CheckedReward
from reward import Reward
from team import Problem

HELDOUT_PERCENT = 20  # share of the question space held out
DRAW_FACTOR = {"train": 2, "heldout": 8}  # questions generated per problem wanted: ~1/(1 - 0.2), ~1/0.2, with slack
MAX_ROUNDS = 8  # generations before a small question space is taken as exhausted


def task_name(task: str | None) -> str | None:
    """NAME of a "reasoning-gym:NAME" task, None for any other task."""
    if not task or not task.startswith(PREFIX):
        return None
    return task[len(PREFIX):]


def check_installed() -> None:
    """One line naming the install when reasoning-gym is missing."""
    if importlib.util.find_spec("reasoning_gym") is None:
        raise RuntimeError("--task reasoning-gym:NAME needs the package reasoning-gym: pip install reasoning-gym")


def parse_options(options: list[str]) -> dict:
    """--task-option key=value pairs as a config dict; values as Python literals (3, 0.5, True, "x"), else text."""
    out = {}
    for item in options:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--task-option {item!r}: write key=value, e.g. --task-option max_disks=3")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def make_dataset(name: str, options: dict, size: int, seed: int):
    """reasoning-gym's dataset NAME with ``options``; an unknown name or option is one line."""
    check_installed()
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        near = difflib.get_close_matches(name, DATASETS, n=3) or sorted(DATASETS)[:5]
        raise ValueError(f"--task reasoning-gym:{name}: no such reasoning-gym dataset; did you mean "
                         f"{' or '.join(near)}? (reasoning_gym.factory.DATASETS lists all {len(DATASETS)})")
    try:
        return reasoning_gym.create_dataset(name, **options, size=size, seed=seed)
    except (TypeError, AssertionError, ValueError) as e:
        config = DATASETS[name][1].__name__
        raise ValueError(f"--task-option {options}: not a valid {config} for reasoning-gym:{name} "
                         f"({type(e).__name__}: {e}); see reasoning_gym's {config}") from e


def is_heldout_question(question: str) -> bool:
    """Whether a question is held out: a sha256 of its text alone (not the seed, the size or the options)."""
    digest = hashlib.sha256(f"reasoning-gym {question}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT


def entry_problem(name: str, entry: dict) -> Problem:
    """One reasoning-gym entry as a problem: its question, its answer (text; the scorer reads the raw value
    and the metadata from the columns), an id from the question's hash (the same question, the same id)."""
    question, answer = entry["question"], entry["answer"]
    pid = f"rg-{name}-{hashlib.sha256(question.encode()).hexdigest()[:12]}"
    text = "" if answer is None else str(answer)
    return Problem(pid, question, text, None, {"answer": answer, "metadata": entry["metadata"]})


def draw(name: str, options: dict, size: int, seed: int) -> list[dict]:
    """``size`` entries of the dataset; a generator that fails on these options is one line."""
    dataset = make_dataset(name, options, size, seed)
    try:
        return list(dataset)
    except Exception as e:  # reasoning-gym's generators raise anything on options they cannot meet
        raise ValueError(f"reasoning-gym:{name} cannot generate problems with {options or 'its default config'} "
                         f"({type(e).__name__}: {e}); change --task-option") from e


def reasoning_gym_problems(name: str, options: dict, n: int, seed: int, split: str = "train") -> list[Problem]:
    """``n`` distinct questions of ``split`` (``is_heldout_question``), deterministic in ``seed``: drawn from
    reasoning-gym under seeds derived from ``seed``, round after round, until ``n`` are found or a round finds
    no new one (a small question space); fewer than ``n`` then, and none is a one-line error."""
    if split not in DRAW_FACTOR:
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    problems: dict[str, Problem] = {}
    for round_ in range(MAX_ROUNDS):
        before = len(problems)
        round_seed = int.from_bytes(hashlib.sha256(f"{seed}:{split}:{round_}".encode()).digest()[:4], "big")
        for entry in draw(name, options, max(8, DRAW_FACTOR[split] * (n - len(problems))), round_seed):
            if is_heldout_question(entry["question"]) == (split == "heldout") and len(problems) < n:
                problems.setdefault(entry["question"], entry_problem(name, entry))
        if len(problems) >= n or len(problems) == before:
            break
    if not problems:
        raise ValueError(f"reasoning-gym:{name} with {options or 'its default config'} gave no {split} questions; "
                         "choose options with more distinct puzzles")
    return list(problems.values())


def task_roles(n_agents: int, protocol: str, prompt: str = "default") -> Roles:
    """reasoning-gym's system prompt ``prompt`` (a key of its SYSTEM_PROMPTS: "default" thinks, then gives the
    answer in <answer> tags; "direct" gives the tagged answer alone) for every agent, the question as the user
    turn; in the chain protocol agents 2..n also read the earlier agents' answers."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if prompt not in SYSTEM_PROMPTS:
        raise ValueError(f"--task-prompt {prompt!r}: not one of reasoning-gym's system prompts "
                         f"({', '.join(SYSTEM_PROMPTS)})")
    system = SYSTEM_PROMPTS[prompt]
    if protocol != "chain" or n_agents == 1:
        return Roles((Role(system, "{problem}"),))
    later = Role(system, "{problem}\n\nThe earlier agents answered:\n{previous}")
    return Roles((Role(system, "{problem}"),) + (later,) * (n_agents - 1))


def tagged_answer(text: str) -> str | None:
    """The content of the last complete <answer>...</answer> in a response, stripped; None without one."""
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, end) if end >= 0 else -1
    if start < 0:
        return None
    return text[start + len("<answer>"):end].strip() or None


def response_answer(text: str) -> str | None:
    """What the scorer judges: the tagged answer if the response has one, else the whole response (None if empty)."""
    tagged = tagged_answer(text)
    return tagged if tagged is not None else (text.strip() or None)


def same_text(answer: str) -> str:
    """An answer with its whitespace collapsed: answers that differ in spacing alone vote together."""
    return " ".join(answer.split())


class ReasoningGymReward:
    """The team reward of a reasoning-gym task: the dataset's own ``score_answer`` (partial credit included) of
    the team's answer, each agent's answer read by ``response_answer``. Independent protocol: the expected score
    of the majority answer under a uniform tie-break (``harness.math_grading.vote_score``); chain: the last agent's."""

    reward_range = (0.0, 1.0)

    def __init__(self, name: str, options: dict):
        self.__name__ = f"reasoning-gym:{name}"
        self.dataset = make_dataset(name, options, size=1, seed=0)  # its score_answer reads the entry alone

    def __call__(self, prompts: list[str], completions: list[list[str]], *, answer: list, metadata: list[dict],
                 protocol: str, **columns) -> list[float]:
        out = []
        for question, texts, gold, meta in zip(prompts, completions, answer, metadata):
            entry = {"question": question, "answer": gold, "metadata": meta}
            answers = [response_answer(t) for t in texts]
            score = lambda a: float(self.dataset.score_answer(a, entry))  # noqa: E731  (one entry's scorer)
            out.append(score(answers[-1]) if protocol == "chain" else vote_score(answers, score, same_text))
        return out


def task_reward(task: str, options: list[str]) -> Reward:
    """The team reward of a ``reasoning-gym:NAME`` task with its --task-option list: its own scorer and range."""
    fn = ReasoningGymReward(task_name(task), parse_options(options))
    return CheckedReward(fn, task, fn.reward_range)
