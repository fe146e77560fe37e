"""Shared-prefix forwards (logprobs.shared_prefix_hidden_states): each distinct
context of a call computed once, the responses run against its expanded
keys/values. Checked against the plain forward over group structures, padding
and both protocols' shapes (grouped contexts, all-distinct contexts), with
gradients; and the property the ratios rely on: a row's result does not depend
on which other rows share its call (fp32 and bf16), so log r is exactly 0
before the first step."""
import copy
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import logprobs
import sat
from logprobs import left_pad, response_hidden_states, right_pad, shared_prefix_hidden_states, turn_forward
from tasks import arithmetic_problems
from team import Agent, Team, TeamConfig
from trust_region import QuantileController

from test_sat import small_config


@pytest.fixture(scope="module")
def agent():
    return Agent.load("tiny", seed=0)


def grouped_turn(vocab: int, groups: list[tuple[int, int]], resp_lens: list[int], seed: int):
    """Rows of (context length, rows sharing it) groups; left-padded contexts, right-padded responses."""
    g = torch.Generator().manual_seed(seed)
    contexts, responses = [], []
    for length, rows in groups:
        ctx = torch.randint(5, vocab, (length,), generator=g).tolist()
        contexts += [ctx] * rows
    for n in resp_lens[: len(contexts)]:
        responses.append(torch.randint(5, vocab, (n,), generator=g).tolist())
    return (*left_pad(contexts, 0), *right_pad(responses, 0))


@settings(max_examples=20)
@given(groups=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 4)), min_size=1, max_size=6),
       resp_lens=st.lists(st.integers(1, 5), min_size=24, max_size=24), seed=st.integers(0, 2**16))
def test_shared_prefix_forward_equals_the_plain_forward(agent, groups, resp_lens, seed):
    """Any group structure (all-distinct contexts, as the chain protocol's later agents see, included)."""
    ctx, cmask, resp, rmask = grouped_turn(agent.model.config.vocab_size, groups, resp_lens, seed)
    with torch.no_grad():
        plain = response_hidden_states(agent.model, ctx, cmask, resp, rmask)  # [N, Lr, H]
        shared = shared_prefix_hidden_states(agent.model, ctx, cmask, resp, rmask)  # [N, Lr, H]
    valid = rmask.bool()
    assert shared.shape == plain.shape
    torch.testing.assert_close(shared[valid], plain[valid], atol=1e-5, rtol=1e-5)


def test_shared_prefix_gradients_equal_the_plain_forward(agent):
    """Gradients reach the shared context through the expanded cache, summed over its rows."""
    ctx, cmask, resp, rmask = grouped_turn(agent.model.config.vocab_size, [(5, 4), (3, 1), (7, 3)], [3, 1, 4, 2] * 6, 1)
    model = copy.deepcopy(agent.model).requires_grad_(True)
    grads = []
    for forward in (response_hidden_states, shared_prefix_hidden_states):
        model.zero_grad(set_to_none=True)
        hidden = forward(model, ctx, cmask, resp, rmask)  # [N, Lr, H]
        logp = logprobs.token_logprobs_from_hidden(model, hidden, resp, 1.0)  # [N, Lr]
        (-(logp * rmask).sum()).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    assert any(float(g.abs().max()) > 1e-3 for g in grads[0])  # the check is not vacuous


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_rows_sharing_its_call(agent, dtype, monkeypatch):
    """Different groupings of the same rows (subsets, orders, a context's rows
    split between calls) give bit-identical rows, and every call makes exactly
    two base-model calls whatever its rows (a sharded agent's ranks must match)."""
    monkeypatch.setattr(logprobs, "SHARE_PREFIX", True)
    model = copy.deepcopy(agent.model).to(dtype)
    turn_like = grouped_turn(model.config.vocab_size, [(6, 4), (2, 4), (7, 4), (4, 4), (6, 2), (1, 3)], [1, 4, 2, 3, 4] * 5, 3)
    calls = []
    model.base_model.register_forward_pre_hook(lambda *_: calls.append(1))
    n = turn_like[0].shape[0]
    with torch.no_grad():
        whole, hidden = turn_forward(model, turn_like, slice(None), 1.0)  # [N, Lr], [N, Lr, H]
        assert len(calls) == 2
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
        for part in (perm[:5], perm[5:12], perm[12:], torch.arange(n - 1, -1, -1), torch.tensor([0]), torch.tensor([3, 4])):
            lp, h = turn_forward(model, turn_like, part, 1.0)
            assert torch.equal(lp, whole[part]) and torch.equal(h, hidden[part])
    assert len(calls) == 2 * 7
    assert float(whole.abs().max()) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [True, False])
def test_a_measurement_computes_each_distinct_row_once(agent, dtype, shared, monkeypatch):
    """Without gradients (behaviour log-probs, KL checks), rows that repeat
    (a group's samples that agree) run once and are copied, on the
    shared-prefix forward and on the plain one (a turn where sharing does not
    pay, --share-prefix on): the response pass sees the 30 distinct rows of
    90, and every row's log-probs and hidden states are bit for bit those of
    the row computed alone. With gradients every row runs (their gradients
    must sum inside the backward's matmuls)."""
    logprobs.set_share_prefix(True, *(() if shared else (1, 4096)))  # one-row training calls: sharing never pays
    model = copy.deepcopy(agent.model).to(dtype)
    distinct = grouped_turn(model.config.vocab_size, [(6, 10), (3, 10), (7, 10)], [1, 5, 2, 4, 3] * 6, 4)  # 30 rows
    order = torch.randperm(90, generator=torch.Generator().manual_seed(1)) % 30  # each row three times, shuffled
    turn_like = [t[order] for t in distinct]
    rows_seen = []
    model.base_model.register_forward_pre_hook(lambda _m, _a, kw: rows_seen.append(kw["input_ids"].shape[0]), with_kwargs=True)
    assert logprobs.prefix_sharing_pays(turn_like) is shared
    with torch.no_grad():
        lp, hidden = turn_forward(model, turn_like, slice(None), 1.0)  # [90, Lr], [90, Lr, H]
        # distinct contexts, then distinct rows; or the distinct rows with their contexts
        assert rows_seen == ([max(3, logprobs.min_call_rows(7)), 30] if shared else [30])
        for i in range(90):
            lp_i, h_i = turn_forward(model, turn_like, torch.tensor([i]), 1.0)
            assert torch.equal(lp_i, lp[i : i + 1]) and torch.equal(h_i, hidden[i : i + 1])
    rows_seen.clear()
    turn_forward(model.requires_grad_(True), turn_like, slice(None), 1.0)
    assert rows_seen[-1] == 90
    assert float(lp.abs().max()) > 0


@pytest.mark.parametrize("protocol", ["independent", "chain"])
@pytest.mark.parametrize("sharing", ["every turn", "where it pays", "never"])
def test_shared_prefix_stage_has_log_ratio_exactly_zero_before_the_first_step(tmp_path, monkeypatch, protocol, sharing):
    """A whole fp32 stage with shared-prefix forwards in every turn, or as
    ``sat.run`` sets it (in the turns where 16-row calls compute fewer tokens
    so: in the chain protocol agent 2's turn, not agent 1's), or with the
    plain forward only (--no-share-prefix): behaviour log-probs of the frozen
    agents over the rollout, training log-probs in shuffled micro-batches of
    the agent whose weights now require grad: log r = 0 exactly."""
    torch.manual_seed(0)
    team = Team([Agent.load("tiny", seed=k) for k in range(2)], TeamConfig(protocol=protocol))
    cfg = small_config(tmp_path, protocol=protocol, minibatch_size=16 if sharing == "where it pays" else 12, epochs=2)
    logprobs.set_share_prefix(sharing != "never", *((cfg.minibatch_size, cfg.token_budget) if sharing == "where it pays" else ()))
    decided = {}  # context width -> the turn's choice
    monkeypatch.setattr(logprobs, "prefix_sharing_pays", lambda t, f=logprobs.prefix_sharing_pays: decided.setdefault(t[0].shape[1], f(t)))
    sampling = sat.SamplingConfig(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, token_budget=cfg.token_budget)
    controllers = {k: QuantileController(delta=cfg.delta, quantile=cfg.quantile, beta=cfg.beta) for k in range(2)}
    record = sat.sat_stage(team, arithmetic_problems(8, seed=1), cfg, sampling, controllers, {}, random.Random(0))
    assert [rec["step0_log_ratio_max"] for rec in record["agents"]] == [0.0, 0.0]
    if sharing == "where it pays" and protocol == "chain":
        assert sorted(decided.values()) == [False, True]  # the two turns took different forwards


def test_share_prefix_option_defaults_from_gradient_checkpointing():
    assert sat.Config(device="cpu").apply_preset().share_prefix is True  # tiny preset: no gradient checkpointing
    assert sat.Config(device="cpu", gradient_checkpointing=True).apply_preset().share_prefix is False
    assert sat.parse_args(["--no-share-prefix"]).share_prefix is False
    with pytest.raises(ValueError, match="--share-prefix needs the key/value cache"):
        sat.Config(device="cpu", share_prefix=True, gradient_checkpointing=True).apply_preset().validate()


def test_log_probs_do_not_depend_on_whether_the_weights_require_grad(agent):
    """The plain forward's positions are a strided slice of the hidden states:
    the LM head must not let torch pick its matmul kernel by the weight's
    requires_grad (the agent being trained) against the frozen agent that
    scored the rollout. Bit for bit, under no_grad and with gradients."""
    model = copy.deepcopy(agent.model)
    turn_like = grouped_turn(model.config.vocab_size, [(7, 4), (5, 4), (6, 4), (3, 4)] * 2, [4, 3, 2, 4] * 8, 1)
    with torch.no_grad():
        frozen = turn_forward(model.requires_grad_(False), turn_like, slice(None), 1.0)[0]  # [32, Lr]
        trained = turn_forward(model.requires_grad_(True), turn_like, slice(None), 1.0)[0]
    assert torch.equal(frozen, trained)
    assert torch.equal(turn_forward(model, turn_like, slice(None), 1.0)[0].detach(), frozen)
    assert float(frozen.abs().max()) > 0
    assert logprobs.head_logits(model, torch.zeros(0, 3, model.config.hidden_size)).shape == (0, 3, model.config.vocab_size)


@settings(max_examples=40, deadline=None)
@given(counts=st.lists(st.integers(1, 4), min_size=1, max_size=5), data=st.data())
def test_expected_distinct_contexts_equals_brute_force(counts, data):
    """E[distinct contexts among m rows drawn without replacement] against the
    average over every m-subset of the rows."""
    from itertools import combinations

    n = sum(counts)
    m = data.draw(st.integers(1, n))
    owner = [c for c, k in enumerate(counts) for _ in range(k)]  # row -> its context
    subsets = list(combinations(range(n), m))
    brute = sum(len({owner[r] for r in s}) for s in subsets) / len(subsets)
    assert logprobs.expected_distinct(torch.tensor(counts), n, m) == pytest.approx(brute, rel=1e-12)


def shapes_turn(groups: int, rows: int, lc: int, lr: int, distinct: bool = False):
    """A turn of ``groups`` contexts of ``lc`` tokens x ``rows`` rows each (all
    rows' contexts distinct with ``distinct``), responses of ``lr`` tokens."""
    ctx = torch.arange(groups * rows if distinct else groups).repeat_interleave(1 if distinct else rows)[:, None] + torch.zeros(1, lc, dtype=torch.long)
    return ctx, torch.ones_like(ctx), torch.ones(groups * rows, lr, dtype=torch.long), torch.ones(groups * rows, lr, dtype=torch.long)


@pytest.mark.parametrize("groups,rows,lc,lr,distinct,minibatch,budget,pays", [
    (16, 4, 7, 32, False, 16, 4096, False),  # the matched workload: 11.1 expected contexts, padded to 19 x 7 + 16 x 32 = 645 > 624 tokens
    (64, 8, 7, 4, False, 128, 4096, True),  # the tiny default: 57.7 expected contexts x 7 + 128 x 4 = 916 < 1408
    (64, 8, 150, 1000, False, 64, 1 << 20, True),  # long prompts (Qwen3-4B): about 42 x 150 + 64 x 1000 < 64 x 1150
    (64, 8, 150, 1000, False, 64, 1150, False),  # one row per token-budget call: nothing to share
    (128, 4, 33, 4, True, 128, 4096, False),  # every context distinct (the chain protocol's later turns): an extra call for nothing
])
def test_prefix_sharing_pays_by_the_tokens_of_a_training_call(monkeypatch, groups, rows, lc, lr, distinct, minibatch, budget, pays):
    turn_like = shapes_turn(groups, rows, lc, lr, distinct=distinct)
    monkeypatch.setattr(logprobs, "TRAINING_CALL", None)
    assert logprobs.prefix_sharing_pays(turn_like)  # no update to size it by: always shared
    logprobs.set_share_prefix(True, minibatch, budget)
    assert logprobs.prefix_sharing_pays(turn_like) is pays


@pytest.mark.parametrize("minibatch", [4, 64])
def test_every_call_of_a_turn_takes_the_turns_path(agent, minibatch):
    """The shared-or-plain choice is the whole turn's (one base-model call per
    plain forward, two per shared one), never the rows' of a call: with 64-row
    minibatches the turn shares, and its 12 distinct contexts alone, which
    would not, still give the full call's rows bit for bit."""
    logprobs.set_share_prefix(True, minibatch, 4096)
    model = copy.deepcopy(agent.model)
    turn_like = grouped_turn(model.config.vocab_size, [(6, 4), (5, 4), (7, 4), (4, 4), (6, 4)] + [(3, 1)] * 12, [2, 1, 2] * 11, 5)
    pays = logprobs.prefix_sharing_pays(turn_like)
    assert pays is (minibatch == 64)  # 4-row calls: their contexts would be padded to 19 rows of 7 tokens
    distinct = torch.arange(20, 32)
    assert not logprobs.prefix_sharing_pays([t[distinct] for t in turn_like])
    calls = []
    model.base_model.register_forward_pre_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        whole, hidden = turn_forward(model, turn_like, slice(None), 1.0)  # [N, Lr], [N, Lr, H]
        for part in (torch.arange(4), distinct, torch.tensor([0, 1, 20, 31])):
            lp, h = turn_forward(model, turn_like, part, 1.0)
            assert torch.equal(lp, whole[part]) and torch.equal(h, hidden[part])
    assert len(calls) == 4 * (2 if pays else 1)


def test_prefix_sharing_is_decided_once_per_turn(monkeypatch):
    """Every forward of a turn asks; the turn's distinct contexts are counted
    once, again only for other tensors, tensors changed in place, or other
    sizes, and the answer is dropped with the turn."""
    counted = []
    monkeypatch.setattr(logprobs, "distinct_contexts", lambda *a, f=logprobs.distinct_contexts: counted.append(1) or f(*a))
    logprobs.set_share_prefix(True, 16, 4096)
    turn_like = shapes_turn(16, 4, 7, 32)
    assert [logprobs.prefix_sharing_pays(turn_like) for _ in range(3)] == [False] * 3 and len(counted) == 1
    assert not logprobs.prefix_sharing_pays(tuple(t.clone() for t in turn_like)) and len(counted) == 2
    turn_like[0][:, 0] = torch.arange(64)  # every context now distinct, in place
    assert not logprobs.prefix_sharing_pays(turn_like) and len(counted) == 3
    logprobs.set_share_prefix(True, 64, 4096)
    long = shapes_turn(16, 4, 150, 32)
    assert logprobs.prefix_sharing_pays(long) and len(counted) == 4
    entries = len(logprobs._SHARING)
    del long
    assert len(logprobs._SHARING) == entries - 1
