"""The vLLM backend's pure parts (``rollout_vllm``, ``vllm_ranks``, ``vllm_weights``), without vLLM installed.

What needs vLLM (real engines sampling, scoring and receiving weights, on CPU
or CUDA) is in ``test_vllm_engine.py``, skipped where vLLM is absent.
"""
import importlib
import inspect
import math
import pickle
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from harness.loading import load_agent
from logprobs import cut_at_eos, left_pad, right_pad
from rollout import SamplingConfig
from scale import memory
from scale import rollout_vllm as rv
from scale import vllm_ranks as vr
from scale import vllm_weights as vw


def tiny_model(tied: bool, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg)


# -- optional dependency -----------------------------------------------------------
def test_import_and_pure_helpers_do_not_import_vllm():
    code = (
        "import sys, torch\n"
        "from scale import rollout_vllm as rv, vllm_ranks, vllm_weights\n"
        "from rollout import SamplingConfig\n"
        "from scale.rollout_vllm import make_backend\n"
        "rv.engine_memory_fractions(3, 0.4)\n"
        "rv.sampling_kwargs(SamplingConfig(), 1, 2)\n"
        "rv.engine_kwargs('m', 0.2, torch.bfloat16, 0, 128)\n"
        "rv.build_requests([[1, 2]])\n"
        "vllm_weights.cpu_payload([('w', torch.ones(2))])\n"
        "vllm_ranks.engine_environment({}, 'cpu')\n"
        "make_backend('vllm', 2, 0).close()  # engines start at the first generate\n"
        "assert 'vllm' not in sys.modules, 'vllm was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True,
                   cwd=str(importlib.import_module("rollout").__file__.rsplit("/", 1)[0]))


# -- memory fractions -----------------------------------------------------------------
def test_engine_memory_fractions_split_what_training_leaves():
    fr = rv.engine_memory_fractions(3, train_fraction=0.4, reserve=0.05)
    assert len(fr) == 3 and fr[0] == fr[1] == fr[2]
    assert sum(fr) == pytest.approx(1 - 0.4 - 0.05)
    assert rv.engine_memory_fractions(1, 0.0, reserve=0.0) == [1.0]


@pytest.mark.parametrize("n,train,needle", [(0, 0.5, "at least one engine"), (3, 1.0, "train_fraction"),
                                            (3, 0.9, "no room for 3 vLLM engines"), (50, 0.5, "--backend hf")])
def test_engine_memory_fractions_errors(n, train, needle):
    with pytest.raises(ValueError) as err:
        rv.engine_memory_fractions(n, train)
    assert needle in str(err.value) and "\n" not in str(err.value)


# -- engine and sampling arguments -------------------------------------------------------
def test_engine_kwargs():
    kw = rv.engine_kwargs("/ckpt/agent_0", 0.25, torch.bfloat16, seed=7, max_model_len=4096)
    assert kw["model"] == "/ckpt/agent_0" and kw["gpu_memory_utilization"] == 0.25 and kw["dtype"] == "bfloat16"
    assert kw["enable_sleep_mode"] is True and kw["skip_tokenizer_init"] is True
    assert kw["generation_config"] == "vllm"  # the checkpoint's top_k=20 etc. must not shape sampling
    assert kw["max_model_len"] == 4096 and kw["seed"] == 7 and "logprobs_mode" not in kw
    assert "kv_cache_memory_bytes" not in kw
    assert rv.engine_kwargs("m", 0.2, torch.float32, 0, 8, logprobs=True)["logprobs_mode"] == "processed_logprobs"
    # the worker extension is importable by the name the engine process will use
    module, cls = kw["worker_extension_cls"].rsplit(".", 1)
    assert getattr(importlib.import_module(module), cls) is vw.WeightSyncExtension
    with pytest.raises(ValueError):
        rv.engine_kwargs("m", 0.2, torch.int8, 0, 8)
    with pytest.raises(ValueError):
        rv.engine_kwargs("m", 0.0, torch.bfloat16, 0, 8)


def test_engine_kwargs_on_cpu():
    """On CPU gpu_memory_utilization would be a share of host memory (the
    default 0.92 is refused) and sleep mode is refused: a KV cache in bytes,
    no sleep mode, eager execution."""
    kw = rv.engine_kwargs("m", 0.25, torch.float32, 0, 256, device="cpu", sleep_mode=False, kv_cache_bytes=64 << 20)
    assert kw["kv_cache_memory_bytes"] == 64 << 20 and kw["enforce_eager"] is True
    assert "gpu_memory_utilization" not in kw and "enable_sleep_mode" not in kw
    with pytest.raises(ValueError, match="KV cache size"):
        rv.engine_kwargs("m", 0.25, torch.float32, 0, 256, device="cpu", sleep_mode=False)


def test_cpu_kv_cache_bytes():

    cfg = load_agent("tiny").model.config  # 4 layers, 2 KV heads of 32
    assert memory.kv_bytes_per_token(cfg, 4) == 2 * 4 * 2 * 32 * 4
    assert memory.cpu_kv_cache_bytes(cfg, 4, 2048) == 64 << 20  # 16 sequences of 2,048 tokens
    assert memory.cpu_kv_cache_bytes(cfg, 4, 16) == 64 << 20  # floor
    big = dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               intermediate_size=12288, vocab_size=151936)
    assert memory.cpu_kv_cache_bytes(big, 2, 32768) == 4 << 30  # cap


def test_sampling_kwargs_match_the_hf_sampler():
    s = SamplingConfig(temperature=0.8, top_p=1.0, max_new_tokens=123)
    kw = rv.sampling_kwargs(s, seed=11, eos_id=5)
    assert kw["n"] == 1 and kw["temperature"] == 0.8 and kw["top_p"] == 1.0 and kw["max_tokens"] == 123
    assert kw["top_k"] in (0, -1) and kw["min_p"] == 0.0 and kw["repetition_penalty"] == 1.0
    assert kw["presence_penalty"] == 0.0 and kw["frequency_penalty"] == 0.0
    assert kw["seed"] == 11 and kw["stop_token_ids"] == [5] and kw["ignore_eos"] is False
    assert kw["logprobs"] is None and rv.sampling_kwargs(s, 1, 5, logprobs=True)["logprobs"] == 0


def test_request_seeds_reproducible_and_distinct():
    from rollout import response_seeds

    a, b = rv.request_seeds(response_seeds(3, 64, 0)), rv.request_seeds(response_seeds(3, 64, 0))
    assert a == b and len(set(a)) == 64 and all(0 <= x < 2 ** 31 - 1 for x in a)
    assert rv.request_seeds([2 ** 31 - 2, 2 ** 31 - 1, 2 ** 31]) == [2 ** 31 - 2, 0, 1]
    assert len(set(a) | set(rv.request_seeds(response_seeds(3, 64, 1)))) == 128  # another agent, other seeds


def test_build_requests_and_lengths():
    reqs = rv.build_requests([[3, 4, 5], torch.tensor([7, 8])])
    assert reqs == [{"prompt_token_ids": [3, 4, 5]}, {"prompt_token_ids": [7, 8]}]
    assert all(type(t) is int for r in reqs for t in r["prompt_token_ids"])
    with pytest.raises(ValueError, match="empty"):
        rv.build_requests([[1], []])
    rv.check_lengths([[1] * 10], max_new_tokens=6, max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        rv.check_lengths([[1] * 11], max_new_tokens=6, max_model_len=16)


# -- outputs -> responses ----------------------------------------------------------------
# The objects below only mimic the *data shape* of vLLM's RequestOutput
# (``.outputs[0].token_ids / finish_reason / stop_reason / logprobs``); the
# functions under test are the conversions.
def request_output(token_ids, finish_reason, stop_reason=None, logprobs=None):
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=token_ids, finish_reason=finish_reason,
                                                    stop_reason=stop_reason, logprobs=logprobs)])


EOS, PAD = 1, 0


def test_outputs_to_responses_cut_like_generate_hf():
    outs = [
        request_output([5, 6, EOS], "stop", EOS),  # stopped on eos, eos included
        request_output([5, 6], "stop", EOS),  # stopped on eos, eos left out: put back
        request_output([7, 8, 9, 9], "length"),  # truncated: keep everything
        request_output([4, EOS, 4, 4], "length"),  # anything after an eos is not part of the response
        request_output((2, 3, EOS), "stop", EOS),  # token ids as a tuple
        request_output([7, PAD, PAD], "length"),  # truncated on sampled pad ids (pad != eos): they are actions
    ]
    got = rv.outputs_to_responses(outs, EOS)
    assert got == [[5, 6, EOS], [5, 6, EOS], [7, 8, 9, 9], [4, EOS], [2, 3, EOS], [7, PAD, PAD]]
    for out, resp in zip(outs[2:4] + outs[5:], got[2:4] + got[5:]):  # identical to the HF path's cut
        assert resp == cut_at_eos(list(out.outputs[0].token_ids), EOS)
    # ... and they pad into the tensors a Turn / TeamBatch holds; the mask covers the sampled pads
    ids, mask = right_pad(got, PAD)
    assert ids.shape == (6, 4) and mask.sum(1).tolist() == [3, 3, 4, 2, 3, 3]
    truncated = torch.tensor([EOS not in r for r in got])
    assert truncated.tolist() == [False, False, True, False, False, True]


def test_outputs_to_logprobs_and_health():
    lp = lambda v: SimpleNamespace(logprob=v)  # noqa: E731  (vLLM's Logprob has a .logprob field)
    outs = [request_output([5, 6, EOS], "stop", EOS, [{5: lp(-0.5)}, {6: lp(-1.0), 9: lp(-3.0)}, {EOS: lp(-0.1)}]),
            request_output([7, 8], "stop", EOS, [{7: -0.2}, {8: -0.3}])]
    resps = rv.outputs_to_responses(outs, EOS)
    got = rv.outputs_to_logprobs(outs, resps)
    assert got[0] == [-0.5, -1.0, -0.1]
    assert got[1][:2] == [-0.2, -0.3] and math.isnan(got[1][2])  # the eos put back has no vLLM log-prob
    hf = torch.tensor([[-0.5, -1.0, -0.1, 0.0], [-0.3, -0.3, -7.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    assert rv.logprob_health(got, hf, mask) == pytest.approx(0.1 / 5)  # only row 1, token 0 differs
    assert rv.logprob_health([[-0.5, -1.0, -0.1]], hf[:1], mask[:1]) == 0.0
    assert math.isnan(rv.logprob_health([[]], hf[:1], torch.zeros(1, 4)))


# -- weight names and tensors --------------------------------------------------------------
def test_vllm_weight_name_mapping():
    q = "model.layers.0.self_attn.q_proj.weight"
    assert vw.vllm_weight_name(q, False) == q
    assert vw.vllm_weight_name("_orig_mod.module.model.norm.weight", False) == "model.norm.weight"
    assert vw.vllm_weight_name("lm_head.weight", tie_word_embeddings=True) is None
    assert vw.vllm_weight_name("lm_head.weight", tie_word_embeddings=False) == "lm_head.weight"
    assert vw.vllm_weight_name("model.rotary_emb.inv_freq", False) is None


@pytest.mark.parametrize("tied", [True, False])
def test_weights_for_vllm_are_the_checkpoint_tensors(tied, tmp_path):
    """vLLM loads exactly the names of a save_pretrained checkpoint, so the
    pushed names must equal them; the tensors are the parameters, not copies."""
    from safetensors import safe_open

    model = tiny_model(tied)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        on_disk = {k: f.get_tensor(k) for k in f.keys()}
    pushed = vw.weights_for_vllm(model)
    assert sorted(n for n, _ in pushed) == sorted(on_disk)
    assert ("lm_head.weight" in on_disk) == (not tied)
    params = dict(model.named_parameters())
    for name, t in pushed:
        assert torch.equal(t, on_disk[name])
        assert t.data_ptr() == params[name].data_ptr() and not t.requires_grad


def test_ipc_rebuild_signature_is_what_the_worker_calls():
    """The worker rebuilds handles as rebuild(*args); the handle format is torch's."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    assert "storage_handle" in inspect.signature(rebuild_cuda_tensor).parameters
    t = torch.ones(3)
    assert vw._materialize(t) is t  # in-process engines get the tensors themselves
    # what crosses the process boundary is plain bytes, unpacked to (name, handle) pairs
    payload = pickle.dumps([("w", (torch.ones, (2,)))])
    (name, obj), = vw._unpack(payload)
    assert name == "w" and torch.equal(vw._materialize(obj), torch.ones(2))
    assert vw._unpack([("w", t)]) == [("w", t)]


# -- versions -------------------------------------------------------------------------------
def test_fingerprint_and_versions_follow_the_weights():
    model = tiny_model(tied=True)
    book = vw.VersionBook()
    v0 = book.observe("a", vw.weights_fingerprint(model.parameters()))
    assert v0 == 0 and book.observe("a", vw.weights_fingerprint(model.parameters())) == 0  # unchanged: same version
    saved = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    v1 = book.observe("a", vw.weights_fingerprint(model.parameters()))
    assert v1 == 1
    with torch.no_grad():  # a one-element change is seen too
        next(model.parameters())[0, 0] += 1e-3
    assert book.observe("a", vw.weights_fingerprint(model.parameters())) == 2
    with torch.no_grad():  # a bit-exact restore (line search rejecting) is a new version of old weights
        for p, s in zip(model.parameters(), saved):
            p.copy_(s)
    assert book.observe("a", vw.weights_fingerprint(model.parameters())) == 3
    assert book.version("a") == 3 and book.version("b") is None
    vw.check_in_sync(3, 3, "agent 1")
    with pytest.raises(RuntimeError, match=r"stale weights.*backend\.sync\(agent\)"):
        vw.check_in_sync(2, 3, "agent 1")
    with pytest.raises(RuntimeError, match="never pushed"):
        vw.check_in_sync(-1, 0, "agent 1")


# -- sleep / wake / push plans -----------------------------------------------------------------
ALL = set(rv.WAKE_TAGS)


def test_plan_wake():
    # a deferred push at the next wake: wake weights, load, wake KV, reset the prefix cache
    assert rv.plan_wake(set(), load=True) == ["wake:weights", "load", "wake:kv_cache", "reset_prefix_cache"]
    assert rv.plan_wake(set(), load=False) == ["wake:weights", "wake:kv_cache", "reset_prefix_cache"]
    assert rv.plan_wake(ALL, load=True) == ["load", "reset_prefix_cache"]  # a new engine: push at once
    assert rv.plan_wake(ALL, load=False) == []
    assert rv.plan_wake({"weights"}, load=True) == ["load", "wake:kv_cache", "reset_prefix_cache"]


def test_plan_sync_and_sleep():
    assert rv.plan_sync(set(), stale=True) == ["defer"]  # asleep (training): pushed at the next wake
    assert rv.plan_sync(ALL, stale=True) == ["load", "reset_prefix_cache"]
    assert rv.plan_sync({"weights"}, stale=True) == ["load"]
    assert rv.plan_sync(ALL, stale=False) == [] and rv.plan_sync(set(), stale=False) == []
    assert rv.plan_sleep(ALL) == ["sleep"] and rv.plan_sleep(set()) == []
    assert rv.plan_sleep({"weights"}) == ["wake:kv_cache", "sleep"]  # vLLM ignores sleep() while half asleep
    assert rv.plan_sleep({"kv_cache"}) == ["wake:weights", "sleep"]
    assert rv.plan_sleep(ALL, sleep_mode=False) == []  # CPU: no sleep mode, engines stay resident


def test_plan_shard_push():
    """A sharded agent's push is a collective: never deferred, and an engine asleep goes back to sleep."""
    assert rv.plan_shard_push(set()) == ["wake:weights", "load", "wake:kv_cache", "sleep"]
    assert rv.plan_shard_push(ALL) == ["load", "reset_prefix_cache"]
    assert rv.plan_shard_push({"weights"}) == ["load"]
    assert rv.plan_shard_push({"kv_cache"}) == ["wake:weights", "load", "reset_prefix_cache", "sleep"]
    assert rv.plan_shard_push(set(), sleep_mode=False) == ["wake:weights", "load"]  # (CPU engines never sleep)


@pytest.mark.parametrize("sleep_mode", [True, False])
@pytest.mark.parametrize("sharded", [False, True])
def test_wake_then_sleep_never_loads_from_disk(sleep_mode, sharded):
    """Walk stages through the plans (as VLLMBackend runs them): every
    rollout samples the agent's current weights, pushed from memory, whether
    the engine sleeps during training (CUDA) or stays resident (CPU), and
    whether a promotion's push waits for the next wake or (a sharded agent,
    ``sync_from_layers``) happens at once; an engine asleep for training
    stays asleep through the promotions (a second agent trains after them)."""
    awake, version, pending, agent_version = set(ALL), -1, False, 0  # a new engine holds disk weights
    for step in ("rollout", "train", "promote", "train", "promote", "rollout", "train", "promote", "rollout", "train",
                 "rollout"):
        if step == "promote" and sharded:
            agent_version += 1
            plan = rv.plan_shard_push(awake, sleep_mode)
        elif step == "promote":
            agent_version += 1
            plan = rv.plan_sync(awake, version != agent_version)
        elif step == "train":
            plan = rv.plan_sleep(awake, sleep_mode)
        else:
            plan = rv.plan_wake(awake, version < 0 or pending)
        for a in plan:
            if a.startswith("wake:"):
                awake.add(a[5:])
            elif a == "sleep" and awake == ALL:  # some vLLM versions ignore sleep() while anything sleeps
                awake.clear()
            elif a == "load":
                assert "weights" in awake  # pushed into resident weights only
                version, pending = agent_version, False
            elif a == "defer":
                pending = True
        if step == "rollout":
            assert version == agent_version and awake == ALL
        if step in ("train", "promote"):
            assert awake == (ALL if not sleep_mode else set())
        if step == "promote" and sharded:
            assert version == agent_version and not pending


# -- transport and the engine-side loader (a stand-in worker, no vLLM) ----------------------------
def test_cpu_payload_is_bytes_that_unpack_to_equal_tensors():
    model = tiny_model(tied=True)
    named = vw.weights_for_vllm(model)
    payload = vw.payload_for(named, in_process=False)
    assert isinstance(payload, bytes)  # vLLM forwards bytes unchanged (tensors it would not)
    back = [(n, vw._materialize(o)) for n, o in vw._unpack(memoryview(payload))]
    assert [n for n, _ in back] == [n for n, _ in named]
    assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for (_, a), (_, b) in zip(back, named))
    assert vw.payload_for(named, in_process=True) is named  # in-process engines get the tensors themselves


class StandInModel(torch.nn.Module):
    """vLLM's model contract, as the extension uses it: load_weights takes
    (name, tensor) pairs and returns the names it loaded."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(2, 2, bias=False)
        self.b = torch.nn.Linear(2, 2, bias=False)

    def load_weights(self, weights):
        loaded = set()
        for name, t in weights:
            self.get_parameter(name).data.copy_(t)
            loaded.add(name)
        return loaded


class StandInWorker(vw.WeightSyncExtension):
    def __init__(self):
        self.model = StandInModel()
        self.model_runner = SimpleNamespace(get_model=lambda: self.model)
        self.reloads = 0

    def get_model(self):
        return self.model

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        assert is_checkpoint_format
        self.reloads += 1
        self.model.load_weights(weights_iterator)


def test_extension_reloads_and_reports_missing_parameters():
    worker = StandInWorker()
    payload = vw.cpu_payload([("a.weight", torch.ones(2, 2)), ("b.weight", 2 * torch.ones(2, 2))])
    assert worker.sat_load_weights(payload) == [] and worker.reloads == 1
    assert torch.equal(worker.model.b.weight, 2 * torch.ones(2, 2))
    assert "load_weights" not in vars(worker.model)  # the recording wrapper is gone again
    assert worker.sat_load_weights(vw.cpu_payload([("a.weight", torch.zeros(2, 2))])) == ["b.weight"]


def test_refresh_packed_copies_reprocesses_modules_that_keep_their_weight():
    calls = []
    method = SimpleNamespace(process_weights_after_loading=lambda m: calls.append(m))
    model = torch.nn.Module()
    model.head = torch.nn.Linear(2, 2)
    model.head.cpu_linear, model.head.quant_method = object(), method  # keeps its weight: refreshed
    model.proj = torch.nn.Linear(2, 2)
    model.proj.cpu_linear, model.proj.quant_method = object(), method
    model.proj.weight = torch.nn.Parameter(torch.empty(0))  # weight moved into the kernel's copy: reloaded already
    model.plain = torch.nn.Linear(2, 2)  # no CPU kernel (CUDA): untouched
    assert vw.refresh_packed_copies(model) == ["head"] and calls == [model.head]


def test_scored_logprobs_reads_the_response_part_of_prompt_logprobs():
    lp = lambda v: SimpleNamespace(logprob=v)  # noqa: E731
    prompt = [3, 4, 5, 6]
    prompt_logprobs = [None, {4: lp(-0.4)}, {5: lp(-0.5), 9: lp(-2.0)}, {6: -0.6}]
    assert rv.scored_logprobs(prompt_logprobs, prompt, 2) == [-0.5, -0.6]


# -- several ranks (torchrun): engine placement, blocks, tensor parallel, pushes in groups ----------
TORCHRUN_ENV = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
                "MASTER_PORT": "29500", "GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "x", "PATH": "/bin", "HF_HOME": "/h"}


def test_engine_environment_isolates_a_ranks_engine():
    """A data-parallel engine must not see torchrun's variables (vLLM would
    read RANK / MASTER_* and join the trainers' group) and on CUDA sees only
    its rank's GPU; one process and tensor-parallel engines keep the environment."""
    one = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "2,3"}
    assert vr.engine_environment(one, "cuda") == one
    cpu = vr.engine_environment(TORCHRUN_ENV, "cpu")
    assert cpu == {"PATH": "/bin", "HF_HOME": "/h"}
    assert vr.engine_environment(TORCHRUN_ENV, "cuda")["CUDA_VISIBLE_DEVICES"] == "1"  # LOCAL_RANK's GPU
    visible = vr.engine_environment({**TORCHRUN_ENV, "CUDA_VISIBLE_DEVICES": "4, 6"}, "cuda")
    assert visible["CUDA_VISIBLE_DEVICES"] == "6" and "RANK" not in visible  # the LOCAL_RANK-th visible one
    with pytest.raises(ValueError, match="one process per visible GPU"):
        vr.engine_environment({**TORCHRUN_ENV, "CUDA_VISIBLE_DEVICES": "4"}, "cuda")
    assert vr.engine_environment(TORCHRUN_ENV, "cuda", tensor_parallel=2) == TORCHRUN_ENV  # the external launcher joins
    assert TORCHRUN_ENV["RANK"] == "3"  # the caller's mapping is not modified


@pytest.mark.parametrize("world,k", [(1, 1), (2, 1), (4, 1), (4, 2), (8, 4), (6, 3)])
def test_engine_blocks_cover_every_block_once_per_engine(world, k):
    """Every block is generated by exactly one engine (data parallel: one rank;
    tensor parallel: all K ranks of one engine group), so the union is the
    one-process batch."""
    n_blocks = 8
    owners = {b: [r for r in range(world) if b in vr.engine_blocks(n_blocks, r, world, k)] for b in range(n_blocks)}
    for b, ranks in owners.items():
        assert len(ranks) == k and ranks == list(range(ranks[0], ranks[0] + k)) and ranks[0] % k == 0, (b, ranks)
    assert sorted({b for r in range(world) for b in vr.engine_blocks(n_blocks, r, world, k)}) == list(range(n_blocks))


def test_blocks_of_rank_follows_the_engines():
    from scale.rollout_hf import HF
    from scale.rollout_vllm import make_backend
    from scale.torchrun import Torchrun

    rank3 = Torchrun(rank=3, world=4)
    assert list(rank3.blocks(8, HF, sharded=False)) == [3, 7]
    for k, blocks in ((1, [3, 7]), (2, [1, 3, 5, 7])):  # K = 2: engine group 1 of 2
        backend = make_backend("vllm", 1, 0, tensor_parallel=k)
        assert backend.tensor_parallel == k and list(rank3.blocks(8, backend, sharded=False)) == blocks
        backend.close()


def test_engine_logprobs_travel_with_each_turn_into_the_health_metric():
    """A turn carries its engine's log-probabilities, block by block through ``rollout_in_blocks`` (so
    every row is compared, whichever rank generated it), and ``health`` compares them per agent with
    the training model's behaviour log-probabilities; the HF backend has none to compare."""
    from harness.math_grading import math_team_config
    from harness.tasks import arithmetic_problems
    from scale.rollout_hf import HF, HFBackend
    from scale.torchrun import rollout_in_blocks
    from team import Team

    class ZeroEngine(HFBackend):  # HF samples; its "engine log-probs" are 0 (probability 1) for every token
        def generate(self, agent, contexts, sampling, seeds):
            self.last = super().generate(agent, contexts, sampling, seeds)
            return self.last

        def last_logprobs(self, agent):
            return [[0.0] * len(r) for r in self.last]

    team = Team([load_agent("tiny", seed=k) for k in range(2)], math_team_config(protocol="chain"))
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=5)
    torch.manual_seed(0)
    batch = rollout_in_blocks(team, arithmetic_problems(3, seed=0), 2, sampling, seed=3, n_blocks=3,
                              backend=ZeroEngine())
    vllm = rv.VLLMBackend(n_engines=2)
    health = vllm.health(team, batch)
    vllm.close()
    for turn, h in zip(batch.turns, health):
        assert [len(r) for r in turn.sampler_logprobs] == turn.response_mask.sum(1).tolist()  # every row, in order
        mask = turn.response_mask.bool()
        assert h == pytest.approx(float(-turn.behaviour_logprobs[mask].mean()), rel=1e-6)
    plain = rollout_in_blocks(team, arithmetic_problems(3, seed=0), 2, sampling, seed=3, n_blocks=3, backend=HF)
    assert HF.health(team, plain) is None and all(t.sampler_logprobs is None for t in plain.turns)


class Echo:
    """Two rounds; the observation repeats the round's responses."""

    max_rounds = 2

    def reset(self, seed: int, **_) -> str:
        return f"Say anything, {seed}."

    def step(self, responses: list[str]) -> tuple[str, bool]:
        return " | ".join(responses), False

    def get_reward(self) -> float:
        return 0.0


def test_an_episodes_engine_logprobs_line_up_with_the_agents_own_tokens_of_every_round():
    """With an environment, each round's engine log-probabilities land on that round's own tokens of the agent's
    whole view (nan on the context between them), so ``health`` compares every round's sampled tokens with the
    training forward's behaviour log-probabilities: here an engine whose log-probs are the training model's on the
    very contexts it was given agrees with them to float rounding; one position off would not."""
    from harness.environments import Environment
    from harness.math_grading import math_team_config
    from rollout import behaviour_logprobs, rollout
    from scale.rollout_hf import HFBackend
    from team import Problem, Team

    class TrainingForwardEngine(HFBackend):  # HF samples; its "engine log-probs": the training forward, per round
        def generate(self, agent, contexts, sampling, seeds):
            drawn = super().generate(agent, contexts, sampling, seeds)
            ctx, cmask = left_pad(contexts, agent.tokenizer.pad_token_id)  # [n, Lc]
            resp, rmask = right_pad(drawn, agent.tokenizer.pad_token_id)  # [n, Lr]
            lp = behaviour_logprobs(agent, (ctx, cmask, resp, rmask), sampling)  # [n, Lr]
            self.last = [lp[i, : len(r)].tolist() for i, r in enumerate(drawn)]
            return drawn

        def last_logprobs(self, agent):
            return self.last

    team = Team([load_agent("tiny", seed=k) for k in range(2)],
                math_team_config(protocol="chain", environment=Environment(Echo, "echo", 2, (0.0, 1.0))))
    rows = [Problem(f"row-{i}", "", "", None, {"seed": i}) for i in range(2)]
    batch = rollout(team, rows, 2, SamplingConfig(temperature=1.0, max_new_tokens=5), TrainingForwardEngine(),
                    seed=4)
    assert batch.rounds == [2] * 4
    for turn, h in zip(batch.turns, rv.VLLMBackend(n_engines=2).health(team, batch)):
        for row, mask in zip(turn.sampler_logprobs, turn.response_mask):
            assert [not math.isnan(v) for v in row] == mask[: len(row)].bool().tolist()  # own tokens, every round
        assert h < 1e-5


def test_tensor_parallel_engine_kwargs_and_refusals():
    kw = rv.engine_kwargs("m", 0.3, torch.bfloat16, 0, 128, tensor_parallel=2)
    assert kw["tensor_parallel_size"] == 2 and kw["distributed_executor_backend"] == "external_launcher"
    assert "distributed_executor_backend" not in rv.engine_kwargs("m", 0.3, torch.bfloat16, 0, 128)
    with pytest.raises(ValueError, match="needs CUDA GPUs"):
        rv.engine_kwargs("m", 0.3, torch.float32, 0, 128, device="cpu", sleep_mode=False, kv_cache_bytes=1 << 20,
                         tensor_parallel=2)
    vr.check_tensor_parallel(1, 3, "cpu", 8, "regenerate")  # K = 1: anything goes
    vr.check_tensor_parallel(2, 4, "cuda:0", 2, "weights")
    for args, needle in (((0, 2, "cuda", 8, "weights"), "must be >= 1"),
                         ((2, 2, "cpu", 8, "weights"), "needs CUDA GPUs"),
                         ((4, 6, "cuda", 8, "weights"), "must divide the number of processes (6)"),
                         ((2, 8, "cuda", 2, "weights"), "use at least 4"),
                         ((2, 4, "cuda", 8, "regenerate"), "--reuse regenerate is not supported")):
        with pytest.raises(ValueError, match=re_escape(needle)) as err:
            vr.check_tensor_parallel(*args)
        assert "\n" not in str(err.value)


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.parametrize("tied", [True, False])
def test_layer_groups_are_the_model_by_decoder_layer(tied):
    """The groups of a plain push: the root's parameters, then one decoder
    layer each, in the order of distributed.full_weights_by_layer; together
    exactly the model's parameters."""
    model = tiny_model(tied)
    groups = vw.layer_groups(model)
    assert len(groups) == 1 + model.config.num_hidden_layers
    assert all(".layers." not in n for n, _ in groups[0]) and any("embed_tokens" in n for n, _ in groups[0])
    for i, group in enumerate(groups[1:]):
        assert group and all(n.startswith(f"model.layers.{i}.") for n, _ in group)
    params = dict(model.named_parameters())
    flat = [(n, t) for g in groups for n, t in g]
    assert sorted(n for n, _ in flat) == sorted(params) and len(flat) == len(params)  # each once: the root first
    assert all(t.data_ptr() == params[n].data_ptr() for n, t in flat)
    sent = [n for g in groups for n, _ in vw.vllm_group(g, tied)]
    assert sorted(sent) == sorted(vw.parameter_specs(model))  # the tied head is not sent


def test_check_group_refuses_shards_casts_unknown_names_and_repeats():
    model = tiny_model(tied=True)
    specs, seen = vw.parameter_specs(model), set()
    group = vw.vllm_group(vw.layer_groups(model)[1], True)
    vw.check_group(group, specs, seen)
    assert seen == {n for n, _ in group}
    name, t = group[0]
    for bad, needle in (([(name, t)], "sent twice"), ([("model.layers.9.x.weight", t)], "not a parameter"),
                        ([(name + "x", t)], "not a parameter")):
        with pytest.raises(RuntimeError, match=needle):
            vw.check_group(bad, specs, set(seen))
    for bad in (t[: t.shape[0] // 2], t.to(torch.bfloat16)):  # one rank's shard; another dtype
        with pytest.raises(RuntimeError, match="push the whole tensor"):
            vw.check_group([(name, bad)], specs, set())


class GroupWorker(vw.WeightSyncExtension):
    """A worker without vLLM's layerwise reload (an older vLLM): groups are collected and loaded at the end."""

    def __init__(self):
        self.model = StandInModel()

    def get_model(self):
        return self.model


def test_push_in_groups_loads_everything_once_at_the_end_without_layerwise_reload():
    worker = GroupWorker()
    assert worker.sat_begin_push() is False
    worker.sat_load_group(vw.cpu_payload([("a.weight", 3 * torch.ones(2, 2))]))
    assert torch.count_nonzero(worker.model.a.weight - 3) > 0  # not yet loaded
    worker.sat_load_group(vw.cpu_payload([("b.weight", 4 * torch.ones(2, 2))]))
    assert worker.sat_end_push() == []
    assert torch.equal(worker.model.a.weight, 3 * torch.ones(2, 2))
    assert torch.equal(worker.model.b.weight, 4 * torch.ones(2, 2))
    worker.sat_begin_push()
    worker.sat_load_group(vw.cpu_payload([("a.weight", torch.zeros(2, 2))]))
    assert worker.sat_end_push() == ["b.weight"]  # a push that misses a parameter is reported


def test_engine_config_of_a_sharded_agent_names_its_architecture(tmp_path):
    """A sharded agent's engine starts from its config alone, with dummy
    weights: the config must name the model class (an in-memory tiny config has
    none, and vLLM then takes the model for a pooling model); a plain agent's
    engine loads its weights as usual."""
    import json

    from scale import distributed

    model = tiny_model(tied=True)
    assert not model.config.architectures and vr.sharded_engine_kwargs(model) == {}
    wrapped = distributed.ShardedLM(model)  # what shard_in_place returns (here without the shards)
    assert vr.sharded_engine_kwargs(wrapped) == {"load_format": "dummy"}
    vr.write_engine_config(wrapped, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert not list(tmp_path.glob("*.safetensors"))


def test_environment_swap_restores_only_what_it_changed(monkeypatch):
    import os

    for k, v in TORCHRUN_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    with vr._environment(vr.engine_environment(dict(os.environ), "cuda")):
        assert "RANK" not in os.environ and "MASTER_PORT" not in os.environ
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "6"
        os.environ["SET_BY_VLLM"] = "0"  # what the engine's constructor sets in this process stays
    assert os.environ["RANK"] == "3" and os.environ["CUDA_VISIBLE_DEVICES"] == "4,6"
    assert os.environ["SET_BY_VLLM"] == "0"
    monkeypatch.delenv("SET_BY_VLLM")
