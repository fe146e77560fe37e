"""Tests for advantage.py, each against a direct Python-loop reference."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import advantage as adv
import logprobs

D = torch.float64


# ---------------------------------------------------------------------------
# masked reductions
# ---------------------------------------------------------------------------


def test_masked_sum_and_mean_ignore_padding_even_if_nan():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    assert logprobs.masked_sum(x, m).item() == 13.0
    assert logprobs.masked_mean(x, m).item() == pytest.approx(13.0 / 4)
    torch.testing.assert_close(logprobs.masked_mean(x, m, dim=1), torch.tensor([1.5, 5.0]))
    torch.testing.assert_close(logprobs.masked_sum(x, m, dim=0), torch.tensor([5.0, 2.0, 6.0]))
    empty = torch.zeros(2, 3, dtype=torch.bool)
    torch.testing.assert_close(logprobs.masked_mean(x, empty, dim=1), torch.zeros(2))  # 0, not nan


# ---------------------------------------------------------------------------
# group advantages
# ---------------------------------------------------------------------------


def group_loop(rewards, ids, eps, clip, weights=None):
    """Per-group Python loop with the population (weighted) std."""
    out = [0.0] * len(rewards)
    weights = [1.0] * len(rewards) if weights is None else weights
    for g in set(ids):
        idx = [i for i, x in enumerate(ids) if x == g]
        wsum = sum(weights[i] for i in idx)
        if wsum == 0:
            continue
        mean = sum(weights[i] * rewards[i] for i in idx) / wsum
        std = math.sqrt(sum(weights[i] * (rewards[i] - mean) ** 2 for i in idx) / wsum)
        for i in idx:
            a = (rewards[i] - mean) / (std + eps) if std + eps > 0 else 0.0
            out[i] = a if clip is None else max(-clip, min(clip, a))
    return out


@given(
    data=st.data(),
    n=st.integers(1, 30),
    clip=st.sampled_from([None, 5.0, 1.0]),
    weighted=st.booleans(),
)
def test_group_advantages_match_per_group_loop(data, n, clip, weighted):
    rewards = data.draw(st.lists(st.floats(-10, 10), min_size=n, max_size=n))
    ids = data.draw(st.lists(st.sampled_from([-3, 0, 7, 1000, 2**40]), min_size=n, max_size=n))
    weight = st.one_of(st.just(0.0), st.floats(1e-3, 3))  # subnormal weights would only test underflow
    weights = data.draw(st.lists(weight, min_size=n, max_size=n)) if weighted else None
    got = adv.group_advantages(
        torch.tensor(rewards, dtype=D),
        torch.tensor(ids),
        eps=1e-6,
        clip=clip,
        weights=None if weights is None else torch.tensor(weights, dtype=D),
    )
    np.testing.assert_allclose(got.numpy(), group_loop(rewards, ids, 1e-6, clip, weights), rtol=1e-9, atol=1e-9)


def test_group_advantages_binary_rewards_known_values():
    # group 7: rewards 1,0,0,0 -> mean 1/4, population std sqrt(3)/4
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0], dtype=D)
    g = torch.tensor([7, 7, 7, 7, 2, 2])
    a = adv.group_advantages(r, g, eps=0.0, clip=None)
    s = math.sqrt(3) / 4
    torch.testing.assert_close(a, torch.tensor([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s, 0.0, 0.0], dtype=D))
    # clip bites for a lone success among many failures: (1 - 1/64) / sqrt(63)/64 ~ 7.9 > 5
    r = torch.zeros(64, dtype=D)
    r[0] = 1.0
    a = adv.group_advantages(r, torch.zeros(64, dtype=torch.long), clip=5.0)
    assert a[0].item() == 5.0 and a[1:].max().item() < 0


def test_group_advantages_integer_rewards_and_bad_inputs():
    a = adv.group_advantages(torch.tensor([1, 0]), torch.tensor([0, 0]))
    assert a.is_floating_point()
    with pytest.raises(ValueError):
        adv.group_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError):
        adv.group_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.long), weights=torch.tensor([1.0, -1.0]))


# ---------------------------------------------------------------------------
# GAE with truncated traces
# ---------------------------------------------------------------------------


def gae_direct(r, v, length, gamma, lam, c):
    """A_t = sum_k (gamma lam)^k (prod_{i=1..k} c_{t+i}) delta_{t+k}, one row, plain floats."""
    delta = [r[t] + gamma * (v[t + 1] if t + 1 < length else 0.0) - v[t] for t in range(length)]
    out = []
    for t in range(length):
        total, coef = 0.0, 1.0
        for k in range(length - t):
            if k > 0:
                coef *= gamma * lam * c[t + k]
            total += coef * delta[t + k]
        out.append(total)
    return out


@given(
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(1, 4),
    T=st.integers(1, 9),
    gamma=st.floats(0.5, 1.0),
    lam=st.floats(0.0, 1.0),
    use_traces=st.booleans(),
)
def test_gae_matches_direct_sum(seed, B, T, gamma, lam, use_traces):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=gen)
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T] right padding
    rewards = torch.randn(B, T, generator=gen, dtype=D)
    values = torch.randn(B, T, generator=gen, dtype=D)
    rho = torch.exp(torch.randn(B, T, generator=gen, dtype=D))
    traces = rho.clamp_max(1.0) if use_traces else None
    # garbage in the padding must not leak into valid positions
    rewards = torch.where(mask, rewards, torch.full_like(rewards, 1e9))
    values = torch.where(mask, values, torch.full_like(values, -1e9))
    a, ret = adv.gae(rewards, values, mask, gamma=gamma, lam=lam, traces=traces)
    for b in range(B):
        n = int(lengths[b])
        c = traces[b].tolist() if use_traces else [1.0] * T
        ref = gae_direct(rewards[b].tolist(), values[b].tolist(), n, gamma, lam, c)
        np.testing.assert_allclose(a[b, :n].numpy(), ref, rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(ret[b, :n].numpy(), np.array(ref) + values[b, :n].numpy(), rtol=1e-9, atol=1e-9)
        assert torch.equal(a[b, n:], torch.zeros(T - n, dtype=D))
        assert torch.equal(ret[b, n:], torch.zeros(T - n, dtype=D))


def test_gae_special_cases():
    r = torch.tensor([[0.0, 0.0, 1.0]], dtype=D)
    v = torch.tensor([[0.2, 0.5, 0.7]], dtype=D)
    m = torch.ones(1, 3, dtype=torch.bool)
    # lam = 1, gamma = 1: Monte-Carlo return minus value
    a, ret = adv.gae(r, v, m, gamma=1.0, lam=1.0)
    torch.testing.assert_close(a, torch.tensor([[0.8, 0.5, 0.3]], dtype=D))
    torch.testing.assert_close(ret, torch.ones(1, 3, dtype=D))
    # lam = 0: one-step TD error
    a, _ = adv.gae(r, v, m, gamma=0.9, lam=0.0)
    torch.testing.assert_close(a, torch.tensor([[0.9 * 0.5 - 0.2, 0.9 * 0.7 - 0.5, 1.0 - 0.7]], dtype=D))
    # a zero trace cuts the tail exactly there
    a, _ = adv.gae(r, v, m, gamma=1.0, lam=1.0, traces=torch.tensor([[1.0, 0.0, 1.0]], dtype=D))
    torch.testing.assert_close(a, torch.tensor([[0.5 - 0.2, 0.5, 0.3]], dtype=D))


def test_make_value_head_draws_nothing_from_the_global_rng():
    """A resumed --adv gae run builds its value heads after the checkpoint restored torch's global RNG: a draw
    there would shift every later sample and the run would leave the straight run's path."""
    agent = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(hidden_size=16)), device="cpu")
    torch.manual_seed(3)
    before = torch.get_rng_state()
    head = adv.make_value_head(agent)
    assert torch.equal(torch.get_rng_state(), before)
    assert head.weight.dtype == torch.float32 and head.weight.shape == (1, 16)
    assert not any(p.requires_grad for p in head.parameters())  # frozen, as between its agent's updates
    assert torch.equal(head.weight, torch.zeros(1, 16)) and torch.equal(head.bias, torch.tensor([0.5]))
    hidden = torch.randn(2, 3, 16)  # [b, L, H]
    assert torch.equal(head(hidden), torch.full((2, 3, 1), 0.5))  # V = 0.5 everywhere before training


# ---------------------------------------------------------------------------
# sequence-aware importance weights
# ---------------------------------------------------------------------------


@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 4), n_agents=st.integers(1, 3))
def test_log_weights_match_explicit_products(seed, B, n_agents):
    gen = torch.Generator().manual_seed(seed)
    entries = []
    for _ in range(n_agents):
        T = int(torch.randint(1, 7, (1,), generator=gen))
        log_rho = 0.7 * torch.randn(B, T, generator=gen, dtype=D)
        mask = torch.rand(B, T, generator=gen) < 0.7
        log_rho = torch.where(mask, log_rho, torch.full_like(log_rho, float("nan")))  # padding is never read
        entries.append((log_rho, mask))
    trunc = adv.truncated_log_weights(entries)
    full = adv.full_log_weights(entries)
    for b in range(B):
        w, W = 1.0, 1.0
        for log_rho, mask in entries:
            for t in range(log_rho.shape[1]):
                if mask[b, t]:
                    rho = math.exp(log_rho[b, t].item())
                    w *= min(1.0, rho)
                    W *= rho
        assert math.exp(trunc[b].item()) == pytest.approx(w, rel=1e-12)
        assert math.exp(full[b].item()) == pytest.approx(W, rel=1e-12)
    assert (trunc <= 0).all() and (trunc <= full + 1e-12).all()


def test_log_weights_first_agent_and_long_sequences():
    assert torch.equal(adv.truncated_log_weights([], batch_size=3), torch.zeros(3))
    assert torch.equal(adv.full_log_weights([], batch_size=2), torch.zeros(2))
    with pytest.raises(ValueError):
        adv.truncated_log_weights([])
    # 20k tokens of rho = 0.9: the product underflows in linear space, not in log space
    log_rho = torch.full((1, 20_000), math.log(0.9), dtype=D)
    got = adv.truncated_log_weights([(log_rho, torch.ones_like(log_rho, dtype=torch.bool))])
    assert got.item() == pytest.approx(20_000 * math.log(0.9), rel=1e-12)


# ---------------------------------------------------------------------------
# truncation bias
# ---------------------------------------------------------------------------


def test_truncation_bias_matches_formula_and_caps_overflow():
    log_W = torch.tensor([0.3, -0.2, 1.0, -2.0], dtype=D)
    log_w = log_W.clamp_max(0.0)
    ratio = torch.tensor([1.1, 0.9, 1.0, 1.2], dtype=D)
    a = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=D)
    rows = zip(log_W.tolist(), log_w.tolist(), ratio.tolist(), a.tolist())
    ref = abs(sum((math.exp(x) - math.exp(y)) * r * q for x, y, r, q in rows) / 4)
    assert adv.truncation_bias(log_W, log_w, ratio, a) == pytest.approx(ref, rel=1e-12)
    # no truncation happened (all rho <= 1): zero bias
    assert adv.truncation_bias(log_w, log_w, ratio, a) == 0.0
    # a weight of e^5000 would overflow: capped at 1e6
    huge = adv.truncation_bias(torch.tensor([5000.0]), torch.tensor([0.0]), torch.ones(1), torch.ones(1))
    assert huge == pytest.approx(1e6 - 1.0)
    assert adv.truncation_bias(torch.zeros(0), torch.zeros(0), torch.zeros(0), torch.zeros(0)) == 0.0


def test_group_advantages_unnormalised_are_reward_minus_weighted_group_mean():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0], dtype=D)
    g = torch.tensor([0, 0, 0, 1, 1])
    w = torch.tensor([0.5, 1.0, 0.5, 1.0, 0.25], dtype=D)
    got = adv.group_advantages(r, g, clip=None, weights=w, normalize=False)
    m0 = (0.5 * 1.0) / 2.0  # weighted mean of group 0
    expected = torch.tensor([1 - m0, -m0, -m0, 0.0, 0.0], dtype=D)
    assert torch.allclose(got, expected)
