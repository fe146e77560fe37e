"""A run's memory plan against its device: ``scale.memory``'s estimate of a configured run (``harness.config.Config``:
its agents, its environment's responder, its adapters), checked when the run starts against the GPU
(``check_run``) or, on CPU, against this machine's RAM (MemTotal of /proc/meminfo; nothing is checked where it
cannot be read): ``check_team_ram`` before any weights are loaded, from the configs that can be read without them,
and ``check_run`` once the team is built. The CPU build of vLLM has no sleep mode, so there its engines count in
the training peak too (CPU_VLLM_PEAKS)."""
from __future__ import annotations

import os

from scale.memory import (
    FIXES,
    PEAKS,
    PHASE_NOTES,
    PROMPT_ALLOWANCE,
    QWEN3_DIMS,
    GiB,
    check_fits,
    count_parameters,
    cpu_kv_cache_bytes,
    estimate_memory,
    format_table,
    head_chunk_tokens,
    kv_bytes_per_token,
    run_max_len,
    stage0_rank_bytes,
)


def available_bytes(device) -> int | None:
    """Free accelerator memory now (None on CPU)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return int(torch.cuda.mem_get_info(device)[0])


def run_estimate(cfg, model_config, n_agents: int, responder: tuple[int, int] = (0, 0)) -> dict[str, int]:
    """``estimate_memory`` of a run (``harness.config.Config``) of ``n_agents`` agents, each taken as large as
    ``model_config`` (the biggest agent), per rank; with --upgrade also Stage-0's (``stage0_rank_bytes``, the
    replacement taken to be as large as the biggest agent); ``responder``: its (weights, KV) bytes
    (``responder_plan``)."""
    gpus, dtype_bytes = int(os.environ.get("WORLD_SIZE", "1")), 4 if cfg.dtype == "float32" else 2
    seq = run_max_len(cfg, n_agents)  # prompt allowance (+ earlier answers) + response
    rows = max(1, min(cfg.minibatch_size, cfg.token_budget // seq))  # rows of a training micro-batch
    est = estimate_memory(model_config, n_agents, cfg.update, dtype_bytes=dtype_bytes,
                          micro_batch_tokens=min(cfg.token_budget, cfg.minibatch_size * seq), max_seq_len=seq,
                          gradient_checkpointing=cfg.gradient_checkpointing, backend=cfg.backend,
                          rollout_tokens=cfg.token_budget, logits_chunk_tokens=head_chunk_tokens(rows, seq),
                          trust_region_copies=3 if cfg.kl_check_every else 2,  # + the in-loop inside snapshot
                          gpus=gpus, engine_tensor_parallel=cfg.vllm_tensor_parallel,
                          shard_frozen=bool(cfg.shard_frozen), responder_bytes=responder, **lora_plan(cfg))
    if cfg.upgrade:  # Stage-0 of --upgrade per rank (the replacement taken to be as large as the biggest agent)
        est.update(stage0_rank_bytes(model_config, model_config, n_agents, gpus=gpus,
                                     dtype_bytes=dtype_bytes, micro_batch_tokens=cfg.token_budget,
                                     gradient_checkpointing=cfg.gradient_checkpointing,
                                     shard_frozen=bool(cfg.shard_frozen)))
    return est


def responder_max_len(cfg, n_agents: int) -> int:
    """The longest chat a responder answers, with its reply: the prompt allowance (its system turn, the card) and,
    per round of an episode, a question (one agent turn, at most --max-new-tokens) and its reply (at most
    --env-model-max-tokens): a suspect's memory grows by one exchange a round at most per agent."""
    return PROMPT_ALLOWANCE + (cfg.max_rounds or 1) * n_agents * (cfg.max_new_tokens + cfg.env_model_max_tokens)


def responder_bytes(cfg, config, dtype_bytes: int, n_agents: int, shared: bool) -> tuple[int, int]:
    """(weights, KV cache) bytes of a run's responder of model ``config``, counted once. Its weights: none where it is
    ``shared`` (a --lora base the agents hold); its KV cache: one batched generate's, --token-budget tokens or its
    longest chat (``responder_max_len``), at its own layers' bytes per token. With --backend vllm a shared responder
    adds no KV either: its base's engine answers it from that engine's cache (``kv_cache``), between the agents'
    generates, never beside them, as ``scale.vllm_lora`` serves it. This plan assumes one generate of the responder
    at a time; a responder on an engine of its own is planned as on HF (its weights once, one generate's KV)."""
    if shared and cfg.backend == "vllm":
        return 0, 0
    tokens = max(cfg.token_budget, responder_max_len(cfg, n_agents))
    return (0 if shared else count_parameters(config) * dtype_bytes), tokens * kv_bytes_per_token(config, dtype_bytes)


def responder_plan(cfg, team) -> tuple[int, int]:
    """``responder_bytes`` of the responder a run's environment asks (``team.config.responder``): shared while it is a
    --lora base the agents share (``harness.responder.shares_weights``; a responder sharing an agent's tensors is
    counted, since it takes its own copy when that agent first trains); (0, 0) without one."""
    from harness.responder import shares_weights

    responder = team.config.responder
    if responder is None:
        return 0, 0
    return responder_bytes(cfg, responder.model.config, responder.dtype.itemsize, len(team), shares_weights(team))


def lora_plan(cfg) -> dict:
    """``estimate_memory``'s adapter arguments of a run (--lora): the rank, the targets and how many bases its agents
    share (``harness.lora.base_key``); none without --lora."""
    if cfg.lora is None:
        return {}
    from harness.config import parse_agents
    from harness.lora import base_key, lora_settings

    settings = lora_settings(cfg.lora, cfg.lora_alpha, cfg.lora_targets)
    return {"lora_rank": settings.rank, "lora_targets": settings.targets,
            "n_bases": len({base_key(s) for s in parse_agents(cfg.agents)})}


def _stage0_error(memory: str, est: dict[str, int], available: int) -> ValueError:
    return ValueError(f"not enough {memory} for Stage-0 of --upgrade: about "
                      f"{est['peak_stage0'] / GiB:.1f} GiB but {available / GiB:.1f} GiB are available; "
                      "fix: use a smaller --token-budget or a smaller replacement")


def check_run(cfg, team, log) -> float | None:
    """For a run on CUDA (``harness.config.Config`` and its team): log what each phase needs against what the GPU
    has, and refuse in one line if it cannot fit. On CPU the same against this machine's RAM (``check_ram``).
    Returns the fraction of the GPU that training keeps during rollouts (what the vLLM engines are sized from), or
    None off CUDA."""
    if on_cpu(cfg.device):
        biggest = max(team.agents, key=lambda a: sum(p.numel() for p in a.model.parameters()))
        check_ram(cfg, biggest.model.config, len(team), log, responder_plan(cfg, team))
        return None
    if not cfg.device.startswith("cuda"):
        return None
    biggest = max(team.agents, key=lambda a: sum(p.numel() for p in a.model.parameters()))
    est = run_estimate(cfg, biggest.model.config, len(team), responder_plan(cfg, team))
    available = available_bytes(cfg.device)
    log(format_table(est, available))
    if available is not None:
        check_fits(est, available)
        if est.get("peak_stage0", 0) > available:
            raise _stage0_error("accelerator memory", est, available)
    return min(0.9, est["peak_training"] / max(available or 1, 1))


# -- CPU runs: the plan against this machine's RAM -------------------------------------------------------------------
RAM = "memory (RAM)"  # what check_fits says ran out on CPU
CPU_FIXES = {**FIXES,
             "weights": "put fewer or smaller agents in the team, or use --dtype bfloat16 (half the bytes of float32)",
             "gathered": "use a smaller model (FSDP2 gathers whole layers; the processes of a machine share its RAM)",
             "gathered_rollout": "use a smaller model (FSDP2 gathers whole layers; the processes of a machine share "
                                 "its RAM)"}
CPU_VLLM_NOTES = {**PHASE_NOTES,
                  "kv_cache": "the vLLM engines' KV caches (cpu_kv_cache_bytes each, resident)",
                  "engine_weights": "vLLM engines' copy (resident: no sleep mode on CPU)"}
CPU_VLLM_FIXES = {**CPU_FIXES,
                  "kv_cache": "use --backend hf (each resident vLLM engine keeps its own KV cache)",
                  "engine_weights": "use --backend hf (no second copy of the weights in vLLM engines)"}
# The CPU build of vLLM has no sleep mode: the engines' weights and KV caches stay resident through training.
CPU_VLLM_PEAKS = {"peak_training": PEAKS["peak_training"] + ("engine_weights", "kv_cache"),
                  "peak_rollout": PEAKS["peak_rollout"]}


def on_cpu(device) -> bool:
    return str(device).split(":")[0] == "cpu"


def ram_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """This machine's RAM: MemTotal of /proc/meminfo, in bytes. None where it cannot be read (no /proc/meminfo, as
    on macOS or Windows, or a MemTotal line in another form); then the CPU checks (``check_ram``,
    ``check_team_ram``) check nothing."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    value, unit = line.split()[1:3]
                    return int(value) * 1024 if unit == "kB" else None
    except (OSError, ValueError):
        return None
    return None


def ram_per_process() -> int | None:
    """``ram_bytes`` shared by the processes torchrun starts on this machine ($LOCAL_WORLD_SIZE; 1 without it):
    each holds its own copy of what ``run_estimate`` counts per rank."""
    ram = ram_bytes()
    return None if ram is None else ram // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def cpu_plan(cfg, model_config, n_agents: int, responder: tuple[int, int] = (0, 0)
             ) -> tuple[dict[str, int], dict, dict, dict]:
    """(estimate, peaks, notes, fixes) of a CPU run. With --backend vllm (the CPU build) each agent (--lora: each
    base) has an engine whose KV cache is sized in bytes as ``rollout_vllm`` sizes it (``cpu_kv_cache_bytes`` at the
    run's longest sequence, ``run_max_len``, or the model's max_position_embeddings where that is shorter), and
    engines stay resident in training (CPU_VLLM_PEAKS)."""
    est = run_estimate(cfg, model_config, n_agents, responder)
    if cfg.backend != "vllm":
        return est, PEAKS, PHASE_NOTES, CPU_FIXES
    max_len = (model_config.get("max_position_embeddings") if isinstance(model_config, dict)
               else getattr(model_config, "max_position_embeddings", None)) or 32768
    max_len = min(max_len, run_max_len(cfg, n_agents))
    engines = lora_plan(cfg).get("n_bases", n_agents)  # one per agent, or with --lora one per base
    est["kv_cache"] = engines * cpu_kv_cache_bytes(model_config, 4 if cfg.dtype == "float32" else 2, max_len)
    for peak, parts in CPU_VLLM_PEAKS.items():
        est[peak] = sum(est[p] for p in parts)
    return est, CPU_VLLM_PEAKS, CPU_VLLM_NOTES, CPU_VLLM_FIXES


def check_ram(cfg, model_config, n_agents: int, log=None, responder: tuple[int, int] = (0, 0)) -> None:
    """A CPU run (``harness.config.Config``) of ``n_agents`` agents as large as ``model_config``: log its memory table
    against this machine's RAM (``ram_per_process``) and refuse in one line if a peak does not fit. Where the RAM
    cannot be read, nothing is checked (and the log says so)."""
    available = ram_per_process()
    if available is None:
        if log:
            log("memory: this machine's RAM cannot be read (no MemTotal in /proc/meminfo): no memory check")
        return
    est, peaks, notes, fixes = cpu_plan(cfg, model_config, n_agents, responder)
    if log:
        log(format_table(est, available, peaks, notes))
    check_fits(est, available, RAM, peaks, notes, fixes)
    if est.get("peak_stage0", 0) > available:
        raise _stage0_error(RAM, est, available)


def spec_model_config(spec):
    """The model config of an agent spec (``team.AgentSpec``), read without loading any weights, or None: a
    Qwen3 short name or Qwen/Qwen3-* hub id from QWEN3_DIMS, another hub id whose config.json is in the local
    Hugging Face cache, a local folder's config.json. None for tiny agents (built in code), GGUF files (converted
    on first load) and a config that cannot be read or lacks what ``model_dims`` needs: the check after loading
    (``check_run``) covers those."""
    if spec.kind == "hub":
        name = spec.source.split("/")[-1].lower()
        if spec.source.lower().startswith("qwen/") and name in QWEN3_DIMS:
            return QWEN3_DIMS[name]
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(spec.source, "config.json")
        if not isinstance(cached, str):
            return None
        folder = os.path.dirname(cached)
    elif spec.kind == "local":
        folder = spec.source
    else:
        return None
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        count_parameters(config)  # the dimensions are there
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return config


def spec_responder_bytes(cfg, spec, team_specs) -> tuple[int, int]:
    """``responder_plan`` before any weights load, from the responder's spec (``spec_model_config``): (0, 0) without
    one or where its config cannot be read (the check after loading covers it); shared where --lora makes it the base
    of an agent (``harness.responder``)."""
    config = spec_model_config(spec) if spec is not None else None
    if config is None:
        return 0, 0
    from harness.lora import base_key

    shared = cfg.lora is not None and any(base_key(s) == base_key(spec) for s in team_specs)
    return responder_bytes(cfg, config, 4 if cfg.dtype == "float32" else 2, len(team_specs), shared)


def check_team_ram(cfg, specs, responder=None) -> None:
    """Before any weights are loaded (``harness.run.validate_run_inputs``), on CPU: refuse in one line a team
    (``harness.config.Config``, its agent specs) whose memory plan (``check_ram``) exceeds this machine's RAM, before
    loading it could exhaust the RAM. The team is estimated as ``check_run`` estimates it after loading, every
    slot as large as the agent with the most parameters, taken among the agents whose config
    ``spec_model_config`` reads (tiny and GGUF agents are left to the check after loading), with the environment's
    ``responder`` spec, if any (``spec_responder_bytes``). Nothing is checked off CPU, or where the RAM cannot be
    read."""
    if not on_cpu(cfg.device) or ram_bytes() is None:
        return
    configs = [c for c in map(spec_model_config, dict.fromkeys(specs)) if c is not None]
    if configs:
        check_ram(cfg, max(configs, key=count_parameters), len(specs),
                  responder=spec_responder_bytes(cfg, responder, specs))
