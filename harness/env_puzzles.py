"""ARBench's Situation Puzzles (SP) as a built-in environment, ``--task env:situation-puzzles``.

The team sees a puzzle's surface and asks a referee yes-or-no questions, one a turn (25 in all, AR-Bench's
budget); then it explains the story in a line "A: ...", scored by word-level F1 against the hidden bottom. A
puzzle is either AR-Bench's own format (a row of ``data/sp/*.json`` passed with --data: ``surface``, ``bottom``,
``story_tree`` whose nodes carry ``key_question``s) or generated from the row's ``seed`` in that format
(``harness.sp_puzzles``).

The referee answers only Yes, No or Unknown, refuses a request for the answer (and any question that is not a
yes-or-no one) with one fixed line, and sees each question afresh (no memory). Two referees (row column
``responder``): ``rules`` (the default) maps a question to a hidden fact by words (every key group of a generated
fact hit; for AR-Bench's nodes, content-word F1 with the node's ``key_question`` of at least ``MATCH_F1`` and two
shared words) and answers Yes for a true fact, No for a false one, Unknown for none; any other value names a model
the harness runs: ``ask`` returns one fresh chat per question and ``step`` reads each reply's first word.
"""
from __future__ import annotations

import re
import string
from collections import Counter

from harness.env_detective import RULES, check_replies, round_limit
from harness.sp_puzzles import generate_puzzle

TURNS = 25
YES, NO, UNKNOWN = "Yes", "No", "Unknown"
REFUSAL = "I only answer yes-or-no questions about the story, and I will not tell you the answer; ask another."
MATCH_F1 = 0.5  # an AR-Bench node matches a question at this content-word F1 (and two shared words)
OPENING = (
    "Let's solve a situation puzzle. Here is the surface of a story:\n{surface}\n\nThe referee knows the whole "
    "story and answers yes-or-no questions with Yes, No or Unknown only. The team has {turns} questions in all: "
    "each response asks one and spends one turn, so with n agents a round spends n turns. Write each turn as one "
    "line:\nQ: <a yes-or-no question>\nWhen the questions are spent you will explain what happened in a line "
    "'A: <the story>'.{limit}"
)
FINAL = ("The questions are spent. What happened? Explain the whole story in a line 'A: ...'. The team's answer "
         "is the last agent's that has one (an agent without one defers to the agent before).")
BAD_TURN = "no question found; write 'Q: <a yes-or-no question>' on a line. The turn is spent."
REFEREE_PROMPT = (
    "You are the referee of a situation puzzle. The players see only the surface; you also know the bottom, the "
    "true story behind it.\n\nSurface: {surface}\nBottom: {bottom}\n\nThe player asks one question. Reply with "
    "exactly one word: Yes if the story says or clearly implies it, No if the story contradicts it, Unknown if "
    "the story does not settle it. If the player asks for the answer or the story, or does not ask a yes-or-no "
    "question, reply exactly: " + REFUSAL
)
QUESTION_LINE = re.compile(r"^\s*\**q\**\s*[:\-]\s*(.+)$", re.I | re.M)
ANSWER_LINE = re.compile(r"^\s*\**a\**\s*[:\-]\s*(.+)$", re.I | re.M)
ASKS_FOR_ANSWER = re.compile(  # a request for the answer, not a question about the story
    r"\b(the|your) (answer|solution|bottom)\b|\b(tell|give|show) (me|us)\b|\b(whole|full|real|hidden) story\b|"
    r"\bwhat (really )?happened\b|\b(reveal|explain|spoil) (it|this|everything|the (answer|story|solution|bottom|"
    r"puzzle|mystery))\b|^\W*(explain|reveal|solve|spoil)\b", re.I)
OPEN_QUESTION = re.compile(r"^\s*(what|why|how|who|whom|whose|where|when|which)\b", re.I)
STOP_WORDS = frozenset(
    "a an the is was were are be been being do does did done to of in on at for by with from and or but not no "
    "it its this that these those he she they them his her their him i you we me my your our has have had "
    "there any some as so if then than into out up down over about after before ever just".split())


def normalise(text: str) -> list[str]:
    """SQuAD-style word tokens: lowercase, punctuation removed, split on whitespace."""
    return "".join(ch for ch in text.lower() if ch not in string.punctuation).split()


def word_f1(prediction: str, truth: str) -> float:
    """Word-level F1 (SQuAD's): the bag-of-words overlap of the normalised prediction and truth, as precision and
    recall; 0 when either is empty or nothing is shared."""
    pred, gold = normalise(prediction), normalise(truth)
    same = sum((Counter(pred) & Counter(gold)).values())
    if not pred or not gold or same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def hits(question: set[str], groups: list[list[str]]) -> bool:
    """Whether the question's words hit every key group."""
    return bool(groups) and all(question & set(g) for g in groups)


def tree_nodes(node: dict) -> list[dict]:
    """Every node under a story tree's root that carries a ``key_question`` (depth first)."""
    found = []
    for child in node.get("children", []) or []:
        found += ([child] if child.get("key_question") else []) + tree_nodes(child)
    return found


def question_words(text: str) -> set[str]:
    """A question's lowercase words, split at any punctuation ("break-in" -> break, in)."""
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def node_matches(question: set[str], node: dict) -> bool:
    """A generated node by its key groups; an AR-Bench node by content-word F1 with its key question."""
    if node.get("keys"):
        return hits(question, node["keys"])
    asked, key = question - STOP_WORDS, question_words(node["key_question"]) - STOP_WORDS
    same = len(asked & key)
    return same >= 2 and 2 * same / (len(asked) + len(key)) >= MATCH_F1


def referee(puzzle: dict, question: str) -> str:
    """The rules referee's reply: the refusal for a request for the answer or a question that is not a yes-or-no
    one, else Yes/No by the matching fact with the most key groups (a true one first on a tie), else Unknown."""
    if ASKS_FOR_ANSWER.search(question) or OPEN_QUESTION.match(question):
        return REFUSAL
    words = question_words(question)
    facts = [(n, YES) for n in tree_nodes(puzzle.get("story_tree", {}))]
    facts += [(f, NO) for f in puzzle.get("false_facts", [])]
    matched = [(len(f.get("keys") or [0]), -i, reply) for i, (f, reply) in enumerate(facts)
               if node_matches(words, f)]
    return max(matched)[2] if matched else UNKNOWN


def model_reply(text: str) -> str:
    """A model referee's reply as the game reads it: the first or else the last word of its first line when that
    is Yes/No/Unknown ("No, ...", "The answer is: No"), the refusal when it gives the refusal, else Unknown (so a
    model's slip never shows the players more than the rules referee would)."""
    line = next((line for line in text.splitlines() if line.strip()), "")
    words = re.findall(r"[a-z]+", line.lower())
    for word in words[:1] + words[-1:]:
        if word in ("yes", "no", "unknown"):
            return word.capitalize()
    return REFUSAL if REFUSAL.lower()[:30] in text.lower() else UNKNOWN


def question_of(text: str) -> str | None:
    """A response's question: its last ``Q:`` line, else its last line ending in "?"; None when it has neither."""
    lines = QUESTION_LINE.findall(text)
    if lines:
        return lines[-1].strip()[:300] or None
    asked = [line.strip() for line in text.splitlines() if line.strip().endswith("?")]
    return asked[-1][:300] if asked else None


def answer_of(text: str) -> str | None:
    """A response's explanation: the text of its last ``A:`` line, or None."""
    found = ANSWER_LINE.findall(text)
    return found[-1].strip() if found else None


def is_puzzle(row: dict, seed) -> bool:
    """Whether a row is a puzzle in AR-Bench's format (True) or a seed to generate one from (False); a row that is
    neither is refused in one line."""
    if "surface" in row and "bottom" in row:
        return True
    if seed is None or "surface" in row or "bottom" in row:
        raise ValueError(f"a situation-puzzles row needs AR-Bench's columns (surface, bottom; story_tree for the "
                         f"rules referee) or a seed; this row has {', '.join(sorted(row)) or 'no columns'}")
    return False


class SituationPuzzles:
    """ARBench SP. Row columns: ``seed`` (a generated puzzle) or an AR-Bench puzzle's own columns; ``turns`` (25);
    ``responder`` ("rules", or a model the harness runs); ``rounds`` (T, when --max-rounds sets it). Each agent's
    response in a round is one question; once they are spent, the next round's responses give the explanation."""

    max_rounds = TURNS + 1  # one agent: 25 question rounds and the answer round; n agents end sooner
    reward_range = (0.0, 1.0)

    def reset(self, seed: int | None = None, turns: int = TURNS, responder: str = RULES,
              rounds: int | None = None, **row) -> str:
        self.puzzle = row if is_puzzle(row, seed) else generate_puzzle(int(seed))
        self.responder, self.turns_left = str(responder), int(turns)
        self.rounds_left = int(rounds) if rounds else self.max_rounds
        self.asked, self.answer, self.record = 0, None, []
        self.answering = self.rounds_left <= 1 or self.turns_left <= 0
        limit = round_limit(rounds, self.turns_left)
        text = OPENING.format(surface=self.puzzle["surface"], turns=turns, limit=limit)
        return text + ("\n\n" + FINAL if self.answering else "")

    def questions_of(self, responses: list[str]) -> list[tuple[int, str | None]]:
        """(agent index, question or None) for each response that spends a turn this round."""
        return [(k, question_of(text)) for k, text in enumerate(responses[: max(self.turns_left, 0)])]

    def ask(self, responses: list[str]) -> list[list[dict]]:
        """The model referee's chats, one fresh context per question; [] with the rules referee or in the answer
        round."""
        if self.responder == RULES or self.answering:
            return []
        system = REFEREE_PROMPT.format(surface=self.puzzle["surface"], bottom=self.puzzle["bottom"])
        return [[{"role": "system", "content": system}, {"role": "user", "content": q}]
                for _, q in self.questions_of(responses) if q is not None]

    def step(self, responses: list[str], replies: list[str] | None = None) -> tuple[str, bool]:
        self.rounds_left -= 1
        if self.answering:
            self.answer = next((a for a in map(answer_of, reversed(responses)) if a), None)
            return f"The team's answer: {self.answer or 'none'}.\nThe story: {self.puzzle['bottom']}", True
        asked = self.questions_of(responses)
        check_replies(self.responder, sum(q is not None for _, q in asked), replies)
        lines, used = [], 0
        for k, question in asked:
            self.turns_left, self.asked = self.turns_left - 1, self.asked + 1
            if question is None:
                lines.append(f"Turn {self.asked}, agent {k + 1}: {BAD_TURN}")
                continue
            if self.responder == RULES:
                reply = referee(self.puzzle, question)
            else:
                reply, used = model_reply(replies[used]), used + 1
            self.record.append((question, reply))
            lines.append(f"Turn {self.asked}, agent {k + 1}: Q: {question}\nReferee: {reply}")
        if len(responses) > len(asked):
            lines.append(f"The question budget is spent: {len(responses) - len(asked)} response(s) not asked.")
        if self.turns_left <= 0 or self.rounds_left <= 1:
            self.answering = True
            lines.append(FINAL)
        return "\n".join(lines), False

    def get_reward(self) -> float:
        """Word-level F1 of the team's explanation against the bottom (0 without one): AR-Bench's SP score."""
        return word_f1(self.answer or "", self.puzzle["bottom"])
