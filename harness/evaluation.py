"""Evaluate a team on AIME24 / AIME25 / MATH-500, or any task: avg@K, pass@k, maj@K (paper, Section 6, Table 1).

Paper setting: avg@64 on AIME24/25, avg@4 on MATH-500, temperature 0.8, top_p 1.0, up to 32,768 new tokens. A
--ckpt team samples with its run's own temperature, top_p and max new tokens (the run folder's config.json) unless
the command line gives them (``harness.eval_setting.resolve_generation``).
Each sample is one joint trajectory of the whole team (``rollout.rollout``, as in training); the team answer
is the majority vote (independent) or the last agent's answer (chain).

    python eval_aime.py --agents "Qwen3-4B x3" --thinking --bench aime24,aime25 --k 64 --out runs/eval-base
    python eval_aime.py --ckpt runs/sat --bench aime24,aime25 --k 64 --out runs/eval-sat   # a sat.py run
    python eval_aime.py --agents "Qwen3-4B x3" --data data/aime24.jsonl --k 64             # offline copy
    OMP_NUM_THREADS=1 python eval_aime.py --agents "tiny x3" --data data/aime24.jsonl --limit 5 --k 4 \\
        --max-new-tokens 16 --out /tmp/ev                                                 # CPU smoke run
    python eval_aime.py --ckpt runs/kk --bench reasoning-gym:knights_knaves --task-option n_people=2 --k 4
    python eval_aime.py --ckpt runs/mine --data mine.csv --reward my_reward.py:reward --k 8   # its own prompts

A benchmark with a reward of its own (a reasoning-gym task, or --reward as in sat.py) scores each sample with it:
avg@K is the mean reward (partial credit included), pass@k counts samples at the reward's maximum, maj@K is the
reward of the first sample that gives the most common team answer. The math benchmarks keep answer matching of
the team's voted answer.

Metrics per benchmark, for the team and each agent (its own answer inside the joint trajectory): avg@K,
the unbiased pass@1 and pass@K, maj@K, each with a 95% percentile bootstrap over problems (2000 resamples,
seed 0), the dominant uncertainty with 30 problems. --out holds predictions.jsonl (a row per benchmark,
problem, sample and who), summary.json and run.json; an environment's episodes also add rounds.jsonl (each
rollout call's rounds: the wall time of the agents' generates, the responder model's and the environment's steps,
summed per benchmark as summary.json's ``round_seconds``). Resumable: rows are appended (fsync) after every chunk,
each chunk is seeded from (seed, benchmark, first problem, chunk), and the metrics are computed from
predictions.jsonl alone, so an interrupted run gives the same metrics (the wall times are those of the calls that
made the rows); a rerun into the same --out with a different setting (run.json) is refused.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from eval_aime import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, aggregate, length_stats, problem_metrics
from harness.config import add_options, default_backend
from harness.environments import BUILTIN_PREFIX
from harness.episodes import ROUND_SECONDS
from harness.eval_folder import (
    ROUNDS_FILE,
    append_rows,
    check_identity,
    markdown_table,
    read_predictions,
    read_rounds,
    row_key,
    truncation_warnings,
    write_summary,
)
from harness.eval_setting import (
    EvalConfig,
    check_context,
    eval_identity,
    load_benchmarks,
    load_team,
    resolve_generation,
)
from harness.math_grading import DEFAULT_REWARD, answers_match, normalize_answer
from reward import Reward
from rollout import SamplingConfig, TeamBatch, rollout
from scale.vllm_lora import make_team_backend  # the entry point picks the backend
from team import Problem, Team


# -- Chunks of work, seeding, and rows -------------------------------------------------------------------
def plan_chunks(n_problems: int, k: int, batch_problems: int, sample_chunk: int) -> list[tuple[range, range, int]]:
    """(problem indices, sample indices, chunk index) of every rollout call, in a fixed order."""
    per_call = sample_chunk or k
    return [(range(p0, min(p0 + batch_problems, n_problems)), range(s0, min(s0 + per_call, k)), c)
            for p0 in range(0, n_problems, batch_problems) for c, s0 in enumerate(range(0, k, per_call))]


def chunk_seed(seed: int, bench: str, first_problem: int, chunk: int) -> int:
    """A seed for one rollout call, independent of which calls ran before (sha256: hash() is salted)."""
    digest = hashlib.sha256(f"{seed}/{bench}/{first_problem}/{chunk}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % (2**63)


def seed_all(seed: int) -> None:
    """Seed torch's, Python's and NumPy's global generators for one rollout call (``chunk_seed``)."""
    torch.manual_seed(seed)  # also seeds every CUDA device
    random.seed(seed)
    np.random.seed(seed % (2**32))


def team_source(answers: list[str | None], team_answer: str | None, protocol: str) -> str | None:
    """Which agent the team answer came from: the last (chain) or the first whose answer equals the vote
    (independent); None when no agent answered."""
    if team_answer is None:
        return None
    if protocol == "chain":
        return f"agent_{len(answers)}"
    key = normalize_answer(team_answer)
    return next(f"agent_{i + 1}" for i, a in enumerate(answers) if a is not None and normalize_answer(a) == key)


def batch_rows(batch: TeamBatch, bench: str, problem_indices: range, samples: range, protocol: str,
               reward: Reward = DEFAULT_REWARD) -> list[dict]:
    """predictions.jsonl rows of one rollout call: per trajectory one row per agent (its response) and one
    for the team (its answer and where it came from). A benchmark with a reward of its own also gives each row
    its ``score`` (the team's reward; an agent's own, ``reward.agent_scores``), ``correct`` at the maximum."""
    rows = []
    group = len(samples)
    for i, problem in enumerate(batch.problems):  # rollout orders trajectories problem-major
        base = {"bench": bench, "problem_index": problem_indices[i // group], "problem_id": problem.id,
                "sample": samples[i % group], "gold": problem.answer}
        answers = [t.answers[i] for t in batch.turns]
        tokens = [int(t.response_mask[i].sum()) for t in batch.turns]
        truncated = [bool(t.truncated[i]) for t in batch.turns]
        top = reward.range[1]
        scored = (lambda x: {"score": float(x), "correct": float(x) >= top}) if reward is not DEFAULT_REWARD else None
        for k, turn in enumerate(batch.turns):
            graded = scored(batch.agent_reward[k, i]) if scored else {"correct": bool(batch.agent_reward[k, i])}
            rows.append({**base, "who": f"agent_{k + 1}", "text": turn.texts[i], "answer": answers[k], **graded,
                         "tokens": tokens[k], "truncated": truncated[k]})
        source = team_source(answers, batch.team_answers[i], protocol)
        graded = scored(batch.rewards[i]) if scored else {"correct": answers_match(batch.team_answers[i],
                                                                                   problem.answer)}
        episode = {} if batch.rounds is None else {"text": batch.transcripts[i], "rounds": batch.rounds[i]}
        rows.append({**base, "who": "team", "text": f"team answer from {source or 'no agent (no answer)'}",
                     "source": source, "answer": batch.team_answers[i], **graded,
                     "tokens": sum(tokens), "truncated": any(truncated), **episode})  # its cost: all its agents'
    return rows


# -- Summary (from predictions.jsonl only) ---------------------------------------------------------------
def summarize(rows: list[dict], benches: dict[str, list[Problem]], k: int) -> dict:
    """Metrics and length statistics per benchmark and who, over the planned problems and samples
    0..K-1 (rows of a larger earlier K are ignored)."""
    out = {}
    for bench, problems in benches.items():
        wanted = {p.id for p in problems}
        mine = [r for r in rows if r["bench"] == bench and r["problem_id"] in wanted and r["sample"] < k]
        whos = sorted({r["who"] for r in mine}, key=lambda w: (w != "team", w))
        metrics, lengths = {}, {}
        for who in whos:
            picked = [r for r in mine if r["who"] == who]
            by_problem: dict[str, dict[int, dict]] = {}
            for r in picked:
                by_problem.setdefault(r["problem_id"], {})[r["sample"]] = r
            missing = [p.id for p in problems if len(by_problem.get(p.id, {})) < k]
            if missing:
                raise RuntimeError(f"{bench}/{who}: {len(missing)} problems lack some of the {k} samples "
                                   f"(first: {missing[0]}); rerun the same command to finish them")
            per_problem = []
            for p in problems:
                samples = [by_problem[p.id][s] for s in range(k)]  # in sample order: fixes maj@K tie-breaks
                scores = [r["score"] for r in samples] if "score" in samples[0] else None
                per_problem.append(problem_metrics([r["correct"] for r in samples], [r["answer"] for r in samples],
                                                   p.answer, k, scores))
            metrics[who] = aggregate(per_problem)
            lengths[who] = length_stats([r["tokens"] for r in picked], [r["truncated"] for r in picked])
        out[bench] = {"n_problems": len(problems), "k": k, "metrics": metrics, "lengths": lengths}
        rounds = [r["rounds"] for r in mine if "rounds" in r]
        if rounds:  # an environment's episodes: the rounds the team used, the share solved (team reward at the top)
            out[bench]["rounds"] = {"mean": float(np.mean(rounds)), "max": int(max(rounds))}
            out[bench]["success"] = metrics["team"]["pass@1"]
    return out


def round_seconds(rows: list[dict], planned: set[tuple]) -> dict[str, dict]:
    """Per benchmark, the wall time of the rollout calls that made its planned chunks ((bench, first problem,
    chunk), as ``plan_chunks`` gives them), summed over their rounds and split between the agents' generates, the
    responder model's and the environment's steps (``harness.episodes.round_stats``). A chunk generated again (a
    resumed, half-written one) counts its last call only: a call's rows start at round 1."""
    calls: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["bench"], r["first_problem"], r["chunk"])
        if key in planned:
            if r["round"] == 1:
                calls[key] = []
            calls.setdefault(key, []).append(r)
    out: dict[str, dict] = {}
    for (bench, *_), call in calls.items():
        mine = out.setdefault(bench, {"rounds": 0, **dict.fromkeys(ROUND_SECONDS, 0.0)})
        mine["rounds"] += len(call)
        for key in ROUND_SECONDS:
            mine[key] += sum(r[key] for r in call)
    return out


def report_round_seconds(per_bench: dict, path: Path, benches: dict[str, list[Problem]], cfg: EvalConfig,
                         log) -> None:
    """Add ``round_seconds`` to each environment benchmark of the summary, and log a line for each."""
    planned = {(bench, prob_idx[0], chunk) for bench, problems in benches.items()
               for prob_idx, _, chunk in plan_chunks(len(problems), cfg.k, cfg.batch_problems, cfg.sample_chunk)}
    for bench, seconds in round_seconds(read_rounds(path), planned).items():
        per_bench[bench]["round_seconds"] = seconds
        log(f"{bench}: {seconds['rounds']} rounds over its rollout calls, wall time "
            + " / ".join(f"{seconds[key]:.1f} s" for key in ROUND_SECONDS) + " (agents / responder / steps)")


# -- The evaluation --------------------------------------------------------------------------------------
def missing_chunks(benches: dict[str, list[Problem]], cfg: EvalConfig, whos: list[str], written: set) -> list[tuple]:
    """(bench, problem indices, samples, chunk index, how many of its samples lack a row) of every rollout
    call that predictions.jsonl does not hold whole, in the fixed order of ``plan_chunks``."""
    todo = []
    for bench, problems in benches.items():
        for prob_idx, samples, chunk in plan_chunks(len(problems), cfg.k, cfg.batch_problems, cfg.sample_chunk):
            missing = sum(any((bench, problems[i].id, s, w) not in written for w in whos)
                          for i in prob_idx for s in samples)
            if missing:
                todo.append((bench, prob_idx, samples, chunk, missing))
    return todo


def generate(team: Team, sampler, sampling: SamplingConfig, benches: dict[str, list[Problem]], todo: list[tuple],
             seed: int, pred_path: Path, written: set, total: int) -> None:
    """Run the missing rollout calls, each seeded by ``chunk_seed`` alone, and append each call's rows."""
    from tqdm import tqdm

    rounds_path = pred_path.parent / ROUNDS_FILE
    read_rounds(rounds_path)  # cuts a line a crash tore before this run appends
    pending = sum(t[-1] for t in todo)
    with tqdm(total=total, initial=total - pending, unit="sample", dynamic_ncols=True,
              disable=None) as pbar:  # only on a terminal
        for bench, prob_idx, samples, chunk, missing in todo:
            problems = [benches[bench][i] for i in prob_idx]
            seed_all(chunk_seed(seed, bench, prob_idx[0], chunk))
            batch = rollout(team, problems, len(samples), sampling, backend=sampler, score=False)
            # a half-written chunk is regenerated whole (same seed, same samples); its missing rows added
            rows = [r for r in batch_rows(batch, bench, prob_idx, samples, team.protocol, team.config.reward)
                    if row_key(r) not in written]
            if batch.per_round:  # before the rows that make the chunk whole: a crash between the two reruns it
                append_rows(rounds_path, [{"bench": bench, "first_problem": prob_idx[0], "chunk": chunk, **r}
                                          for r in batch.per_round])
            append_rows(pred_path, rows)
            written.update(row_key(r) for r in rows)
            pbar.update(missing)


def evaluate_benchmarks(cfg: EvalConfig, log=print) -> dict:
    """Generate what predictions.jsonl lacks, then summarise it; returns summary.json's content."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cfg.validate()
    cfg, taken, saved_in = resolve_generation(cfg)  # a --ckpt team samples as its run did, unless told otherwise
    if taken:
        log(f"from {saved_in}: {', '.join(f'{k} {v}' for k, v in taken.items())} (the run's own; "
            f"{' / '.join('--' + k.replace('_', '-') for k in taken)} to override)")
    full = load_benchmarks(cfg)  # before any model loads: a wrong name or no network fails in seconds
    benches = {name: problems[: cfg.limit] for name, problems in full.items()}
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = cfg.backend or default_backend(device)
    identity = eval_identity(cfg, full, backend, device)
    sampling = SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                              token_budget=cfg.token_budget)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    check_identity(out, identity)
    pred_path = out / "predictions.jsonl"
    written = {row_key(r) for r in read_predictions(pred_path)}
    todo = missing_chunks(benches, cfg, ["team"] + [f"agent_{i + 1}" for i in range(len(identity["agents"]))],
                          written)
    total = sum(len(p) for p in benches.values()) * cfg.k
    if todo:
        team = load_team(cfg, identity, device)
        check_context(team, benches, cfg.max_new_tokens)
        log(f"team: {', '.join(identity['agents'])} | protocol {identity['protocol']} | thinking "
            f"{'on' if identity['enable_thinking'] else 'off'} | {device}/{backend} | "
            f"{sum(t[-1] for t in todo)} of {total} samples to generate")
        sampler = make_team_backend(backend, team, cfg.seed, health=False)  # vLLM: an engine per agent, or per base
        try:
            generate(team, sampler, sampling, benches, todo, cfg.seed, pred_path, written, total)
        finally:
            sampler.close()
    per_bench = summarize(read_predictions(pred_path), benches, cfg.k)
    report_round_seconds(per_bench, out / ROUNDS_FILE, benches, cfg, log)
    summary = {"setting": {**identity, "k": cfg.k, "limit": cfg.limit, "batch_problems": cfg.batch_problems,
                           "sample_chunk": cfg.sample_chunk or cfg.k},
               "interval": f"95% percentile bootstrap over problems ({BOOTSTRAP_RESAMPLES} resamples, "
                           f"seed {BOOTSTRAP_SEED})",
               "benchmarks": per_bench}
    write_summary(out, summary)
    log(markdown_table(per_bench, cfg.k))
    for line in truncation_warnings(per_bench, cfg.max_new_tokens):
        log(line)
    return summary


# -- Several settings and their composite (the paper's Table 3: AIME24, AIME25 and ARBench-DC) ---------------
DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def bench_settings(cfg: EvalConfig) -> list[EvalConfig]:
    """A --bench list that names an env:NAME beside other benchmarks, as settings evaluated apart, each in its own
    subfolder of --out: the named datasets together, the data files among the names (e.g. data/aime24.jsonl, the
    offline copies) together, and each env:NAME on its own (its team acts over rounds in that environment)."""
    names = [b.strip() for b in cfg.bench.split(",") if b.strip()]
    envs = [b for b in names if b.startswith(BUILTIN_PREFIX)]
    if cfg.data or not envs or len(names) == 1:
        return [cfg]
    files = [b for b in names if b.endswith(DATA_SUFFIXES)]
    rest = [b for b in names if b not in envs and b not in files]
    sub = lambda name, **kw: replace(cfg, out=str(Path(cfg.out) / name), **kw)  # noqa: E731
    plain = dict(task_option=[], env_model=None)  # an environment's options stay with it
    return ([sub("datasets", bench=",".join(rest), **plain)] if rest else []) + \
        ([sub("files", data=",".join(files), **plain)] if files else []) + \
        [sub(e.replace(":", "_"), bench=e) for e in envs]


def evaluate(cfg: EvalConfig, log=print) -> dict:
    """``evaluate_benchmarks`` once per setting (``bench_settings``); with several, then the team's avg@K of every
    benchmark and their mean, the composite (the paper's Table 3 composite is the mean of AIME24, AIME25 and
    ARBench-DC accuracy), written to composite.json and printed as a table."""
    settings = bench_settings(cfg)
    if len(settings) == 1:
        return evaluate_benchmarks(cfg, log)
    benchmarks = {}
    for sub in settings:
        benchmarks.update(evaluate_benchmarks(sub, log)["benchmarks"])
    team = {name: b["metrics"]["team"][f"avg@{cfg.k}"]["value"] for name, b in benchmarks.items()}
    composite = {"benchmarks": team, "composite": sum(team.values()) / len(team), "k": cfg.k}
    Path(cfg.out, "composite.json").write_text(json.dumps(composite, indent=2) + "\n")
    log(f"team avg@{cfg.k} %, and their mean:\n| " + " | ".join([*team, "composite"]) + " |\n|"
        + "---|" * (len(team) + 1) + "\n| " + " | ".join(f"{100 * v:.1f}" for v in [*team.values(),
                                                                                    composite["composite"]]) + " |")
    return composite


# -- CLI -------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> EvalConfig:
    p = argparse.ArgumentParser(prog="eval_aime.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                argument_default=argparse.SUPPRESS)
    add_options(p, EvalConfig)
    return EvalConfig(**vars(p.parse_args(argv)))


def main(argv=None) -> int:
    cfg = parse_args(argv)
    start = time.time()
    try:
        evaluate(cfg)
    except (ValueError, FileNotFoundError, RuntimeError) as err:  # one line; 2: a bad option or input
        print(f"eval_aime.py: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2 if isinstance(err, ValueError) else 1
    print(f"done in {time.time() - start:.1f} s; predictions and summary.json in {cfg.out}")
    return 0

