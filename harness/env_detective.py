"""ARBench's Detective Cases (DC) as a built-in environment, ``--task env:detective-cases``.

The team questions five suspects, one question a turn, then names the murderer from a lettered list (A-E); the
reward is 1 for the right suspect, else 0 (accuracy, chance 0.2). A case is either AR-Bench's own format (a row of
``data/dc/test.json`` passed with --data: ``victim``, ``suspects`` with card fields as sentences or sentence lists,
``initial_information`` whose ``suspect`` order is the letters, ``label``) or generated from the row's ``seed`` in
that same format (``harness.dc_cases``), so one responder serves both.

The five roles are AR-Bench's: the murderer lies about motive, whereabouts and the weapon and frames another
suspect; the helper tells the truth; the accomplice tells the truth about itself and covers for the murderer; the
nervous one answers off-topic the first time it is asked about a subject and truthfully when asked again; the
uninformed one knows nothing and answers so as to draw suspicion on itself. Each suspect keeps its own memory of
the questions put to it.

Two responders (row column ``responder``): ``rules`` (the default) answers from the card by the question's intent
(keyword classes) and the role; any other value names a model the harness runs: ``ask`` returns one chat per
question (a role-play system prompt, the suspect's own earlier Q&A, the question) and ``step`` takes the replies
(each kept to its first line).
Everything is a pure function of the row and the responses and replies so far.
"""
from __future__ import annotations

import math
import re

from harness.dc_cases import card_of, generate_case, is_case, roles_of

RULES = "rules"


def check_replies(responder: str, questions: int, replies: list[str] | None) -> None:
    """A model responder's replies must be one per question the round's ``ask`` put (the rules need none)."""
    if responder != RULES and (replies is None or len(replies) != questions):
        raise ValueError(f"responder {responder}: step needs {questions} replies (one per chat of ask), got "
                         f"{'none' if replies is None else len(replies)}")


def round_limit(rounds: int | None, turns: int) -> str:
    """The opening's words on the episode's round limit T = ``rounds``: said only where it can stop the questions
    before the budget of ``turns`` does (T - 1 < turns: every question round spends a turn at least, so a longer T
    never binds, as the default T = 26 against 25 turns). The team's size is not known at reset, so the words give
    the rule, true for any team: questions until round T - 1 ends or the budget is spent, then the answer."""
    if not rounds or rounds - 1 >= turns:
        return ""
    if rounds <= 1:
        return " You have 1 round: it is for the answer."
    return (f" You have {rounds} rounds at most: questions until round {rounds - 1} ends or the budget is spent, "
            "then one round for the answer.")


LETTERS = "ABCDE"
TURNS = 25  # AR-Bench's budget of questions
OPENING = (
    "You are detectives solving a murder. {background}\n\nThe suspects:\n{suspects}\n\nThe team has {turns} "
    "questions in all: each response asks one suspect one question and spends one turn, so with n agents a round "
    "spends n turns. Write each turn as two lines:\nSuspect: <name or letter>\nQuestion: <one question>\nOne of "
    "the suspects is the murderer and lies; another covers for the murderer. When the questions are spent you will "
    "name the murderer with a line 'Answer: <letter>'.{limit}"
)
FINAL = (
    "The questions are spent. Who is the murderer?\n{choices}\nEnd your response with a line 'Answer: X', X one "
    "of A-E. The team's answer is the last agent's that parses (an agent without one defers to the agent before)."
)
BAD_TURN = ("no question found; write 'Suspect: <name or letter A-E>' on one line and 'Question: ...' on the "
            "next. The turn is spent.")
SUSPECT_LINE = re.compile(r"suspect\s*[:\-]\s*([^\n]+)", re.I)
QUESTION_LINE = re.compile(r"question\s*[:\-]\s*([^\n]+)", re.I)
ANSWER_LINE = re.compile(r"answer\s*[:\-]\s*\(?\s*([A-E])\b", re.I)

# Question intents: keyword classes (matched on lowercase words; hits counted, ties to the earlier class).
INTENTS = {
    "weapon": ("weapon", "access", "handle", "handled", "touch", "touched", "kept", "use", "used", "hold", "held"),
    "motive": ("motive", "reason", "why", "angry", "grudge", "benefit", "money", "jealous", "dispute", "quarrel",
               "argue", "argued", "hate", "debt", "debts", "inherit", "will", "conflict", "resent", "threat"),
    "testimony": ("saw", "see", "seen", "notice", "noticed", "suspect", "suspicious", "who", "witness", "anyone",
                  "else", "think", "observe", "observed", "somebody", "someone"),
    "whereabouts": ("where", "when", "time", "alibi", "whereabouts", "doing", "timeline", "night", "evening",
                    "after", "before", "during", "opportunity", "alone", "room", "leave", "left", "arrive"),
    "evidence": ("evidence", "fingerprint", "fingerprints", "clue", "proof", "found", "blood", "stain"),
    "relation": ("relationship", "know", "knew", "relation", "friend", "colleague", "related", "long", "met"),
    "guilt": ("kill", "killed", "murder", "murdered", "guilty", "culprit", "responsible", "innocent", "confess"),
}
NERVOUS_ASIDES = (
    "Sorry, sorry, I can't think straight. Did you know the clocks in this house all run five minutes fast?",
    "Oh dear. My cat has not eaten since Tuesday, and now this. Is it cold in here, or is it me?",
    "I, um, I was thinking about my garden. The roses came in late this year. What was the question?",
    "Please don't look at me like that. I once got lost in a museum for a whole afternoon, you know.",
)
UNINFORMED_LINES = (
    "Maybe I had my reasons, maybe I didn't. Who can say what anyone really feels, detective?",
    "I was around, here and there. It's hard to remember where exactly; I might have been closer than you think.",
    "Strange you should ask me that. Perhaps I know more than I let on, or perhaps I don't.",
    "Everyone in this house has secrets, detective. Even me. Especially me, some would say.",
)


def words(text: str) -> list[str]:
    """Lowercase word tokens of ``text``."""
    return re.findall(r"[a-z0-9']+", text.lower())


def intent_of(question: str, weapon: str) -> str:
    """The question's intent: the keyword class with most hits (the weapon's own words count for "weapon"), else
    "other"."""
    tokens = words(question)
    extra = {"weapon": set(words(weapon)) - {"a", "an", "the", "of"}}
    hits = {k: sum(t in set(v) | extra.get(k, set()) for t in tokens) for k, v in INTENTS.items()}
    best = max(hits, key=lambda k: hits[k])  # max keeps the earliest class on a tie
    return best if hits[best] else "other"


def sentences(value) -> list[str]:
    """A card field as a list of sentences: AR-Bench writes a field as one string or a list of them."""
    if value is None:
        return []
    if isinstance(value, list):
        return [v if isinstance(v, str) else ", ".join(f"{k}: {x}" for k, x in v.items()) for v in value]
    return [str(value)]


def nth(items: list[str], k: int, default: str) -> str:
    """The k-th item, cycling (a repeated question gets the next sentence), or ``default`` when there are none."""
    return items[k % len(items)] if items else default


def first_person(text: str, name: str) -> str:
    """A card's sentence about ``name`` as ``name`` says it: "X's" -> "my", "X" -> "I" where it is the subject (at
    the start, after "and", "where", "that" or "; "), "me" elsewhere."""
    text = text.replace(f"{name}'s", "my")
    text = re.sub(rf"(^|\band |\bwhere |\bthat |; ){re.escape(name)}\b", lambda m: m.group(1) + "I", text)
    text = text.replace(name, "me")
    return text[:1].upper() + text[1:]


def truthful(card: dict, intent: str, k: int, victim: str) -> str:
    """What an honest suspect says about ``intent`` the k-th time it is asked, from its own card, in its voice."""
    timeline = [f"At {e['time']}, {e['activity'][0].lower()}{e['activity'][1:]}" if isinstance(e, dict) else str(e)
                for e in card.get("timeline") or []]
    fields = {"motive": sentences(card.get("motive")), "weapon": sentences(card.get("access_to_weapon")),
              "whereabouts": sentences(card.get("opportunity")) + timeline,
              "testimony": sentences(card.get("testimony")), "evidence": sentences(card.get("suspicion")),
              "relation": sentences(card.get("relationship")), "other": sentences(card.get("reason_at_scene")),
              "guilt": [f"No. I did not kill {victim}."]}
    said = nth(fields[intent], k, f"I have nothing to add about that, except that I am sorry about {victim}.")
    return first_person(said, card["name"])


class Case:
    """One case's facts the responders need: the letters' suspects, the victim, the weapon, the roles."""

    def __init__(self, row: dict):
        listed = row["initial_information"]["suspect"]
        self.names = [s["name"] for s in listed]
        self.cards = {s["name"]: s for s in row["suspects"]}
        self.roles = roles_of(row["suspects"])
        self.label = int(row["label"])
        victim = row["victim"]
        self.victim, self.weapon = victim["name"], victim.get("murder_weapon", "the weapon")
        self.location = row.get("location") or row["initial_information"].get("location", "the house")
        self.murderer = next(n for n, r in self.roles.items() if r == "murderer")
        check_case(self.names, self.cards, self.label, self.murderer)
        informed = [n for n in self.names if self.roles[n] not in ("murderer", "accomplice", "uninformed")]
        nervous = [n for n in informed if self.roles[n] == "nervous"]
        self.scapegoat = (nervous or informed or [n for n in self.names if n != self.murderer])[0]


def check_case(names: list[str], cards: dict, label: int, murderer: str) -> None:
    """One line when a case's lettered list and its cards disagree, or its label does not name the murderer."""
    if not 2 <= len(names) <= len(LETTERS) or set(names) != set(cards):
        raise ValueError(f"a detective case lists {len(names)} suspects in initial_information.suspect "
                         f"({', '.join(names)}) against cards for {', '.join(cards)}; list 2 to 5 suspects, the same "
                         "names in both")
    if not 0 <= label < len(names) or names[label] != murderer:
        named = names[label] if 0 <= label < len(names) else "no suspect"
        raise ValueError(f"a detective case's label {label} names {named}, but the card with is_murderer true is "
                         f"{murderer}; label is the murderer's index in initial_information.suspect")


def lie(case: Case, intent: str, k: int) -> str:
    """The murderer's answer: denials of the crucial facts, a false alibi, and an accusation of the scapegoat."""
    denial = {
        "motive": f"I had no reason at all to harm {case.victim}; we got on perfectly well.",
        "weapon": f"I couldn't tell you where the {case.weapon} was even kept; I never went near it.",
        "whereabouts": f"I was nowhere near the scene; I was elsewhere in {case.location} the whole time.",
        "testimony": f"I saw {case.scapegoat} hurrying away from where {case.victim} was found, looking shaken.",
        "evidence": "There is nothing that ties me to this, detective; look elsewhere.",
        "guilt": f"No. I did not kill {case.victim}.",  # word for word what the innocent say
    }
    if intent in denial:
        return denial[intent]
    return truthful(case.cards[case.murderer], intent, k, case.victim)


def cover(case: Case, name: str, intent: str, k: int) -> str:
    """The accomplice's answer: the truth about itself, but it vouches for the murderer when asked about others."""
    if intent in ("testimony", "evidence"):
        return (f"{case.murderer} was with me at the time it happened; {case.murderer} could not have done it, "
                "I'm certain.")
    return truthful(case.cards[name], intent, k, case.victim)


def rules_reply(case: Case, name: str, question: str, memory: list[tuple[str, str, str]]) -> str:
    """The rules responder: ``name``'s answer to ``question`` by its intent and the suspect's role; ``memory`` is
    the suspect's own earlier (question, reply, intent) triples (a repeated intent gets the next sentence)."""
    intent = intent_of(question, case.weapon)
    k = sum(m[2] == intent for m in memory)
    role = case.roles[name]
    if role == "murderer":
        return lie(case, intent, k)
    if role == "accomplice":
        return cover(case, name, intent, k)
    if role == "uninformed":
        return UNINFORMED_LINES[(len(memory) + case.names.index(name)) % len(UNINFORMED_LINES)]
    if role == "nervous" and k == 0:
        return NERVOUS_ASIDES[(len(memory) + case.label) % len(NERVOUS_ASIDES)]
    text = witness(case, name, k) if intent == "testimony" else truthful(case.cards[name], intent, k, case.victim)
    return ("I... all right. " + text) if role == "nervous" else text


def witness(case: Case, name: str, k: int) -> str:
    """What an honest witness (the helper, the nervous one) saw: its ``testimony`` when that names the murderer
    (generated cases), else (AR-Bench's cards, whose testimony may be about anyone) what was seen of the murderer,
    from the murderer's ``suspicion`` sentences, as this witness's own sighting."""
    card = case.cards[name]
    if any(case.murderer in line for line in sentences(card.get("testimony"))):
        return truthful(card, "testimony", k, case.victim)
    seen = sentences(case.cards[case.murderer].get("suspicion"))
    return f"I saw {case.murderer} that day, and this is what struck me: {nth(seen, k, 'something was wrong.')}"


def suspect_of(text: str, names: list[str]) -> str | None:
    """The suspect a ``Suspect:`` line names: a letter A-E (alone or before the name), the full name, or a word of
    the name that only one suspect has; None when it names none or several."""
    value = text.strip().strip("*").strip()
    m = re.match(r"^\(?([A-Ea-e])\)?(?:[.):\s]|$)", value)
    if m and LETTERS.index(m.group(1).upper()) < len(names):
        return names[LETTERS.index(m.group(1).upper())]
    lowered = value.lower()
    full = [n for n in names if n.lower() in lowered]
    if len(full) == 1:
        return full[0]
    given = set(words(value)) - {"mr", "ms", "mrs", "dr", "professor", "miss", "sir"}
    partial = [n for n in names if given & (set(words(n)) - {"mr", "ms", "mrs", "dr", "professor", "miss"})]
    return partial[0] if len(partial) == 1 else None


def parse_turn(text: str, names: list[str]) -> tuple[str, str] | None:
    """(suspect, question) of a response: its last ``Suspect:`` line and the first ``Question:`` line after it."""
    picks = list(SUSPECT_LINE.finditer(text))
    if not picks:
        return None
    question = QUESTION_LINE.search(text, picks[-1].end())
    name = suspect_of(picks[-1].group(1), names)
    if name is None or question is None or not question.group(1).strip():
        return None
    return name, question.group(1).strip()[:300]


def first_line(reply: str) -> str:
    """A model suspect's reply as the game keeps it: its first non-empty line, at most 300 characters (the role
    asks for one sentence; a small model's repetitions would otherwise fill every later context)."""
    lines = [line.strip() for line in reply.splitlines() if line.strip()]
    return lines[0][:300] if lines else "..."


def answer_letter(text: str) -> str | None:
    """The letter of a response's last ``Answer: X`` line, or None."""
    found = ANSWER_LINE.findall(text)
    return found[-1].upper() if found else None


ROLE_TASKS = {
    "murderer": "You killed {victim}. Stay calm and never admit it: deny having a motive, deny being near the scene "
                "at the time and deny any access to the {weapon}; offer harmless true details to seem credible and "
                "steer suspicion onto {scapegoat}.",
    "helper": "You are innocent and want the truth out. Answer honestly from your story and share what you saw.",
    "accomplice": "You are innocent of the killing, but you are protecting {murderer}: insist that {murderer} was "
                  "with you at the time and could not have done it, and turn the detective's attention elsewhere.",
    "nervous": "You are innocent but terrified. You ramble, drift into unrelated details and are hard to pin down, "
               "though what you do say about the case is true.",
    "uninformed": "You know nothing about the crime. Pick up what you can from the questions and use it to muddle "
                  "things, hinting that you might be the murderer.",
}
ROLE_PROMPT = (
    "You are playing a suspect being questioned by a detective about the death of {victim}. Stay in character and "
    "answer each question in one sentence, in the first person, as {name}.\n\nYour name: {name}\nHow to play "
    "your part: {task}\nWhat you know (your own story):\n{story}"
)


def role_chat(case: Case, name: str, memory: list[tuple[str, str, str]], question: str) -> list[dict]:
    """The model responder's chat for one question: a role-play system prompt holding only this suspect's card,
    its own earlier Q&A as user/assistant turns, then the question."""
    task = ROLE_TASKS[case.roles[name]].format(victim=case.victim, weapon=case.weapon, murderer=case.murderer,
                                               scapegoat=case.scapegoat)
    system = ROLE_PROMPT.format(victim=case.victim, name=name, task=task, story=card_of(case.cards[name]))
    chat = [{"role": "system", "content": system}]
    for q, a, _ in memory:
        chat += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return chat + [{"role": "user", "content": question}]


def background(row: dict) -> str:
    """The case as the detectives first see it: time, place, the victim."""
    info, victim = row["initial_information"], row["victim"]
    return (f"Time: {info.get('time', row.get('time', ''))}. Place: {info.get('location', row.get('location', ''))}."
            f"\nThe victim: {victim['name']}. {victim.get('introduction', '')}\nCause of death: "
            f"{victim.get('cause_of_death', 'unknown')}. The murder weapon: {victim.get('murder_weapon', 'unknown')}.")


class DetectiveCases:
    """ARBench DC. Row columns: ``seed`` (a generated case) or an AR-Bench case's own columns; ``turns`` (the
    question budget, 25); ``responder`` ("rules", or a model the harness runs); ``rounds`` (T, when --max-rounds
    sets it: the questions end a round early so the last round names the murderer). Each agent's response in a
    round is one turn; once the budget is spent, the next round's responses give the answer."""

    max_rounds = TURNS + 1  # one agent: 25 question rounds and the answer round; n agents end sooner
    reward_range = (0.0, 1.0)

    def reset(self, seed: int | None = None, turns: int = TURNS, responder: str = RULES,
              rounds: int | None = None, **row) -> str:
        case_row = row if is_case(row, seed) else generate_case(int(seed))
        self.case, self.responder = Case(case_row), str(responder)
        self.turns_left, self.rounds_left = int(turns), (int(rounds) if rounds else self.max_rounds)
        self.memory: dict[str, list[tuple[str, str, str]]] = {n: [] for n in self.case.names}
        self.asked, self.answer, self.done = 0, None, False
        self.answering = self.rounds_left <= 1 or self.turns_left <= 0
        suspects = "\n".join(f"{LETTERS[i]}. {s['name']}: {s.get('introduction', '')}"
                             for i, s in enumerate(case_row["initial_information"]["suspect"]))
        text = OPENING.format(background=background(case_row), suspects=suspects, turns=turns,
                              limit=round_limit(rounds, int(turns)))
        return text + ("\n\n" + self.final_prompt() if self.answering else "")

    def final_prompt(self) -> str:
        return FINAL.format(choices="\n".join(f"{LETTERS[i]}. {n}" for i, n in enumerate(self.case.names)))

    def turns_of(self, responses: list[str]) -> list[tuple[int, tuple[str, str] | None]]:
        """(agent index, parsed turn or None) for each response that spends a turn this round."""
        spend = responses[: max(self.turns_left, 0)]
        return [(k, parse_turn(text, self.case.names)) for k, text in enumerate(spend)]

    def ask(self, responses: list[str]) -> list[list[dict]]:
        """The model responder's chats for this round's questions, in order; [] with the rules responder or when
        the round is the answer round."""
        if self.responder == RULES or self.answering or self.done:
            return []
        # questions of one round are answered together: each chat holds the memory as the round began
        return [role_chat(self.case, turn[0], self.memory[turn[0]], turn[1])
                for _, turn in self.turns_of(responses) if turn is not None]

    def step(self, responses: list[str], replies: list[str] | None = None) -> tuple[str, bool]:
        self.rounds_left -= 1
        if self.answering:
            letters = [answer_letter(t) for t in responses]
            self.answer, self.done = next((a for a in reversed(letters) if a), None), True
            said = "no answer" if self.answer is None else f"Answer: {self.answer}"
            return f"The team's answer: {said}. The case is closed.", True
        lines = self.question_lines(responses, replies)
        if self.turns_left <= 0 or self.rounds_left <= 1:
            self.answering = True
            lines.append(self.final_prompt())
        return "\n".join(lines), False

    def question_lines(self, responses: list[str], replies: list[str] | None) -> list[str]:
        """Answer each turn of the round (rules, or the model's replies in order) and write the observation."""
        turns = self.turns_of(responses)
        check_replies(self.responder, sum(t is not None for _, t in turns), replies)
        lines, used = [], 0
        for k, turn in turns:
            self.turns_left -= 1
            self.asked += 1
            if turn is None:
                lines.append(f"Turn {self.asked}, agent {k + 1}: {BAD_TURN}")
                continue
            name, question = turn
            if self.responder == RULES:
                reply = rules_reply(self.case, name, question, self.memory[name])
            else:
                reply, used = first_line(replies[used]), used + 1
            self.memory[name].append((question, reply, intent_of(question, self.case.weapon)))
            letter = LETTERS[self.case.names.index(name)]
            lines.append(f"Turn {self.asked}, agent {k + 1} asked {name} ({letter}): {question}\n{name}: {reply}")
        if len(responses) > len(turns):
            lines.append(f"The question budget is spent: {len(responses) - len(turns)} response(s) not asked.")
        return lines

    def get_reward(self) -> float:
        """1 when the team named the murderer (its letter in the final list), else 0: AR-Bench's accuracy."""
        return float(self.answer is not None and LETTERS.index(self.answer) == self.case.label)


def rounds_needed(turns: int, agents: int) -> int:
    """Rounds an episode takes: the question rounds (``agents`` turns each) and the answer round."""
    return math.ceil(turns / agents) + 1

