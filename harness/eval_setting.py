"""What an evaluation (``eval_aime.py``) is of: its options, the benchmarks and the team they name, and the
identity that decides which samples are drawn.

``EvalConfig`` holds every option (the command line is built from it, as ``harness.cli`` builds sat.py's from
``Config``). From it come the benchmarks (``load_benchmarks``: --data files, --bench names or one reasoning-gym
task), the team (``load_team``: a named team or a sat.py checkpoint, with the prompts it was trained with) and
``eval_identity``: the team, its weights' sha256, the benchmarks' sha256 and every setting that changes the
samples. ``harness.eval_folder`` keeps that identity in run.json, so a rerun into the same --out with another
setting is refused instead of mixing predictions.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from harness import reasoning_gym_task as rg
from harness.config import BACKENDS, opt, parse_agents
from harness.datafiles import load_problems
from harness.environments import (
    Environment,
    episode_reward,
    game_options,
    game_problems,
    load_environment,
    responder_spec,
)
from harness.loading import agent_seed, check_hub_available, load_agent, load_saved_team
from harness.math_grading import DEFAULT_REWARD, math_team_config
from harness.roles import parse_roles
from harness.run_folder import folder_digests, latest_checkpoint, run_folder_of, verify_checkpoint
from harness.tasks import BOXED_INSTRUCTION, canonical_dataset_name, env_game, load_dataset_by_name
from harness.user_reward import load_reward
from reward import Reward
from team import PROTOCOLS, Problem, Team


@dataclass
class EvalConfig:
    """Every knob of an evaluation; ``None`` is decided at run time."""

    agents: str = opt("Qwen3-4B x3", 'the team, e.g. "Qwen3-4B x3", "tiny x3" (ignored with --ckpt)')
    ckpt: str | None = opt(None, "a sat.py run folder (latest checkpoint), a checkpoints/stage_XXXX folder, or a "
                           "team folder")
    bench: str = opt("aime24,aime25", "comma-separated dataset names: aime24, aime25, math500, one "
                                      "reasoning-gym:NAME (its held-out questions, scored by its own verifier), or "
                                      "env:NAME (a built-in environment's held-out episodes); an env:NAME beside other "
                                      "benchmarks (or data files) evaluates each setting apart and prints their "
                                      "composite, the mean of the team's avg@K (the paper's Table 3)")
    env: str | None = opt(None, "the environment the team acts in over rounds, FILE.py:NAME (as in sat.py); "
                                "default: a --ckpt team's own, if it was trained in one")
    max_rounds: int | None = opt(None, "T, the most rounds of an episode (default: the environment's)")
    env_model: str | None = opt(None, "the responder model an environment asks (any --agents spec; as in sat.py)")
    env_model_max_tokens: int = opt(64, "the most new tokens of one responder reply")
    data: str | None = opt(None, "comma-separated data files (.jsonl/.json/.csv/.parquet) or Hub ids instead of "
                                 "--bench (each file stem names a benchmark)")
    problem_key: str | None = opt(None, "the problem column of --data (as in sat.py)")
    answer_key: str = opt("answer", "the gold-answer column of --data (as in sat.py)")
    reward: str | None = opt(None, "score samples with this team reward, FILE.py:NAME or package.module:NAME (as in "
                                   "sat.py); default: answer matching, or a reasoning-gym task's own scorer")
    task_option: list[str] = opt([], "KEY=VALUE: the config of a reasoning-gym:NAME or env:NAME benchmark "
                                     "(repeatable; e.g. instances=planbench for env:blocksworld)")
    reasoning_gym_size: int = opt(100, "held-out questions generated for a reasoning-gym:NAME benchmark, or "
                                       "episodes of an env:NAME one")
    k: int = opt(64, "samples (joint trajectories) per problem (paper: 64 on AIME, 4 on MATH-500)")
    protocol: str | None = opt(None, "default: the checkpoint's, else independent", PROTOCOLS)
    thinking: bool | None = opt(None, "Qwen3's thinking mode (default: the checkpoint's, else off)")
    instruction: str | None = opt(None, "text appended to every problem (default: a --ckpt team's own, else sat.py's "
                                        "boxed-answer one; none for a reasoning-gym:NAME benchmark, whose roles "
                                        "ask for <answer> tags)")
    temperature: float | None = opt(None, "sampling temperature (default: a --ckpt run's own, else 0.8)")
    top_p: float | None = opt(None, "nucleus top-p (default: a --ckpt run's own, else 1.0)")
    max_new_tokens: int | None = opt(None, "new tokens per response at most (default: a --ckpt run's own, else "
                                           "32768)")
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
        for name in ("max_new_tokens", "token_budget", "temperature"):  # None: decided by ``resolve_generation``
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 (got {getattr(self, name)})")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1] (got {self.top_p})")
        if self.backend == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ValueError("--backend vllm but vLLM is not installed: pip install -r requirements-vllm.txt, or "
                             "use --backend hf")
        if not self.ckpt:
            for spec in parse_agents(self.agents):
                check_hub_available(spec)


# -- The benchmarks --------------------------------------------------------------------------------------
def load_benchmarks(cfg: EvalConfig) -> dict[str, list[Problem]]:
    """{benchmark name: every problem} from --data files or --bench names."""
    gym, game = gym_bench(cfg), env_game(cfg.bench.strip()) if not cfg.data else None
    if game:  # the held-out episodes of sat.py --seed 0
        options = game_options(game, cfg.task_option, cfg.env_model)
        return {cfg.bench.strip(): game_problems(game, options, cfg.reasoning_gym_size, 0, "heldout",
                                                 benchmark_environment(cfg).max_rounds)}
    if cfg.data:
        specs = [p.strip() for p in cfg.data.split(",") if p.strip()]
        rows_of_env = benchmark_environment(cfg) is not None  # an environment's rows: no column required
        benches = {Path(s).stem: load_problems(s, cfg.problem_key, cfg.answer_key, environment=rows_of_env)
                   for s in specs}
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


def gym_bench(cfg: EvalConfig) -> str | None:
    """NAME when the benchmark is ``reasoning-gym:NAME`` (and no --data replaces it), else None."""
    return rg.task_name(cfg.bench.strip()) if not cfg.data else None


def benchmark_environment(cfg: EvalConfig) -> Environment | None:
    """The environment the team acts in: --env, an env:NAME benchmark, or the one a --ckpt team was trained in
    (with its T, unless --max-rounds says otherwise)."""
    if cfg.env or env_game(cfg.bench.strip()) and not cfg.data:
        return load_environment(cfg.env or cfg.bench.strip(), cfg.max_rounds)
    saved = json.loads((team_folder(cfg.ckpt) / "team.json").read_text()).get("environment") if cfg.ckpt else None
    if saved:
        return load_environment(saved["spec"], cfg.max_rounds or saved["max_rounds"])
    return None


def benchmark_reward(cfg: EvalConfig) -> Reward:
    """The reward samples are scored with: --reward, an environment's own, a reasoning-gym benchmark's own scorer,
    or the built-in one."""
    if cfg.reward:
        return load_reward(cfg.reward)
    env = benchmark_environment(cfg)
    if env is not None:
        return episode_reward(env)
    if gym_bench(cfg):
        return rg.task_reward(cfg.bench.strip(), cfg.task_option)
    return DEFAULT_REWARD


# -- The identity: what decides which samples are drawn --------------------------------------------------
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


# The paper's evaluation sampling (Section 6: temperature 0.8, top_p 1.0, up to 32,768 new tokens): the default for a
# named team, and for a --ckpt team whose run folder holds no config.json.
GENERATION_DEFAULTS = {"temperature": 0.8, "top_p": 1.0, "max_new_tokens": 32768}


def saved_generation(ckpt: str | None) -> tuple[dict, Path | None]:
    """The sampling settings a --ckpt team was trained and evaluated with (those of GENERATION_DEFAULTS in its run
    folder's config.json, written by sat.py), and that file; ({}, None) for a named team or a team folder that
    lies outside a run folder."""
    if not ckpt:
        return {}, None
    run = run_folder_of(team_folder(ckpt).parent)  # RUN for RUN/checkpoints/stage_XXXX/team
    path = run / "config.json" if run is not None else None
    if path is None or not path.is_file():
        return {}, None
    saved = json.loads(path.read_text())
    return {k: saved[k] for k in GENERATION_DEFAULTS if saved.get(k) is not None}, path


def resolve_generation(cfg: EvalConfig) -> tuple[EvalConfig, dict, Path | None]:
    """``cfg`` with every sampling setting the command line left out (None) taken from the --ckpt run's
    config.json, else from GENERATION_DEFAULTS; also what was taken from the checkpoint, and its file. A --ckpt
    team is asked as it was trained, as with its instruction and roles (``team_identity``)."""
    missing = [k for k in GENERATION_DEFAULTS if getattr(cfg, k) is None]
    saved, path = saved_generation(cfg.ckpt) if missing else ({}, None)
    taken = {k: saved[k] for k in missing if k in saved}
    return replace(cfg, **{k: taken.get(k, GENERATION_DEFAULTS[k]) for k in missing}), taken, path


def team_identity(cfg: EvalConfig) -> dict:
    """The team part of what decides which samples are drawn, resolved without loading any weights."""
    cfg = resolve_generation(cfg)[0]  # the sampling the samples are drawn with, never None
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
    gym = gym_bench(cfg) or env_game(cfg.bench.strip())
    roles = meta.get("roles") if cfg.ckpt else None  # the prompts the team was trained with
    if roles is None and gym_bench(cfg):
        roles = rg.task_roles(len(team["agents"]), protocol).to_dict()
    saved = meta.get("instruction") if cfg.ckpt else None  # the prompt suffix the team was trained with
    default = "" if gym else saved if saved is not None else BOXED_INSTRUCTION
    instruction = cfg.instruction if cfg.instruction is not None else default
    return {**team, "protocol": protocol, "enable_thinking": thinking, "instruction": instruction, "roles": roles,
            "reward": cfg.reward or (cfg.bench.strip() if gym else None), "temperature": cfg.temperature,
            "top_p": cfg.top_p, "max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed,
            **({"environment": env.name, "max_rounds": env.max_rounds} if (env := benchmark_environment(cfg)) else {})}


def eval_identity(cfg: EvalConfig, benches: dict[str, list[Problem]], backend: str, device: str) -> dict:
    """Everything that defines the predictions: the team and its weights, the data (every problem, before
    --limit), the sampling and how the work is chunked (each chunk's seed depends on it)."""
    return {**team_identity(cfg), "benchmarks_sha256": benchmarks_fingerprint(benches),
            "backend": backend, "device": torch.device(device).type, "token_budget": cfg.token_budget,
            "batch_problems": cfg.batch_problems, "sample_chunk": cfg.sample_chunk}


# -- The team --------------------------------------------------------------------------------------------
def load_team(cfg: EvalConfig, identity: dict, device: str) -> Team:
    """The team the identity names, asked with its prompts and scored with the benchmark's reward."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    roles = identity["roles"] and parse_roles(identity["roles"], "the team's roles", len(identity["agents"]),
                                              identity["protocol"])
    team_cfg = math_team_config(protocol=identity["protocol"], enable_thinking=identity["enable_thinking"],
                                instruction=identity["instruction"], roles=roles, reward=benchmark_reward(cfg),
                                environment=benchmark_environment(cfg))
    env = team_cfg.environment
    game = env_game(cfg.bench.strip()) if env is not None and not cfg.data else None
    responder = responder_spec(env, game_options(game, cfg.task_option, cfg.env_model) if game else {},
                               cfg.env_model)
    team_cfg.responder_max_tokens = cfg.env_model_max_tokens
    if cfg.ckpt:
        team = load_saved_team(identity["ckpt"], device=device, dtype=dtype)
        team.config = team_cfg  # --instruction replaces the saved one: every team is asked the same question
    else:  # agent_seed: the same tiny weights as sat.py's initial team
        team = Team([load_agent(spec, device=device, dtype=dtype, seed=agent_seed(cfg.seed, k))
                     for k, spec in enumerate(parse_agents(cfg.agents))], team_cfg)
    if responder:  # tiny weights of the slot after the team's last
        team_cfg.responder = load_agent(parse_agents(responder)[0], device=device, dtype=dtype,
                                        seed=agent_seed(cfg.seed, len(team)))
    return team


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
