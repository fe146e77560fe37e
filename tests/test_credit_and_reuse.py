"""Issue 12: the team reward without a dictator, `--reuse regenerate` is exact, and the
per-step certificate in episode units against brute force on an enumerable two-agent team."""
import copy
import itertools
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import bounds
import harness.cli
import harness.run
from advantage import credit_correlation
from harness.config import Config
from harness.loading import load_agent
from harness.math_grading import answers_match, majority_vote, math_team_config, vote_reward
from harness.tasks import arithmetic_problems
from logprobs import batched_response_logprobs
from rollout import SamplingConfig, regenerate, rollout
from scale.rollout_hf import HF
from team import Agent, Team


# -- the team reward: expected correctness under a uniform tie-break -------------------------
def test_vote_reward_known_values():
    assert vote_reward(["5", "6", "7"], "5") == pytest.approx(1 / 3)  # three-way tie: agent 1 is no dictator
    assert vote_reward(["6", "5", "7"], "5") == pytest.approx(1 / 3)
    assert vote_reward(["5", "6", "6"], "5") == 0.0  # a majority decides
    assert vote_reward(["6", "5", "5"], "5") == 1.0
    assert vote_reward(["5", "6"], "6") == 0.5
    assert vote_reward(["5", None, None], "5") == 1.0  # abstentions do not vote
    assert vote_reward([None, ""], "5") == 0.0
    assert vote_reward(["1/2", "0.5", "3"], "1/2") == 1.0  # normalised before counting
    assert majority_vote(["5", "6", "7"]) == "5"  # the displayed answer: earliest without rng


answer_lists = st.lists(st.one_of(st.none(), st.sampled_from(["1", "2", "3", "4"])), min_size=1, max_size=5)


@given(answers=answer_lists, gold=st.sampled_from(["1", "2"]), seed=st.integers(0, 10**6))
def test_vote_reward_is_the_uniform_tie_break_expectation_and_symmetric(answers, gold, seed):
    # brute force: probability 1/m for each of the m answers with the most votes
    counts = {a: answers.count(a) for a in set(answers) if a is not None}
    expected = 0.0
    if counts:
        top = [a for a, c in counts.items() if c == max(counts.values())]
        expected = sum(a == gold for a in top) / len(top)
    assert vote_reward(answers, gold) == pytest.approx(expected)
    shuffled = list(answers)
    random.Random(seed).shuffle(shuffled)
    assert vote_reward(shuffled, gold) == pytest.approx(expected)  # symmetric in the agents
    # the seeded uniform tie-break of majority_vote averages to the same value
    rng = random.Random(seed)
    draws = [answers_match(majority_vote(answers, rng), gold) for _ in range(4000)]
    assert abs(sum(draws) / len(draws) - expected) < 0.05


def credit(rule, acc=(0.9, 0.3, 0.3), wrong=tuple(str(w) for w in range(10, 20))):
    """Exact E[R | agent k right] - E[R | agent k wrong] per agent: each agent is right with
    its accuracy, else uniform over ten wrong answers (enumerated, no sampling)."""
    out = []
    for k in range(3):
        by = {True: [0.0, 0.0], False: [0.0, 0.0]}  # [sum p R, sum p]
        per_agent = [[("5", a)] + [(w, (1 - a) / len(wrong)) for w in wrong] for a in acc]
        for combo in itertools.product(*per_agent):
            p = combo[0][1] * combo[1][1] * combo[2][1]
            answers = [c[0] for c in combo]
            right = answers[k] == "5"
            by[right][0] += p * rule(answers)
            by[right][1] += p
        out.append(by[True][0] / by[True][1] - by[False][0] / by[False][1])
    return out


def test_later_agents_get_credit_for_being_right():
    earliest = credit(lambda a: float(majority_vote(a) == "5"))
    uniform = credit(lambda a: vote_reward(a, "5"))
    assert earliest[1] < 0.15 * earliest[0]  # the dictator: agents 2, 3 get about a ninth of agent 1's credit
    assert uniform[1] == pytest.approx(uniform[2]) and uniform[1] > 4 * earliest[1] and uniform[1] > 0.9 * uniform[0]
    # equal accuracies: equal credit under the uniform tie-break, not under "earliest wins"
    eq_u, eq_e = (credit(lambda a: vote_reward(a, "5"), acc=(0.4,) * 3),
                  credit(lambda a: float(majority_vote(a) == "5"), acc=(0.4,) * 3))
    assert eq_u[0] == pytest.approx(eq_u[1]) == pytest.approx(eq_u[2])
    assert eq_e[0] > 1.5 * eq_e[1]


def test_credit_correlation_exact():
    assert credit_correlation(torch.tensor([1.0, -1.0, 1.0, -1.0]),
                              torch.tensor([1.0, 0.0, 1.0, 0.0])) == pytest.approx(1.0)
    # sum(a c) / sqrt(sum a^2 sum c^2), centred
    assert credit_correlation(torch.tensor([1.0, 2.0, 3.0, 4.0]),
                              torch.tensor([0.0, 0.0, 1.0, 0.0])) == pytest.approx(0.5 / (5 * 0.75) ** 0.5)
    assert credit_correlation(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0])) is None


# -- --reuse regenerate is exact -------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny3():
    return [load_agent("tiny", seed=k) for k in range(3)]


def promote(agent, scale=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in agent.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


@pytest.mark.slow  # over 10 s on two busy cores
def test_regenerate_independent_redraws_only_the_promoted_turn_from_the_promoted_policy(tiny3):
    agents = [Agent(a.spec, copy.deepcopy(a.model), a.tokenizer) for a in tiny3]
    team = Team(agents, math_team_config(protocol="independent"))
    problem = arithmetic_problems(1, seed=3)[0]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=1)
    torch.manual_seed(0)
    batch = rollout(team, [problem] * 300, group_size=10, sampling=sampling, backend=HF)  # 3000 rows, groups of 10
    old_probs = first_token_probs(team.agents[0], batch)
    promote(team.agents[0])
    new_probs = first_token_probs(team.agents[0], batch)
    new, generated = regenerate(team, batch, 0, sampling, HF)
    assert generated == len(batch)  # one turn redrawn, not the whole team
    for k in (1, 2):  # the other agents' responses are untouched
        assert new.turns[k] is batch.turns[k]
    turn = new.turns[0]
    # cached behaviour log-probs = teacher-forced log-probs under the promoted model
    fresh = batched_response_logprobs(team.agents[0].model, turn.tensors, 1.0, 1 << 14)
    assert torch.allclose(fresh, turn.behaviour_logprobs, atol=1e-5)
    # and the responses are distributed as the promoted policy (not the old one)
    counts = torch.bincount(turn.response_ids[:, 0], minlength=len(new_probs)).double() / len(new)
    tv_new, tv_old = 0.5 * (counts - new_probs).abs().sum(), 0.5 * (counts - old_probs).abs().sum()
    assert 0.5 * (new_probs - old_probs).abs().sum() > 0.2  # the promotion moved the policy
    assert tv_new < 0.06 < tv_old
    # rewards are rescored on the new answers
    expected = [vote_reward([t.answers[i] for t in new.turns], problem.answer) for i in range(len(new))]
    assert new.rewards.tolist() == pytest.approx(expected)


def first_token_probs(agent, batch):
    ctx = batch.turns[0].context_ids[:1][batch.turns[0].context_mask[:1].bool()][None]  # one prompt, all rows alike
    with torch.no_grad():
        return torch.softmax(agent.model(ctx).logits[0, -1].double(), -1)


def test_regenerate_chain_redraws_the_promoted_turn_and_the_turns_after_it(tiny3):
    team = Team(tiny3, math_team_config(protocol="chain"))
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=4)
    torch.manual_seed(1)
    batch = rollout(team, arithmetic_problems(4, seed=0), group_size=4, sampling=sampling, backend=HF)
    new, generated = regenerate(team, batch, 1, sampling, HF)
    assert generated == 2 * len(batch)
    assert new.turns[0] is batch.turns[0]
    tok = team.agents[2].tokenizer
    for i in range(len(new)):  # agent 3 read agent 2's *new* answer
        ctx = tok.decode(new.turns[2].context_ids[i][new.turns[2].context_mask[i].bool()])
        assert f"Agent 2: {new.turns[1].answers[i] or '?'}\n" in ctx


def test_cli_reuse_and_its_preset_defaults():
    assert harness.cli.parse_args(["--reuse", "regenerate"]).reuse == "regenerate"
    assert Config().apply_preset().reuse == "weights"
    assert Config(agents="Qwen3-4B x3").apply_preset().reuse == "regenerate"


# -- the surrogate L_i in episode units: brute force on a two-agent team -----------------------
def two_agent_team(seed, protocol, n_prompts=2, vocab=3):
    """Prompts s ~ mu; agent 1 answers a1 ~ pi1(.|s); agent 2 answers a2 ~ pi2(.|s, a1) (chain)
    or pi2(.|s) (independent, broadcast over a1); reward R(s, a1, a2) in [0, 1]. One token each."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.softmax(torch.randn(n_prompts, generator=g, dtype=torch.float64), 0)
    pi1 = torch.softmax(2 * torch.randn(n_prompts, vocab, generator=g, dtype=torch.float64), -1)
    if protocol == "chain":
        pi2 = torch.softmax(2 * torch.randn(n_prompts, vocab, vocab, generator=g, dtype=torch.float64), -1)
    else:
        pi2 = torch.softmax(2 * torch.randn(n_prompts, 1, vocab, generator=g, dtype=torch.float64), -1).expand(
            n_prompts, vocab, vocab)
    R = torch.rand(n_prompts, vocab, vocab, generator=g, dtype=torch.float64)
    return mu, pi1, pi2, R


def joint(mu, pi1, pi2):
    return mu[:, None, None] * pi1[:, :, None] * pi2  # [S, V, V] P(s, a1, a2)


def exact_surrogate(mu, pi1, pi2, R, agent, new):
    """E_{tau ~ old}[(r_j - 1)(R - b(s))], b(s) = E_old[R | s]: the population value of what
    sat.trust_region_step estimates (the group mean of one prompt's trajectories is b(s))."""
    P = joint(mu, pi1, pi2)  # [S, V, V]
    b = (P * R).sum((1, 2)) / P.sum((1, 2))  # [S]
    r = (new / pi1)[:, :, None].expand_as(R) if agent == 0 else new / pi2  # [S, V, V]
    return float((P * (r - 1) * (R - b[:, None, None])).sum())


@pytest.mark.parametrize("protocol", ["chain", "independent"])
@pytest.mark.parametrize("seed", range(6))
def test_surrogate_identity_matches_brute_force_on_two_agents(protocol, seed):
    """advantage.step_estimates' identity: with exact quantities the surrogate IS the step's change."""
    mu, pi1, pi2, R = two_agent_team(seed, protocol)
    g = torch.Generator().manual_seed(100 + seed)
    tilt = lambda p: torch.softmax(p.log() + torch.randn(p.shape, generator=g, dtype=torch.float64), -1)  # noqa: E731
    new1 = tilt(pi1)
    new2 = tilt(pi2) if protocol == "chain" else tilt(pi2[:, :1]).expand_as(pi2)
    J = lambda a, b: float((joint(mu, a, b) * R).sum())  # noqa: E731
    for order in ([0, 1], [1, 0]):  # a stage in either order: pi_hat^0 -> pi_hat^1 -> pi_hat^2
        cur = [pi1, pi2]
        total_gain = 0.0
        for j in order:
            new = new1 if j == 0 else new2
            surrogate = exact_surrogate(mu, cur[0], cur[1], R, j, new)
            before = J(*cur)
            cur[j] = new
            change = J(*cur) - before
            cert = bounds.certificate(surrogate, 0.0, 1.0, gamma=0.0)  # exact quantities: no bias, no sample term
            assert cert["gain"] == pytest.approx(change, abs=1e-12)  # the finite-horizon lemma is an equality
            assert cert["occupancy_penalty"] == 0.0 and cert["lower_bound"] <= change + 1e-12
            # the turn-level MDP's units (gamma = 1 - 1/n) count the same episode n = 2 times
            assert bounds.certificate(surrogate, 0.0, 1.0, gamma=0.5)["gain"] == pytest.approx(2 * change, abs=1e-12)
            total_gain += cert["gain"]
        assert total_gain == pytest.approx(J(new1, new2) - J(pi1, pi2), abs=1e-12)  # Theorem 4.4 telescopes


@pytest.mark.slow  # over 10 s on two busy cores: two runs
def test_joint_and_weights_runs_log_no_step_bound(tmp_path):
    for update, reuse in (("joint", "regenerate"), ("sequential", "weights")):
        cfg = Config(agents="tiny x2", stages=1, batch_size=16, group_size=4, epochs=1, minibatch_size=16,
                     warmup_steps=10, eval_size=8, out=str(tmp_path / update), device="cpu", update=update,
                     reuse=reuse).apply_preset()
        rec = harness.run.run(cfg, log=lambda *_: None)[-1]
        assert rec["step_bounds"].startswith("none:") and all(a["step_bound"] is None for a in rec["agents"])
        assert "surrogate_estimate" in rec["agents"][0] and "lower_bound" not in rec["agents"][0]
        assert -1.0 <= rec["certificate"]["lower_bound"] <= rec["measured_change"]  # the held-out stage bound
        assert all(0.0 < a["ess_ratio"] <= 1.0 for a in rec["agents"])


@pytest.mark.slow  # over 10 s on two busy cores: a whole run
def test_regenerate_run_keeps_weights_at_one(tmp_path):
    cfg = Config(agents="tiny x3", stages=1, batch_size=16, group_size=4, epochs=1, minibatch_size=16,
                 warmup_steps=10, eval_size=8, out=str(tmp_path / "run"), device="cpu",
                 reuse="regenerate").apply_preset()
    rec = harness.run.run(cfg, log=lambda *_: None)[-1]
    assert [a["ess_ratio"] for a in rec["agents"]] == [1.0, 1.0, 1.0] and all(a["zeta"] == 0.0 for a in rec["agents"])
    # the rollout, then per step the turn it changes drawn before it (the bound's "before") and after it
    assert rec["generations"] == 16 * 3 + 16 * 3 * 2
    assert rec["step_bounds"].startswith("each")
    for a in rec["agents"]:
        b = a["step_bound"]
        assert b["n"] == 16 and b["delta_conf"] == pytest.approx(cfg.delta_conf / 3)
        assert b["lower_bound"] == pytest.approx(max(b["mean_change"] - b["sample_penalty"], -1.0))
        assert -1.0 <= b["lower_bound"] < 1.0
    no_bounds = Config(agents="tiny x3", stages=1, batch_size=16, group_size=4, epochs=1, minibatch_size=16,
                       warmup_steps=10, eval_size=8, out=str(tmp_path / "plain"), device="cpu",
                       reuse="regenerate", step_bounds=False).apply_preset()
    assert harness.run.run(no_bounds, log=lambda *_: None)[-1]["generations"] == 16 * 3 + 16 * 2  # no draw for a bound



def test_counterfactual_baseline_brute_force_and_independent_of_own_answer():
    from harness.math_grading import DEFAULT_REWARD
    from reward import counterfactual_baselines
    from team import Problem

    gold = Problem(id="p", problem="1+4", answer="5")
    answers = [["5", "6", "7"], ["6", "6", "5"], ["5", "5", None], ["8", "6", "7"]]  # one group of G = 4, 3 agents

    def baselines(answers):
        texts = [[str(a) for a in row] for row in answers]
        return counterfactual_baselines(DEFAULT_REWARD, [gold] * 4, texts, answers, "independent",
                                        torch.zeros(4, dtype=torch.long))

    b = baselines(answers)
    for k in range(3):
        for t in range(4):
            swapped = [answers[t][:k] + [answers[u][k]] + answers[t][k + 1:] for u in range(4) if u != t]
            assert b[k, t].item() == pytest.approx(sum(vote_reward(a, "5") for a in swapped) / 3)
    # b_k(tau) does not read agent k's own answer in tau: changing it moves only the others' baselines
    changed = [list(a) for a in answers]
    changed[0][1] = "5"
    b2 = baselines(changed)
    assert b2[1, 0] == b[1, 0]
    assert b2[0, 0].item() == pytest.approx(5 / 9) and b[0, 0].item() == pytest.approx(1 / 9)
