"""Multi-round episodes (harness/episodes.py) checked exactly, with no sampling noise.

1. A team of two real (tiny) agents whose vocabulary is five tokens plays a deterministic game of up to two rounds
   through the real implementation, one token a turn, so every joint trajectory of a prompt can be enumerated
   (11 that end after the first round, 14 * 25 after the second). Each trajectory's probability is the product of
   the models' own next-token distributions at each decision, read by a plain forward of the model on the context
   the implementation builds for it (its own functions replay each trajectory: ``start_episode``,
   ``episode_context``, ``speak``, the environment's ``step``). Against that brute force:
   a. the rollout's sampled episodes, their behaviour log-probabilities and rewards;
   b. ``logprobs.measure_kl``: the exact per-state KL of a perturbed agent j at agent j's own decisions only;
   c. the finite-horizon identity behind ``advantage.step_estimates`` (paper, Section 5): with exact weights,
      E[(r_j - 1)(R - b(s))] = J(new) - J(old), r_j from the implementation's log rho over every round;
   d. the loss (``update``) gives the environment's and the other agent's tokens exactly zero gradient.
   And what each agent's view holds in the independent protocol.
2. The same kind of game as a tabular toy MDP (tests/toy_mdp.py: states are transcripts), where a sequential SAT
   stage with exact advantages never lowers J and keeps the per-step and stage bounds (paper, Section 4).
"""
import copy
import dataclasses
import hashlib
import itertools

import pytest
import torch
import toy_mdp as tm
from hypothesis import given
from hypothesis import strategies as st
from test_toy_mdp_properties import check_stage_bound, check_step_bounds

from advantage import UpdateInputs, step_estimates
from harness.config import Config, resolve_agent_spec
from harness.environments import Environment
from harness.episodes import (
    ENVIRONMENT,
    episode_context,
    episode_turn,
    score_episodes,
    speak,
    start_episode,
    transcript,
)
from harness.loading import TINY_CHAT_TEMPLATE, build_char_tokenizer, build_tiny_model, prepare_tokenizer
from harness.math_grading import math_team_config
from logprobs import TurnTensors, masked_sum, measure_kl, turn_forward
from reward import Reward
from rollout import SamplingConfig, TeamBatch, rollout
from scale.rollout_hf import HF
from team import Agent, Problem, Team
from update import _micro_batch_loss, _Tally

# -- A team small enough to enumerate ---------------------------------------------------------------------------
# eos doubles as pad (one special token fewer to enumerate); the
# role markers are what the tiny chat template writes; with no <|unk|>, any other character encodes to nothing.
SPECIALS = ["<|endoftext|>", "<|user|>", "<|assistant|>"]
CHARS = ["a", "b"]
VOCAB = len(SPECIALS) + len(CHARS)
TEMPERATURE = 0.9
SAMPLING = SamplingConfig(temperature=TEMPERATURE, max_new_tokens=1, token_budget=1 << 16)
PROBLEMS = [Problem("p0", "ab", ""), Problem("p1", "ba", "")]  # mu: uniform over these


class PassGame:
    """Two rounds; the episode ends after the first round when the agents said the same, else the environment
    answers with what they said. Reward: a fixed pseudo-random function of the whole history."""

    max_rounds = 2
    reward_range = (0.0, 1.0)

    def reset(self, problem, **_):
        self.history = [problem]
        return problem

    def step(self, responses):
        self.history.append("|".join(responses))
        return (responses[0] or "a") + (responses[1] or "b"), responses[0] == responses[1]

    def get_reward(self):
        digest = hashlib.blake2b("/".join(self.history).encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little") / 2 ** 32


def env_reward(prompts, completions, *, env_reward, **_):
    return list(env_reward)


ENV = Environment(PassGame, "PassGame", PassGame.max_rounds, PassGame.reward_range)
REWARD = Reward(env_reward, "the game's reward", PassGame.reward_range)


def small_tokenizer():
    """``harness.loading.build_char_tokenizer``'s construction on a five-token vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(SPECIALS + CHARS)}, merges=[]))
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.chat_template = TINY_CHAT_TEMPLATE
    return prepare_tokenizer(tok, "small", "tiny")


def jitter(model, scale: float, seed: int):
    """Add Gaussian noise to every weight: peaked, distinct next-token distributions (a fresh model is near
    uniform)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def small_agent(seed: int) -> Agent:
    tok = small_tokenizer()
    model = jitter(build_tiny_model(tok, layers=1, seed=seed, hidden=32), 0.5, 100 + seed)
    return Agent(resolve_agent_spec("tiny"), model, tok)


def moved(agent: Agent, seed: int, scale: float = 0.3) -> Agent:
    """A copy of ``agent`` with perturbed weights: the agent j a step promotes."""
    return Agent(agent.spec, jitter(copy.deepcopy(agent.model), scale, seed), agent.tokenizer)


# -- Brute force: every episode of a prompt, replayed through the implementation -------------------------------
def end_round(env, e, n: int) -> None:
    """The environment's answer to the round just spoken, as ``episode_rollout`` records it."""
    observation, done = env.step(e.state, e.problem, [text for _, text in e.said[-n:]])
    e.said.append((ENVIRONMENT, observation))
    e.rounds += 1
    e.done = done or e.rounds == env.max_rounds


def clone(e):
    """An independent copy of an episode: its lists (of token lists, of said entries) copied, the environment's
    object deep-copied, the immutable rest shared (``copy.deepcopy`` of every token list is the slow part)."""
    out = copy.copy(e)
    for f in dataclasses.fields(e):
        value = getattr(e, f.name)
        if isinstance(value, list):
            setattr(out, f.name, [list(x) if isinstance(x, list) else x for x in value])
    out.state = copy.deepcopy(e.state)
    return out


def enumerate_episodes(team: Team, problem: Problem):
    """(decisions: token prefix -> (agent, its context ids), leaves: [(tokens, finished Episode)]) of every joint
    trajectory of ``problem``. Decisions come in the rollout's order (round by round, agents in order) and a
    trajectory is its tokens in that order; contexts are the rollout's own (``episode_context``)."""
    env, n = team.config.environment, len(team)
    decisions, leaves = {}, []

    def visit(e, tokens, k):
        decisions[tokens] = (k, list(episode_context(team, e, k)))
        for v in range(VOCAB):
            child = clone(e)
            speak(child, k, [v], team.agents[k].tokenizer)
            if k + 1 < n:
                visit(child, tokens + (v,), k + 1)
                continue
            end_round(env, child, n)
            if child.done:
                leaves.append((tokens + (v,), child))
            else:
                visit(child, tokens + (v,), 0)

    visit(start_episode(team, problem), (), 0)
    return decisions, leaves


@torch.no_grad()
def next_token_probs(model, contexts: list[list[int]]) -> torch.Tensor:
    """[n, V] float64 softmax(logits / T) after each context: one plain causal forward, right-padded (a causal
    model's last real position never sees the padding), the model's own LM head."""
    width = max(len(c) for c in contexts)
    ids = torch.tensor([c + [0] * (width - len(c)) for c in contexts])  # [n, L]
    logits = model(input_ids=ids).logits  # [n, L, V]
    last = logits[torch.arange(len(contexts)), torch.tensor([len(c) - 1 for c in contexts])]  # [n, V]
    return torch.softmax(last.double() / TEMPERATURE, -1)  # [n, V]


def decision_probs(models, decisions) -> dict:
    """token prefix -> [V] the deciding agent's next-token distribution (agent k plays ``models[k]``)."""
    out = {}
    for k, model in enumerate(models):
        prefixes = [p for p, (agent, _) in decisions.items() if agent == k]
        probs = next_token_probs(model, [decisions[p][1] for p in prefixes])  # [n, V]
        out.update(zip(prefixes, probs))
    return out


def path_prob(probs: dict, tokens) -> float:
    return float(torch.stack([probs[tokens[:d]][tokens[d]] for d in range(len(tokens))]).prod())


class Enumerated:
    """Every episode of every prompt as one TeamBatch built by the implementation (``episode_turn``,
    ``score_episodes``), with the brute-force decisions, distributions and probabilities beside it."""

    def __init__(self, team: Team):
        self.team = team
        self.decisions, self.tokens, episodes, self.row_problem = [], [], [], []
        for s, problem in enumerate(PROBLEMS):
            decisions, leaves = enumerate_episodes(team, problem)
            self.decisions.append(decisions)
            self.tokens += [t for t, _ in leaves]
            episodes += [e for _, e in leaves]
            self.row_problem += [s] * len(leaves)
        group_ids = torch.tensor(self.row_problem)  # [N]
        turns = [episode_turn(team, k, episodes, SAMPLING, HF, False) for k in range(len(team))]  # no behaviour
        self.batch = TeamBatch([e.problem for e in episodes], group_ids, turns,
                               *score_episodes(team, episodes, turns, [transcript(e) for e in episodes]),
                               rounds=[e.rounds for e in episodes])
        self.rewards = self.batch.rewards.double()  # [N]
        self.episodes = episodes

    def probs(self, models) -> list[dict]:
        return [decision_probs(models, d) for d in self.decisions]

    def weights(self, probs: list[dict]) -> torch.Tensor:
        """[N] P(tau): mu(s) times the product over decisions."""
        return torch.tensor([path_prob(probs[s], t) / len(PROBLEMS) for s, t in zip(self.row_problem, self.tokens)],
                            dtype=torch.float64)

    def J(self, models) -> float:
        return float((self.weights(self.probs(models)) * self.rewards).sum())

    def own_decisions(self, j: int, row: int) -> list[tuple]:
        """The prefixes at which agent j decides in trajectory ``row``, in order."""
        tokens, n = self.tokens[row], len(self.team)
        return [tokens[:d] for d in range(len(tokens)) if d % n == j]

    def own_positions(self, j: int, row: int) -> list[int]:
        """Where agent j's tokens sit in its response (its view after the first prompt), read off the contexts it
        decided on (each token follows its context), not off any mask."""
        decisions = self.decisions[self.row_problem[row]]
        lengths = [len(decisions[p][1]) for p in self.own_decisions(j, row)]
        return [n - lengths[0] for n in lengths]


def make_team(protocol: str) -> Team:
    return Team([small_agent(0), small_agent(1)], math_team_config(protocol=protocol, reward=REWARD, environment=ENV))


@pytest.fixture(scope="module", params=["independent", "chain"])
def game(request):
    team = make_team(request.param)
    return Enumerated(team)


def models_of(team: Team, j: int | None = None, new=None) -> list:
    return [new.model if k == j else a.model for k, a in enumerate(team.agents)]


# -- 1a: J exactly; the rollout's episodes and behaviour log-probabilities --------------------------------------
def test_enumeration_is_a_distribution_and_J_is_exact(game):
    team, probs = game.team, game.probs(models_of(game.team))
    weights = game.weights(probs)  # [N]
    assert float(weights.sum()) == pytest.approx(1.0, abs=1e-12)
    for k, turn in enumerate(game.batch.turns):  # the loss mask is exactly agent k's own tokens, every round
        assert all(turn.response_mask[row].nonzero()[:, 0].tolist() == game.own_positions(k, row)
                   for row in range(len(game.tokens)))
    counts = {r: game.batch.rounds.count(r) for r in (1, 2)}
    texts = [team.agents[0].tokenizer.decode([v], skip_special_tokens=True) for v in range(VOCAB)]
    agree = sum(a == b for a in texts for b in texts)  # first rounds that end the episode (a special reads "")
    assert agree == 3 * 3 + 2
    assert counts == {1: len(PROBLEMS) * agree, 2: len(PROBLEMS) * (VOCAB ** 2 - agree) * VOCAB ** 2}
    # R(tau) through the reward path of the rollout equals the game's own reward of the history
    for row in range(0, len(game.tokens), 97):
        assert game.rewards[row] == pytest.approx(game.episodes[row].state.get_reward(), abs=1e-6)
    J = float((weights * game.rewards).sum())
    assert 0.0 < J < 1.0
    # the same J from the decision tree, by backward induction over the distributions (no leaf list)
    by_tree = sum(expected_reward(team, probs[s], p) for s, p in enumerate(PROBLEMS)) / len(PROBLEMS)
    assert J == pytest.approx(by_tree, abs=1e-6)


def expected_reward(team: Team, probs: dict, problem: Problem) -> float:
    """E[R | problem] by recursion over the decisions, the game replayed through ``PassGame`` alone."""
    def value(tokens) -> float:
        if tokens not in probs:  # a finished episode: replay the game on the texts the agents spoke
            game = PassGame()
            game.reset(problem=problem.problem)
            for r in range(0, len(tokens), 2):
                texts = [team.agents[k].tokenizer.decode([tokens[r + k]], skip_special_tokens=True) for k in range(2)]
                game.step(texts)
            return game.get_reward()
        return sum(float(probs[tokens][v]) * value(tokens + (v,)) for v in range(VOCAB))

    return value(())


def test_rollout_behaviour_logprobs_are_the_brute_force_ones(game):
    team = game.team
    probs = game.probs(models_of(team))
    batch = rollout(team, PROBLEMS, 40, SAMPLING, HF, score=True, seed=7)
    index = {(game.row_problem[i], t): i for i, t in enumerate(game.tokens)}
    seen_rounds = set()
    for i in range(len(batch)):
        s = int(batch.group_ids[i])
        own = [batch.turns[k].response_ids[i][batch.turns[k].response_mask[i].bool()].tolist() for k in range(2)]
        assert len(own[0]) == len(own[1]) == batch.rounds[i]  # one token a turn, one turn a round
        tokens = tuple(own[r % 2][r // 2] for r in range(2 * batch.rounds[i]))  # decision order: round, agent
        row = index[(s, tokens)]  # a trajectory of the enumeration, its rounds and all
        seen_rounds.add(batch.rounds[i])
        assert float(batch.rewards[i]) == pytest.approx(float(game.rewards[row]), abs=1e-6)
        for k in range(2):
            turn, mine = batch.turns[k], game.batch.turns[k]
            # the rollout's view of agent k is the replayed one, token for token, mask for mask
            assert turn.context_ids[i][turn.context_mask[i].bool()].tolist() == \
                mine.context_ids[row][mine.context_mask[row].bool()].tolist()
            width = int(turn.response_mask[i].nonzero().max()) + 1
            assert turn.response_ids[i][:width].tolist() == mine.response_ids[row][:width].tolist()
            assert turn.response_mask[i][:width].tolist() == mine.response_mask[row][:width].tolist()
            brute = [float(probs[s][p][game.tokens[row][len(p)]]) for p in game.own_decisions(k, row)]
            logp = turn.behaviour_logprobs[i]
            assert logp[turn.response_mask[i].bool()].tolist() == pytest.approx(
                torch.tensor(brute).log().tolist(), abs=1e-5)
            assert (logp[~turn.response_mask[i].bool()] == 0).all()  # nothing on others' or the env's tokens
    assert seen_rounds == {1, 2}


# -- 1b, 1c: the per-state KL and the surrogate identity of a moved agent ----------------------------------------
@pytest.mark.parametrize("j", [0, 1])
def test_kl_and_surrogate_identity_of_a_moved_agent(game, j):
    team, batch = game.team, game.batch
    new = moved(team.agents[j], seed=50 + j)
    turn = batch.turns[j]
    kl, new_logp, log_rho = measure_kl(new, team.agents[j].model, turn, TEMPERATURE, SAMPLING.token_budget)
    # 1b: one KL per own token of agent j (its decisions), none for the environment or the other agent
    decisions = [p for row in range(len(batch)) for p in game.own_decisions(j, row)]
    assert kl.numel() == int(turn.response_mask.sum()) == sum(batch.rounds) == len(decisions)
    old_probs, new_probs = game.probs(models_of(team)), game.probs(models_of(team, j, new))
    brute_kl, brute_new = [], []
    for row in range(len(batch)):
        s = game.row_problem[row]
        for p in game.own_decisions(j, row):
            q, p_old = new_probs[s][p], old_probs[s][p]
            brute_kl.append(float((q * (q.log() - p_old.log())).sum()))
            brute_new.append(float(q[game.tokens[row][len(p)]].log()))
    assert kl.tolist() == pytest.approx(brute_kl, abs=2e-6, rel=1e-4)
    assert max(brute_kl) > 1e-2  # the move is real
    assert new_logp[turn.response_mask.bool()].tolist() == pytest.approx(brute_new, abs=1e-5)
    assert (log_rho[~turn.response_mask.bool()] == 0).all()
    # 1c: E_old[(r_j - 1)(R - b(s))] = J(new) - J(old), r_j over agent j's tokens in every round
    weights = game.weights(old_probs)  # [N]
    group = torch.tensor(game.row_problem)  # [N]
    baseline = torch.stack([(weights * game.rewards)[group == s].sum() / weights[group == s].sum()
                            for s in range(len(PROBLEMS))])[group]  # [N] b(s) = E_old[R | s]
    log_r = masked_sum(log_rho, turn.response_mask, dim=1).double()  # [N]
    surrogate = float((weights * (log_r.exp() - 1) * (game.rewards - baseline)).sum())
    change = game.J(models_of(team, j, new)) - game.J(models_of(team))
    assert abs(change) > 1e-3
    assert surrogate == pytest.approx(change, abs=2e-6)
    # the step's estimate (advantage.step_estimates) on the enumerated rows, P(tau) folded into the advantage
    n = len(batch)
    inputs = UpdateInputs(turn, (game.rewards - baseline).float(), (n * weights * (game.rewards - baseline)).float(),
                          torch.zeros(n), torch.zeros(n))
    estimate = step_estimates(inputs, log_rho, kl, batch, j)
    assert estimate["surrogate_estimate"] == pytest.approx(change, abs=2e-5)
    assert estimate["zeta"] == 0.0
    # the identity has teeth: a ratio that also counted the tokens agent j did not write misses the change
    present = turn.response_mask.flip(-1).cummax(-1).values.flip(-1)  # [N, Lr] every token up to its last own one
    leaked_turn = TurnTensors(turn.context_ids, turn.context_mask, turn.response_ids, present)
    leaked = [turn_forward(m, leaked_turn, slice(None), TEMPERATURE)[0] for m in (new.model, team.agents[j].model)]
    leaked_r = masked_sum(leaked[0] - leaked[1], present, dim=1).double().exp()  # [N]
    wrong = float((weights * (leaked_r - 1) * (game.rewards - baseline)).sum())
    assert abs(wrong - change) > 10 * abs(surrogate - change) + 1e-4


# -- 1d: the environment's and the other agent's tokens get no gradient -----------------------------------------
@pytest.mark.parametrize("ratio", ["seq", "seq-mean", "token"])
def test_loss_gives_tokens_agent_j_did_not_write_no_gradient(game, ratio):
    j = 1  # its view holds agent 0's turns, the environment's answers and its own turns
    team, batch = game.team, game.batch
    trained = moved(team.agents[j], seed=9, scale=0.05)
    ended = [i for i, r in enumerate(batch.rounds) if r == 1]
    rows = torch.tensor(sorted(set(ended) | set(range(0, len(batch), 97))))  # [b] one-round and two-round episodes
    cfg = Config(agents="tiny x2", temperature=TEMPERATURE, ratio=ratio, eps_clip=0.2, kl_estimator="k3").apply_preset()
    turn = copy.copy(batch.turns[j])  # the behaviour log-probs of the rows used: the unmoved agent's forward
    turn.behaviour_logprobs = torch.zeros(turn.response_ids.shape)  # [N, Lr]
    turn.behaviour_logprobs[rows] = turn_forward(team.agents[j].model, turn.tensors, rows, TEMPERATURE)[0]
    adv = torch.linspace(-1.0, 1.0, len(batch))  # [N]
    inputs = UpdateInputs(turn, adv, adv, torch.full((len(batch),), -0.1), torch.zeros(len(batch)))
    lc = turn.context_ids.shape[1]
    predicts_own = torch.zeros(len(rows), lc + turn.response_ids.shape[1], dtype=torch.bool)  # [b, Lc + Lr]
    for b, row in enumerate(rows.tolist()):  # position lc - 1 + t predicts response token t (no mask read)
        predicts_own[b, [lc - 1 + t for t in game.own_positions(j, row)]] = True

    def loss_and_grads(noise: float):
        """The micro-batch loss on ``rows``, with noise added to the final hidden states (hence the logits and
        log-probs) at every position that does not predict one of agent j's tokens, and the gradient the
        backward pass leaves on those hidden states."""
        trained.model.requires_grad_(True)
        trained.model.zero_grad(set_to_none=True)
        seen = {}

        def hook(module, args, out):
            g = torch.Generator().manual_seed(0)
            out = out + noise * torch.randn(out.shape, generator=g) * (~predicts_own)[..., None]  # [b, L, H]
            out.register_hook(lambda grad: seen.setdefault("grad", grad))
            return out

        handle = trained.model.model.norm.register_forward_hook(hook)
        try:
            loss = _micro_batch_loss(trained, inputs, rows, cfg.core(), 0.5, None, _Tally())
            loss.backward()
        finally:
            handle.remove()
        params = [p.grad.clone() for p in trained.model.parameters()]
        return loss.detach(), seen["grad"], params

    loss, hidden_grad, params = loss_and_grads(0.0)
    assert (hidden_grad[~predicts_own] == 0).all()  # exactly 0 wherever the token is not agent j's own
    assert (hidden_grad[predicts_own].abs().sum(-1) > 0).float().mean() > 0.9  # and a signal at its own tokens
    noisy_loss, noisy_grad, noisy_params = loss_and_grads(3.0)
    assert torch.equal(noisy_loss, loss)  # other log-probs perturbed: nothing changes
    assert torch.equal(noisy_grad, hidden_grad)
    assert all(torch.equal(a, b) for a, b in zip(noisy_params, params))
    # so do behaviour log-probs written (wrongly) at those positions
    garbage = copy.copy(turn)
    garbage.behaviour_logprobs = torch.where(turn.response_mask.bool(), turn.behaviour_logprobs, 7.0)
    inputs = UpdateInputs(garbage, adv, adv, inputs.log_w, inputs.log_w_full)
    assert torch.equal(loss_and_grads(0.0)[0], loss)


# -- What each agent's view holds ---------------------------------------------------------------------------------
def test_independent_views_hold_every_earlier_turn_of_the_others():
    """Independent protocol: from the second round on, each agent's new user turn holds what the others said up to
    the environment's last answer (``episode_context``'s docstring), so no agent is kept from a turn it never saw.
    Scripted turns, the project's own character tokenizer."""
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, layers=1, hidden=32)
    team = Team([Agent(resolve_agent_spec("tiny"), model, tok) for _ in range(2)],
                math_team_config(protocol="independent", reward=REWARD, environment=ENV))
    e = start_episode(team, PROBLEMS[0])
    for k, text in enumerate(["x1", "y1"]):
        episode_context(team, e, k)
        speak(e, k, tok(text)["input_ids"] + [tok.eos_token_id], tok)
    end_round(ENV, e, 2)
    views = [tok.decode(episode_context(team, e, k)[e.prompt_len[k]:]) for k in range(2)]
    assert "Agent 2: y1" in views[0]
    assert "Agent 1: x1" in views[1]


def test_round_one_views_chain_whole_responses_independent_none(game):
    """Round 1 with an environment. Chain: agent 2 decides on a context that holds agent 1's whole response of the
    round (the environment then applies both on one world), not the answer a math extractor reads from it (here
    none: "Agent 1: ?"). Independent: on the opening alone, whatever agent 1 said. Every round-1 decision of agent 2
    in the enumerated game, against its own chat template rendering what it should read."""
    team = game.team
    tok = team.agents[1].tokenizer
    for s, problem in enumerate(PROBLEMS):
        contexts = set()
        for v in range(VOCAB):
            agent, context = game.decisions[s][(v,)]
            said = tok.decode([v], skip_special_tokens=True)
            chain = team.protocol == "chain" and said
            expected = f"{problem.problem}\n\nAgent 1: {said}" if chain else problem.problem
            rendered = tok.apply_chat_template([{"role": "user", "content": expected}], tokenize=False,
                                               add_generation_prompt=True)
            assert agent == 1
            assert context == tok(rendered, add_special_tokens=False)["input_ids"], (v, tok.decode(context))
            contexts.add(tuple(context))
        assert len(contexts) == (3 if team.protocol == "chain" else 1)  # chain: after "a", "b" and a special


def test_chain_round_one_scripted_view_names_agent_one_s_words():
    """The same on the project's character tokenizer, scripted: agent 1 says "x1 then y2" (no number a math
    extractor would read as its answer), and agent 2's first prompt holds those words."""
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, layers=1, hidden=32)
    team = Team([Agent(resolve_agent_spec("tiny"), model, tok) for _ in range(2)],
                math_team_config(protocol="chain", reward=REWARD, environment=ENV))
    e = start_episode(team, PROBLEMS[0])
    episode_context(team, e, 0)
    speak(e, 0, tok("x1 then y2")["input_ids"] + [tok.eos_token_id], tok)
    view = tok.decode(episode_context(team, e, 1))
    assert view.endswith("Agent 1: x1 then y2<|assistant|>"), view


# -- 2: the round game as a tabular MDP over transcripts --------------------------------------------------------
def round_game(seed: int, n_actions: tuple[int, ...], rounds: int, gamma: float, p_end: float):
    """(ToyMDP, its transcripts) of a deterministic game: a state is the history of joint actions so far (one per
    round played), the next state is the history extended by the round's joint action, and the episode ends
    (the absorbing last state, reward 0 there) after ``rounds`` rounds or earlier where the environment says
    so; the reward, a fixed random number per finished history, comes with the round that ends it."""
    g = torch.Generator().manual_seed(seed)
    joint = list(itertools.product(*(range(a) for a in n_actions)))
    histories = [()]
    for r in range(rounds - 1):
        ends = torch.rand(len(histories), len(joint), generator=g) < p_end
        histories += [h + (a,) for i, h in enumerate(histories) if len(h) == r
                      for b, a in enumerate(joint) if not ends[i, b]]
    index = {h: i for i, h in enumerate(histories)}
    S = len(histories) + 1  # the last: the absorbing end
    P = torch.zeros(S, *n_actions, S, dtype=tm.DTYPE)
    R = torch.zeros(S, *n_actions, dtype=tm.DTYPE)
    P[(S - 1,) + (slice(None),) * len(n_actions) + (S - 1,)] = 1.0
    for h, s in index.items():
        for a in joint:
            nxt = index.get(h + (a,), S - 1)
            P[(s,) + a + (nxt,)] = 1.0
            if nxt == S - 1:
                R[(s,) + a] = float(torch.rand((), generator=g, dtype=tm.DTYPE))
    mu = torch.zeros(S, dtype=tm.DTYPE)
    mu[0] = 1.0
    return tm.ToyMDP(P=P, R=R, mu=mu, gamma=gamma), histories


def J_by_trajectories(mdp: tm.ToyMDP, histories, logps) -> float:
    """E[gamma^(rounds - 1) R] summed over every joint trajectory of the game (no linear algebra)."""
    index = {h: i for i, h in enumerate(histories)}
    end = mdp.n_states - 1
    joint = list(itertools.product(*(range(a) for a in mdp.n_actions)))

    def value(h, discount):
        s = index[h]
        total = 0.0
        for a in joint:
            p = float(torch.stack([logps[i][s, a[i]] for i in range(len(a))]).sum().exp())
            nxt = int(mdp.P[(s,) + a].argmax())
            total += p * (discount * float(mdp.R[(s,) + a]) + (value(h + (a,), discount * mdp.gamma)
                                                               if nxt != end else 0.0))
        return total

    return value((), 1.0)


@st.composite
def round_games(draw):
    n_actions = tuple(draw(st.lists(st.integers(2, 3), min_size=2, max_size=2)))
    rounds = draw(st.sampled_from([2, 2, 3]))
    gamma = draw(st.floats(0.3, 0.95))
    p_end = draw(st.sampled_from([0.0, 0.3]))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    deltas = draw(st.lists(st.floats(1e-3, 1.0), min_size=2, max_size=2))
    mdp, histories = round_game(seed, n_actions, rounds, gamma, p_end)
    return mdp, histories, tm.random_team(seed + 1, mdp), deltas


@given(case=round_games())
def test_round_game_sequential_stage_never_lowers_J_and_keeps_its_bounds(case):
    mdp, histories, team, deltas = case
    assert tm.solve_policy(mdp, team)["J"] == pytest.approx(J_by_trajectories(mdp, histories, team), abs=1e-12)
    for order in ([0, 1], [1, 0]):
        stage = tm.sat_stage(mdp, team, order, deltas)
        assert all(b >= a - 1e-12 for a, b in zip(stage["J"], stage["J"][1:])), stage["J"]
        check_step_bounds(stage)
        check_stage_bound(stage)
        final = stage["logps"]
        assert stage["J"][-1] == pytest.approx(J_by_trajectories(mdp, histories, final), abs=1e-12)
