"""Tasks: where a run's problems (id, text, gold answer) come from.

Paper, Section 6: training on DAPO-Math-17k / DeepScaleR, evaluation on AIME24/25 and MATH-500. Sources: a
synthetic addition task (the CPU default run and the tests), JSONL files (offline copies in ``data/``) and
Hugging Face datasets by short name. ``load_task(cfg)`` gives a run its training and held-out problems.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from harness import reasoning_gym_task as rg
from harness.datafiles import answer_text, load_problems
from harness.environments import BUILTIN_PREFIX, game_options, game_problems
from team import Problem

# -- Synthetic addition task -----------------------------------------------------------------------------
# difficulty -> ((a_min, a_max), (b_min, b_max)), inclusive. Difficulty 1 (400 pairs, answers 20..68) is
# learnable by a tiny model with sparse reward on 2 CPU cores.
DIFFICULTY_RANGES = {
    1: ((10, 49), (10, 19)),     # two-digit + small two-digit
    2: ((10, 99), (10, 99)),     # two-digit + two-digit
    3: ((100, 999), (10, 99)),   # three-digit + two-digit
}
HELDOUT_PERCENT = 20  # share of each pair space kept out of training


def is_heldout_pair(a: int, b: int) -> bool:
    """Whether (a, b) is held out: a sha256 of the pair alone (not the seed, not the difficulty), so a
    held-out pair is never a training pair whatever the seed or difficulty."""
    digest = hashlib.sha256(f"{a}+{b}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT


@lru_cache(maxsize=None)
def _split_pairs(difficulty: int, split: str) -> tuple[tuple[int, int], ...]:
    """All (a, b) pairs of one difficulty that fall in `split`, in a fixed order."""
    if difficulty not in DIFFICULTY_RANGES:
        raise ValueError(f"difficulty must be one of {sorted(DIFFICULTY_RANGES)}, got {difficulty}")
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    (a_lo, a_hi), (b_lo, b_hi) = DIFFICULTY_RANGES[difficulty]
    return tuple((a, b) for a in range(a_lo, a_hi + 1) for b in range(b_lo, b_hi + 1)
                 if is_heldout_pair(a, b) == (split == "heldout"))


def arithmetic_problems(n: int, seed: int, difficulty: int = 1, split: str = "train") -> list[Problem]:
    """``n`` addition problems "a+b" -> str(a+b), deterministic in ``seed``: drawn without replacement
    from the split, then again from a reshuffle (difficulty 1 has 327 train / 73 held-out pairs), repeats
    with ids suffixed "-r1", "-r2", ... so that ids stay unique."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    pairs = _split_pairs(difficulty, split)
    rng = random.Random(seed)
    problems: list[Problem] = []
    rep = 0
    while len(problems) < n:
        suffix = f"-r{rep}" if rep else ""
        for a, b in rng.sample(pairs, min(len(pairs), n - len(problems))):
            problems.append(Problem(f"arith-d{difficulty}-{a}+{b}{suffix}", f"{a}+{b}", str(a + b)))
        rep += 1
    return problems


# -- Arithmetic as a chat problem (small real instruct models) ------------------------------------------
# kind -> (operator, (a_min, a_max), (b_min, b_max)), inclusive; "-" keeps a - b >= 0. "sub1" is the
# inverse of "add1" (a = b + c, b, c in 1..9), so the two are one fact family.
CHAT_KINDS = {
    "add1": ("+", (1, 9), (1, 9)),      # one-digit addition, 81 facts
    "sub1": ("-", (2, 18), (1, 9)),     # a - b with a one-digit result 1..9, 81 facts
    "mul1": ("*", (2, 9), (2, 9)),      # the times table, 64 facts
    "add21": ("+", (10, 99), (1, 9)),   # two-digit + one-digit, 810 facts
    "add2": ("+", (10, 99), (10, 99)),  # two-digit + two-digit
    "sub2": ("-", (10, 99), (10, 99)),  # two-digit - two-digit
}
# arithmetic-chat's problems, one kind in turn: the kinds on which SmolLM2-135M-Instruct, sampled, earns some reward
# (bench/smollm2_task.py at T 0.5, 32 train problems each: mul1 0.38; add1 0.03, 0.31 counting a bare "7 + 3 = 10";
# sub1 and add21 0.00). Held out, 64 each: 0.23 for the mix at T 0.4 (add1 0.05, mul1 0.42).
CHAT_MIX = ("add1", "mul1")
# Appended to each problem by load_task: a short answer, boxed (16-18 tokens a response at T 0.5, against 27-30 for
# "Put the answer in \boxed{}.", which is no more accurate).
CHAT_INSTRUCTION = "\nGive the answer in the form \\boxed{answer}."


def is_heldout_fact(a: int, op: str, b: int) -> bool:
    """Whether the fact "a op b" is held out: a sha256 of the fact alone (not the seed or the kind), with
    + and * facts in one order (3*4 and 4*3 are one fact, on one side of the split)."""
    if op in "+*":
        a, b = min(a, b), max(a, b)
    digest = hashlib.sha256(f"chat {a}{op}{b}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT


@lru_cache(maxsize=None)
def _chat_facts(kind: str, split: str) -> tuple[tuple[int, str, int], ...]:
    """All facts (a, op, b) of one kind that fall in ``split``, in a fixed order."""
    if kind not in CHAT_KINDS:
        raise ValueError(f"kind must be one of {', '.join(CHAT_KINDS)}, got {kind!r}")
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    op, (a_lo, a_hi), (b_lo, b_hi) = CHAT_KINDS[kind]
    facts = []
    for a in range(a_lo, a_hi + 1):
        for b in range(b_lo, b_hi + 1):
            if op == "-" and not (a >= b and (kind != "sub1" or 1 <= a - b <= 9)):
                continue
            if is_heldout_fact(a, op, b) == (split == "heldout"):
                facts.append((a, op, b))
    return tuple(facts)


def chat_arithmetic_problems(n: int, seed: int, split: str = "train", kinds=CHAT_MIX) -> list[Problem]:
    """``n`` problems "a op b = ?" -> str(value), the kinds in turn, deterministic in ``seed``: each kind's
    facts drawn without replacement from the split, then from a reshuffle, repeats with ids suffixed
    "-r1", "-r2", ... so that ids stay unique. The instruction (CHAT_INSTRUCTION) is added by load_task."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not kinds:
        raise ValueError("kinds must name at least one of " + ", ".join(CHAT_KINDS))
    rng = random.Random(seed)
    pools = {kind: [] for kind in kinds}
    rounds = dict.fromkeys(kinds, -1)
    problems: list[Problem] = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        if not pools[kind]:
            pools[kind] = rng.sample(_chat_facts(kind, split), len(_chat_facts(kind, split)))[::-1]
            rounds[kind] += 1
        a, op, b = pools[kind].pop()
        value = a + b if op == "+" else a - b if op == "-" else a * b
        suffix = f"-r{rounds[kind]}" if rounds[kind] else ""
        problems.append(Problem(f"chat-{kind}-{a}{op}{b}{suffix}", f"{a} {op} {b} = ?", str(value)))
    return problems


def noisy_label(answer: str, rng: random.Random, p_wrong: float = 0.5, others: list[str] = ()) -> str:
    """A warm-start label (it stands in for pretraining tiny agents): right with prob 1 - p_wrong, else off
    by 1, 2 or 10 (never negative), a spread of answers around the truth for sparse reward to sharpen. An answer
    that is not a whole number is replaced by one of ``others`` (other problems' answers: the task's format)."""
    if rng.random() >= p_wrong:
        return answer
    if not answer.isdigit():
        return rng.choice(list(others) or [answer])
    value = int(answer)
    candidates = [value + d for d in (-10, -2, -1, 1, 2, 10) if value + d >= 0]
    return str(rng.choice(candidates))


# -- JSONL files -----------------------------------------------------------------------------------------
_JSONL_HINT = 'each line must be one JSON object with "problem" and "answer"'


def _chat_to_text(prompt) -> str | None:
    """Problem text from either a plain string or a chat list [{"role", "content"}]."""
    if isinstance(prompt, str):
        return prompt.strip() or None
    if isinstance(prompt, list):  # the last user turn holds the problem; system turns are instructions
        for message in reversed(prompt):
            if isinstance(message, dict) and message.get("role", "user") == "user":
                content = message.get("content")
                if isinstance(content, str) and content.strip():
                    return content.strip()
    return None


def load_jsonl(path) -> list[Problem]:
    """Problems from a JSONL file: one object per line with "problem" (or "prompt") and "answer",
    optionally "id" (default "<file stem>-<line no>"). A bad line raises ValueError in one line naming the
    file, the line, what is wrong and how to fix it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; pass a JSONL file ({_JSONL_HINT}) or a dataset name "
                                f"({', '.join(DATASETS)})")
    problems = []
    with open(path, encoding="utf-8-sig") as f:  # -sig: tolerate a BOM
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e}); {_JSONL_HINT}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}; {_JSONL_HINT}")
            raw_problem = obj.get("problem", obj.get("prompt"))
            if raw_problem is None:
                raise ValueError(f'{where}: missing "problem" (or "prompt"); {_JSONL_HINT}')
            text = _chat_to_text(raw_problem)
            if text is None:
                raise ValueError(f'{where}: "problem" is empty or not text; {_JSONL_HINT}')
            if "answer" not in obj:
                raise ValueError(f'{where}: missing "answer"; {_JSONL_HINT}')
            answer = answer_text(obj["answer"])
            if answer is None:
                raise ValueError(f'{where}: "answer" must be a non-empty string, a number, a list or an object, '
                                 f'got {obj["answer"]!r}; {_JSONL_HINT}')
            pid = str(obj["id"]) if obj.get("id") is not None else f"{path.stem}-{lineno}"
            problems.append(Problem(pid, text, answer))
    return problems


# -- Public datasets by name -----------------------------------------------------------------------------
@dataclass(frozen=True)
class DatasetSpec:
    """Where a named dataset lives on the Hub and which (dotted: "reward_model.ground_truth") fields hold what."""
    hub_id: str
    configs: tuple  # (None,) for the default config; several are concatenated
    split: str
    problem_field: str
    answer_field: str
    id_field: str | None = None
    dedupe: bool = False  # drop repeated problem texts


# From the dataset cards. DAPO-Math-17k stores a chat list whose user turn wraps the problem in an
# instruction, and repeats each problem many times (1.79M rows for ~17k problems): dedupe.
DATASETS: dict[str, DatasetSpec] = {
    "dapo-math-17k": DatasetSpec("BytedTsinghua-SIA/DAPO-Math-17k", (None,), "train",
                                 "prompt", "reward_model.ground_truth", "extra_info.index", dedupe=True),
    "aime24": DatasetSpec("HuggingFaceH4/aime_2024", (None,), "train", "problem", "answer", "id"),
    "aime25": DatasetSpec("opencompass/AIME2025", ("AIME2025-I", "AIME2025-II"), "test", "question", "answer"),
    "math500": DatasetSpec("HuggingFaceH4/MATH-500", (None,), "test", "problem", "answer", "unique_id"),
    "deepscaler": DatasetSpec("agentica-org/DeepScaleR-Preview-Dataset", (None,), "train", "problem", "answer"),
}
DATASET_ALIASES = {
    "dapo": "dapo-math-17k", "dapo-math": "dapo-math-17k", "dapo-17k": "dapo-math-17k",
    "aime2024": "aime24", "aime-24": "aime24", "aime-2024": "aime24",
    "aime2025": "aime25", "aime-25": "aime25", "aime-2025": "aime25",
    "math-500": "math500",
    "deepscaler-preview": "deepscaler", "deepscaler-preview-dataset": "deepscaler",
}


def canonical_dataset_name(name: str) -> str:
    """The DATASETS key for a user-given name (case-insensitive, '_' == '-')."""
    key = dataset_key(name)
    if key not in DATASETS:
        aliases = {k: [a for a, v in DATASET_ALIASES.items() if v == k] for k in DATASETS}
        known = ", ".join(f"{k} ({'/'.join(aliases[k])})" if aliases[k] else k for k in DATASETS)
        raise ValueError(f"unknown dataset {name!r}; known names: {known}; or pass a JSONL file "
                         f"({_JSONL_HINT}), e.g. data/aime24.jsonl")
    return key


def _get_field(row: dict, dotted: str):
    """row["a"]["b"] for "a.b"; None if any step is missing."""
    value = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


# DAPO's user turn: "Solve the following math problem step by step. ...\n\n<problem>\n\nRemember to put
# your answer on its own line after "Answer:"." Our agents bring their own template: keep the problem.
_DAPO_HEAD = re.compile(r"^Solve the following math problem[^\n]*\n\n", re.S)
_DAPO_TAIL = re.compile(r"\n\nRemember to put your answer[^\n]*$", re.S)


def row_to_problem(row: dict, spec: DatasetSpec, fallback_id: str) -> Problem | None:
    """One dataset record -> Problem, or None if it lacks a problem or answer."""
    text = _chat_to_text(_get_field(row, spec.problem_field))
    answer = answer_text(_get_field(row, spec.answer_field))
    if text is None or answer is None:
        return None
    if spec.problem_field == "prompt":  # a DAPO-style prompt: the bare problem
        text = _DAPO_TAIL.sub("", _DAPO_HEAD.sub("", text)).strip()
    raw_id = _get_field(row, spec.id_field) if spec.id_field else None
    pid = str(raw_id) if raw_id is not None else fallback_id
    return Problem(pid, text, answer)


def rows_to_problems(rows, spec: DatasetSpec, prefix: str, limit: int | None = None) -> list[Problem]:
    """Convert records, skipping unusable ones and (if spec.dedupe) repeats."""
    problems, seen = [], set()
    for i, row in enumerate(rows):
        if limit is not None and len(problems) >= limit:
            break
        p = row_to_problem(row, spec, f"{prefix}-{i}")
        if p is None or (spec.dedupe and p.problem in seen):
            continue
        seen.add(p.problem)
        problems.append(p)
    return problems


def load_dataset_by_name(name: str, split: str | None = None, limit: int | None = None) -> list[Problem]:
    """Problems of a public dataset (DATASETS) via ``datasets``: ValueError for an unknown name,
    RuntimeError in one line (pass a JSONL file instead) when it cannot be fetched, e.g. offline."""
    key = canonical_dataset_name(name)
    spec = DATASETS[key]
    try:
        import datasets  # lazy: heavy, and not needed for the synthetic task
        rows = []
        for config in spec.configs:
            rows.extend(datasets.load_dataset(spec.hub_id, config, split=split or spec.split))
    except Exception as e:  # network, auth, cache and hub errors all look different
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        raise RuntimeError(
            f"could not fetch dataset {key!r} ({spec.hub_id}): {type(e).__name__}: {reason}; "
            f"pass --data path/to.jsonl instead (offline copies of aime24, aime25 and math500 are in data/)"
        ) from e
    return rows_to_problems(rows, spec, key, limit)


def load_problem_set(spec: str, problem_key: str | None = None, answer_key: str = "answer",
                     environment: bool = False) -> list[Problem]:
    """A data file (.jsonl/.json/.csv/.parquet) or Hub id ``org/name[:config][:split]``, its columns named by the
    keys (``harness.datafiles``; ``environment``: an environment's rows, no column required); otherwise one of the
    named math datasets (DATASETS)."""
    if is_named_dataset(spec):
        return load_dataset_by_name(spec)
    return load_problems(spec, problem_key, answer_key, environment=environment)


def dataset_key(name: str) -> str:
    """A user-given dataset name as a DATASETS key would be (case-insensitive, '_' == '-', aliases resolved)."""
    key = name.strip().lower().replace("_", "-")
    return DATASET_ALIASES.get(key, key)


def is_named_dataset(spec: str) -> bool:
    """Whether ``spec`` is one of the named math datasets (or an alias), not a file or a Hub id."""
    return dataset_key(spec) in DATASETS


# -- A run's problems ------------------------------------------------------------------------------------
BOXED_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."


SYNTHETIC_TASKS = ("arithmetic", "arithmetic-chat")
TRAIN_POOL = 4096  # training problems generated for a synthetic or reasoning-gym task


def user_instruction(text: str | None) -> str:
    """What --instruction appends to each problem of a user's data: nothing by default, "boxed" for
    BOXED_INSTRUCTION, else the text on a line of its own."""
    if not text:
        return ""
    return BOXED_INSTRUCTION if text == "boxed" else "\n" + text


def env_game(task: str | None) -> str | None:
    """NAME of an "env:NAME" task, None for any other task."""
    return task[len(BUILTIN_PREFIX):] if task and task.startswith(BUILTIN_PREFIX) else None


def load_task(cfg) -> tuple[list[Problem], list[Problem], str]:
    """(train problems, held-out problems, instruction appended to each problem) for a run's Config."""
    game = env_game(cfg.task) if not cfg.data else None
    if game:  # an environment's rows: one seed each, training and held-out seeds apart
        options = game_options(game, cfg.task_option, cfg.env_model)
        train = game_problems(game, options, TRAIN_POOL, cfg.seed, "train", cfg.max_rounds)
        heldout = game_problems(game, options, cfg.eval_size, cfg.seed, "heldout", cfg.max_rounds)
        return train, heldout, user_instruction(cfg.instruction)
    gym = rg.task_name(cfg.task) if not cfg.data else None
    synthetic = cfg.task in SYNTHETIC_TASKS and not cfg.data
    if gym:  # the instruction comes with the task's roles (reasoning_gym_task.task_roles)
        wanted = min(TRAIN_POOL, max(64, cfg.stages * cfg.batch_size // cfg.group_size))  # a generator can be slow
        train = rg.reasoning_gym_problems(gym, rg.parse_options(cfg.task_option), wanted, cfg.seed)
        instruction = user_instruction(cfg.instruction)
    elif not synthetic:
        spec = cfg.data or cfg.task
        train = load_problem_set(spec, cfg.problem_key, cfg.answer_key, cfg.environment_spec() is not None)
        instruction = BOXED_INSTRUCTION if is_named_dataset(spec) else user_instruction(cfg.instruction)
    elif cfg.task == "arithmetic":
        train = arithmetic_problems(TRAIN_POOL, seed=cfg.seed, split="train")
        instruction = ""  # tiny agents answer "23+15" with "38"
    else:  # a chat model answers "7 * 8 = ?" with "... \boxed{56}"
        train = chat_arithmetic_problems(TRAIN_POOL, seed=cfg.seed, split="train")
        instruction = CHAT_INSTRUCTION
    if cfg.eval_data:
        heldout = load_problem_set(cfg.eval_data, cfg.problem_key, cfg.answer_key, cfg.environment_spec() is not None)
    elif gym:  # questions of the held-out split, never a training one
        heldout = rg.reasoning_gym_problems(gym, rg.parse_options(cfg.task_option), cfg.eval_size, cfg.seed + 1,
                                            split="heldout")
    elif synthetic:
        make = arithmetic_problems if cfg.task == "arithmetic" else chat_arithmetic_problems
        heldout = make(cfg.eval_size, seed=cfg.seed + 1, split="heldout")
    else:  # hold out the tail of the training set
        train = train[:]
        random.Random(cfg.seed).shuffle(train)
        n_eval = min(cfg.eval_size, max(1, len(train) // 10))
        train, heldout = train[n_eval:], train[:n_eval]
    return train, heldout[: cfg.eval_size], instruction
