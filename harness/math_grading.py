"""The math task's answer grading: the answer read from a response, compared with the gold one, and voted on.

The team reward is shared by every agent's tokens, so a false positive teaches the team to be wrong: when unsure
the matcher says no. ``extract_answer`` -> ``normalize_answer`` / ``answers_match`` (exact rationals, math-verify
where installed); ``majority_vote`` / ``vote_reward`` for the independent protocol. ``team_correct`` is the
built-in team reward R(tau) built from them, and ``math_team_config`` hands a Team (``team.TeamConfig``) this
reading of answers, this vote and its reward.
"""
from __future__ import annotations

import random
import re
import threading
from fractions import Fraction
from functools import lru_cache
from typing import Callable

from harness.datafiles import answer_text
from harness.user_reward import CheckedReward
from reward import Reward
from team import TeamConfig

# -- Answer extraction -----------------------------------------------------------------------------------
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
    """Content of the last non-empty \\boxed{...} / \\fbox{...} / "\\boxed 5" (no box may be unclosed)."""
    for m in reversed(list(_BOX_COMMANDS.finditer(text))):
        if text.startswith("{", m.end()):
            content = _braced(text, m.end())
        else:  # "\boxed 5": the argument runs up to a space or "$"
            arg = re.match(r" +([^\s$]+)", text[m.end():])
            content = arg.group(1) if arg else None
        if content and content.strip():
            return content.strip()
    return None


def has_unclosed_box(text: str) -> bool:
    """Whether some \\boxed{ is never closed: the response was cut inside its answer, which is then missing
    (an earlier box may be the one it was correcting)."""
    return any(m.end() < len(text) and text[m.end()] == "{" and _braced(text, m.end()) is None
               for m in _BOX_COMMANDS.finditer(text))


def _answer_phrase(text: str) -> str | None:
    """X from the last "final answer is X" / "answer: X", up to the end of its sentence. Math between
    dollars may hold escaped dollars ("$\\$18.90$"); a plain "$18.90" is a currency sign. Any digit after
    X's sentence ("The answer is 12. Wait, actually 13.") is a self-correction: None, no guessing."""
    matches = list(_ANSWER_PHRASE.finditer(text))
    if not matches:
        return None
    line = text[matches[-1].end():]
    rest = line.split("\n", 1)[0].strip()
    inner = re.match(r"\$+((?:\\\$|[^$])+?)\$+(?!\d)", rest) if rest.startswith("$") else None
    if inner:  # "$\frac{1}{2}$." -> the math between the dollars
        answer, used = inner.group(1).strip(), inner.end()
    else:
        answer = re.split(r"\.\s", rest, maxsplit=1)[0]  # stop at the end of the sentence
        used = len(answer)
        answer = answer.strip().rstrip(".").strip()
    after = line[line.index(rest) + used:] if rest else line
    if re.search(r"\d", after):
        return None
    return answer or None


def _extract(text: str, final_only: bool) -> str | None:
    if has_unclosed_box(text):
        return None
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    phrase = _answer_phrase(text)
    if phrase is not None or final_only or _ANSWER_PHRASE.search(text):  # a self-corrected phrase: no answer
        return phrase
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def extract_answer(text: str, final_only: bool = False) -> str | None:
    """The final answer in a model response, or None (any unclosed \\boxed{): the last complete box; else the
    last answer phrase; else, unless ``final_only`` (math benchmarks), the last number (the synthetic task's
    bare answers). For thinking models the text after the last "</think>" is used when it yields an answer."""
    if not text:
        return None
    if "</think>" in text:
        after = _extract(text.rsplit("</think>", 1)[1], final_only)
        if after is not None:
            return after
    return _extract(text, final_only)


# -- Normalisation and equivalence -----------------------------------------------------------------------
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
    while (i := s.find(command + "{")) >= 0:
        start = i + len(command)
        inner = _braced(s, start)
        if inner is None:
            break
        s = s[:i] + inner + s[start + len(inner) + 2:]
    return s


def _fracs_to_slash(s: str) -> str:
    r"""\frac{a}{b} -> (a)/(b), \frac34 -> 3/4; plain numbers keep no brackets."""
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    while (i := s.find("\\frac{")) >= 0:
        num = _braced(s, i + 5)
        if num is None:
            break
        j = i + 5 + len(num) + 2  # the denominator's "{"
        den = _braced(s, j) if s.startswith("{", j) else None
        if den is None:
            break
        s = s[:i] + f"{_bracket(num)}/{_bracket(den)}" + s[j + len(den) + 2:]
    return s


def _bracket(x: str) -> str:
    """A fraction's numerator or denominator: plain numbers bare, anything else in brackets."""
    return x if re.fullmatch(r"-?\d+(?:\.\d+)?", x) else f"({x})"


@lru_cache(maxsize=1 << 16)  # pure; asked for the same few answers ~10^5 times a stage (vote rewards)
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
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(left) and s.endswith(right) and len(s) >= len(left) + len(right):
            s = s[len(left):len(s) - len(right)].strip()  # math-mode delimiters around the whole answer
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
    """A canonical string (equal strings, equal answers): formatting stripped, plain numbers rewritten
    exactly ("033" -> "33", "0.50" and "\\frac{1}{2}" -> "1/2", "-4/2" -> "-2"). None -> ""."""
    if s is None:
        return ""
    return _normalize(str(s))


@lru_cache(maxsize=1 << 16)
def _normalize(s: str) -> str:
    """normalize_answer, memoised (the counterfactual baselines ask ~10^5 times a stage)."""
    s = _clean(s)
    value = to_fraction(s)
    if value is not None:
        return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
    return s


@lru_cache(maxsize=1)
def _load_math_verify():
    """The math_verify module, or None; imported on first use (it pulls in sympy)."""
    try:
        import math_verify
    except ImportError:  # pragma: no cover - depends on the environment
        return None
    return math_verify


def math_verify_available() -> bool:
    return _load_math_verify() is not None


def _math_verify_match(pred: str, gold: str, timeout_s: int = 3) -> bool:
    """math-verify's verdict on pred vs gold; False if it cannot parse either. Its timeout uses
    signal.alarm, main thread only: elsewhere it runs without one (answers are short)."""
    mv = _load_math_verify()
    if mv is None:
        raise RuntimeError("math_verify is not installed; pip install math-verify, or use backend='builtin'")
    timeout = timeout_s if threading.current_thread() is threading.main_thread() else None
    try:  # math-verify looks for LaTeX inside math delimiters
        gold_parsed = mv.parse(f"${gold.strip()}$", parsing_timeout=timeout)
        pred_parsed = mv.parse(f"${pred.strip()}$", parsing_timeout=timeout)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(mv.verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except Exception:  # a parser or sympy failure is "no match", never a crash in the reward
        return False


def answers_match(pred: str | None, gold: str, backend: str = "auto") -> bool:
    """Whether the extracted answer ``pred`` equals the gold answer. builtin: equal ``normalize_answer``
    strings; math_verify: symbolic equivalence; auto: builtin first (no false positives, no sympy), two
    plain numbers that differ are different (math-verify's rounding would accept 0.333333 for 1/3), and
    otherwise (expressions, tuples, intervals) math-verify decides when installed, else no match."""
    if pred is None or not str(pred).strip():
        return False
    pred, gold = str(pred), str(gold)
    if backend == "math_verify":
        return _math_verify_match(pred, gold)
    if backend not in ("auto", "builtin"):
        raise ValueError(f"backend must be 'auto', 'builtin' or 'math_verify', got {backend!r}")
    a, b = normalize_answer(pred), normalize_answer(gold)
    if a and a == b:
        return True
    if backend == "builtin" or (to_fraction(a) is not None and to_fraction(b) is not None):
        return False
    return math_verify_available() and _math_verify_match(pred, gold)


def grade(text: str, gold: str, backend: str = "auto") -> tuple[str | None, bool]:
    """(extracted answer, whether it is correct) for a model response."""
    pred = extract_answer(text)
    return pred, answers_match(pred, gold, backend)


def tied_answers(answers: list[str | None], same=normalize_answer) -> list[str]:
    """The answers tied for most votes (answers equal under ``same`` vote together), each as first written,
    earliest first (None and empty abstain; [] if all do)."""
    counts: dict[str, int] = {}
    first: dict[str, str] = {}  # key -> first spelling; insertion order = first index
    for ans in answers:
        if ans is None or not str(ans).strip():
            continue
        key = same(ans)
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, ans)
    best = max(counts.values(), default=0)
    return [ans for key, ans in first.items() if counts[key] == best]


def majority_vote(answers: list[str | None], rng: random.Random | None = None) -> str | None:
    """The most common answer after normalisation, as first written (None if all abstain). A tie goes to
    the answer given first, or with ``rng`` to a uniform draw among the tied."""
    tied = tied_answers(answers)
    if not tied:
        return None
    return tied[0] if rng is None else rng.choice(tied)


def vote_score(answers: list[str | None], score: Callable[[str], float], same=normalize_answer) -> float:
    """The expected ``score`` of the majority answer under a uniform tie-break (answers equal under ``same`` vote
    together; None and empty abstain; 0 if all do)."""
    tied = tied_answers(answers, same)
    return sum(score(a) for a in tied) / len(tied) if tied else 0.0


def vote_reward(answers: list[str | None], gold: str, backend: str = "auto") -> float:
    """The independent protocol's team reward: the expected correctness of the majority vote under a
    uniform tie-break (0 if all abstain). Symmetric in the agents: with ties to the earliest agent, agent 1
    alone would decide every three-way disagreement."""
    return vote_score(answers, lambda a: float(answers_match(a, gold, backend)))


# -- The built-in team reward R(tau), and the Team's reading of answers --------------------------------------
def team_correct(prompts: list[str], completions: list[list[str]], *, answer: list, agent_answers: list[list],
                 protocol: str, **columns) -> list[float]:
    """The built-in team reward (paper, Section 3): independent protocol, the expected correctness of the
    majority vote of the agents' answers under a uniform tie-break (``vote_reward``); chain, whether the last
    agent's answer is right."""
    golds = [g if isinstance(g, str) else answer_text(g) or "" for g in answer]  # a data file's raw gold: any JSON
    if protocol == "independent":
        return [vote_reward(list(answers), gold) for answers, gold in zip(agent_answers, golds)]
    return [float(answers_match(answers[-1], gold)) for answers, gold in zip(agent_answers, golds)]


DEFAULT_REWARD = CheckedReward(team_correct, "the built-in team reward")


def agent_answer(text: str, instruction: str) -> str | None:
    """An agent's answer in its response to a prompt ending in ``instruction``: asked for a \\boxed{} answer, only a
    complete final one counts (not a truncated one, not a bare last number)."""
    return extract_answer(text, final_only="\\boxed" in instruction)


def math_team_config(protocol: str = "independent", enable_thinking: bool = False, instruction: str = "",
                     roles=None, reward: Reward = DEFAULT_REWARD, environment=None) -> TeamConfig:
    """A team's config with the math task's reading of answers (``agent_answer``), its team answer
    (``majority_vote``) and ``reward`` (default the built-in one): what every team the entry points build uses."""
    return TeamConfig(reward=reward, extract=agent_answer, vote=majority_vote, protocol=protocol,
                      enable_thinking=enable_thinking, instruction=instruction, roles=roles, environment=environment)
