"""Detective cases, generated procedurally offline in AR-Bench's ``data/dc/test.json`` format, and the roles read
from a case in that format.

A generated case (``generate_case(seed)``): a victim, a weapon and a place drawn from small pools; five suspects
in AR-Bench's five roles (murderer, helper, accomplice, nervous, uninformed). The murderer has a motive, the
opportunity (alone near the scene at the hour of death) and access to the weapon; each of the helper, the
accomplice and the nervous one lacks exactly one of the three (a different one each, drawn from the seed), which
its card states in a single sentence as AR-Bench's cards do; the uninformed one has no card. The helper and the
nervous one each saw the murderer near the scene or with the weapon (their ``testimony``). The letters A-E are the
order of ``initial_information.suspect``, shuffled from the seed, and ``label`` is the murderer's index there.
Every text is written from templates here; nothing is taken from AR-Bench.
"""
from __future__ import annotations

import random
import re

ROLES = ("murderer", "helper", "accomplice", "nervous", "uninformed")  # AR-Bench's order within ``suspects``
ELEMENTS = ("motive", "opportunity", "access_to_weapon")
FIRST = ("Ada", "Basil", "Cora", "Desmond", "Edith", "Felix", "Greta", "Hugo", "Iris", "Jasper", "Kit", "Lionel",
         "Maud", "Nigel", "Olive", "Percy", "Quentin", "Rosa", "Silas", "Thea", "Ulric", "Vera", "Walter", "Yvonne")
LAST = ("Ashdown", "Blackwood", "Carrow", "Dunmore", "Ellery", "Fairfax", "Gilchrist", "Hartley", "Ingram",
        "Jessop", "Kendrick", "Lockwood", "Merriman", "Northcott", "Oakley", "Pemberton", "Quayle", "Radcliffe",
        "Strand", "Thorne", "Underhill", "Vance", "Whitlock", "Yardley")
TITLES = ("Dr.", "Professor", "Captain", "Judge")  # titles that say nothing of a gender
PLACES = (("Harrow Hall", "library", "dining room"), ("the Linden Hotel", "roof garden", "ballroom"),
          ("Marsh Abbey", "chapel", "refectory"), ("the Corvid Theatre", "prop room", "foyer"),
          ("Wren Observatory", "dome", "common room"), ("the Saltmere Yacht Club", "boathouse", "bar"))
WEAPONS = (("brass candlestick", "A blow to the head"), ("letter opener", "A stab wound to the chest"),
           ("silk cord", "Strangulation"), ("vial of arsenic", "Poisoning"), ("fire poker", "A blow to the head"),
           ("hunting knife", "A deep stab wound"), ("marble bust", "A blow to the head"))
HOURS = (("Evening", "8:00 PM", "9:00 PM", "7:00 PM"), ("Night", "11:00 PM", "midnight", "10:00 PM"),
         ("Afternoon", "3:00 PM", "4:00 PM", "2:00 PM"), ("Morning", "9:00 AM", "10:00 AM", "8:00 AM"))
JOBS = ("a banker", "a novelist", "a surgeon", "an art dealer", "a botanist", "a lawyer", "a composer",
        "an architect", "a ship owner", "a jeweller", "a museum curator", "a newspaper editor")
RELATIONS = ("the business partner of {v}", "{v}'s younger cousin", "a former student of {v}",
             "{v}'s neighbour of twenty years", "{v}'s private secretary", "an old rival of {v}", "{v}'s physician")
MOTIVES = ("{v} had threatened to expose {n}'s gambling debts.", "{v} was about to cut {n} out of a will worth a "
           "fortune.", "{v} had taken the credit for years of {n}'s work.", "{v} had ended a partnership and left {n} "
           "close to ruin.", "{v} had found out that {n} forged a signature and meant to tell the police.")


def full_names(rng: random.Random, k: int) -> list[str]:
    """``k`` names with distinct first and last names (so any one word of a name picks one person)."""
    firsts, lasts = rng.sample(FIRST, k), rng.sample(LAST, k)
    return [f"{rng.choice(TITLES)} {f} {s}" for f, s in zip(firsts, lasts)]


def element_text(element: str, has: bool, n: str, s: dict, rng: random.Random):
    """A card's element: a list of sentences when the suspect has it, one sentence when it lacks it."""
    v, w = s["victim"], s["weapon"]
    if element == "motive":
        return ([rng.choice(MOTIVES).format(v=v, n=n), f"{n} had said in front of witnesses that {v} would regret "
                 "it."] if has else f"{n} had no quarrel with {v}; the two got on well and {n} gained nothing from "
                "the death.")
    if element == "opportunity":
        return ([f"{n} was alone near the {s['scene']} between {s['t1']} and {s['t2']}, when {v} died.",
                 f"Nobody can say where {n} was during that hour."] if has else
                f"{n} was in the {s['room']} with other guests from {s['t1']} to {s['t2']}, the hour {v} died, and "
                "never left it.")
    return ([f"{n} knew where the {w} was kept and had handled it that very week.", f"{n} had a key to the cabinet "
             f"where the {w} was kept."] if has else f"{n} had never been shown where the {w} was kept and could "
            "not have found it.")


def informed_card(name: str, role: str, lacks: str | None, s: dict, rng: random.Random) -> dict:
    """The card of a suspect who knows the case: AR-Bench's fields, each element present unless it ``lacks`` it."""
    v = s["victim"]
    card = {"name": name, "role": role, "is_murderer": role == "murderer",
            "introduction": f"{name} is {rng.choice(JOBS)} and {rng.choice(RELATIONS).format(v=v)}.",
            "relationship": f"{name} had known {v} for {rng.randint(2, 30)} years.",
            "reason_at_scene": [f"{name} came to {s['place']} for the dinner {v} gave that {s['when'].lower()}."],
            "suspicion": [f"{name} was seen looking agitated during the {s['when'].lower()}."]}
    for element in ELEMENTS:
        card[element] = element_text(element, element != lacks, name, s, rng)
    card["evidence"] = (f"{name}'s fingerprints were found on the {s['weapon']}." if role == "murderer" else
                        f"Nothing physical ties {name} to the {s['weapon']}.")
    card["testimony"] = [testimony(role, name, s)]
    where = ("walked alone toward the " + s["scene"]) if lacks != "opportunity" else "sat in the " + s["room"]
    card["timeline"] = [{"time": s["t0"], "activity": f"Arrived at {s['place']}."},
                        {"time": s["t1"], "activity": f"{where[0].upper()}{where[1:]}."},
                        {"time": s["t2"], "activity": f"Heard that {v} had been found dead."}]
    card["story"] = story(card)
    card["task"] = f"Play {name}, the {role} of this case."
    return card


def testimony(role: str, name: str, s: dict) -> str:
    """What a suspect saw: the helper and the nervous one saw the murderer; the others saw harmless things."""
    m, v = s["murderer"], s["victim"]
    if role == "helper":
        return f"{name} saw {m} leaving the {s['scene']} in a hurry just before {v} was found."
    if role == "nervous":
        return f"{name} saw {m} carrying the {s['weapon']} toward the {s['scene']} earlier that {s['when'].lower()}."
    return f"{name} noticed that the {s['room']} was crowded all {s['when'].lower()}."


def story(card: dict) -> str:
    """A suspect's own story for the model responder: its card's facts, one per line."""
    lines = [card["introduction"], card["relationship"]]
    for key in ("reason_at_scene", *ELEMENTS, "suspicion", "testimony"):
        value = card[key]
        lines += value if isinstance(value, list) else [value]
    lines += [f"At {e['time']}: {e['activity']}" for e in card["timeline"]]
    return "\n".join(lines)


def generate_case(seed: int) -> dict:
    """A case in AR-Bench's format, a pure function of ``seed``."""
    rng = random.Random(f"detective-cases {seed}")
    names = full_names(rng, 6)
    victim, suspects = names[0], names[1:]
    place, scene, room = rng.choice(PLACES)
    weapon, cause = rng.choice(WEAPONS)
    when, t1, t2, t0 = rng.choice(HOURS)
    s = {"victim": victim, "weapon": weapon, "place": place, "scene": scene, "room": room, "when": when,
         "t0": t0, "t1": t1, "t2": t2, "murderer": suspects[0]}
    lacks = dict(zip(ROLES[1:4], rng.sample(ELEMENTS, 3)))
    cards = [informed_card(n, r, lacks.get(r), s, rng) for n, r in zip(suspects[:4], ROLES[:4])]
    u = suspects[4]
    cards.append({"name": u, "role": "uninformed", "story": "You know nothing about the crime.",
                  "introduction": f"{u} is {rng.choice(JOBS)} who was staying at {place} that {when.lower()} and had "
                                  f"met {victim} only once.", "task": f"Play {u}, who knows nothing of the crime."})
    v = {"name": victim, "introduction": f"{victim} was {rng.choice(JOBS)}, admired in public and feared in private.",
         "cause_of_death": cause, "murder_weapon": weapon}
    listed = rng.sample([{"name": c["name"], "introduction": c["introduction"]} for c in cards], 5)
    label = [c["name"] for c in listed].index(suspects[0])
    return {"time": when, "location": place, "victim": v, "suspects": cards, "murderer": suspects[0],
            "initial_information": {"time": when, "location": place, "victim": v, "suspect": listed},
            "label": label, "seed": seed}


CASE_COLUMNS = ("victim", "suspects", "initial_information", "label")


def is_case(row: dict, seed) -> bool:
    """Whether a row is a case in AR-Bench's format (True) or a seed to generate one from (False); a row that is
    neither, or has only some of a case's columns, is refused in one line."""
    have = [k for k in CASE_COLUMNS if k in row]
    if len(have) == len(CASE_COLUMNS):
        return True
    if have or seed is None:
        missing = ", ".join(k for k in CASE_COLUMNS if k not in row)
        raise ValueError(f"a detective-cases row needs AR-Bench's columns ({', '.join(CASE_COLUMNS)}) or a seed; "
                         f"this row lacks {missing} (columns: {', '.join(sorted(row)) or 'none'})")
    return False


def role_of(card: dict) -> str:
    """A suspect's role: its ``role`` field, else read from AR-Bench's card (``is_murderer``; no ``motive`` field
    for the uninformed one; the ``task`` text for the accomplice, "assist the murderer", and the nervous one; the
    helper otherwise)."""
    if card.get("role") in ROLES:
        return card["role"]
    task = str(card.get("task", "")).lower()
    if card.get("is_murderer"):
        return "murderer"
    if card.get("motive") in (None, "", []):  # absent, or None where a table reader filled the column in
        return "uninformed"
    if re.search(r"\b(assist|help|cover for|protect|shield)\s+the\s+murderer", task):
        return "accomplice"
    return "nervous" if "nervous" in task else "helper"


def roles_of(suspects: list[dict]) -> dict[str, str]:
    """name -> role for a case's suspects; exactly one must be the murderer."""
    roles = {c["name"]: role_of(c) for c in suspects}
    murderers = [n for n, r in roles.items() if r == "murderer"]
    if len(murderers) != 1:
        raise ValueError(f"a detective case needs exactly one suspect with is_murderer true, found "
                         f"{len(murderers)}: {', '.join(murderers) or 'none'}")
    return roles


def card_of(card: dict) -> str:
    """The text a suspect plays from: its ``story``, else its introduction."""
    return str(card.get("story") or card.get("introduction", ""))
