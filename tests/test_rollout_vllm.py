"""The vLLM backend's pure parts, on CPU and without vLLM installed.

What needs vLLM and a GPU (an engine sampling, sleeping and receiving weights)
is in the last test, which is skipped unless both are present.
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

import rollout_vllm as rv
from logprobs import cut_at_eos, right_pad
from rollout import SamplingConfig


def tiny_model(tied: bool, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg)


# -- optional dependency -----------------------------------------------------------
def test_import_and_pure_helpers_do_not_import_vllm():
    code = (
        "import sys, torch, rollout_vllm as rv\n"
        "from rollout import SamplingConfig\n"
        "rv.engine_memory_fractions(3, 0.4)\n"
        "rv.sampling_kwargs(SamplingConfig(), 1, 2)\n"
        "rv.engine_kwargs('m', 0.2, torch.bfloat16, 0, 128)\n"
        "rv.build_requests([[1, 2]])\n"
        "assert 'vllm' not in sys.modules, 'vllm was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(importlib.import_module("rollout").__file__.rsplit("/", 1)[0]))


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
    assert rv.engine_kwargs("m", 0.2, torch.float32, 0, 8, logprobs=True)["logprobs_mode"] == "processed_logprobs"
    # the worker extension is importable by the name the engine process will use
    module, cls = kw["worker_extension_cls"].rsplit(".", 1)
    assert getattr(importlib.import_module(module), cls) is rv.WeightSyncExtension
    with pytest.raises(ValueError):
        rv.engine_kwargs("m", 0.2, torch.int8, 0, 8)
    with pytest.raises(ValueError):
        rv.engine_kwargs("m", 0.0, torch.bfloat16, 0, 8)


def test_sampling_kwargs_match_the_hf_sampler():
    s = SamplingConfig(temperature=0.8, top_p=1.0, max_new_tokens=123)
    kw = rv.sampling_kwargs(s, seed=11, eos_id=5)
    assert kw["n"] == 1 and kw["temperature"] == 0.8 and kw["top_p"] == 1.0 and kw["max_tokens"] == 123
    assert kw["top_k"] in (0, -1) and kw["min_p"] == 0.0 and kw["repetition_penalty"] == 1.0
    assert kw["presence_penalty"] == 0.0 and kw["frequency_penalty"] == 0.0
    assert kw["seed"] == 11 and kw["stop_token_ids"] == [5] and kw["ignore_eos"] is False
    assert kw["logprobs"] is None and rv.sampling_kwargs(s, 1, 5, logprobs=True)["logprobs"] == 0


def test_request_seeds_reproducible_and_distinct():
    torch.manual_seed(3)
    a = rv.request_seeds(rv.draw_base_seed(), 64)
    torch.manual_seed(3)
    b = rv.request_seeds(rv.draw_base_seed(), 64)
    assert a == b and len(set(a)) == 64 and all(0 <= x < 2 ** 31 - 1 for x in a)
    assert rv.request_seeds(2 ** 31 - 2, 3) == [2 ** 31 - 2, 0, 1]


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
    ]
    got = rv.outputs_to_responses(outs, EOS, PAD)
    assert got == [[5, 6, EOS], [5, 6, EOS], [7, 8, 9, 9], [4, EOS], [2, 3, EOS]]
    for out, resp in zip(outs[2:4], got[2:4]):  # identical to the HF path's cut
        assert resp == cut_at_eos(list(out.outputs[0].token_ids), EOS, PAD)
    # ... and they pad into the tensors a Turn / TeamBatch holds
    ids, mask = right_pad(got, PAD)
    assert ids.shape == (5, 4) and mask.sum(1).tolist() == [3, 3, 4, 2, 3]
    truncated = torch.tensor([EOS not in r for r in got])
    assert truncated.tolist() == [False, False, True, False, False]


def test_outputs_to_logprobs_and_health():
    lp = lambda v: SimpleNamespace(logprob=v)  # noqa: E731  (vLLM's Logprob has a .logprob field)
    outs = [request_output([5, 6, EOS], "stop", EOS, [{5: lp(-0.5)}, {6: lp(-1.0), 9: lp(-3.0)}, {EOS: lp(-0.1)}]),
            request_output([7, 8], "stop", EOS, [{7: -0.2}, {8: -0.3}])]
    resps = rv.outputs_to_responses(outs, EOS, PAD)
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
    assert rv.vllm_weight_name("model.layers.0.self_attn.q_proj.weight", False) == "model.layers.0.self_attn.q_proj.weight"
    assert rv.vllm_weight_name("_orig_mod.module.model.norm.weight", False) == "model.norm.weight"
    assert rv.vllm_weight_name("lm_head.weight", tie_word_embeddings=True) is None
    assert rv.vllm_weight_name("lm_head.weight", tie_word_embeddings=False) == "lm_head.weight"
    assert rv.vllm_weight_name("model.rotary_emb.inv_freq", False) is None


@pytest.mark.parametrize("tied", [True, False])
def test_weights_for_vllm_are_the_checkpoint_tensors(tied, tmp_path):
    """vLLM loads exactly the names of a save_pretrained checkpoint, so the
    pushed names must equal them; the tensors are the parameters, not copies."""
    from safetensors import safe_open

    model = tiny_model(tied)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        on_disk = {k: f.get_tensor(k) for k in f.keys()}
    pushed = rv.weights_for_vllm(model)
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
    assert rv._materialize(t) is t  # in-process engines get the tensors themselves
    # what crosses the process boundary is plain bytes, unpacked to (name, handle) pairs
    payload = pickle.dumps([("w", (torch.ones, (2,)))])
    (name, obj), = rv._unpack(payload)
    assert name == "w" and torch.equal(rv._materialize(obj), torch.ones(2))
    assert rv._unpack([("w", t)]) == [("w", t)]


# -- versions -------------------------------------------------------------------------------
def test_fingerprint_and_versions_follow_the_weights():
    model = tiny_model(tied=True)
    book = rv.VersionBook()
    v0 = book.observe("a", rv.weights_fingerprint(model))
    assert v0 == 0 and book.observe("a", rv.weights_fingerprint(model)) == 0  # unchanged: same version
    saved = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    v1 = book.observe("a", rv.weights_fingerprint(model))
    assert v1 == 1
    with torch.no_grad():  # a one-element change is seen too
        next(model.parameters())[0, 0] += 1e-3
    assert book.observe("a", rv.weights_fingerprint(model)) == 2
    with torch.no_grad():  # a bit-exact restore (line search rejecting) is a new version of old weights
        for p, s in zip(model.parameters(), saved):
            p.copy_(s)
    assert book.observe("a", rv.weights_fingerprint(model)) == 3
    assert book.version("a") == 3 and book.version("b") is None
    rv.check_in_sync(3, 3, "agent 1")
    with pytest.raises(RuntimeError, match="sync_weights"):
        rv.check_in_sync(2, 3, "agent 1")


# -- sleep / wake / push plans -----------------------------------------------------------------
ALL = set(rv.WAKE_TAGS)


def test_plan_wake():
    # the brief's order after a promotion: wake weights, load, wake KV, reset the prefix cache
    assert rv.plan_wake(set(), stale=True) == ["wake:weights", "load", "wake:kv_cache", "reset_prefix_cache"]
    assert rv.plan_wake(set(), stale=False) == ["wake:weights", "wake:kv_cache", "reset_prefix_cache"]
    assert rv.plan_wake(ALL, stale=True) == ["load", "reset_prefix_cache"]  # a new engine: push at once
    assert rv.plan_wake(ALL, stale=False) == []
    assert rv.plan_wake({"weights"}, stale=True) == ["load", "wake:kv_cache", "reset_prefix_cache"]


def test_plan_sync_and_sleep():
    assert rv.plan_sync(set(), stale=True) == []  # asleep (training): pushed at the next wake
    assert rv.plan_sync(ALL, stale=True) == ["load", "reset_prefix_cache"]
    assert rv.plan_sync({"weights"}, stale=True) == ["load"]
    assert rv.plan_sync(ALL, stale=False) == []
    assert rv.plan_sleep(ALL) == ["sleep"] and rv.plan_sleep(set()) == []
    assert rv.plan_sleep({"weights"}) == ["wake:kv_cache", "sleep"]  # vLLM ignores sleep() while half asleep


def test_wake_then_sleep_never_loads_from_disk():
    """Walk a stage through the plans: a stale engine is always loaded from
    memory before it samples, and no plan ever reloads the checkpoint."""
    awake, version, agent_version = set(ALL), -1, 0  # a new engine holds disk weights
    log = []
    for step in ("rollout", "train", "promote", "rollout", "train", "rollout"):
        if step == "promote":
            agent_version += 1
            plan = rv.plan_sync(awake, version != agent_version)
        elif step == "train":
            plan = rv.plan_sleep(awake)
        else:
            plan = rv.plan_wake(awake, version != agent_version)
        for a in plan:
            if a.startswith("wake:"):
                awake.add(a[5:])
            elif a == "sleep":
                awake.clear()
            elif a == "load":
                version = agent_version
        log.append((step, plan))
        if step == "rollout":
            assert version == agent_version and awake == ALL
    assert all("reload" not in a for _, plan in log for a in plan)


# -- vLLM itself (GPU only) ------------------------------------------------------------------------
def test_vllm_engine_end_to_end():
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("vLLM engines need a CUDA GPU")
    from rollout import SamplingConfig as SC
    from logprobs import batched_response_logprobs, left_pad
    from team import Agent

    agent = Agent.load("tiny", device="cuda", dtype=torch.bfloat16, seed=0)
    reg = rv.configure(n_engines=1, train_fraction=0.5, health_logprobs=True, enforce_eager=True)
    try:
        sampling = SC(temperature=1.0, max_new_tokens=8, backend="vllm")
        contexts = [agent.encode_prompt([{"role": "user", "content": f"{a}+{a}"}]) for a in range(10, 18)]
        tok = agent.tokenizer

        def health():
            resp = rv.generate_vllm(agent, contexts, sampling)
            assert all(len(r) <= 8 for r in resp) and all(tok.eos_token_id not in r[:-1] for r in resp)
            ctx, cmask = left_pad(contexts, tok.pad_token_id)
            ids, mask = right_pad(resp, tok.pad_token_id)
            hf = batched_response_logprobs(agent.model, (ctx, cmask, ids, mask), 1.0, 1 << 14)
            return rv.logprob_health(rv.last_logprobs(agent), hf, mask)

        assert health() < 0.05  # engine created from disk, then given the in-memory weights
        with torch.no_grad():
            for p in agent.model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        rv.sleep_all()
        rv.sync_weights(agent)  # asleep: pushed at the next wake
        assert health() < 0.05  # sampled from the new weights, not the backed-up old ones
        reg.assert_in_sync(agent)
    finally:
        rv.shutdown()
