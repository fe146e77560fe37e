"""One SAT stage on one GPU: seconds and peak memory per phase, sequential vs joint.

Three randomly initialised agents of Qwen3-0.6B's published shape (hidden
1024, 28 layers, 16 heads, 8 KV heads, head_dim 128, intermediate 3072,
vocab 151936, tied embeddings; nothing is downloaded), bf16, HF backend. The
stage is sat.py's own ``sat_stage`` (rollout -> per-agent update -> trust-region
check -> promotion); this script only wraps sat.py's and rollout.py's functions
with timers and CUDA peak-memory probes, so what it measures is what a run does.

    python bench/gpu_stage.py                                  # GPU: Qwen3-0.6B-shaped agents, bf16
    OMP_NUM_THREADS=1 python bench/gpu_stage.py --tiny --device cpu    # smoke test (small dims)

Prints, for ``--update sequential`` and ``--update joint``: rollout tokens/s,
seconds and peak allocated memory per phase (generate, scoring, advantages,
each agent's update, trust-region check, exact-KL measurements), next to the
``scale.memory`` estimate of the training peak.

The text side uses team.build_char_tokenizer() (no real tokenizer can be
downloaded) while the model keeps its 151936-token vocabulary: sampled ids
beyond the tokenizer's 102 decode to "" (checked at start), so answers are
extracted from the in-vocabulary characters only. A random model never
answers right, so every group advantage would be 0 and no parameter would
move; by default (--synthetic-reward) the team reward is replaced by the
parity of the agents' first sampled tokens, so the updates, the KL checks and
the line search do their real work. The compute per phase is that of a real
checkpoint of this shape.
"""
from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rollout as rollout_mod  # noqa: E402
import sat  # noqa: E402
import update as update_mod  # noqa: E402
from harness.config import Config  # noqa: E402
from harness.loading import build_char_tokenizer  # noqa: E402
from harness.math_grading import math_team_config  # noqa: E402
from harness.run import trust_regions_for  # noqa: E402
from harness.tasks import arithmetic_problems  # noqa: E402
from rollout import SamplingConfig  # noqa: E402
from scale import memory  # noqa: E402
from scale.rollout_hf import HF, HFBackend  # noqa: E402
from team import Agent, AgentSpec, Team  # noqa: E402

QWEN3_06B = memory.QWEN3_DIMS["qwen3-0.6b"]
TINY_DIMS = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=4096, tie_word_embeddings=True)


# ---------------------------------------------------------------------------
# Timing and peak memory per phase
# ---------------------------------------------------------------------------
class PhaseMeter:
    """Wall seconds and peak allocated accelerator memory per named phase.

    Phases nest (an exact-KL measurement inside an agent's update): on every
    phase boundary the peak seen so far is credited to all open phases and the
    CUDA peak counter restarts, so a nested probe never hides an outer peak."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.open: list[str] = []
        self.records: dict[str, dict] = defaultdict(lambda: {"seconds": 0.0, "calls": 0, "peak": 0})
        self.order: list[str] = []

    def _fold(self) -> None:
        if not self.cuda:
            return
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        for name in self.open:
            self.records[name]["peak"] = max(self.records[name]["peak"], peak)
        torch.cuda.reset_peak_memory_stats()

    @contextmanager
    def phase(self, name: str):
        self._fold()
        if name not in self.records:
            self.order.append(name)
        self.open.append(name)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._fold()
            self.records[name]["seconds"] += time.perf_counter() - t0
            self.records[name]["calls"] += 1
            self.open.pop()


def timed(meter: PhaseMeter, fn, name_of, after=None):
    """fn wrapped in a phase whose name may depend on the arguments."""
    def wrapper(*args, **kwargs):
        with meter.phase(name_of(*args, **kwargs)):
            out = fn(*args, **kwargs)
        if after is not None:
            after(out)
        return out
    return wrapper


def synthetic_score(score_team):
    """rollout.score_team with the team reward replaced by the parity of the sum of the agents' first
    response tokens: it varies within every group, so advantages and updates are not all zero."""
    def wrapper(team, flat, turns, group_ids):
        answers, _, agent_reward, _ = score_team(team, flat, turns, group_ids)
        first = torch.stack([t.response_ids[:, 0] for t in turns]).sum(0)  # [N]
        return answers, (first % 2).float(), agent_reward, None  # no vote baselines for this reward: group mean
    return wrapper


@contextmanager
def instrumented(meter: PhaseMeter, counters: dict, synthetic: bool):
    """Wrap the functions a stage calls (module and class attributes, looked up at call time) with
    phases; restore them afterwards. A name a module does not have is skipped."""
    def count_tokens(responses):
        counters["generated_tokens"] += sum(len(r) for r in responses)

    def kl_phase(fn):
        return timed(meter, fn, lambda *a, **k: "  exact KL measurements")

    patches = [
        (sat, "team_rollout", lambda fn: timed(meter, fn, lambda *a, **k: "rollout (generate + scoring)")),
        (HFBackend, "generate", lambda fn: timed(meter, fn, lambda *a, **k: "  generate", count_tokens)),
        (rollout_mod, "batched_response_logprobs",
         lambda fn: timed(meter, fn, lambda *a, **k: "  scoring (behaviour log-probs)")),
        (sat, "build_inputs", lambda fn: timed(meter, fn, lambda *a, **k: "advantages + weights")),
        (sat, "train_agents", lambda fn: timed(meter, fn, lambda team, slots, *a, **k:
                                               "update agent " + ",".join(str(j + 1) for j in slots))),
        (sat, "trust_region_step", lambda fn: timed(meter, fn, lambda team, j, *a, **k:
                                                f"trust-region check agent {j + 1}")),
        (sat, "measure_kl", kl_phase),
        (update_mod, "measure_kl", kl_phase),
    ]
    if synthetic:
        patches.append((rollout_mod, "score_team", synthetic_score))
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches if name in owner.__dict__]
    try:
        for owner, name, wrap in patches:
            if name in owner.__dict__:
                setattr(owner, name, wrap(getattr(owner, name)))
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


# ---------------------------------------------------------------------------
# The team
# ---------------------------------------------------------------------------
def build_team(dims: dict, n_agents: int, device: torch.device, dtype: torch.dtype, seed: int) -> Team:
    """n randomly initialised Qwen3ForCausalLM of the given shape, each with
    the character tokenizer (the same code path as a downloaded checkpoint)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    agents = []
    for k in range(n_agents):
        tok = build_char_tokenizer()
        config = Qwen3Config(**dims, max_position_embeddings=4096, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id, bos_token_id=None)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + k)
            with torch.device(device):  # initialise on the device: no 2x host copy of 0.6B parameters
                model = Qwen3ForCausalLM(config)
        model.to(dtype=dtype)
        agents.append(Agent(AgentSpec(name=f"random-{k + 1}", kind="tiny", source="random"), model, tok))
    return Team(agents, math_team_config(protocol="independent", instruction=""))


def check_out_of_vocab_decoding(team: Team, vocab: int) -> None:
    """The model samples ids the character tokenizer does not have; they must decode safely (to nothing)."""
    tok = team.agents[0].tokenizer
    beyond = [len(tok), vocab - 1]
    text = tok.decode(beyond, skip_special_tokens=True)
    if text != "":
        raise RuntimeError(f"ids beyond the tokenizer ({beyond}) decode to {text!r}; expected ''")


def stage_config(args, update: str, device: torch.device) -> Config:
    cfg = Config(agents="tiny x3", task="arithmetic", stages=1, update=update, order="static", delta=0.05,
                 beta=0.01, lr=1e-5, group_size=args.group_size, batch_size=args.prompts * args.group_size,
                 max_new_tokens=args.max_new_tokens, temperature=1.0, epochs=args.epochs,
                 minibatch_size=args.minibatch_size, token_budget=args.token_budget,
                 kl_check_every=args.kl_check_every, eval_size=8, warmup_steps=0, device=str(device), backend="hf",
                 seed=args.seed)
    cfg = cfg.apply_preset()  # fills any knob added to Config later
    cfg.validate()
    return cfg


# ---------------------------------------------------------------------------
# One measured stage
# ---------------------------------------------------------------------------
def run_stage(args, dims: dict, update: str, device: torch.device, dtype: torch.dtype) -> dict:
    cfg = stage_config(args, update, device)
    team = build_team(dims, args.agents, device, dtype, args.seed)
    check_out_of_vocab_decoding(team, dims["vocab_size"])
    problems = arithmetic_problems(args.prompts, seed=args.seed, split="train")
    sampling = SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                              token_budget=cfg.token_budget)
    meter, counters = PhaseMeter(device), defaultdict(int)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    with instrumented(meter, counters, args.synthetic_reward), meter.phase("stage"):
        run = sat.RunState(team, trust_regions_for(cfg, len(team)), {}, random.Random(args.seed), HF)
        record = sat.sat_stage(run, problems, cfg.core(), sampling)[0].row()
    out = {"update": update, "meter": meter, "generated_tokens": counters["generated_tokens"], "record": record,
           "resident": resident, "cfg": cfg}
    del team
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def estimate_for(args, dims: dict, update: str, dtype_bytes: int) -> dict:
    """memory.py's estimate for this stage, with today's sat.py settings:
    no gradient checkpointing, the LM head over 1024 positions of every row
    of a micro-batch, the whole rollout batch in one generate chunk."""
    seq = 32 + args.max_new_tokens  # prompt (~25 characters + template) + response
    rows = args.minibatch_size
    return memory.estimate_memory(dims, args.agents, update, dtype_bytes=dtype_bytes, micro_batch_tokens=rows * seq,
                                  max_seq_len=seq, gradient_checkpointing=False, backend="hf",
                                  rollout_tokens=args.prompts * args.group_size * seq,
                                  logits_chunk_tokens=rows * min(1024, args.max_new_tokens),
                                  optimizer_bytes_per_param=2 * dtype_bytes)  # torch AdamW: m, v in the params' dtype


def report(result: dict, estimate: dict, cuda: bool) -> None:
    meter, rec = result["meter"], result["record"]
    gib = memory.GiB
    gen = meter.records["  generate"]
    print(f"\n== update {result['update']}: team reward {rec['team_reward']:.3f}, "
          f"mean response {rec['mean_response_tokens']:.1f} tokens, truncated {rec['truncated_fraction']:.0%}")
    print(f"generate: {result['generated_tokens']} tokens in {gen['seconds']:.2f}s = "
          f"{result['generated_tokens'] / max(gen['seconds'], 1e-9):,.0f} tok/s; rollout incl. scoring "
          f"{rec['rollout_tokens_per_s']:,.0f} tok/s")
    print(f"{'phase':<36} {'calls':>5} {'seconds':>8} {'peak GiB':>9}")
    for name in meter.order:
        r = meter.records[name]
        peak = f"{r['peak'] / gib:9.2f}" if cuda else f"{'n/a':>9}"
        print(f"{name:<36} {r['calls']:>5} {r['seconds']:>8.2f} {peak}")
    agents = "; ".join(f"agent {a['agent']}: kl_q {a['kl_quantile']:.2e} bt {a['backtracks']} "
                      f"{'accepted' if a['accepted'] else 'rejected'}" for a in rec["agents"])
    print(agents)
    measured = max(meter.records[n]["peak"] for n in meter.order if n.startswith("update")) if cuda else None
    line = f"scale.memory estimate: peak_training {estimate['peak_training'] / gib:.2f} GiB"
    if measured is not None:
        line += (f" | measured peak during the updates {measured / gib:.2f} GiB "
                 f"(resident before the stage {result['resident'] / gib:.2f} GiB)")
    print(line)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true",
                   help="small dims (hidden 64, 2 layers, vocab 4096) for a CPU smoke test")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--agents", type=int, default=3)
    p.add_argument("--prompts", type=int, default=None, help="default 8 (tiny: 4)")
    p.add_argument("--group-size", type=int, default=None, help="default 4 (tiny: 2)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 256 (tiny: 8)")
    p.add_argument("--minibatch-size", type=int, default=None, help="default 8 (tiny: 4)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--token-budget", type=int, default=1 << 16)
    p.add_argument("--kl-check-every", type=int, default=0)
    p.add_argument("--updates", default="sequential,joint", help="comma-separated: sequential, joint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-synthetic-reward", dest="synthetic_reward", action="store_false",
                   help="keep the real (always 0 for random models) team reward: no parameter moves")
    args = p.parse_args(argv)
    small = dict(prompts=4, group_size=2, max_new_tokens=8, minibatch_size=4)
    large = dict(prompts=8, group_size=4, max_new_tokens=256, minibatch_size=8)
    for k, v in (small if args.tiny else large).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available: use --device cpu (with --tiny)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dims = TINY_DIMS if args.tiny else QWEN3_06B
    n_params = memory.count_parameters(dims)
    shape = "tiny" if args.tiny else "Qwen3-0.6B shape"
    print(f"{args.agents} agents x {n_params / 1e6:.1f} M parameters ({shape}, random), "
          f"{dtype}, {device}; {args.prompts} prompts x G={args.group_size}, max_new_tokens {args.max_new_tokens}, "
          f"minibatch {args.minibatch_size}, torch threads {torch.get_num_threads()}")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / memory.GiB
        print(f"GPU: {torch.cuda.get_device_name(device)}, {total:.0f} GiB")
    results = []
    for update in [u.strip() for u in args.updates.split(",") if u.strip()]:
        t0 = time.perf_counter()
        result = run_stage(args, dims, update, device, dtype)
        est = estimate_for(args, dims, update, 4 if dtype == torch.float32 else 2)
        report(result, est, device.type == "cuda")
        print(f"({time.perf_counter() - t0:.1f}s including building the team)")
        results.append(result)
    if device.type == "cuda" and len(results) == 2:
        peaks = [max(r["meter"].records[n]["peak"] for n in r["meter"].order if n.startswith("update"))
                 for r in results]
        print(f"\npeak memory during updates: {results[0]['update']} {peaks[0] / memory.GiB:.2f} GiB vs "
              f"{results[1]['update']} {peaks[1] / memory.GiB:.2f} GiB ({peaks[1] / max(peaks[0], 1):.2f}x)")


if __name__ == "__main__":
    main()
