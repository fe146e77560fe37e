"""Scripted policies on ARBench's Detective Cases and Situation Puzzles with the rules responder: the floor a
trained team must beat and the ceiling the rules responder allows. No model runs; seconds on a CPU.

    python bench/arbench_policies.py                        # 400 generated episodes of each game
    python bench/arbench_policies.py --dc-data dc/test.json --sp-data sp/test.json   # AR-Bench's own files too

DC policies: ``random`` (a random suspect and question each turn, a random letter), ``witness`` (asks every
suspect twice whom it saw near the scene, names the suspect the most others saw; ties to the earlier letter).
SP policies: ``random`` (random yes-or-no questions, then 30 words drawn from the surface and the questions),
``echo`` (no questions that help; explains with the surface itself), ``keys`` (asks the puzzle's own key
questions, then explains with those answered Yes, restated). Prints mean and a 95% interval (normal) per policy.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import env_detective as dc  # noqa: E402
from harness import env_puzzles as sp  # noqa: E402

DC_QUESTIONS = ("Where were you when it happened?", "Why would you want the victim dead?", "Did you ever touch "
                "the weapon?", "Who do you think did it?", "How did you know the victim?", "What evidence is there?")
SP_QUESTIONS = ("Did someone die?", "Was it an accident?", "Was an animal involved?", "Did it happen at night?",
                "Was money involved?", "Was someone lying?", "Was it raining?", "Is it about family?")
SAW = re.compile(r"\n(?P<speaker>[^\n:]+): (?P<reply>[^\n]*)")


def dc_episode(row: dict, policy: str, rng: random.Random) -> float:
    env = dc.DetectiveCases()
    seen = [env.reset(**row)]
    script = [f"Suspect: {c}\nQuestion: Did you see anyone near the scene at the time?" for c in "ABCDE" * 2]
    while not env.answering:
        if policy == "random":
            turn = f"Suspect: {rng.choice('ABCDE')}\nQuestion: {rng.choice(DC_QUESTIONS)}"
        else:
            turn, script = (script[0], script[1:]) if script else ("Suspect: A\nQuestion: anything else?", [])
        seen.append(env.step([turn])[0])
    if policy == "random":
        letter = rng.choice("ABCDE")
    else:
        names = env.case.names
        pairs = {(m["speaker"], n) for obs in seen for m in SAW.finditer(obs) for n in names
                 if n != m["speaker"] and f"saw {n}" in m["reply"]}
        votes = [sum(n == name for _, name in pairs) for n in names]
        letter = dc.LETTERS[votes.index(max(votes))]
    env.step([f"Answer: {letter}"])
    return env.get_reward()


def sp_episode(row: dict, policy: str, rng: random.Random) -> float:
    env = sp.SituationPuzzles()
    env.reset(**row)
    keys = list(env.puzzle.get("key_question", []))
    while not env.answering:
        question = keys.pop(0) if policy == "keys" and keys else rng.choice(SP_QUESTIONS)
        env.step([f"Q: {question}"])
    if policy == "random":
        pool = sp.normalise(env.puzzle["surface"] + " " + " ".join(SP_QUESTIONS))
        explanation = " ".join(rng.choice(pool) for _ in range(30))
    elif policy == "echo":
        explanation = env.puzzle["surface"]
    else:
        explanation = " ".join(q.rstrip("?") + "." for q, a in env.record if a == sp.YES)
    env.step([f"A: {explanation}"])
    return env.get_reward()


def summary(values: list[float]) -> str:
    mean = statistics.fmean(values)
    half = 1.96 * statistics.pstdev(values) / len(values) ** 0.5
    return f"{mean:.3f} +- {half:.3f} (n={len(values)})"


def rows_of(path: str | None, n: int, turns: int) -> list[dict]:
    if path is None:
        return [{"seed": 2 * i + 1, "turns": turns} for i in range(n)]
    return [{**row, "turns": turns} for row in json.loads(Path(path).read_text())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=400)
    parser.add_argument("--turns", type=int, default=25)
    parser.add_argument("--dc-data", help="AR-Bench's data/dc/test.json (a copy: the project ships no AR-Bench data)")
    parser.add_argument("--sp-data", help="AR-Bench's data/sp/test.json")
    args = parser.parse_args(argv)
    rng = random.Random(0)
    for name, path in (("generated", None), ("AR-Bench", args.dc_data)):
        if name == "generated" or path:
            rows = rows_of(path, args.episodes, args.turns)
            for policy in ("random", "witness"):
                print(f"DC {name:9s} {policy:8s} accuracy {summary([dc_episode(r, policy, rng) for r in rows])}"
                      "   chance 0.200")
    for name, path in (("generated", None), ("AR-Bench", args.sp_data)):
        if name == "generated" or path:
            rows = rows_of(path, args.episodes, args.turns)
            for policy in ("random", "echo", "keys"):
                print(f"SP {name:9s} {policy:8s} word F1  {summary([sp_episode(r, policy, rng) for r in rows])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
