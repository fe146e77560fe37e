"""Common random numbers: the seeded sampler is exact, and draws under one seed are coupled.

Every response is sampled under a seed of its own (``scale.rollout_hf.SeededSampler``: inverse-CDF sampling of the
tempered softmax on one uniform per row and position, a function of the row's seed alone). The paired
certificates (``bounds.paired_change_bound``) need two things of it: each draw has exactly the tempered
softmax's distribution (else the paired mean is biased), and two close policies under one seed mostly give
the same response (else pairing gains nothing). Both are checked here on the tiny agents and on fixed
logits over a small vocabulary.
"""
import pytest
import torch
from scipy.stats import chisquare

from harness.loading import load_agent
from harness.math_grading import math_team_config
from harness.tasks import arithmetic_problems
from rollout import SamplingConfig, response_seeds, rollout
from scale.rollout_hf import HF, SeededSampler, generate_hf, tempered_probs
from team import Team

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])  # [V] a small vocabulary


def sampled_counts(temperature: float, top_p: float, n: int, position: int) -> torch.Tensor:
    """[V] how often each token is drawn at ``position`` by n rows with seeds 0..n-1."""
    sampler = SeededSampler(list(range(n)), temperature, top_p)
    for _ in range(position + 1):
        scores = sampler(None, LOGITS.expand(n, -1).clone())  # [n, V]: 0 on the drawn token, -inf elsewhere
    assert bool((scores == 0).sum(-1).eq(1).all())  # exactly one finite score per row: greedy takes it
    return torch.bincount(scores.argmax(-1), minlength=len(LOGITS)).double()


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8)])
@pytest.mark.parametrize("position", [0, 5])
def test_seeded_sampler_draws_the_tempered_softmax(temperature, top_p, position):
    """Pearson's chi-square at every position: the draws follow softmax(logits / T), restricted to the
    top-p nucleus; a token outside the nucleus is never drawn."""
    n = 40000
    counts = sampled_counts(temperature, top_p, n, position)
    probs = tempered_probs(LOGITS[None], temperature, top_p)[0]  # [V]
    support = probs > 0
    assert counts[~support].sum() == 0
    p_value = chisquare(counts[support].numpy(), (probs[support] * n).numpy()).pvalue
    assert p_value > 1e-4, (counts.tolist(), (probs * n).tolist())
    if top_p < 1:
        assert int(support.sum()) < len(LOGITS)  # the nucleus really cut tokens: the check has teeth


def test_positions_and_rows_draw_independent_uniforms():
    """The same row at two positions, and two rows at one position, agree only as often as independent
    draws would (P(agree) = sum p^2)."""
    n = 40000
    sampler = SeededSampler(list(range(n)), 1.0)
    first = sampler(None, LOGITS.expand(n, -1).clone()).argmax(-1)  # [n]
    second = sampler(None, LOGITS.expand(n, -1).clone()).argmax(-1)  # [n]
    p2 = float((LOGITS.softmax(-1) ** 2).sum())
    sd = (p2 * (1 - p2) / n) ** 0.5
    assert abs(float((first == second).double().mean()) - p2) < 5 * sd
    assert abs(float((first[1:] == first[:-1]).double().mean()) - p2) < 5 * sd


def tiny_team(seed: int, n: int = 2) -> Team:
    return Team([load_agent("tiny", seed=seed + k) for k in range(n)], math_team_config(protocol="chain"))


def test_identical_policies_under_one_seed_give_identical_responses():
    """Two copies of a team, one seed: the same responses in every row and turn; another seed: other
    responses in most rows."""
    problems, sampling = arithmetic_problems(16, seed=0), SamplingConfig(temperature=1.0, max_new_tokens=6)
    a = rollout(tiny_team(0), problems, 4, sampling, HF, seed=123)
    b = rollout(tiny_team(0), problems, 4, sampling, HF, seed=123)
    c = rollout(tiny_team(0), problems, 4, sampling, HF, seed=124)
    for k in range(2):
        assert a.turns[k].texts == b.turns[k].texts
        assert torch.equal(a.turns[k].behaviour_logprobs, b.turns[k].behaviour_logprobs)
        assert sum(x == y for x, y in zip(a.turns[k].texts, c.turns[k].texts)) < len(a) / 4


def test_a_response_does_not_depend_on_the_rest_of_its_batch():
    """Row i drawn alone or among 31 others (sorted and chunked differently) under its seed: the same
    response."""
    agent = load_agent("tiny", seed=0)
    contexts = [agent.encode_prompt([{"role": "user", "content": f"{a}+{a * 7 % 13}"}]) for a in range(32)]
    seeds = response_seeds(7, len(contexts), 0)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8)
    together = generate_hf(agent, contexts, sampling, seeds)
    alone = [generate_hf(agent, [c], sampling, [s])[0] for c, s in zip(contexts[::5], seeds[::5])]
    assert alone == together[::5]


def test_a_nearby_policy_under_the_same_seeds_mostly_agrees():
    """A policy moved a little (weights perturbed by 1e-3 of their scale) answers like the original in
    most rows under the same seeds, and rarely under other seeds: the coupling that makes paired
    differences sparse, with each draw still its own policy's."""
    problems, sampling = arithmetic_problems(32, seed=1), SamplingConfig(temperature=1.0, max_new_tokens=6)
    base, moved = tiny_team(0, 1), tiny_team(0, 1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moved.agents[0].model.parameters():
            p.add_(1e-3 * p.abs().mean() * torch.randn(p.shape, generator=g))
    same = rollout(base, problems, 4, sampling, HF, seed=5).turns[0].texts
    coupled = rollout(moved, problems, 4, sampling, HF, seed=5).turns[0].texts
    other = rollout(moved, problems, 4, sampling, HF, seed=6).turns[0].texts
    agree = sum(x == y for x, y in zip(same, coupled)) / len(same)
    chance = sum(x == y for x, y in zip(same, other)) / len(same)
    print(f"\n[coupling] tiny agent moved by 1e-3: same seeds agree in {agree:.0%} of rows, other seeds {chance:.0%}")
    assert coupled != same  # the policy did move
    assert agree > 0.8 and chance < 0.3
