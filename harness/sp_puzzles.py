"""Situation puzzles, generated procedurally offline in AR-Bench's ``data/sp`` format.

A puzzle is a template (a surface, a bottom, hidden facts) with its slots (a name, an object, a number, ...)
filled from the row's seed. Each hidden fact is a yes-or-no ``key_question`` with ``keys``: groups of words, a
group hit when the question holds any word of it; a question is about the fact when it hits every group. The true
facts are ``story_tree`` nodes (answered Yes), as AR-Bench's are; the template's tempting wrong guesses are
``false_facts`` (answered No), a field AR-Bench does not have. Every text is written here; nothing is taken from
AR-Bench.
"""
from __future__ import annotations

import random

NAMES = ("Alex", "Blair", "Casey", "Devon", "Emery", "Frankie", "Harper", "Jordan", "Kai", "Logan", "Morgan",
         "Noel", "Parker", "Quinn", "Reese", "Sage", "Taylor", "Robin")
SLOTS = {
    "item": ("wallet", "ring", "watch", "notebook"), "venue": ("cinema", "theatre", "concert hall"),
    "pet": ("dog", "cat"), "n": ("five", "seven", "ten"), "dish": ("stew", "pie", "dumplings", "curry"),
    "clock": ("grandfather clock", "mantel clock"), "relative": ("sister", "brother", "son", "daughter"),
    "event": ("fun run", "fundraiser", "charity auction"), "instrument": ("cello", "harp", "double bass"),
    "place": ("car park", "square", "market"),
}
GONE = ["died", "dead", "death", "die", "passed", "gone"]
# (surface, bottom, true facts, false facts); a fact is (key question, key groups); "{x}" fills a slot, and a key
# "@x" stands for the slot's words
TEMPLATES = (
    ("{name} paid for a ticket to the {venue}, went in, and came out again ten minutes later, delighted. Why?",
     "The day before, {name} had lost a {item} at the {venue}. Buying a ticket was the only way back inside. "
     "{name} found the {item} under a seat and left happily, with no interest in the show.",
     [("Had {name} lost something?", [["lost", "lose", "missing", "dropped", "left"]]),
      ("Was {name} looking for a {item}?", [["@item"]]),
      ("Did {name} find what was lost?", [["found", "find", "recover", "recovered", "retrieve"]]),
      ("Was the {item} under a seat?", [["seat", "seats", "floor"]]),
      ("Had {name} been at the {venue} the day before?", [["before", "yesterday", "earlier", "previous"]])],
     [("Did {name} enjoy the show?", [["enjoy", "enjoyed", "like", "liked", "watch", "watched", "love"]]),
      ("Was {name} meeting someone?", [["meet", "meeting", "met", "friend", "date"]])]),
    ("Every evening {name} parked outside the house and sat in the car for {n} minutes before going in. One "
     "evening {name} went straight in, and cried that night.",
     "{name}'s old {pet} always came to the door to greet {name}, and it needed {n} minutes to walk there from its "
     "bed; {name} waited so that it could arrive first. The evening {name} went straight in, the {pet} had died.",
     [("Was {name} waiting for an animal?", [["@pet", "animal", "pet"]]),
      ("Did the {pet} die?", [["@pet", "animal", "pet"], GONE]),
      ("Did something die?", [GONE]),
      ("Was the {pet} old?", [["old", "elderly", "age", "aged", "slow"]]),
      ("Did the {pet} come to greet {name}?", [["greet", "door", "welcome", "meet"]])],
     [("Was {name} avoiding someone in the house?", [["avoid", "avoiding", "afraid", "scared", "fear"]]),
      ("Was {name} on the phone in the car?", [["phone", "call", "calling", "radio", "music"]])]),
    ("{name} tasted the {dish} at a roadside diner, recognised it at once, and called a lawyer.",
     "The {dish} was made from the secret recipe of {name}'s late grandmother, written in a family book that was "
     "stolen from {name}'s house a year before. The diner's cook had the stolen book.",
     [("Was it a family recipe?", [["recipe", "family", "grandmother", "grandma"]]),
      ("Had something been stolen from {name}?", [["stolen", "stole", "theft", "robbed", "burgled", "taken"]]),
      ("Did the cook have the book?", [["cook", "chef", "diner", "owner"], ["book", "notebook", "recipe"]])],
     [("Was the {dish} poisoned?", [["poison", "poisoned", "sick", "ill", "drug", "drugged"]]),
      ("Did the {dish} taste bad?", [["bad", "awful", "terrible", "disgusting", "horrible"]])]),
    ("{name} woke up, glanced at the {clock}, and knew at once that someone had been in the house overnight.",
     "{name} wound the {clock} every evening but had forgotten to the night before, so it should have stopped. "
     "It was running and showed the right time: {name}'s {relative}, who had a key, had come in late to leave a "
     "parcel and had wound it.",
     [("Had {name} forgotten to wind the clock?", [["wind", "wound", "winding", "forgot", "forgotten"]]),
      ("Was the clock showing the right time?", [["right", "correct", "running", "working", "accurate"]]),
      ("Did the visitor have a key?", [["key", "keys"]]),
      ("Was the visitor the {relative}?", [["@relative", "family", "relative"]])],
     [("Was there a break-in?", [["broke", "break", "forced", "burglar", "burglary", "thief", "stolen", "steal",
                                  "intruder"]]),
      ("Had the clock stopped?", [["stopped", "stop", "broken"]])]),
    ("{name} walked across the {place} through heavy rain with no umbrella or hat, yet not one hair on {name}'s "
     "head got wet.",
     "{name} had shaved off every hair the day before for a {event} and was bald; {name}'s coat and shoes were "
     "soaked through.",
     [("Was {name} bald?", [["bald", "shaved", "shave", "hairless"]]),
      ("Did {name}'s clothes get wet?", [["clothes", "coat", "shoes", "shirt", "body"], ["wet", "soaked", "damp"]]),
      ("Was it for a {event}?", [["charity", "fundraiser", "@event", "money", "cause"]])],
     [("Was {name} under a roof or in a tunnel?", [["covered", "roof", "shelter", "indoors", "tunnel", "inside"]]),
      ("Did {name} wear a hood?", [["hood", "cap", "scarf", "wig", "helmet"]])]),
    ("Every week for a year {name} bought two train tickets for the same journey, and always travelled alone.",
     "{name} plays the {instrument} in an orchestra; its big case needs a seat of its own, so {name} bought it a "
     "ticket for each trip to rehearsals.",
     [("Was the second ticket for an object?", [["object", "thing", "luggage", "case", "bag", "@instrument"]]),
      ("Does {name} play music?", [["music", "musician", "play", "plays", "orchestra", "@instrument"]]),
      ("Did the trips go to rehearsals?", [["rehearsal", "rehearsals", "practice", "concert", "concerts"]])],
     [("Was the second ticket for someone who had died?", [GONE + ["ghost", "memory"]]),
      ("Was the ticket for a friend or partner?", [["friend", "partner", "wife", "husband", "companion", "lover"]])]),
)


def fill(text: str, slots: dict) -> str:
    return text.format(**slots)


def keys_of(groups: list[list[str]], slots: dict) -> list[list[str]]:
    """Key groups with "@slot" replaced by the slot's words, all lowercase."""
    out = []
    for group in groups:
        words = [w for k in group for w in (slots[k[1:]].split() if k.startswith("@") else [k])]
        out.append(sorted({w.lower() for w in words}))
    return out


def generate_puzzle(seed: int) -> dict:
    """A puzzle in AR-Bench's format (surface, bottom, story_tree with key_question nodes, key_question), plus
    ``false_facts``; a pure function of ``seed``."""
    rng = random.Random(f"situation-puzzles {seed}")
    surface, bottom, true_facts, false_facts = TEMPLATES[rng.randrange(len(TEMPLATES))]
    slots = {k: rng.choice(v) for k, v in SLOTS.items()} | {"name": rng.choice(NAMES)}
    nodes = [{"value": fill(q, slots), "key_question": fill(q, slots), "keys": keys_of(g, slots), "children": []}
             for q, g in true_facts]
    return {"surface": fill(surface, slots), "bottom": fill(bottom, slots),
            "story_tree": {"value": fill(bottom, slots).split(". ")[0], "children": nodes},
            "key_question": [n["key_question"] for n in nodes],
            "false_facts": [{"key_question": fill(q, slots), "keys": keys_of(g, slots)} for q, g in false_facts],
            "seed": seed}
