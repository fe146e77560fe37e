"""Tasks and answer grading: where problems come from and how answers are scored.

Three things live here, each as small pure functions:

1. Problems. A `Problem` is (id, problem text, gold answer). They come from
   - a synthetic addition task ("23+15" -> "38") used by the CPU default run and
     the tests (`arithmetic_problems`, plus `noisy_label` for the supervised warm
     start that stands in for pretraining),
   - JSONL files (`load_jsonl`), e.g. the offline copies in ../shared/data/,
   - public Hugging Face datasets by short name (`load_dataset_by_name`).
   `load_problems(spec)` picks between a file and a name.

2. Grading. `extract_answer` pulls the final answer out of a model response,
   `answers_match` decides whether it equals the gold answer, `grade` does both.
   The team reward of SAT is 1 exactly when the team answer matches, so a false
   positive here teaches the model to be wrong; the matcher is built to prefer
   a false negative when unsure (see `answers_match`).

3. `majority_vote`: the team answer of the "independent" protocol.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import threading
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from pathlib import Path


@dataclass(frozen=True)
class Problem:
    id: str
    problem: str
    answer: str


# ---------------------------------------------------------------------------
# Synthetic addition task
# ---------------------------------------------------------------------------

# difficulty -> ((a_min, a_max), (b_min, b_max)), inclusive. Difficulty 1 is the
# range measured to be learnable by a tiny model with sparse reward (SAT.md §9):
# 400 pairs, answers 20..68. Each level is its own pair space (difficulty 2's
# contains difficulty 1's; the held-out side of a shared pair is the same).
DIFFICULTY_RANGES = {
    1: ((10, 49), (10, 19)),     # two-digit + small two-digit
    2: ((10, 99), (10, 99)),     # two-digit + two-digit
    3: ((100, 999), (10, 99)),   # three-digit + two-digit
}
# (Pair spaces are enumerated, so they are kept small: difficulty 3 has 81,000.)
HELDOUT_PERCENT = 20  # share of each pair space kept out of training


def is_heldout_pair(a: int, b: int) -> bool:
    """Whether the pair (a, b) belongs to the held-out split.

    Decided by a hash of the pair alone (not the seed, not the difficulty), so a
    held-out pair is never a training pair, whatever the seed, and a pair that
    appears at two difficulties is on the same side at both. sha256 rather than
    hash() because Python salts str hashes per process.
    """
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
    want_heldout = split == "heldout"
    return tuple(
        (a, b)
        for a in range(a_lo, a_hi + 1)
        for b in range(b_lo, b_hi + 1)
        if is_heldout_pair(a, b) == want_heldout
    )


def arithmetic_problems(n: int, seed: int, difficulty: int = 1, split: str = "train") -> list[Problem]:
    """`n` addition problems "a+b" with answer str(a+b), deterministic in `seed`.

    Pairs are drawn without replacement from the split while n fits in it. If n
    exceeds the split size (difficulty 1 has 327 train / 73 held-out pairs),
    the split is reshuffled and drawn again, so pairs repeat; repeats get ids
    with a "-r1", "-r2", ... suffix so that ids stay unique.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    pairs = _split_pairs(difficulty, split)
    rng = random.Random(seed)
    problems: list[Problem] = []
    rep = 0
    while len(problems) < n:
        take = rng.sample(pairs, min(len(pairs), n - len(problems)))
        suffix = f"-r{rep}" if rep else ""
        for a, b in take:
            problems.append(Problem(f"arith-d{difficulty}-{a}+{b}{suffix}", f"{a}+{b}", str(a + b)))
        rep += 1
    return problems


def noisy_label(answer: str, rng: random.Random, p_wrong: float = 0.5) -> str:
    """A label for the supervised warm start: right with prob 1 - p_wrong.

    Otherwise the answer is off by 1, 2 or 10 in either direction, never the
    right one and never negative. Plausible near-misses (rather than random
    numbers) give the warm-started model a spread of answers around the truth,
    which is what lets sparse exact-match reward find the right one (SAT.md §9).
    """
    value = int(answer)
    if rng.random() >= p_wrong:
        return answer
    candidates = [value + d for d in (-10, -2, -1, 1, 2, 10) if value + d >= 0]
    return str(rng.choice(candidates))


# ---------------------------------------------------------------------------
# JSONL files
# ---------------------------------------------------------------------------

_JSONL_HINT = 'each line must be one JSON object with "problem" and "answer"'


def _answer_to_str(value) -> str | None:
    """Gold answers may be stored as int, float or str; keep them as str."""
    if isinstance(value, bool):  # bool is an int subclass; never a real answer
        return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str) and value.strip():
        return value.strip()
    return None


def _chat_to_text(prompt) -> str | None:
    """Problem text from either a plain string or a chat list [{"role", "content"}]."""
    if isinstance(prompt, str):
        return prompt.strip() or None
    if isinstance(prompt, list):
        # The last user turn holds the problem; system turns are instructions.
        for message in reversed(prompt):
            if isinstance(message, dict) and message.get("role", "user") == "user":
                content = message.get("content")
                if isinstance(content, str) and content.strip():
                    return content.strip()
    return None


def load_jsonl(path) -> list[Problem]:
    """Problems from a JSONL file: one object per line with "problem" (or
    "prompt") and "answer", optionally "id" (default: "<file stem>-<line no>").

    Blank lines are skipped. Any bad line raises ValueError with a one-line
    message naming the file, the line number, what is wrong and how to fix it.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no such file; pass a JSONL file ({_JSONL_HINT}) or a dataset name "
            f"({', '.join(DATASETS)})"
        )
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
            answer = _answer_to_str(obj["answer"])
            if answer is None:
                raise ValueError(
                    f'{where}: "answer" must be a non-empty string or a number, got {obj["answer"]!r}; {_JSONL_HINT}'
                )
            pid = str(obj["id"]) if obj.get("id") is not None else f"{path.stem}-{lineno}"
            problems.append(Problem(pid, text, answer))
    return problems


# ---------------------------------------------------------------------------
# Public datasets by name
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetSpec:
    """Where a named dataset lives on the Hub and which fields hold what.

    Field names may be dotted paths into nested records ("reward_model.ground_truth").
    """
    hub_id: str
    configs: tuple  # (None,) for the default config; several are concatenated
    split: str
    problem_field: str
    answer_field: str
    id_field: str | None = None
    dedupe: bool = False  # drop repeated problem texts


# The schemas below are taken from the dataset cards. DAPO-Math-17k stores the
# problem as a chat list whose user turn wraps it in a fixed instruction, and
# the published copy repeats each problem many times (1.79M rows for ~17k
# problems), hence dedupe.
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
    key = name.strip().lower().replace("_", "-")
    key = DATASET_ALIASES.get(key, key)
    if key not in DATASETS:
        aliases = lambda k: [a for a, v in DATASET_ALIASES.items() if v == k]
        known = ", ".join(f"{k} ({'/'.join(aliases(k))})" if aliases(k) else k for k in DATASETS)
        raise ValueError(
            f"unknown dataset {name!r}; known names: {known}; or pass a JSONL file "
            f"({_JSONL_HINT}), e.g. ../shared/data/aime24.jsonl"
        )
    return key


def _get_field(row: dict, dotted: str):
    """row["a"]["b"] for "a.b"; None if any step is missing."""
    value = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


# DAPO's user turn is "Solve the following math problem step by step. ...\n\n
# <problem>\n\nRemember to put your answer on its own line after "Answer:"."
# Our agents bring their own prompt template, so keep only the problem; if the
# wrapper ever changes, these patterns simply do not match and the text is kept.
_DAPO_HEAD = re.compile(r"^Solve the following math problem[^\n]*\n\n", re.S)
_DAPO_TAIL = re.compile(r"\n\nRemember to put your answer[^\n]*$", re.S)


def strip_dapo_instruction(text: str) -> str:
    """The bare problem from a DAPO-style prompt (unchanged if not wrapped)."""
    return _DAPO_TAIL.sub("", _DAPO_HEAD.sub("", text)).strip()


def row_to_problem(row: dict, spec: DatasetSpec, fallback_id: str) -> Problem | None:
    """One dataset record -> Problem, or None if it lacks a problem or answer."""
    text = _chat_to_text(_get_field(row, spec.problem_field))
    answer = _answer_to_str(_get_field(row, spec.answer_field))
    if text is None or answer is None:
        return None
    if spec.problem_field == "prompt":
        text = strip_dapo_instruction(text)
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
    """Problems of a public dataset (see DATASETS), downloaded via `datasets`.

    Raises ValueError for an unknown name and RuntimeError (one line, saying to
    pass a JSONL file instead) when the dataset cannot be fetched, e.g. offline.
    """
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
            f"pass --data path/to.jsonl instead (e.g. the copies in ../shared/data/)"
        ) from e
    return rows_to_problems(rows, spec, key, limit)


def load_problems(spec: str) -> list[Problem]:
    """A .jsonl path (or any existing file) -> load_jsonl; otherwise a dataset name."""
    if spec.lower().endswith(".jsonl") or Path(spec).is_file():
        return load_jsonl(spec)
    return load_dataset_by_name(spec)


# ---------------------------------------------------------------------------
# Answer extraction
# ---------------------------------------------------------------------------

_BOX_COMMANDS = re.compile(r"\\(?:boxed|fbox)")
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
_ANSWER_PHRASE = re.compile(r"(?:final answer is|answer is|answer\s*:)\s*", re.I)


def _braced(text: str, start: int) -> str | None:
    """Content of the {...} group opening at text[start], braces matched; None if unclosed."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{" and (i == 0 or text[i - 1] != "\\"):
            depth += 1
        elif text[i] == "}" and text[i - 1] != "\\":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
    return None


def _last_boxed(text: str) -> str | None:
    """Content of the last complete \\boxed{...} / \\fbox{...} / "\\boxed 5"."""
    for m in reversed(list(_BOX_COMMANDS.finditer(text))):
        rest = m.end()
        if rest < len(text) and text[rest] == "{":
            content = _braced(text, rest)
        elif rest < len(text) and text[rest] == " ":
            # "\boxed 5": the argument is the next run up to space or "$".
            arg = re.match(r" +([^\s$]+)", text[rest:])
            content = arg.group(1) if arg else None
        else:
            content = None
        if content is not None and content.strip():
            return content.strip()
        # unclosed (truncated) or empty box: try the one before it
    return None


def _answer_phrase(text: str) -> str | None:
    """X from the last "final answer is X" / "answer: X", up to the end of its sentence."""
    matches = list(_ANSWER_PHRASE.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end():].split("\n", 1)[0].strip()
    if rest.startswith("$"):  # "$\frac{1}{2}$." -> the math between the dollars
        inner = re.match(r"\$+([^$]+)\$+", rest)
        if inner:
            return inner.group(1).strip() or None
    rest = re.split(r"\.\s", rest, maxsplit=1)[0]  # stop at the end of the sentence
    rest = rest.strip().rstrip(".").strip()
    return rest or None


def _extract(text: str) -> str | None:
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    phrase = _answer_phrase(text)
    if phrase is not None:
        return phrase
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def extract_answer(text: str) -> str | None:
    """The final answer in a model response, or None.

    Order: the last complete \\boxed{...} (or \\fbox{...}, or "\\boxed 5"), with
    nested braces matched; else the last "final answer is X" / "answer: X";
    else the last number (int, decimal, a/b, negative). For thinking models,
    only the text after the last "</think>" is used when it yields an answer,
    so a number mentioned mid-thought does not count as the answer.
    """
    if not text:
        return None
    if "</think>" in text:
        after = _extract(text.rsplit("</think>", 1)[1])
        if after is not None:
            return after
    return _extract(text)


# ---------------------------------------------------------------------------
# Normalisation and equivalence
# ---------------------------------------------------------------------------

# Formatting that never changes the value of an answer.
_DELETE = [r"\left", r"\right", r"\!", r"\,", r"\;", r"\:", r"\displaystyle", "\\ ", "~"]
_UNIT_WORDS = (
    "cm|mm|km|m|meters?|metres?|centimeters?|inches|inch|in|feet|foot|ft|yards?|miles?|"
    "units?|square|sq|cubic|degrees?|deg|radians?|rad|seconds?|sec|s|minutes?|min|hours?|hrs?|"
    "days?|weeks?|years?|dollars?|cents?|grams?|g|kg|pounds?|lbs?|liters?|litres?|ml|l|"
    "mph|percent|points?|ways|people|students"
)
_NUMERAL = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?"
_NUMBER_WITH_UNIT = re.compile(rf"^({_NUMERAL})\s*(?:(?:{_UNIT_WORDS})\b\.?(?:\^\{{?[23]\}}?)?\s*)+$", re.I)


def _unwrap_command(s: str, command: str) -> str:
    r"""Replace every \command{X} by X (brace-matched, so X may contain braces)."""
    while True:
        i = s.find(command + "{")
        if i < 0:
            return s
        start = i + len(command)
        inner = _braced(s, start)
        if inner is None:
            return s
        s = s[:i] + inner + s[start + len(inner) + 2:]


def _fracs_to_slash(s: str) -> str:
    r"""\frac{a}{b} -> (a)/(b), \frac34 -> 3/4; plain numbers keep no brackets."""
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    while True:
        i = s.find("\\frac{")
        if i < 0:
            return s
        num = _braced(s, i + 5)
        if num is None:
            return s
        j = i + 5 + len(num) + 2
        if j >= len(s) or s[j] != "{":
            return s
        den = _braced(s, j)
        if den is None:
            return s
        wrap = lambda x: x if re.fullmatch(r"-?\d+(?:\.\d+)?", x) else f"({x})"
        s = s[:i] + f"{wrap(num)}/{wrap(den)}" + s[j + len(den) + 2:]


def to_fraction(s: str) -> Fraction | None:
    """Exact value of a normalised plain number ("33", "-0.5", "3/4"), else None."""
    if not re.fullmatch(_NUMERAL, s):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _clean(s: str) -> str:
    """Strip formatting, wrappers and units, leaving the bare answer."""
    s = s.strip()
    # Math-mode delimiters around the whole answer.
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(left) and s.endswith(right) and len(s) >= len(left) + len(right):
            s = s[len(left):len(s) - len(right)].strip()
    for cmd in ("\\boxed", "\\fbox", "\\text", "\\textbf", "\\mathrm", "\\mathbf", "\\mbox"):
        s = _unwrap_command(s, cmd)
    for token in _DELETE:
        s = s.replace(token, "")
    s = s.replace("{,}", "")  # LaTeX thousands separator 1{,}000
    # Degrees, percent and currency carry no value of their own in these benchmarks.
    s = re.sub(r"\^\s*\{?\\circ\}?", "", s)
    s = s.replace("\\circ", "").replace("°", "")
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "").replace("$", "")
    s = s.strip().rstrip(".").strip()
    # "x = 5" -> "5": a bare variable name on the left is not part of the value.
    m = re.fullmatch(r"[A-Za-z](?:_\{?\w+\}?)?\s*=\s*(.+)", s)
    if m:
        s = m.group(1).strip()
    m = _NUMBER_WITH_UNIT.match(s)
    if m:
        s = m.group(1)
    # Thousands separators, only in a well-formed grouping so "1,2" (a tuple) stays.
    if re.fullmatch(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    s = _fracs_to_slash(s)
    return re.sub(r"\s+", "", s)


def normalize_answer(s: str | None) -> str:
    """A canonical string for an answer; equal strings mean equal answers.

    Formatting is stripped (see _clean). Plain numbers are rewritten exactly:
    "033" -> "33", "0.50" and "\\frac{1}{2}" -> "1/2", "1,000" -> "1000", "-4/2"
    -> "-2". Anything else (expressions, tuples, text) is returned cleaned but
    otherwise as written. None -> "".
    """
    if s is None:
        return ""
    s = _clean(str(s))
    value = to_fraction(s)
    if value is not None:
        return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
    return s


def _builtin_match(pred: str, gold: str) -> bool:
    a, b = normalize_answer(pred), normalize_answer(gold)
    return bool(a) and a == b


@lru_cache(maxsize=1)
def _load_math_verify():
    """The math_verify module, or None if not installed. Imported on first use:
    it pulls in sympy (~0.5 s), which the integer-only synthetic task never needs."""
    try:
        import math_verify
    except ImportError:  # pragma: no cover - depends on the environment
        return None
    return math_verify


def math_verify_available() -> bool:
    return _load_math_verify() is not None


def _math_verify_match(pred: str, gold: str, timeout_s: int = 3) -> bool:
    """math-verify's verdict on pred vs gold; False if it cannot parse either.

    math-verify bounds its sympy work with signal.alarm, which only works in the
    main thread; elsewhere we run it without its timeout (answers are short, so
    the risk is small) rather than let it raise.
    """
    mv = _load_math_verify()
    if mv is None:
        raise RuntimeError("math_verify is not installed; pip install math-verify, or use backend='builtin'")
    timeout = timeout_s if threading.current_thread() is threading.main_thread() else None
    wrap = lambda s: f"${s.strip()}$"  # math-verify looks for LaTeX inside math delimiters
    try:
        gold_parsed = mv.parse(wrap(gold), parsing_timeout=timeout)
        pred_parsed = mv.parse(wrap(pred), parsing_timeout=timeout)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(mv.verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except Exception:  # a parser or sympy failure is "no match", never a crash in the reward
        return False


def answers_match(pred: str | None, gold: str, backend: str = "auto") -> bool:
    """Whether the extracted answer `pred` equals the gold answer.

    backend="builtin": normalize_answer on both sides, compare strings (so
      numbers compare exactly as rationals).
    backend="math_verify": math-verify's parse + verify (symbolic equivalence).
    backend="auto" (default): the built-in check first; if it matches, done
      (it only accepts identical canonical forms, so it adds no false
      positives, and it is fast and needs no sympy). If both sides are plain
      numbers that differ, the answer is no: exact comparison is definitive
      there, and math-verify's rounding would accept e.g. 0.333333 for 1/3 or
      0.5 for 50%. Otherwise (expressions, tuples, intervals) math-verify
      decides when installed, else no match. False positives would pay reward
      for wrong answers, so every doubt resolves to False.
    """
    if pred is None or not str(pred).strip():
        return False
    pred, gold = str(pred), str(gold)
    if backend == "builtin":
        return _builtin_match(pred, gold)
    if backend == "math_verify":
        return _math_verify_match(pred, gold)
    if backend != "auto":
        raise ValueError(f"backend must be 'auto', 'builtin' or 'math_verify', got {backend!r}")
    a, b = normalize_answer(pred), normalize_answer(gold)
    if a and a == b:
        return True
    if to_fraction(a) is not None and to_fraction(b) is not None:
        return False
    return math_verify_available() and _math_verify_match(pred, gold)


def grade(text: str, gold: str, backend: str = "auto") -> tuple[str | None, bool]:
    """(extracted answer, whether it is correct) for a model response."""
    pred = extract_answer(text)
    return pred, answers_match(pred, gold, backend)


def majority_vote(answers: list[str | None]) -> str | None:
    """The most common answer among the agents', compared after normalisation.

    None and empty answers abstain; if all abstain the result is None. A tie is
    won by the answer given first (lowest agent index), so the result never
    depends on dict or set order. Returns the answer as first written, so the
    caller can grade it like any agent's answer.
    """
    counts: dict[str, int] = {}
    first: dict[str, str] = {}  # key -> first original string; insertion order = first index
    for ans in answers:
        if ans is None or not str(ans).strip():
            continue
        key = normalize_answer(ans)
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, ans)
    if not counts:
        return None
    best = max(counts.values())
    for key, ans in first.items():  # earliest first, so the first maximal key wins ties
        if counts[key] == best:
            return ans
    return None  # unreachable
