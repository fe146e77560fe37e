"""One agent, side by side: TRL's GRPOTrainer and SAT's one-agent stage on the same model, prompts and sizes.

Both sides train SmolLM2-135M-Instruct (the GGUF file ``--agents SmolLM2-135M`` loads, read once into float32 by
``harness.loading.load_agent``; TRL gets that model object and its tokenizer) on the arithmetic-chat task of the
CPU preset: the same P prompts (those SAT's stage 1 draws), G samples each, the same max new tokens, temperature,
lr, torch threads and reward (the project's grading of the boxed answer against the gold,
``harness.math_grading``). One TRL optimizer step is one SAT stage: P x G completions, one AdamW step (SAT with
``--minibatch-size`` P x G, one epoch). Every measured run is a fresh process; TRL and SAT alternate.

    python bench/trl_side_by_side.py                           # 3 x TRL and 3 x SAT, P 4 x G 4, 48 tokens, 1 thread
    python bench/trl_side_by_side.py --repeats 1 --learn-seconds 300 --learners trl,sat,sat-x3
    python bench/trl_side_by_side.py --sat-args "--no-step-bounds --step-size adaptive"

Prints median seconds per phase and per whole process with SAT/TRL ratios, and generated tokens per second.
``--learn-seconds N`` also trains each learner for about N seconds of optimizer steps (evaluation excluded) and
prints held-out accuracy before and after on the same seeded rows (``sat.evaluate``), with 95% intervals, and
each learner minus the one before it, paired by row (``--save`` keeps the rows for pairing across runs).

TRL is an optional bench dependency, imported only here: pip install trl==1.16.0.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRL_REQUIREMENT = "trl==1.16.0"
MODEL = "SmolLM2-135M"
sys.path.insert(0, str(ROOT))  # the project's modules, for the worker processes
UNWRITTEN = str(Path(tempfile.gettempdir()) / "trl_side_by_side_unused")  # --out of a config no run writes
# (row label, SAT phase, TRL phase); None: that side has no such phase
ROWS = [("generation (the stage's sampling)", "generation", "generation"),
        ("  of which step-bound redraws", "redraw generation", None),
        ("scoring (rewards, behaviour log-probs)", "scoring", "scoring"),
        ("update (forward, backward, AdamW)", "update", "update"),
        ("exact-KL check and line search", "kl check", None),
        ("stage = one optimizer step", "stage", "stage"),
        ("  stage less the step-bound redraws", "stage less redraws", "stage"),
        ("held-out evaluation", "evaluation", None),
        ("checkpoint", "checkpoint", None),
        ("model load", "model load", "model load"),
        ("trainer setup", None, "trainer setup"),
        ("whole process", "process", "process"),
        ("  less held-out evaluation, checkpoint", "process less", "process")]


def require_trl():
    """The trl module, or a one-line exit naming the install."""
    try:
        import trl
    except ImportError:
        sys.exit(f"bench/trl_side_by_side.py needs TRL, an optional bench dependency: pip install {TRL_REQUIREMENT}")
    return trl


# ---------------------------------------------------------------------------
# The shared settings: one sat.py command line both sides read
# ---------------------------------------------------------------------------
def sat_argv(args, agents: str = MODEL, stages: int = 1, out: str = "") -> list[str]:
    """The sat.py options of this bench: the CPU preset with P x G joint trajectories in one AdamW step."""
    n = args.prompts * args.group_size
    return ["--agents", agents, "--task", "arithmetic-chat", "--stages", str(stages), "--batch-size", str(n),
            "--group-size", str(args.group_size), "--minibatch-size", str(n), "--epochs", "1",
            "--max-new-tokens", str(args.max_new_tokens), "--temperature", str(args.temperature), "--lr", str(args.lr),
            "--threads", str(args.threads), "--seed", str(args.seed), "--eval-size", str(args.eval_size),
            "--eval-samples", str(args.eval_samples), "--out", out or UNWRITTEN,
            *shlex.split(args.sat_args)]


def resolved_config(args, agents: str = MODEL, stages: int = 1, out: str = ""):
    import harness.cli
    import harness.run

    return harness.run.resolve(harness.cli.parse_args(sat_argv(args, agents, stages, out)))


def stage_one_prompts(train: list, n: int, seed: int) -> list:
    """The prompts stage 1 of a new run draws (``sat.run_stages``: the run's Python RNG, ``seed_run``'s)."""
    import random

    rng = random.Random(seed)
    return [train[rng.randrange(len(train))] for _ in range(n)]


# ---------------------------------------------------------------------------
# TRL's side
# ---------------------------------------------------------------------------
def grpo_config(args, out: str, max_steps: int):
    """GRPOConfig at this bench's sizes: float32 on the CPU, no gradient checkpointing, no reference model (beta 0,
    TRL's default), a constant lr, AdamW as SAT's (betas 0.9/0.99, no weight decay, gradient norm clipped to 1),
    sequence ratios averaged over sequences (SAT's --ratio seq-mean: GSPO), no logging, evaluation or checkpoints."""
    from trl import GRPOConfig

    return GRPOConfig(output_dir=out, per_device_train_batch_size=args.prompts * args.group_size,
                      gradient_accumulation_steps=1, num_generations=args.group_size,
                      max_completion_length=args.max_new_tokens, temperature=args.temperature, top_p=1.0, top_k=0,
                      learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                      adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=1.0, beta=args.trl_beta, epsilon=0.2,
                      importance_sampling_level="sequence", loss_type="grpo", num_iterations=1, use_cpu=True,
                      bf16=False, fp16=False, gradient_checkpointing=False, report_to="none", logging_steps=10 ** 6,
                      save_strategy="no", eval_strategy="no", max_steps=max_steps, seed=args.seed, disable_tqdm=True,
                      dataloader_num_workers=0, log_completions=False)


def trl_dataset(problems: list, instruction: str):
    """The problems as TRL's conversational rows: SAT's user turn (problem + instruction), the gold, the id."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": [{"role": "user", "content": p.problem + instruction}],
                               "answer": p.answer, "id": p.id} for p in problems])


def graded_reward(instruction: str, seen: list):
    """A TRL reward function that grades as SAT's one-agent team reward does: the agent's boxed answer
    (``agent_answer``) against the gold, by the independent protocol's vote (``vote_reward``) of one answer."""
    from harness.math_grading import agent_answer, vote_reward

    def correct(prompts, completions, answer, id, **_):
        seen.extend(id)
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [vote_reward([agent_answer(t, instruction)], gold) for t, gold in zip(texts, answer)]
    return correct


def trl_trainer(args, agent, problems: list, instruction: str, max_steps: int, out: str, seen: list):
    from trl import GRPOTrainer

    agent.model.requires_grad_(True)  # an Agent is loaded frozen; TRL trains every parameter
    return GRPOTrainer(model=agent.model, reward_funcs=graded_reward(instruction, seen),
                       args=grpo_config(args, out, max_steps), train_dataset=trl_dataset(problems, instruction),
                       processing_class=agent.tokenizer)


def time_trl(trainer, seconds: dict, counts: dict, budget_s: float = math.inf) -> None:
    """Timers around the trainer's generation, reward and generate-and-score calls, and a callback that times
    each optimizer step and stops training once the steps have taken ``budget_s`` seconds."""
    from transformers import TrainerCallback

    def timed(name, fn, after=None):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0
            if after is not None:
                after(out)
            return out
        return wrapper

    def count(out):
        counts["tokens"] = counts.get("tokens", 0) + sum(len(ids) for ids in out[1])  # completion ids, eos included

    trainer._generate = timed("generation", trainer._generate, count)
    trainer._calculate_rewards = timed("rewards", trainer._calculate_rewards)
    trainer._generate_and_score_completions = timed("generate and score", trainer._generate_and_score_completions)

    class StepClock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()

        def on_step_end(self, _args, _state, control, **__):
            seconds["stage"] = seconds.get("stage", 0.0) + time.perf_counter() - self.t0
            counts["steps"] = counts.get("steps", 0) + 1
            control.should_training_stop = seconds["stage"] >= budget_s
    trainer.add_callback(StepClock())


def trl_phases(seconds: dict) -> dict:
    """The table's TRL phases from the timers: scoring = generate-and-score less generation; update = the step
    less generate-and-score (forward, backward, AdamW)."""
    gen_score = seconds.get("generate and score", 0.0)
    return {**seconds, "scoring": gen_score - seconds.get("generation", 0.0),
            "update": seconds.get("stage", 0.0) - gen_score}


def trl_worker(args) -> dict:
    """One TRL optimizer step on SAT's stage-1 prompts, timed."""
    require_trl()
    from harness.loading import load_agent
    from harness.run import load_problems

    cfg = resolved_config(args).cfg
    train, _, instruction = load_problems(cfg)
    prompts = stage_one_prompts(train, args.prompts, cfg.seed)
    seconds, counts, seen = {}, {}, []
    t0 = time.perf_counter()
    agent = load_agent(MODEL)
    seconds["model load"] = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        trainer = trl_trainer(args, agent, prompts, instruction, 1, out, seen)
        seconds["trainer setup"] = time.perf_counter() - t0
        time_trl(trainer, seconds, counts)
        trainer.train()
    return {"phases": trl_phases(seconds), "tokens": counts.get("tokens", 0), "prompt_ids": sorted(set(seen))}


# ---------------------------------------------------------------------------
# SAT's side
# ---------------------------------------------------------------------------
def time_sat(meter, counts: dict):
    """bench/gpu_stage.py's phase timers around the functions a run calls; generation is named (and its tokens
    counted) by the phase it runs in: the stage's rollout, a step-bound redraw, or the held-out evaluation."""
    from gpu_stage import timed

    import harness.run
    import rollout as rollout_mod
    import sat
    from harness import run_folder
    from scale.rollout_hf import HFBackend

    def where(name):  # the held-out evaluation's calls apart from the stage's
        return lambda *_, **__: ("eval " if "evaluation" in meter.open else
                                 "redraw " if "redraw" in meter.open else "") + name

    def count(responses):
        name = where("generation")()
        counts[name] = counts.get(name, 0) + sum(len(r) for r in responses)

    def named(name, after=None):
        return lambda fn: timed(meter, fn, where(name), after)

    return [(sat, "sat_stage", named("stage")), (sat, "redraw", named("redraw")),
            (HFBackend, "generate", named("generation", count)),
            (rollout_mod, "behaviour_logprobs", named("behaviour log-probs")),
            (rollout_mod, "score_team", named("rewards")), (sat, "train_agents", named("update")),
            (sat, "trust_region_step", named("kl check")), (sat, "evaluate", named("evaluation")),
            (run_folder, "save_checkpoint", named("checkpoint")), (harness.run, "load_agent", named("model load"))]


def patched(patches: list):
    """Apply (owner, name, wrap) patches; returns a function that restores them."""
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    for owner, name, wrap in patches:
        setattr(owner, name, wrap(owner.__dict__[name]))
    return lambda: [setattr(owner, name, fn) for owner, name, fn in saved]


def sat_worker(args) -> dict:
    """``harness.run.run`` with one stage (stage-0 evaluation, the stage, its evaluation, its checkpoint), timed."""
    import torch
    from gpu_stage import PhaseMeter

    import harness.run
    import sat

    seen: list = []
    meter, counts = PhaseMeter(torch.device("cpu")), {}
    restore = patched(time_sat(meter, counts) + [(sat, "sat_stage", lambda fn: lambda run, problems, *a, **k: (
        seen.extend(p.id for p in problems), fn(run, problems, *a, **k))[1])])
    try:
        with tempfile.TemporaryDirectory() as tmp:
            rows = harness.run.run_resolved(resolved_config(args, out=str(Path(tmp) / "run")), log=lambda *_: None)
    finally:
        restore()
    s = {name: meter.records[name]["seconds"] for name in meter.order}
    s["scoring"] = sum(s.get(f"{where}{name}", 0.0) for where in ("", "redraw ")
                       for name in ("behaviour log-probs", "rewards"))
    s["generation"] = s.get("generation", 0.0) + s.get("redraw generation", 0.0)  # all the stage's sampling
    s["stage less redraws"] = s["stage"] - s.get("redraw", 0.0)
    return {"phases": s, "tokens": counts.get("generation", 0) + counts.get("redraw generation", 0),
            "redraw_tokens": counts.get("redraw generation", 0), "prompt_ids": sorted(set(seen)),
            "team_reward": rows[-1]["team_reward"]}


# ---------------------------------------------------------------------------
# Learning per second: each learner trains for about the same seconds, then the same held-out evaluation
# ---------------------------------------------------------------------------
def learn_trl(args, budget_s: float):
    """TRL's GRPO on the training pool until its optimizer steps have taken ``budget_s``; (team, seconds, steps)."""
    require_trl()
    from harness.loading import load_agent
    from harness.math_grading import math_team_config
    from harness.run import load_problems
    from team import Agent, Team

    cfg = resolved_config(args).cfg
    train, _, instruction = load_problems(cfg)
    agent, seconds, counts = load_agent(MODEL), {}, {}
    with tempfile.TemporaryDirectory() as out:
        trainer = trl_trainer(args, agent, train, instruction, 10 ** 6, out, [])
        time_trl(trainer, seconds, counts, budget_s)
        trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    return Team([Agent(agent.spec, model, agent.tokenizer)], math_team_config(instruction=instruction)), \
        seconds["stage"], counts["steps"]


def learn_sat(args, agents: str, budget_s: float):
    """SAT's stages (``sat.sat_stage``, prompts drawn as ``sat.run_stages`` draws them) until they have taken
    ``budget_s``; (team, seconds, stages)."""
    import harness.run
    import sat
    from scale.rollout_hf import HF

    inputs = resolved_config(args, agents, stages=10 ** 6)
    cfg = inputs.cfg
    train, _, instruction = harness.run.load_problems(cfg)
    run = harness.run.start_team(inputs, train, instruction, lambda *_: None).run_state(HF, lambda *_: None)
    spent, stages = 0.0, 0
    while spent < budget_s:
        prompts = [train[run.rng.randrange(len(train))] for _ in range(cfg.batch_size // cfg.group_size)]
        t0 = time.perf_counter()
        sat.sat_stage(run, prompts, cfg.core(), cfg.core().sampling)
        spent, stages = spent + time.perf_counter() - t0, stages + 1
    return run.team, spent, stages


def held_out(team, args, agents: str) -> list[float]:
    """The team's rewards on the held-out rows, each row under its own seed (``sat.evaluate``): the same rows and
    seeds for every learner, so before and after pair row by row."""
    import harness.run
    import sat
    from scale.rollout_hf import HF

    cfg = resolved_config(args, agents).cfg
    heldout = harness.run.load_problems(cfg)[1]
    return sat.evaluate(team, heldout, cfg.core().sampling, cfg.core(), HF)["eval_rewards"]


def learn_worker(args) -> dict:
    """``--worker learn-NAME``: the held-out rewards before, the training, the held-out rewards after."""
    import harness.run

    name = args.worker.removeprefix("learn-")
    agents = {"trl": MODEL, "sat": MODEL, "sat-x3": f"{MODEL} x3"}[name]
    inputs = resolved_config(args, agents)
    start = harness.run.build_team(inputs, harness.run.load_problems(inputs.cfg)[2])
    before = held_out(start, args, agents)
    del start
    team, seconds, steps = (learn_trl(args, args.learn_seconds) if name == "trl"
                            else learn_sat(args, agents, args.learn_seconds))
    after = held_out(team, args, agents)
    return {"learner": name, "seconds": seconds, "steps": steps, "before": before, "after": after}


def interval(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of its normal 95% interval)."""
    n = len(values)
    mean = sum(values) / n
    sd = statistics.stdev(values) if n > 1 else 0.0
    return mean, 1.96 * sd / math.sqrt(n)


def learning_table(results: list[dict]) -> None:
    print(f"\n{'learner':<8} {'steps':>5} {'train s':>8} {'rows':>5} {'before':>14} {'after':>14} "
          f"{'paired gain':>16} {'gain per 1000 s':>16}")
    for r in results:
        (b, bw), (a, aw) = interval(r["before"]), interval(r["after"])
        g, gw = interval([y - x for x, y in zip(r["before"], r["after"])])
        per = 1000 / r["seconds"]
        print(f"{r['learner']:<8} {r['steps']:>5} {r['seconds']:>8.1f} {len(r['after']):>5} {b:>6.3f} +- {bw:.3f} "
              f"{a:>6.3f} +- {aw:.3f} {g:>+7.3f} +- {gw:.3f} {g * per:>+7.3f} +- {gw * per:.3f}")
    for r, s in zip(results, results[1:]):  # the same rows under the same seeds: learners pair row by row
        if len(r["after"]) == len(s["after"]):
            d, dw = interval([y - x for x, y in zip(r["after"], s["after"])])
            print(f"{s['learner']} - {r['learner']} after training, paired by row: {d:+.3f} +- {dw:.3f}")


# ---------------------------------------------------------------------------
# The parent: fresh processes, alternating, then the table
# ---------------------------------------------------------------------------
def run_worker(args, kind: str, extra: list[str] = ()) -> dict:
    """``kind`` in a fresh process (this script with --worker); its result with the process's wall seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        argv = [sys.executable, __file__, "--worker", kind, "--result", str(out), *extra, *forwarded(args)]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
        t0 = time.perf_counter()
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if done.returncode != 0:
            sys.exit(f"the {kind} worker failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        result = json.loads(out.read_text())
    result.setdefault("phases", {})["process"] = wall
    return result


def forwarded(args) -> list[str]:
    keys = ["prompts", "group_size", "max_new_tokens", "temperature", "lr", "threads", "seed", "eval_size",
            "eval_samples", "trl_beta", "learn_seconds"]
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys] + [f"--sat-args={args.sat_args}"]


def median(results: list[dict], phase: str | None) -> float | None:
    return None if phase is None else statistics.median(r["phases"].get(phase, 0.0) for r in results)


def phase_table(sat_runs: list[dict], trl_runs: list[dict]) -> None:
    """Median seconds per phase of each side and SAT/TRL, then generated tokens and tokens per second."""
    print(f"\n{f'median seconds, {len(sat_runs)} SAT / {len(trl_runs)} TRL processes':<40} "
          f"{'SAT':>8} {'TRL':>8} {'SAT/TRL':>8}")
    for label, sat_phase, trl_phase in ROWS:
        s, t = median(sat_runs, sat_phase), median(trl_runs, trl_phase)
        cells = [f"{x:8.1f}" if x is not None else f"{'-':>8}" for x in (s, t)]
        shown = s is not None and t is not None and t >= 0.1  # a ratio to a phase TRL all but skips says nothing
        print(f"{label:<40} {cells[0]} {cells[1]} " + (f"{s / t:8.2f}" if shown else f"{'-':>8}"))
    tokens = [statistics.median(r["tokens"] for r in runs) for runs in (sat_runs, trl_runs)]
    rates = [statistics.median(r["tokens"] / r["phases"]["generation"] for r in runs) for runs in (sat_runs, trl_runs)]
    print(f"{'generated tokens a stage':<40} {tokens[0]:>8.0f} {tokens[1]:>8.0f} {tokens[0] / tokens[1]:>8.2f}")
    print(f"{'generated tokens per second':<40} {rates[0]:>8.1f} {rates[1]:>8.1f} {rates[0] / rates[1]:>8.2f}")


def compare(args) -> None:
    """``--repeats`` processes per side, TRL and SAT in turn, then the table."""
    sat_runs, trl_runs = [], []
    for k in range(args.repeats):
        for kind, runs in (("trl", trl_runs), ("sat", sat_runs)):
            runs.append(run_worker(args, kind))
            print(f"run {k + 1} {kind}: process {runs[-1]['phases']['process']:.1f} s, stage "
                  f"{runs[-1]['phases']['stage']:.1f} s, {runs[-1]['tokens']} tokens", flush=True)
    for r in sat_runs:  # what a TRL process does not do: evaluate, checkpoint
        r["phases"]["process less"] = r["phases"]["process"] - r["phases"]["evaluation"] - r["phases"]["checkpoint"]
    same = {tuple(r["prompt_ids"]) for r in sat_runs + trl_runs}
    print(f"prompts: the same {len(next(iter(same)))} on both sides" if len(same) == 1 else f"prompts differ: {same}")
    phase_table(sat_runs, trl_runs)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=4, help="P prompts a stage / optimizer step")
    p.add_argument("--group-size", type=int, default=4, help="G samples per prompt (TRL's num_generations)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="(TRL's max_completion_length)")
    p.add_argument("--temperature", type=float, default=0.4, help="the CPU preset's")
    p.add_argument("--lr", type=float, default=1e-6, help="the CPU preset's")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each worker process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-size", type=int, default=16, help="SAT's held-out problems (the preset: 64)")
    p.add_argument("--eval-samples", type=int, default=1, help="SAT's samples per held-out problem (the preset: 4)")
    p.add_argument("--trl-beta", type=float, default=0.0, help="TRL's KL weight (0: no reference model)")
    p.add_argument("--sat-args", default="", help="more sat.py options for SAT's side, written with '=' when one "
                   "option: --sat-args=--no-step-bounds")
    p.add_argument("--repeats", type=int, default=3, help="timed processes per side, alternating")
    p.add_argument("--learn-seconds", type=float, default=0, help="also train each learner this long (0: skip)")
    p.add_argument("--learners", default="trl,sat", help="for --learn-seconds: trl, sat, sat-x3 (comma-separated)")
    p.add_argument("--save", help="for --learn-seconds: also write every learner's held-out rewards to this JSON file")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        work = {"trl": trl_worker, "sat": sat_worker}.get(args.worker, learn_worker)
        Path(args.result).write_text(json.dumps(work(args)))
        return
    trl = require_trl()
    print(f"TRL {trl.__version__} GRPOTrainer vs SAT, {MODEL} (one agent; sat-x3: three): {args.prompts} prompts "
          f"x G {args.group_size}, {args.max_new_tokens} new tokens, T {args.temperature}, lr {args.lr}, float32, "
          f"{args.threads} thread(s)" + (f"; SAT also {args.sat_args}" if args.sat_args else ""))
    if args.repeats:
        compare(args)
    if args.learn_seconds:
        results = [run_worker(args, f"learn-{name}") for name in args.learners.split(",")]
        if args.save:
            Path(args.save).write_text(json.dumps(results))
        learning_table(results)


if __name__ == "__main__":
    main()
