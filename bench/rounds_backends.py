"""The rollout backends on one multi-round batch (an environment's episodes), side by side in one run: Hugging Face
(``scale.rollout_hf``) against vLLM (CPU build, or GPU), and what the HF backend spends re-reading each round's
whole context.

Every round, the HF backend left-pads each agent's whole view so far (its first prompt, every earlier turn, the
environment's answers) and forwards all of it before the first new token: a prefill of the whole context, of which
all but the round's new observation was read the round before. vLLM's engines keep those prefixes in their prefix
cache. The same agents, environment rows and seeds for every backend; each draws ``rollout.rollout`` with
``score=False`` (generation only), repeated, alternating the backends so that a busy machine slows both alike. The
start (vLLM: the engines) is one warm-up episode, timed apart. Then one more HF rollout, timed call by call: each
agent's generate of each round split into the prefill (one forward over the left-padded contexts, chunked as
``generate_hf`` chunks them: the first step of its ``decode``) and the rest (decoding).

    python bench/rounds_backends.py                       # SmolLM2-135M x3, env:guess-numbers, 8 episodes, 4 rounds
    python bench/rounds_backends.py --agents "SmolLM2-135M x2" --kv-cache-mib 512    # a machine short of memory
    python bench/rounds_backends.py --task env:detective-cases --task-option turns=4 --max-rounds 4
    python bench/rounds_backends.py --agents "tiny x2" --prompts 2 --max-rounds 2 --max-new-tokens 4 --repeats 1 \\
        --backends hf                                     # CI

Prints per backend: own tokens generated, seconds (median of the repeats), tokens/s, and for vLLM the share of
prompt tokens its engines read from the prefix cache; then per round (HF): the agents' mean context tokens, prefill
and decode seconds, and the prefill's share.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness.run  # noqa: E402
from harness.config import Config  # noqa: E402
from logprobs import chunks_by_budget, left_pad  # noqa: E402
from rollout import SamplingConfig, rollout  # noqa: E402
from scale import memory  # noqa: E402
from scale.rollout_hf import HFBackend, new_cache  # noqa: E402
from scale.rollout_vllm import make_backend, team_engines  # noqa: E402


@torch.no_grad()
def prefill_seconds(agent, contexts: list[list[int]], sampling: SamplingConfig) -> float:
    """Seconds of the forwards ``generate_hf`` runs before its first new token: the contexts sorted by length,
    chunked by the token budget, each chunk left-padded and forwarded whole into a fresh KV cache."""
    model = getattr(agent.model, "lm", agent.model)
    order = sorted(range(len(contexts)), key=lambda i: len(contexts[i]))
    chunks = chunks_by_budget([len(contexts[i]) + sampling.max_new_tokens for i in order], sampling.token_budget)
    t0 = time.perf_counter()
    for sl in chunks:
        ids, mask = left_pad([contexts[i] for i in order[sl]], agent.tokenizer.pad_token_id)  # [n, Lc]
        ids, mask = ids.to(agent.device), mask.to(agent.device)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)  # [n, Lc]
        model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=new_cache(model),
              use_cache=True, logits_to_keep=1)
    return time.perf_counter() - t0


class TimedHF(HFBackend):
    """The HF backend, each generate timed whole and its prefill timed apart (an extra forward, not counted in the
    generate's seconds): per call (the model asked, contexts, context tokens, prefill s, generate s)."""

    def __init__(self):
        self.calls: list[tuple[object, int, int, float, float]] = []

    def generate(self, agent, contexts, sampling, seeds):
        prefill = prefill_seconds(agent, contexts, sampling)
        t0 = time.perf_counter()
        out = super().generate(agent, contexts, sampling, seeds)
        self.calls.append((agent, len(contexts), sum(map(len, contexts)), prefill, time.perf_counter() - t0))
        return out


def per_round(calls: list, agents: list) -> list[dict]:
    """The team's calls grouped by round (each round calls every agent once, in order; a responder's calls are
    left out): contexts, mean context tokens, prefill and generate seconds summed over the agents."""
    team = [c for c in calls if any(c[0] is a for a in agents)]
    rounds = [team[r:r + len(agents)] for r in range(0, len(team), len(agents))]
    return [{"round": r + 1, "contexts": sum(c[1] for c in cs), "context_tokens": sum(c[2] for c in cs) /
             sum(c[1] for c in cs), "prefill": sum(c[3] for c in cs), "generate": sum(c[4] for c in cs)}
            for r, cs in enumerate(rounds)]


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", default="SmolLM2-135M x3")
    p.add_argument("--task", default="env:guess-numbers")
    p.add_argument("--task-option", action="append", default=[], help="KEY=VALUE, as sat.py takes it")
    p.add_argument("--max-rounds", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8, help="episodes per rollout (group size 1)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--backends", default="hf,vllm")
    p.add_argument("--kv-cache-mib", type=int, default=None,
                   help="each CPU engine's KV cache (default: memory.cpu_kv_cache_bytes, 16 of the longest episodes)")
    return p.parse_args(argv)


def timed_rollouts(team, problems, sampling, backends: dict, repeats: int) -> tuple[dict, dict]:
    """(seconds of each repeat, own tokens) per backend, the backends alternating; every rollout under seed 0."""
    seconds, tokens = {n: [] for n in backends}, {}
    for _ in range(repeats):
        for name, backend in backends.items():
            t0 = time.perf_counter()
            batch = rollout(team, problems, 1, sampling, backend, score=False, seed=0)
            seconds[name].append(time.perf_counter() - t0)
            tokens[name] = batch.num_tokens
    return seconds, tokens


def main(argv=None) -> None:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    cfg = Config(agents=args.agents, task=args.task, task_option=args.task_option, max_rounds=args.max_rounds,
                 max_new_tokens=args.max_new_tokens, device="cuda" if torch.cuda.is_available() else "cpu",
                 dtype=args.dtype, warmup_steps=0, stages=0).apply_preset()
    inputs = harness.run.run_inputs(cfg)
    cfg = inputs.cfg  # max_rounds resolved from the environment
    train, _, instruction = harness.run.load_problems(cfg)
    team = harness.run.build_team(inputs, instruction)
    problems = train[: args.prompts]
    sampling = SamplingConfig(temperature=args.temperature, top_p=1.0, max_new_tokens=args.max_new_tokens,
                              token_budget=cfg.token_budget)
    backends, started = {}, {}
    for name in args.backends.split(","):
        t0 = time.perf_counter()
        backends[name] = make_backend(name, team_engines(team), seed=0, health=False,
                                      max_model_len=memory.run_max_len(cfg, len(team)))
        if args.kv_cache_mib and name == "vllm":
            backends[name].kv_cache_bytes = args.kv_cache_mib << 20
        rollout(team, problems[:1], 1, sampling, backends[name], score=False, seed=1)  # vLLM: engines start here
        started[name] = time.perf_counter() - t0
    try:
        seconds, tokens = timed_rollouts(team, problems, sampling, backends, args.repeats)
        timed = TimedHF()
        rollout(team, problems, 1, sampling, timed, score=False, seed=0)
        report(args, team, backends, started, seconds, tokens, per_round(timed.calls, team.agents))
    finally:
        for b in backends.values():
            b.close()


def report(args, team, backends, started, seconds, tokens, rounds) -> None:
    print(f"\n{args.agents} on {args.task}, {args.prompts} episodes x {len(team)} agents, at most {args.max_rounds} "
          f"rounds of {args.max_new_tokens} new tokens, {args.dtype}, {args.threads} threads, median of "
          f"{args.repeats}")
    print(f"{'backend':<8} {'start s':>8} {'tokens':>7} {'seconds':>8} {'tokens/s':>9}  prefix-cache share")
    speed = {}
    for name, backend in backends.items():
        med = statistics.median(seconds[name])
        speed[name] = tokens[name] / med
        shares = [f"{backend.prefix_cache_share(a):.0%}" for a in team.agents] if name == "vllm" else "-"
        print(f"{name:<8} {started[name]:>8.1f} {tokens[name]:>7} {med:>8.2f} {speed[name]:>9.1f}  {shares}")
    if set(speed) == {"hf", "vllm"}:
        print(f"ratio vllm/hf tokens/s: {speed['vllm'] / speed['hf']:.2f}")
    print("HF, round by round (prefill timed apart: one forward over each agent's left-padded contexts):")
    print(f"{'round':>5} {'contexts':>8} {'ctx tok':>8} {'prefill s':>9} {'decode s':>9} {'prefill %':>9}")
    for r in rounds:
        decode = r["generate"] - r["prefill"]
        print(f"{r['round']:>5} {r['contexts']:>8} {r['context_tokens']:>8.0f} {r['prefill']:>9.2f} {decode:>9.2f} "
              f"{r['prefill'] / r['generate']:>9.0%}")


if __name__ == "__main__":
    main()
