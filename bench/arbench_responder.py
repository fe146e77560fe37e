"""A model as ARBench's responder, on the chats the environments' ``ask`` builds: scripted questions to DC's
suspects and SP's referee, every chat of a round answered in one batched greedy ``generate`` (the shape the harness
uses), the transcript printed with the seconds each round's generate took.

    python bench/arbench_responder.py --model FOLDER_OR_HUB_ID [--episodes 4] [--rounds 2]

A smoke check that the chats fit a model's chat template and what its replies look like; no score is computed.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import env_detective as dc  # noqa: E402
from harness import env_puzzles as sp  # noqa: E402

DC_TURNS = ("Where were you at the time of the murder?", "Did you have a reason to harm the victim?",
            "Who did you see near the scene?", "Did you touch the weapon?", "How did you know the victim?")


def generator(model_id: str, max_new_tokens: int):
    """chats -> replies: one left-padded batch, greedy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_id)
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_id).eval()

    def answer(chats: list[list[dict]]) -> list[str]:
        texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
        batch = tok(texts, return_tensors="pt", padding=True)  # input_ids: [chats, longest prompt]
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)  # [chats, prompt + new]
        return [tok.decode(o[batch["input_ids"].shape[1]:], skip_special_tokens=True) for o in out]

    return answer


def play_round(envs: list, responses: list[list[str]], answer) -> float:
    """One round of every episode: all their chats in one generate; returns its seconds."""
    chats = [env.ask(r) for env, r in zip(envs, responses)]
    start = time.perf_counter()
    flat = answer([c for cs in chats for c in cs]) if any(chats) else []
    seconds = time.perf_counter() - start
    for env, r, cs in zip(envs, responses, chats):
        replies, flat = flat[: len(cs)], flat[len(cs):]
        print(env.step(r, replies)[0], "\n")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model folder or Hub id with a chat template")
    parser.add_argument("--episodes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    answer = generator(args.model, args.max_new_tokens)
    suspects = [dc.DetectiveCases() for _ in range(args.episodes)]
    referees = [sp.SituationPuzzles() for _ in range(args.episodes)]
    for i, (d, s) in enumerate(zip(suspects, referees)):
        d.reset(seed=2 * i + 1, responder=args.model)
        s.reset(seed=2 * i + 1, responder=args.model)
    for r in range(args.rounds):
        dc_turns = [[f"Suspect: {c}\nQuestion: {q}" for c, q in zip("ABCDE", DC_TURNS)]] * args.episodes
        sp_turns = [[f"Q: {q}" for q in ["Did someone die?", "What is the answer?", *env.puzzle["key_question"][:2]]]
                    for env in referees]
        print(f"DC round {r + 1}: {play_round(suspects, dc_turns, answer):.1f} s for "
              f"{5 * args.episodes} chats in one generate")
        print(f"SP round {r + 1}: {play_round(referees, sp_turns, answer):.1f} s for "
              f"{4 * args.episodes} chats in one generate")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
