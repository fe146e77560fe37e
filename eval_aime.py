"""Evaluate a team on AIME24 / AIME25 / MATH-500, or any task: avg@K, pass@k, maj@K (paper, Section 6, Table 1).

Paper setting: avg@64 on AIME24/25, avg@4 on MATH-500, temperature 0.8, top_p 1.0, up to 32,768 new tokens.
Each sample is one joint trajectory of the whole team (``rollout.rollout``, as in training); the team answer
is the majority vote (independent) or the last agent's answer (chain).

    python eval_aime.py --agents "Qwen3-4B x3" --thinking --bench aime24,aime25 --k 64 --out runs/eval-base
    python eval_aime.py --ckpt runs/sat --bench aime24,aime25 --k 64 --out runs/eval-sat   # a sat.py run
    python eval_aime.py --agents "Qwen3-4B x3" --data data/aime24.jsonl --k 64             # offline copy
    OMP_NUM_THREADS=1 python eval_aime.py --agents "tiny x3" --data data/aime24.jsonl --limit 5 --k 4 \
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
problem, sample and who), summary.json and run.json. Resumable: rows are appended (fsync) after every chunk,
each chunk is seeded from (seed, benchmark, first problem, chunk), and the summary is computed from
predictions.jsonl alone, so an interrupted run gives the same summary; a rerun into the same --out with a
different setting (run.json) is refused.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from harness import reasoning_gym_task as rg
from harness.config import BACKENDS, add_options, default_backend, opt, parse_agents
from harness.datafiles import load_problems
from harness.loading import check_hub_available, load_agent, load_saved_team
from harness.math_grading import DEFAULT_REWARD, answers_match, majority_vote, math_team_config, normalize_answer
from harness.roles import parse_roles
from harness.run_folder import folder_digests, latest_checkpoint, verify_checkpoint
from harness.tasks import BOXED_INSTRUCTION, canonical_dataset_name, load_dataset_by_name
from harness.user_reward import load_reward
from reward import Reward
from rollout import SamplingConfig, TeamBatch, rollout
from scale.rollout_vllm import make_backend  # the entry point picks the backend
from team import PROTOCOLS, Problem, Team

TRUNCATION_WARNING = 0.05  # warn when more than this share of an agent's responses hit --max-new-tokens
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


# -- Configuration ---------------------------------------------------------------------------------------
@dataclass
class EvalConfig:
    """Every knob of an evaluation; ``None`` is decided at run time."""

    agents: str = opt("Qwen3-4B x3", 'the team, e.g. "Qwen3-4B x3", "tiny x3" (ignored with --ckpt)')
    ckpt: str | None = opt(None, "a sat.py run folder (latest checkpoint), a checkpoints/stage_XXXX folder, or a "
                           "team folder")
    bench: str = opt("aime24,aime25", "comma-separated dataset names: aime24, aime25, math500, or one "
                                      "reasoning-gym:NAME (its held-out questions, scored by its own verifier)")
    data: str | None = opt(None, "comma-separated data files (.jsonl/.json/.csv/.parquet) or Hub ids instead of "
                                 "--bench (each file stem names a benchmark)")
    problem_key: str | None = opt(None, "the problem column of --data (as in sat.py)")
    answer_key: str = opt("answer", "the gold-answer column of --data (as in sat.py)")
    reward: str | None = opt(None, "score samples with this team reward, FILE.py:NAME or package.module:NAME (as in "
                                   "sat.py); default: answer matching, or a reasoning-gym task's own scorer")
    task_option: list[str] = opt([], "KEY=VALUE: the config of a reasoning-gym:NAME benchmark (repeatable)")
    reasoning_gym_size: int = opt(100, "held-out questions generated for a reasoning-gym:NAME benchmark")
    k: int = opt(64, "samples (joint trajectories) per problem (paper: 64 on AIME, 4 on MATH-500)")
    protocol: str | None = opt(None, "default: the checkpoint's, else independent", PROTOCOLS)
    thinking: bool | None = opt(None, "Qwen3's thinking mode (default: the checkpoint's, else off)")
    instruction: str | None = opt(None, "text appended to every problem (default: a --ckpt team's own, else sat.py's "
                                        "boxed-answer one; none for a reasoning-gym:NAME benchmark, whose roles "
                                        "ask for <answer> tags)")
    temperature: float = opt(0.8, "sampling temperature")
    top_p: float = opt(1.0, "nucleus top-p")
    max_new_tokens: int = opt(32768, "new tokens per response at most")
    token_budget: int = opt(1 << 17, "max (context + response) tokens per generate chunk (memory)")
    backend: str | None = opt(None, "default: vllm on a GPU when installed, else hf", BACKENDS)
    device: str | None = opt(None, "default: cuda when available, else cpu")
    seed: int = opt(0, "seeds the sampling of every chunk (and tiny agents' weights, as in sat.py)")
    limit: int | None = opt(None, "evaluate only the first N problems of each benchmark")
    batch_problems: int = opt(1, "problems per rollout call")
    sample_chunk: int = opt(0, "samples per problem per rollout call (0: all K); rows are written after each call")
    out: str = opt("runs/eval", "output folder")

    def validate(self) -> None:
        if self.k < 1:
            raise ValueError(f"--k must be >= 1 (got {self.k})")
        if self.batch_problems < 1:
            raise ValueError(f"--batch-problems must be >= 1 (got {self.batch_problems})")
        if self.sample_chunk < 0:
            raise ValueError(f"--sample-chunk must be >= 0 (got {self.sample_chunk}); 0 means all K samples at once")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1 (got {self.limit})")
        if self.protocol is not None and self.protocol not in PROTOCOLS:
            raise ValueError(f"unknown protocol '{self.protocol}': choose one of {', '.join(PROTOCOLS)}")
        for name in ("max_new_tokens", "token_budget", "temperature"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 (got {getattr(self, name)})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1] (got {self.top_p})")
        if self.backend == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ValueError("--backend vllm but vLLM is not installed: pip install -r requirements-vllm.txt, or "
                             "use --backend hf")
        if not self.ckpt:
            for spec in parse_agents(self.agents):
                check_hub_available(spec)


# -- Metrics (pure functions of per-problem sample outcomes) ---------------------------------------------
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are right: 1 - C(n-c, k) / C(n, k), as the product
    prod_{i<k} (n-c-i) / (n-i) (no huge binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:  # every k-subset contains a right sample
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def majority_correct(answers: list[str | None], gold: str) -> bool:
    """maj@K of one problem (all abstaining is wrong); a tie goes to the answer seen first: deterministic."""
    return answers_match(majority_vote(answers), gold)


def bootstrap_ci(scores: list[float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED,
                 level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of per-problem scores."""
    x = np.asarray(scores, dtype=np.float64)  # [P]
    if len(x) == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(resamples, len(x)))].mean(axis=1)  # [resamples]
    lo, hi = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    return (float(lo), float(hi))


def problem_metrics(correct: list[bool], answers: list[str | None], gold: str, k: int,
                    scores: list[float] | None = None) -> dict[str, float]:
    """avg@K, pass@1, pass@K and maj@K of one problem from its K samples. ``scores``: each sample's reward (a
    benchmark with a reward of its own): avg@K is their mean and maj@K the score of the first sample that gives
    the majority answer; ``correct`` then says which samples earned the reward's maximum."""
    n, c = len(correct), sum(correct)
    if scores is None:
        return {f"avg@{k}": c / n, "pass@1": pass_at_k(n, c, 1), f"pass@{k}": pass_at_k(n, c, k),
                f"maj@{k}": float(majority_correct(answers, gold))}
    majority = majority_vote(answers)
    first = next((s for a, s in zip(answers, scores) if a is not None and majority is not None
                  and normalize_answer(a) == normalize_answer(majority)), 0.0)
    return {f"avg@{k}": sum(scores) / n, "pass@1": pass_at_k(n, c, 1), f"pass@{k}": pass_at_k(n, c, k),
            f"maj@{k}": float(first)}


def aggregate(per_problem: list[dict[str, float]]) -> dict[str, dict]:
    """Mean over problems of each metric, with its 95% bootstrap interval."""
    out = {}
    for name in per_problem[0]:
        scores = [m[name] for m in per_problem]
        out[name] = {"value": float(np.mean(scores)), "ci95": list(bootstrap_ci(scores))}
    return out


def length_stats(tokens: list[int], truncated: list[bool]) -> dict[str, float]:
    """Response length (tokens) and the share that hit --max-new-tokens."""
    return {"mean_tokens": float(np.mean(tokens)), "median_tokens": float(statistics.median(tokens)),
            "max_tokens": int(max(tokens)), "truncated": float(np.mean(truncated))}


# -- Benchmarks and the team -----------------------------------------------------------------------------
def load_benchmarks(cfg: EvalConfig) -> dict[str, list[Problem]]:
    """{benchmark name: every problem} from --data files or --bench names."""
    gym = gym_bench(cfg)
    if cfg.data:
        specs = [p.strip() for p in cfg.data.split(",") if p.strip()]
        benches = {Path(s).stem: load_problems(s, cfg.problem_key, cfg.answer_key) for s in specs}
    elif gym:  # the held-out split sat.py never trains on (seed 1: as sat.py --seed 0 draws its held-out rows)
        benches = {cfg.bench.strip(): rg.reasoning_gym_problems(gym, rg.parse_options(cfg.task_option),
                                                                cfg.reasoning_gym_size, 1, split="heldout")}
    else:
        names = [canonical_dataset_name(b) for b in cfg.bench.split(",") if b.strip()]  # unknown: before downloads
        if not names:
            raise ValueError("empty --bench: give e.g. aime24,aime25 or math500")
        _quiet_hub_logging()
        benches = {}
        for name in names:
            try:
                benches[name] = load_dataset_by_name(name)
            except RuntimeError as err:  # offline: say how to use the local copy
                raise RuntimeError(f"{err}; offline, evaluate a local copy with --data data/{name}.jsonl") from err
    for name, problems in benches.items():
        if not problems:
            raise ValueError(f"benchmark '{name}' has no problems; pass a JSONL file with one problem per line")
        ids = [p.id for p in problems]
        if len(set(ids)) != len(ids):
            raise ValueError(f"benchmark '{name}' has repeated problem ids; give every problem a unique \"id\"")
    return benches


def _quiet_hub_logging() -> None:
    """Offline, the hub client logs five retry lines before failing: keep the one error line instead."""
    try:
        import datasets
        import huggingface_hub.utils.logging as hub_logging
    except ImportError:
        return
    hub_logging.set_verbosity_error()
    datasets.logging.set_verbosity_error()


def team_folder(ckpt: str) -> Path:
    """The folder load_saved_team reads: <stage>/team for a run or stage folder, or a team folder itself."""
    path = Path(ckpt)
    if (path / "team.json").exists():
        return path
    team_dir = latest_checkpoint(path) / "team"
    if not (team_dir / "team.json").exists():
        raise FileNotFoundError(f"--ckpt {ckpt}: no team/team.json in {team_dir.parent}; pass a run folder written "
                                "by sat.py")
    return team_dir


def checkpoint_sha256(folder: Path) -> str:
    """sha256 over the team folder's files (the stage's verified checksums.json when there is one): two
    teams with the same names but different weights never share an --out."""
    manifest = verify_checkpoint(folder.parent) if folder.name == "team" else None
    digests = ({k[len("team/"):]: v for k, v in manifest.items() if k.startswith("team/")} if manifest is not None
               else folder_digests(folder))
    return hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()


def benchmarks_fingerprint(benches: dict[str, list[Problem]]) -> dict[str, str]:
    """sha256 of each benchmark's problems (id, text, gold); --limit only takes a prefix, so it is not part of it."""
    return {name: hashlib.sha256(json.dumps([[p.id, p.problem, p.answer] for p in problems]).encode()).hexdigest()
            for name, problems in benches.items()}


def team_identity(cfg: EvalConfig) -> dict:
    """The team part of what decides which samples are drawn, resolved without loading any weights."""
    if cfg.ckpt:
        folder = team_folder(cfg.ckpt)
        meta = json.loads((folder / "team.json").read_text())
        team = {"ckpt": str(folder.resolve()), "agents": meta["agents"], "weights_sha256": checkpoint_sha256(folder)}
        protocol = cfg.protocol or meta["protocol"]
        thinking = meta.get("enable_thinking", False) if cfg.thinking is None else cfg.thinking
    else:  # tiny weights come from the seed (in the identity); hub weights from their id
        team = {"ckpt": None, "agents": [s.name for s in parse_agents(cfg.agents)], "weights_sha256": None}
        protocol = cfg.protocol or "independent"
        thinking = bool(cfg.thinking)
    gym = gym_bench(cfg)
    roles = meta.get("roles") if cfg.ckpt else None  # the prompts the team was trained with
    if roles is None and gym:
        roles = rg.task_roles(len(team["agents"]), protocol).to_dict()
    saved = meta.get("instruction") if cfg.ckpt else None  # the prompt suffix the team was trained with
    default = "" if gym else saved if saved is not None else BOXED_INSTRUCTION
    instruction = cfg.instruction if cfg.instruction is not None else default
    return {**team, "protocol": protocol, "enable_thinking": thinking, "instruction": instruction, "roles": roles,
            "reward": cfg.reward or (cfg.bench.strip() if gym else None), "temperature": cfg.temperature,
            "top_p": cfg.top_p, "max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed}


def load_team(cfg: EvalConfig, identity: dict, device: str) -> Team:
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    roles = identity["roles"] and parse_roles(identity["roles"], "the team's roles", len(identity["agents"]),
                                              identity["protocol"])
    team_cfg = math_team_config(protocol=identity["protocol"], enable_thinking=identity["enable_thinking"],
                                instruction=identity["instruction"], roles=roles, reward=benchmark_reward(cfg))
    if cfg.ckpt:
        team = load_saved_team(identity["ckpt"], device=device, dtype=dtype)
        team.config = team_cfg  # --instruction replaces the saved one: every team is asked the same question
        return team
    # seed * 100 + k: the same tiny weights as sat.py's initial team
    agents = [load_agent(spec, device=device, dtype=dtype, seed=cfg.seed * 100 + k)
              for k, spec in enumerate(parse_agents(cfg.agents))]
    return Team(agents, team_cfg)


def gym_bench(cfg: EvalConfig) -> str | None:
    """NAME when the benchmark is ``reasoning-gym:NAME`` (and no --data replaces it), else None."""
    return rg.task_name(cfg.bench.strip()) if not cfg.data else None


def benchmark_reward(cfg: EvalConfig) -> Reward:
    """The reward samples are scored with: --reward, a reasoning-gym benchmark's own scorer, or the built-in one."""
    if cfg.reward:
        return load_reward(cfg.reward)
    if gym_bench(cfg):
        return rg.task_reward(cfg.bench.strip(), cfg.task_option)
    return DEFAULT_REWARD


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
            graded = scored(batch.agent_correct[k, i]) if scored else {"correct": bool(batch.agent_correct[k, i])}
            rows.append({**base, "who": f"agent_{k + 1}", "text": turn.texts[i], "answer": answers[k], **graded,
                         "tokens": tokens[k], "truncated": truncated[k]})
        source = team_source(answers, batch.team_answers[i], protocol)
        graded = scored(batch.rewards[i]) if scored else {"correct": answers_match(batch.team_answers[i],
                                                                                   problem.answer)}
        rows.append({**base, "who": "team", "text": f"team answer from {source or 'no agent (no answer)'}",
                     "source": source, "answer": batch.team_answers[i], **graded,
                     "tokens": sum(tokens), "truncated": any(truncated)})  # the team sample's cost: all its agents'
    return rows


def row_key(row: dict) -> tuple:
    return (row["bench"], row["problem_id"], row["sample"], row["who"])


# -- predictions.jsonl: append-only, crash-safe ----------------------------------------------------------
def read_predictions(path: Path) -> list[dict]:
    """The rows written so far, line by line, without their text (a thinking run writes gigabytes). A torn
    last line (a crash) is cut off the file; a repeated key keeps its first row."""
    if not path.exists():
        return []
    rows, seen, good_end = [], set(), 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):  # rows are written whole and newline-terminated: this one is torn
                break
            good_end += len(line)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # cannot come from this program's appends; regenerate it rather than stop
                print(f"eval_aime.py: warning: {path}:{lineno} is not valid JSON; it will be regenerated",
                      file=sys.stderr)
                continue
            if row_key(row) not in seen:
                seen.add(row_key(row))
                rows.append({k: v for k, v in row.items() if k != "text"})
    if good_end < path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return rows


def append_rows(path: Path, rows: list[dict]) -> None:
    """Append rows and force them to disk before the next chunk starts."""
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())


def check_identity(out: Path, identity: dict) -> None:
    """Write run.json on the first run; refuse to mix predictions of a different setting (every key of
    either side is compared, so a checkpoint team and a named team never share an --out)."""
    path = out / "run.json"
    if path.exists():
        saved = json.loads(path.read_text())
        diff = [describe_difference(k, saved.get(k), identity.get(k))
                for k in sorted(set(saved) | set(identity)) if saved.get(k) != identity.get(k)]
        if diff:
            pred = out / "predictions.jsonl"
            holds = ("holds predictions of" if pred.exists() and pred.stat().st_size
                     else "was started (no predictions yet) with")
            raise ValueError(f"--out {out} {holds} a different setting ({'; '.join(diff)}); use a new --out")
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(identity, indent=2))
    os.replace(tmp, path)


def describe_difference(key: str, there, now) -> str:
    """One setting that differs, with both values when they are short."""
    a, b = repr(there), repr(now)
    return f"{key}: {a} there vs {b} now" if len(a) + len(b) <= 80 else f"{key} differs"


def check_context(team: Team, benches: dict[str, list[Problem]], max_new_tokens: int) -> None:
    """Refuse, before generating, a --max-new-tokens that runs past an agent's positions."""
    for k, agent in enumerate(team.agents):
        limit = getattr(agent.model.config, "max_position_embeddings", None)
        if limit is None:
            continue
        longest = max(len(team.prompt_ids(k, p, ["?"] * k)) for problems in benches.values() for p in problems)
        if longest + max_new_tokens > limit:
            raise ValueError(f"--max-new-tokens {max_new_tokens} plus the longest prompt ({longest} tokens) exceeds "
                             f"the context of agent {k + 1} '{agent.spec.name}' ({limit} positions); pass "
                             f"--max-new-tokens {max(limit - longest, 0)} or less")


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
    return out


def markdown_table(summary: dict, k: int) -> str:
    names = [f"avg@{k}", "pass@1", f"pass@{k}", f"maj@{k}"]
    head = ["bench", "who", *[f"{n} % [95% CI]" for n in names], "tokens mean / median / max", "truncated"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for bench, b in summary.items():
        for who, m in b["metrics"].items():
            cells = [f"{100 * m[n]['value']:.1f} [{100 * m[n]['ci95'][0]:.1f}, {100 * m[n]['ci95'][1]:.1f}]"
                     for n in names]
            ln = b["lengths"][who]
            lengths = f"{ln['mean_tokens']:.0f} / {ln['median_tokens']:.0f} / {ln['max_tokens']}"
            lines.append("| " + " | ".join([bench, who, *cells, lengths, f"{100 * ln['truncated']:.1f}%"]) + " |")
    return "\n".join(lines)


def truncation_warnings(summary: dict, max_new_tokens: int) -> list[str]:
    """A truncated thinking model scores as wrong without any error: say so loudly."""
    out = []
    for bench, b in summary.items():
        for who, ln in b["lengths"].items():
            if who != "team" and ln["truncated"] > TRUNCATION_WARNING:
                out.append(f"warning: {bench} {who}: {100 * ln['truncated']:.1f}% of responses hit --max-new-tokens "
                           f"{max_new_tokens} (no end of sequence); their answers are likely missing, so accuracy is "
                           f"underestimated; raise --max-new-tokens (thinking models need up to 32768)")
    return out


# -- The evaluation --------------------------------------------------------------------------------------
def evaluate_benchmarks(cfg: EvalConfig, log=print) -> dict:
    """Generate what predictions.jsonl lacks, then summarise it; returns summary.json's content."""
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cfg.validate()
    full = load_benchmarks(cfg)  # before any model loads: a wrong name or no network fails in seconds
    benches = {name: problems[: cfg.limit] for name, problems in full.items()}
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = cfg.backend or default_backend(device)
    # everything that defines the predictions: team and weights, data, sampling and how work is chunked (seeds)
    identity = {**team_identity(cfg), "benchmarks_sha256": benchmarks_fingerprint(full),
                "backend": backend, "device": torch.device(device).type, "token_budget": cfg.token_budget,
                "batch_problems": cfg.batch_problems, "sample_chunk": cfg.sample_chunk}
    sampling = SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                              token_budget=cfg.token_budget)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    check_identity(out, identity)
    pred_path = out / "predictions.jsonl"
    written = {row_key(r) for r in read_predictions(pred_path)}

    whos = ["team"] + [f"agent_{i + 1}" for i in range(len(identity["agents"]))]
    todo = []  # (bench, problem indices, samples, chunk index, how many of its samples lack a row)
    for bench, problems in benches.items():
        for prob_idx, samples, chunk in plan_chunks(len(problems), cfg.k, cfg.batch_problems, cfg.sample_chunk):
            missing = sum(any((bench, problems[i].id, s, w) not in written for w in whos)
                          for i in prob_idx for s in samples)
            if missing:
                todo.append((bench, prob_idx, samples, chunk, missing))
    total = sum(len(p) for p in benches.values()) * cfg.k
    pending = sum(t[-1] for t in todo)
    if todo:
        team = load_team(cfg, identity, device)
        check_context(team, benches, cfg.max_new_tokens)
        log(f"team: {', '.join(identity['agents'])} | protocol {identity['protocol']} | thinking "
            f"{'on' if identity['enable_thinking'] else 'off'} | {device}/{backend} | {pending} of {total} samples "
            "to generate")
        sampler = make_backend(backend, len(team), cfg.seed, health=False)  # vLLM: one engine per agent
        try:
            with tqdm(total=total, initial=total - pending, unit="sample", dynamic_ncols=True,
                      disable=None) as pbar:  # only on a terminal
                for bench, prob_idx, samples, chunk, missing in todo:
                    problems = [benches[bench][i] for i in prob_idx]
                    seed_all(chunk_seed(cfg.seed, bench, prob_idx[0], chunk))
                    batch = rollout(team, problems, len(samples), sampling, backend=sampler, score=False)
                    # a half-written chunk is regenerated whole (same seed, same samples); its missing rows added
                    rows = [r for r in batch_rows(batch, bench, prob_idx, samples, team.protocol, team.config.reward)
                            if row_key(r) not in written]
                    append_rows(pred_path, rows)
                    written.update(row_key(r) for r in rows)
                    pbar.update(missing)
        finally:
            sampler.close()
    per_bench = summarize(read_predictions(pred_path), benches, cfg.k)
    summary = {"setting": {**identity, "k": cfg.k, "limit": cfg.limit, "batch_problems": cfg.batch_problems,
                           "sample_chunk": cfg.sample_chunk or cfg.k},
               "interval": f"95% percentile bootstrap over problems ({BOOTSTRAP_RESAMPLES} resamples, "
                           f"seed {BOOTSTRAP_SEED})",
               "benchmarks": per_bench}
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, out / "summary.json")
    log(markdown_table(per_bench, cfg.k))
    for line in truncation_warnings(per_bench, cfg.max_new_tokens):
        log(line)
    return summary


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
        evaluate_benchmarks(cfg)
    except (ValueError, FileNotFoundError, RuntimeError) as err:  # one line; 2: a bad option or input
        print(f"eval_aime.py: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2 if isinstance(err, ValueError) else 1
    print(f"done in {time.time() - start:.1f} s; predictions and summary.json in {cfg.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
