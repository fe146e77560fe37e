"""Accelerator memory of a SAT run (on CPU: RAM), estimated from the model config before anything is loaded.

SAT's memory claim (paper, Section 5: agents are updated one at a time) is concrete: only the agent being updated
holds gradients, optimizer state and a frozen reference copy. ``estimate_memory`` gives bytes per component (per rank
under torchrun), so a run says at start whether it fits, and why not:

    weights              every agent's weights
    master_weights       fp32 masters of the agents trained at once (bf16, one process: team.MasterWeightAdamW)
    grads_optimizer      fp32 gradients + AdamW m, v of the agents trained at once (+ one transient bf16 gradient);
                         under torchrun the FSDP2 fp32 copy (master, gradients, m, v: 16 B a parameter) / N
    reference            the frozen pi_j,cur copy for the exact per-state KL
    trust_region_copies  the line search's snapshots (theta_cur, theta_new)
    activations          one micro-batch's saved activations + the LM-head logits chunk + the fp32 head weight
    kv_cache             the rollout's KV cache (HF sampling, or the vLLM engines)
    engine_weights       the vLLM engines' copy of the weights (0 with --backend hf)
    gathered             --shard-frozen (weights, reference, snapshots as FSDP2 shards, 1/N each): units held whole
                         at once in training: two models' root and two decoder layers, two layers' fp32 gradients
    gathered_rollout     --shard-frozen, in the rollout: HF generate as ``gathered``; vLLM one model's root and two
                         layers (the behaviour log-prob forward, or the weight push, one FSDP2 unit at a time)

vLLM sleeps during training and the optimizer is gone during rollouts, so two peaks must fit:

    peak_training = weights + master_weights + grads_optimizer + reference + trust_region_copies + activations
                    + gathered
    peak_rollout  = weights + engine_weights + kv_cache + gathered_rollout

Parameters are counted exactly (Qwen3 layout; tested against ``Qwen3ForCausalLM``); activations are an estimate,
good to tens of percent.

A run's plan (its config, its responder, its adapters), checked at its start against the GPU or, on CPU, this
machine's RAM: ``scale.run_memory``.

    python -m scale.memory --model qwen3-4b --n-agents 3                 # one GPU: the table per component
    python -m scale.memory --model qwen3-8b --rows 2 --gpus 1,2,4,8      # per-rank plan under torchrun
    python -m scale.memory --model qwen3-4b --stage0 qwen3-8b --gpus 1,2,4,8   # Stage-0 of --upgrade, per rank
    python -m scale.memory --model qwen3-4b --rows 2 --lora 64 --gpus 1,2,4,8   # adapters: one GPU a run
"""
from __future__ import annotations

from logprobs import KL_CHUNK_POSITIONS, LOGITS_CHUNK_TOKENS, head_chunk_positions

GiB = 1024 ** 3

PHASES = ("weights", "master_weights", "grads_optimizer", "reference", "trust_region_copies", "activations",
          "kv_cache", "engine_weights", "gathered", "gathered_rollout", "responder_weights", "responder_kv")
PEAKS = {
    "peak_training": ("weights", "master_weights", "grads_optimizer", "reference", "trust_region_copies",
                      "activations", "gathered", "responder_weights"),
    "peak_rollout": ("weights", "engine_weights", "kv_cache", "gathered_rollout", "responder_weights",
                     "responder_kv"),
}
FIXES = {  # one-line fixes per component, for check_fits
    "weights": "put fewer or smaller agents on this GPU, or run under torchrun with --shard-frozen "
               "(every agent as FSDP2 shards over the GPUs)",
    "master_weights": "use --update sequential (joint keeps fp32 master weights of every agent) or a smaller model",
    "grads_optimizer": "use --update sequential (joint keeps optimizer state for every agent) or a smaller model",
    "reference": "use --update sequential (joint keeps a reference copy of every agent) or a smaller model",
    "trust_region_copies": "use a smaller model (the line search keeps theta_cur and theta_new)",
    "activations": "use a smaller --minibatch-size or --token-budget (fewer tokens per micro-batch)",
    "kv_cache": "use a smaller --token-budget or --max-new-tokens, or --backend hf",
    "engine_weights": "use --backend hf (no second copy of the weights in vLLM engines)",
    "gathered": "use more GPUs or a smaller model (FSDP2 gathers whole layers)",
    "gathered_rollout": "use more GPUs or a smaller model (FSDP2 gathers whole layers)",
    "responder_weights": "use a smaller --env-model, or the same model as an agent with --lora (it then shares "
                         "the agents' base)",
    "responder_kv": "use a smaller --token-budget or --env-model-max-tokens",
}
PHASE_NOTES = {
    "weights": "all agents, training copies",
    "master_weights": "fp32 master of the agents updated at once",
    "grads_optimizer": "fp32 grads + AdamW m, v of the agents updated at once",
    "reference": "frozen pi_cur copy for the exact KL",
    "trust_region_copies": "line-search snapshots theta_cur, theta_new",
    "activations": "one micro-batch + LM-head logits chunk",
    "kv_cache": "rollout KV cache",
    "engine_weights": "vLLM engines' copy (asleep in training)",
    "gathered": "--shard-frozen: units gathered whole at once",
    "gathered_rollout": "--shard-frozen: units gathered whole in the rollout",
    "responder_weights": "the environment's responder model (--env-model; none: a --lora base it shares)",
    "responder_kv": "the responder's generate KV cache (none: on a --lora base's vLLM engine, in its kv_cache)",
}


# -- model dimensions and exact parameter count ------------------------------------------------------------------
def model_dims(config) -> dict:
    """The dimensions used here, from a HF config or a dict (head_dim defaults to hidden / heads and the KV heads
    to the heads, as in the HF configs)."""
    def get(key, default=None):
        return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)

    hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
    return {
        "hidden": hidden,
        "layers": int(get("num_hidden_layers")),
        "intermediate": int(get("intermediate_size")),
        "vocab": int(get("vocab_size")),
        "heads": heads,
        "kv_heads": int(get("num_key_value_heads") or heads),
        "head_dim": int(get("head_dim") or hidden // heads),
        "tied": bool(get("tie_word_embeddings", False)),
        "attention_bias": bool(get("attention_bias", False)),
    }


def count_parameters(config) -> int:
    """Exact parameter count of a Qwen3-layout causal LM."""
    d = model_dims(config)
    h, q_dim, kv_dim = d["hidden"], d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    attention = h * q_dim + 2 * h * kv_dim + q_dim * h  # q, k, v, o projections
    if d["attention_bias"]:
        attention += q_dim + 2 * kv_dim + h
    attention += 2 * d["head_dim"]  # q_norm, k_norm: one weight per head dimension, shared by heads
    mlp = 3 * h * d["intermediate"]  # gate, up, down
    norms = 2 * h  # input_layernorm, post_attention_layernorm
    head = 0 if d["tied"] else d["vocab"] * h
    return d["vocab"] * h + d["layers"] * (attention + mlp + norms) + h + head  # embeddings, layers, final norm, head


def linear_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer of a Qwen3-layout decoder layer, by module name."""
    d = model_dims(config)
    h, q_dim, kv_dim, inter = d["hidden"], d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"], d["intermediate"]
    return {"q_proj": (h, q_dim), "k_proj": (h, kv_dim), "v_proj": (h, kv_dim), "o_proj": (q_dim, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def adapter_parameters(config, rank: int, targets: tuple[str, ...] = ("all-linear",)) -> int:
    """Exact parameter count of a LoRA adapter of ``rank`` (A: rank x in, B: out x rank) on the ``targets`` of every
    decoder layer ("all-linear": all seven; a name no layer has counts nothing)."""
    shapes = linear_shapes(config)
    names = list(shapes) if tuple(targets) == ("all-linear",) else [t for t in targets if t in shapes]
    return model_dims(config)["layers"] * sum(rank * sum(shapes[n]) for n in names)


def root_and_layer(config) -> tuple[int, int]:
    """Parameters of FSDP2's root unit (embeddings, final norm, an untied head) and of one decoder layer."""
    d = model_dims(config)
    root = d["vocab"] * d["hidden"] * (1 if d["tied"] else 2) + d["hidden"]
    return root, (count_parameters(config) - root) // d["layers"]


def kv_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    """K and V of every layer for one token."""
    d = model_dims(config)
    return 2 * d["layers"] * d["kv_heads"] * d["head_dim"] * dtype_bytes


PROMPT_ALLOWANCE = 1024  # tokens allowed for a task prompt in its chat template (and for the answers' wrapping)


def run_max_len(cfg, n_agents: int) -> int:
    """The longest sequence a run's rollout reaches (``harness.config.Config``): the prompt allowance, the earlier
    agents' answers in the chain protocol (at most --max-new-tokens each) and the response. An environment's
    episode of T = ``cfg.max_rounds`` rounds grows each agent's view by every agent's turn and an observation (one
    prompt allowance) a round. The vLLM engines of a run are sized to it (``rollout_vllm.make_backend``), the memory
    plan counts it."""
    rounds = cfg.max_rounds or 1
    if rounds > 1:
        return rounds * (PROMPT_ALLOWANCE + n_agents * cfg.max_new_tokens)
    answers = n_agents if cfg.protocol == "chain" else 1
    return PROMPT_ALLOWANCE + answers * cfg.max_new_tokens


def cpu_kv_cache_bytes(config, dtype_bytes: int, max_model_len: int, sequences: int = 16,
                       floor: int = 64 << 20, cap: int = 4 << 30) -> int:
    """A CPU vLLM engine's KV cache (``kv_cache_memory_bytes``): room for ``sequences`` sequences of
    ``max_model_len`` tokens (vLLM needs at least one), within [floor, cap]."""
    want = kv_bytes_per_token(config, dtype_bytes) * int(max_model_len) * int(sequences)
    return int(min(max(want, floor), cap))


def activation_bytes_per_token(config, dtype_bytes: int = 2, gradient_checkpointing: bool = True) -> int:
    """Saved-for-backward bytes of the decoder stack for one token.

    Per layer of the HF Qwen3 forward: each RMSNorm keeps an fp32 copy of its input and its output ((4 + b) per
    element; two of width H, plus q_norm / k_norm over q and k); attention keeps q, k (after RoPE), v and its output
    (b each); the MLP keeps gate, up, act(gate) and their product (4 b I). With gradient checkpointing only each
    layer's input (b H) is kept, plus one layer recomputed in backward."""
    d = model_dims(config)
    b = dtype_bytes
    h, q_dim, kv_dim, inter = d["hidden"], d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"], d["intermediate"]
    full_layer = 2 * (4 + b) * h + (4 + b) * (q_dim + kv_dim) + b * (2 * q_dim + 2 * kv_dim) + 4 * b * inter
    if gradient_checkpointing:
        return d["layers"] * b * h + full_layer
    return d["layers"] * full_layer


def logits_bytes_per_token(config) -> int:
    """The fp32 LM head on one position (``logprobs.head_logits``): logits, tempered logits, log-softmax."""
    return model_dims(config)["vocab"] * 3 * 4


def head_chunk_tokens(rows: int, length: int, chunk_tokens: int = LOGITS_CHUNK_TOKENS) -> int:
    """The largest LM-head chunk of a [rows, length] forward (``logprobs.head_chunk_positions`` of every row)."""
    return rows * min(length, head_chunk_positions(rows, chunk_tokens))


def head_fp32_bytes(config) -> int:
    """The fp32 copy of the LM head weight that ``head_logits`` makes per chunk."""
    d = model_dims(config)
    return d["vocab"] * d["hidden"] * 4


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# -- the estimate ------------------------------------------------------------------------------------------------
def estimate_memory(model_config, n_agents: int, update: str = "sequential", dtype_bytes: int = 2,
                    micro_batch_tokens: int = 8192, max_seq_len: int = 4096, gradient_checkpointing: bool = True,
                    backend: str = "hf", rollout_tokens: int | None = None, logits_chunk_tokens: int | None = None,
                    optimizer_bytes_per_param: int = 8, trust_region_copies: int = 2, gpus: int = 1,
                    engine_tensor_parallel: int = 1, shard_frozen: bool = False, lora_rank: int | None = None,
                    lora_targets: tuple[str, ...] = ("all-linear",), n_bases: int = 1,
                    responder_bytes: tuple[int, int] = (0, 0)) -> dict[str, int]:
    """Bytes per component and the two peaks (module docstring), per rank.

    micro_batch_tokens: tokens of one gradient micro-batch. max_seq_len: the longest context + response.
    rollout_tokens: tokens in the KV cache at once (default max(micro_batch_tokens, max_seq_len)).
    logits_chunk_tokens: positions through the LM head at once (``head_chunk_tokens``). dtype_bytes < 4 adds the
    fp32 masters. gpus: torchrun ranks (the trained agent's fp32 state / gpus; the rest whole on every rank unless
    ``shard_frozen``: weights, reference and snapshots / gpus, plus ``gathered``). engine_tensor_parallel: K of
    ``--vllm-tensor-parallel`` (a rank holds 1/K of every engine). lora_rank (--lora): ``n_bases`` bases shared by
    the agents plus an adapter each (``adapter_parameters``); masters, gradients, AdamW, the reference and the
    snapshots cover an adapter, and an engine holds a base with the adapters (one engine per base).
    responder_bytes: (weights, KV cache) of an environment's responder model (``responder_plan``), counted once."""
    if update not in ("sequential", "joint"):
        raise ValueError(f"update must be 'sequential' or 'joint' (got {update!r})")
    if backend not in ("hf", "vllm"):
        raise ValueError(f"backend must be 'hf' or 'vllm' (got {backend!r})")
    for name, value in (("n_agents", n_agents), ("gpus", gpus), ("engine_tensor_parallel", engine_tensor_parallel)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1 (got {value})")
    d = model_dims(model_config)
    if lora_rank is None:
        params = count_parameters(model_config)  # what one agent trains and the trust region copies
        all_weights = n_agents * params * dtype_bytes
        largest_tensor = max(d["vocab"] * d["hidden"], d["hidden"] * d["intermediate"])  # embedding or an MLP matrix
    else:
        params = adapter_parameters(model_config, lora_rank, lora_targets)
        all_weights = (n_bases * count_parameters(model_config) + n_agents * params) * dtype_bytes
        largest_tensor = lora_rank * max(d["hidden"], d["intermediate"])  # an adapter's A or B
    trained = n_agents if update == "joint" else 1  # agents holding grads + optimizer state at once
    weight_bytes = params * dtype_bytes
    transient_grad = largest_tensor * dtype_bytes if dtype_bytes < 4 else 0  # a bf16 grad before its fp32 add
    rollout_tokens = rollout_tokens if rollout_tokens is not None else max(micro_batch_tokens, max_seq_len)
    chunk = logits_chunk_tokens if logits_chunk_tokens is not None else min(micro_batch_tokens, LOGITS_CHUNK_TOKENS)
    train_act = micro_batch_tokens * activation_bytes_per_token(model_config, dtype_bytes, gradient_checkpointing)
    kl_check = KL_CHUNK_POSITIONS * 2 * logits_bytes_per_token(model_config)  # the exact KL: one chunk of two models
    estimate = {
        "weights": all_weights,
        "master_weights": trained * params * 4 if dtype_bytes < 4 and gpus == 1 else 0,
        "grads_optimizer": (trained * params * (4 + optimizer_bytes_per_param) + transient_grad if gpus == 1
                            else _ceil_div(trained * params * (4 + 4 + optimizer_bytes_per_param), gpus)),
        "reference": trained * weight_bytes,
        "trust_region_copies": trained * trust_region_copies * weight_bytes,
        "activations": max(train_act + chunk * logits_bytes_per_token(model_config), kl_check)
        + head_fp32_bytes(model_config),
        "kv_cache": max(rollout_tokens, max_seq_len) * kv_bytes_per_token(model_config, dtype_bytes),
        "engine_weights": _ceil_div(all_weights, engine_tensor_parallel) if backend == "vllm" else 0,
        "gathered": 0,
        "gathered_rollout": 0,
        "responder_weights": responder_bytes[0],
        "responder_kv": responder_bytes[1],
    }
    if shard_frozen and gpus > 1:
        for part in ("weights", "reference", "trust_region_copies"):
            estimate[part] = _ceil_div(estimate[part], gpus)
        root, layer = root_and_layer(model_config)
        one_model = (root + 2 * layer) * dtype_bytes
        estimate["gathered"] = 2 * one_model + 2 * layer * 4
        estimate["gathered_rollout"] = one_model if backend == "vllm" else estimate["gathered"]
    for peak, parts in PEAKS.items():
        estimate[peak] = sum(estimate[p] for p in parts)
    return estimate


STAGE0_RANK_NOTES = {
    "stage0_team": "the team's agents, the incumbent among them (whole on every rank)",
    "stage0_pi_pre": "the replacement as loaded, frozen (whole)",
    "stage0_replacement": "the replacement's weights that measure the KL (whole; each pass's result written in)",
    "stage0_train_state": "the trainable copy: N = 1: grads + AdamW (+ fp32 master in bf16); "
                          "N > 1: fp32 shards, grads, AdamW / N",
    "stage0_gathered": "N > 1: FSDP2 units gathered at once (root + 2 layers; with --shard-frozen of 3 models; "
                       "2 layers' fp32 grads)",
    "stage0_activations": "this rank's rows of a micro-batch: trunk activations + pi_pre's and pi_cur's hidden states",
    "stage0_logits_blocks": "LM-head blocks of STAGE0_LOGITS_BUDGET fp32 elements, 8 live",
    "stage0_sharding": "N > 1, while the trainable copy is made: a whole copy + one fp32 layer "
                       "(before the optimizer exists)",
}


def stage0_rank_bytes(team_config, replacement_config, n_agents: int, gpus: int = 1, dtype_bytes: int = 2,
                      micro_batch_tokens: int = 8192, logits_budget: int = 1 << 22, optimizer_bytes_per_param: int = 8,
                      gradient_checkpointing: bool = True, live_blocks: int = 8,
                      shard_frozen: bool = False) -> dict[str, int]:
    """Per-rank bytes of Stage-0 of ``--upgrade`` (Eqs. (6)-(7), ``plug_and_play.fit_stage0``) with ``gpus`` ranks
    (STAGE0_RANK_NOTES). The trainable copy is made from a deep copy (``stage0_sharding``) before the optimizer
    state exists, so the peak takes the larger. ``shard_frozen`` (gpus > 1): team, pi_pre and replacement are
    shards (1/N each), the copy is built shard by shard, and three models' roots and two layers each are gathered.

        peak_stage0 = team + pi_pre + replacement + logits blocks + max(train_state + gathered + activations, sharding)
    """
    p_team, p_new = count_parameters(team_config), count_parameters(replacement_config)
    root, layer = root_and_layer(replacement_config)
    if gpus == 1:
        state = p_new * (4 + optimizer_bytes_per_param + (4 if dtype_bytes < 4 else 0))
    else:
        state = _ceil_div(p_new * (4 + 4 + optimizer_bytes_per_param), gpus)
    per_token = (activation_bytes_per_token(replacement_config, dtype_bytes, gradient_checkpointing)
                 + 2 * model_dims(replacement_config)["hidden"] * dtype_bytes)
    parts = {
        "stage0_team": n_agents * p_team * dtype_bytes,
        "stage0_pi_pre": p_new * dtype_bytes,
        "stage0_replacement": p_new * dtype_bytes,
        "stage0_train_state": state,
        "stage0_gathered": (root + 2 * layer) * dtype_bytes + 2 * layer * 4 if gpus > 1 else 0,
        "stage0_activations": _ceil_div(micro_batch_tokens, gpus) * per_token,
        "stage0_logits_blocks": live_blocks * logits_budget * 4,
        "stage0_sharding": p_new * dtype_bytes + 4 * layer if gpus > 1 else 0,
    }
    if shard_frozen and gpus > 1:
        for key in ("stage0_team", "stage0_pi_pre", "stage0_replacement"):
            parts[key] = _ceil_div(parts[key], gpus)
        parts["stage0_gathered"] = 3 * (root + 2 * layer) * dtype_bytes + 2 * layer * 4
        parts["stage0_sharding"] = 0
    fit = parts["stage0_train_state"] + parts["stage0_gathered"] + parts["stage0_activations"]
    parts["peak_stage0"] = (parts["stage0_team"] + parts["stage0_pi_pre"] + parts["stage0_replacement"]
                            + parts["stage0_logits_blocks"] + max(fit, parts["stage0_sharding"]))
    return parts


# -- verdicts and tables -----------------------------------------------------------------------------------------
def check_fits(estimate: dict[str, int], available_bytes: int, memory: str = "accelerator memory",
               peaks: dict | None = None, notes: dict | None = None, fixes: dict | None = None) -> None:
    """A one-line ValueError naming the peak that does not fit, its largest component and the fix; None if it fits.
    The component blamed is the largest one a flag can shrink (the weights only when they alone do not fit).
    ``memory`` names what ran out ("memory (RAM)" on CPU); ``peaks``, ``notes``, ``fixes`` replace PEAKS,
    PHASE_NOTES and FIXES (a CPU run: ``cpu_plan``)."""
    peaks, notes, fixes = peaks or PEAKS, notes or PHASE_NOTES, fixes or FIXES
    for peak, parts in peaks.items():
        need = estimate[peak]
        if need <= available_bytes:
            continue
        movable = [p for p in parts if p != "weights" and estimate[p] > 0]
        worst = "weights" if estimate["weights"] > available_bytes or not movable else max(movable, key=estimate.get)
        raise ValueError(
            f"not enough {memory}: {peak.replace('peak_', '')} needs about {need / GiB:.1f} GiB "
            f"but {available_bytes / GiB:.1f} GiB are available; largest part: {worst} "
            f"{estimate[worst] / GiB:.1f} GiB ({notes[worst]}); fix: {fixes[worst]}"
        )


def format_table(estimate: dict[str, int], available: int | None = None, peaks: dict | None = None,
                 notes: dict | None = None) -> str:
    """GiB per component and peak, for the start of a run (``peaks``, ``notes``: as in ``check_fits``)."""
    peaks, notes = peaks or PEAKS, notes or PHASE_NOTES
    rows = [f"{'memory phase':<20} {'GiB':>9}  note"]
    rows += [f"{phase:<20} {estimate[phase] / GiB:>9.2f}  {notes[phase]}" for phase in PHASES]
    rows += [f"{peak:<20} {estimate[peak] / GiB:>9.2f}  = {' + '.join(parts)}" for peak, parts in peaks.items()]
    if "peak_stage0" in estimate:  # a plug-and-play upgrade (stage0_rank_bytes)
        rows.append(f"{'peak_stage0':<20} {estimate['peak_stage0'] / GiB:>9.2f}  = team + pi_pre + replacement + "
                    f"LM-head blocks + max(train state + gathered + activations, sharding) (Stage-0 of --upgrade)")
    if available is not None:
        verdict = "fits" if max(estimate[p] for p in peaks) <= available else "does NOT fit"
        rows.append(f"{'available':<20} {available / GiB:>9.2f}  {verdict}")
    return "\n".join(rows)


def _fit_columns(need: int, gib_list: list[float]) -> str:
    return "  ".join(f"{'fits' if need <= g * GiB else 'NO':>10}" for g in gib_list)


def plan_table(model: str, n_agents: int, gpus_list: list[int], gib_list: list[float], shard_frozen: bool = True,
               **kw) -> str:
    """Per-rank peaks (estimates) for each number of GPUs and whether they fit GPUs of each size (GiB as the driver
    reports it: cards sold as "80 GB" and "141 GB" report about 79.6 and 140.4 GiB). ``shard_frozen``: agents,
    reference and snapshots as FSDP2 shards for gpus > 1 (the run's default on CUDA), else whole on every rank."""
    how = ("agents, reference and line-search snapshots as FSDP2 shards (--shard-frozen)" if shard_frozen
           else "agents, reference and line-search snapshots whole on every rank (--no-shard-frozen)")
    rows = [f"ESTIMATES (not measured): {model} x{n_agents}, per-rank plan (gpus > 1: {how})",
            f"{'gpus':>4} {'train/rank GiB':>15} {'rollout/rank GiB':>17} {'grads+AdamW/rank':>17}  "
            + "  ".join(f"{g:>6g} GiB" for g in gib_list)]
    for n in gpus_list:
        est = estimate_memory(QWEN3_DIMS[model], n_agents, gpus=n, shard_frozen=shard_frozen, **kw)
        rows.append(f"{n:>4} {est['peak_training'] / GiB:>15.1f} {est['peak_rollout'] / GiB:>17.1f} "
                    f"{est['grads_optimizer'] / GiB:>17.1f}  {_fit_columns(max(est[p] for p in PEAKS), gib_list)}")
    return "\n".join(rows)


def lora_plan_table(model: str, n_agents: int, rank: int, gpus_list: list[int], gib_list: list[float], **kw) -> str:
    """--lora on a node of N GPUs: sat.py runs a team of adapters as one process on one GPU (it refuses torchrun
    with --lora: the agents' shared base would have to be one set of FSDP2 shards for all of them), so whatever N is,
    a run's peaks are the one-GPU plan, and N GPUs hold N such runs (seeds) side by side, not one run faster."""
    est = estimate_memory(QWEN3_DIMS[model], n_agents, gpus=1, lora_rank=rank, **kw)
    fits = _fit_columns(max(est[p] for p in PEAKS), gib_list)
    rows = [f"ESTIMATES (not measured): {model} x{n_agents} --lora {rank}, one process on one GPU at any --gpus "
            "(sat.py refuses torchrun with --lora): N GPUs run N such runs side by side",
            f"{'gpus':>4} {'train/GPU GiB':>15} {'rollout/GPU GiB':>17} {'grads+AdamW/GPU':>17} {'runs':>5}  "
            + "  ".join(f"{g:>6g} GiB" for g in gib_list)]
    rows += [f"{n:>4} {est['peak_training'] / GiB:>15.1f} {est['peak_rollout'] / GiB:>17.1f} "
             f"{est['grads_optimizer'] / GiB:>17.1f} {n:>5}  {fits}" for n in gpus_list]
    return "\n".join(rows)


def stage0_plan_table(model: str, replacement: str, n_agents: int, gpus_list: list[int], gib_list: list[float],
                      **kw) -> str:
    """Per-rank Stage-0 peaks (estimates) of ``--upgrade SLOT=replacement`` in a team of ``n_agents`` x ``model``
    for each number of GPUs, and whether they fit (``stage0_rank_bytes``)."""
    keys = ("stage0_team", "stage0_pi_pre", "stage0_replacement", "stage0_train_state", "stage0_gathered",
            "stage0_activations", "stage0_logits_blocks", "stage0_sharding")
    short = ("team", "pi_pre", "repl.", "train", "gather", "activ.", "logits", "sharding")
    how = ", --shard-frozen (team, pi_pre, replacement as FSDP2 shards)" if kw.get("shard_frozen") else ""
    rows = [f"ESTIMATES (not measured): Stage-0 of --upgrade to {replacement} in a team of {model} x{n_agents}{how}, "
            "GiB per rank",
            f"{'gpus':>4} " + " ".join(f"{s:>8}" for s in short) + f" {'peak':>8}  "
            + "  ".join(f"{g:>6g} GiB" for g in gib_list)]
    for n in gpus_list:
        est = stage0_rank_bytes(QWEN3_DIMS[model], QWEN3_DIMS[replacement], n_agents, gpus=n, **kw)
        rows.append(f"{n:>4} " + " ".join(f"{est[k] / GiB:>8.1f}" for k in keys)
                    + f" {est['peak_stage0'] / GiB:>8.1f}  {_fit_columns(est['peak_stage0'], gib_list)}")
    rows += [f"  {s}: {STAGE0_RANK_NOTES[k]}" for s, k in zip(short, keys)]
    rows.append("  peak = team + pi_pre + repl. + logits + max(train + gather + activ., sharding)")
    return "\n".join(rows)


# The published Qwen3 dense models' dimensions (their config.json), so a table needs no download.
QWEN3_DIMS = {
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, intermediate_size=3072, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, num_hidden_layers=28, intermediate_size=6144, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, num_hidden_layers=36, intermediate_size=9728, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, intermediate_size=12288, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    "qwen3-14b": dict(hidden_size=5120, num_hidden_layers=40, intermediate_size=17408, num_attention_heads=40,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    "qwen3-32b": dict(hidden_size=5120, num_hidden_layers=64, intermediate_size=25600, num_attention_heads=64,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
}


def main(argv=None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m scale.memory",
                                description="Print the memory estimate of a SAT run (no download).")
    p.add_argument("--model", default="qwen3-4b", choices=sorted(QWEN3_DIMS))
    p.add_argument("--n-agents", type=int, default=3)
    p.add_argument("--update", default="sequential", choices=["sequential", "joint"])
    p.add_argument("--backend", default="vllm", choices=["hf", "vllm"])
    p.add_argument("--rows", type=int, default=32, help="sequences per gradient micro-batch (--minibatch-size)")
    p.add_argument("--max-seq-len", type=int, default=33792, help="prompt + max new tokens")
    p.add_argument("--rollout-tokens", type=int, default=1 << 17,
                   help="tokens in the KV cache at once (--token-budget)")
    p.add_argument("--no-checkpointing", action="store_true")
    p.add_argument("--available-gib", type=float, default=None)
    p.add_argument("--gpus", default="1", help="processes / GPUs under torchrun, e.g. 4 or 1,2,4,8 (per-rank plan)")
    p.add_argument("--vllm-tensor-parallel", type=int, default=1, help="ranks per vLLM engine (each holds 1/K of it)")
    p.add_argument("--gpu-gib", default="79.6,140.4",
                   help="memory per GPU in GiB as the driver reports it, for the fit columns of the per-rank plan "
                        "(an H100 80GB reports 79.6, an H200 140.4)")
    p.add_argument("--stage0", default=None, choices=sorted(QWEN3_DIMS), metavar="MODEL",
                   help="per-rank plan of Stage-0 of --upgrade SLOT=MODEL in a team of --n-agents x --model, "
                        "for --gpus")
    p.add_argument("--shard-frozen", action=argparse.BooleanOptionalAction, default=True,
                   help="per-rank plan (gpus > 1) with the agents, the reference and the line-search snapshots as "
                        "FSDP2 shards, as a torchrun run on CUDA holds them (--no-shard-frozen: whole on every rank)")
    p.add_argument("--lora", type=int, default=None, metavar="RANK",
                   help="agents as LoRA adapters of this rank (all linear layers) on one shared base, as sat.py --lora "
                        "RANK holds them (one process on one GPU: with --gpus N, N such runs side by side)")
    args = p.parse_args(argv)
    if args.lora is not None and args.lora < 1:
        p.exit(2, f"{p.prog}: error: --lora must be >= 1 (got {args.lora})\n")
    if args.lora is not None and args.stage0:
        p.exit(2, f"{p.prog}: error: --lora with --stage0: the planner has no Stage-0 plan of adapters (sat.py checks "
                  "an upgrade's Stage-0 as whole weights, an upper bound); drop one of them\n")
    for name in ("n_agents", "rows", "max_seq_len", "rollout_tokens", "vllm_tensor_parallel"):
        if getattr(args, name) < 1:
            p.exit(2, f"{p.prog}: error: --{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})\n")
    if args.available_gib is not None and args.available_gib <= 0:
        p.exit(2, f"{p.prog}: error: --available-gib must be > 0 (got {args.available_gib})\n")
    gpus, gib = [int(g) for g in str(args.gpus).split(",")], [float(g) for g in args.gpu_gib.split(",")]
    checkpointing = not args.no_checkpointing
    if args.stage0:  # micro-batches of --rollout-tokens (= --token-budget)
        print(stage0_plan_table(args.model, args.stage0, args.n_agents, gpus, gib,
                                micro_batch_tokens=args.rollout_tokens, gradient_checkpointing=checkpointing,
                                shard_frozen=args.shard_frozen))
        return
    kw = dict(update=args.update, micro_batch_tokens=args.rows * args.max_seq_len, max_seq_len=args.max_seq_len,
              gradient_checkpointing=checkpointing, backend=args.backend, rollout_tokens=args.rollout_tokens,
              logits_chunk_tokens=head_chunk_tokens(args.rows, args.max_seq_len),
              engine_tensor_parallel=args.vllm_tensor_parallel)
    if args.lora is not None and (len(gpus) > 1 or gpus[0] > 1):
        print(lora_plan_table(args.model, args.n_agents, args.lora, gpus, gib, **kw))
        return
    kw.update({"lora_rank": args.lora} if args.lora is not None else {})
    if len(gpus) > 1 or gpus[0] > 1:
        print(plan_table(args.model, args.n_agents, gpus, gib, shard_frozen=args.shard_frozen, **kw))
        return
    est = estimate_memory(QWEN3_DIMS[args.model], args.n_agents, **kw)
    print(f"{args.model} x{args.n_agents}, {args.update} update, backend {args.backend}: "
          f"{count_parameters(QWEN3_DIMS[args.model]) / 1e9:.3f} B parameters per agent")
    if args.lora is not None:
        print(f"--lora {args.lora}: one base shared by the {args.n_agents} agents, each a LoRA adapter of "
              f"{adapter_parameters(QWEN3_DIMS[args.model], args.lora) / 1e6:.1f} M parameters on all linear layers"
              " (what trains, the reference, the snapshots)")
    print(format_table(est, int(args.available_gib * GiB) if args.available_gib else None))


if __name__ == "__main__":
    main()
