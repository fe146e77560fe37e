"""A responder model inside the environment (``Environment.ask``, ``harness.episodes.responder_replies``): every
question of a round, across all episodes, answered in one batched generate; each reply a function of its row, round,
question and chat alone, so episodes replay exactly; the responder frozen, its words context only."""
import pytest
import torch

from harness.environments import Environment, EnvironmentFault, play, responder_spec
from harness.episodes import responder_seed
from harness.loading import load_agent
from harness.math_grading import math_team_config
from rollout import SamplingConfig, rollout
from scale.rollout_hf import HF
from team import Problem, Team


class Oracle:
    """Each agent's words go to the responder as one question; the observation is the replies."""

    max_rounds = 3

    def reset(self, seed: int, **_) -> str:
        self.heard: list[str] = []
        return f"Ask the oracle {seed}."

    def ask(self, responses: list[str]) -> list[list[dict]]:
        return [[{"role": "user", "content": f"Q{k}: {text[:6]}"}] for k, text in enumerate(responses)]

    def step(self, responses: list[str], replies: list[str]) -> tuple[str, bool]:
        self.heard += replies
        return "\n".join(f"Oracle to agent {k + 1}: {r}" for k, r in enumerate(replies)), False

    def get_reward(self) -> float:
        return float(len("".join(self.heard)) % 2)


ORACLE = Environment(Oracle, "oracle", 3, (0.0, 1.0))
ROWS = [Problem(f"row-{i}", "", "", None, {"seed": i}) for i in range(3)]
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=4)


class CountingBackend:
    """The HF backend, counting each generate: (which model, how many contexts)."""

    def __init__(self):
        self.calls: list[tuple[object, int]] = []

    def generate(self, agent, contexts, sampling, seeds):
        self.calls.append((agent, len(contexts)))
        return HF.generate(agent, contexts, sampling, seeds)

    def __getattr__(self, name):
        return getattr(HF, name)


def oracle_team(responder=None) -> Team:
    config = math_team_config(protocol="chain", environment=ORACLE)
    config.responder, config.responder_max_tokens = responder, 5
    return Team([load_agent("tiny", seed=k) for k in range(2)], config)


@pytest.fixture(scope="module")
def responder():
    return load_agent("tiny", seed=7)


def test_every_question_of_a_round_is_answered_in_one_generate(responder):
    backend = CountingBackend()
    batch = rollout(oracle_team(responder), ROWS, 2, SAMPLING, backend, score=False, seed=3)
    asked = [n for model, n in backend.calls if model is responder]
    assert asked == [len(ROWS) * 2 * 2] * ORACLE.max_rounds  # rows x group x agents, once a round
    assert len(backend.calls) == ORACLE.max_rounds * 3  # and one generate per agent per round
    assert all(t.count("Oracle to agent") == 2 * ORACLE.max_rounds for t in batch.transcripts)


def test_a_reply_is_a_function_of_its_row_round_and_question_alone(responder):
    """The same episodes replay word for word; each reply equals the reply drawn alone under its seed, whatever
    else shared its batch."""
    team = oracle_team(responder)
    first = rollout(team, ROWS, 1, SAMPLING, HF, score=False, seed=11)
    again = rollout(team, ROWS, 1, SAMPLING, HF, score=False, seed=11)
    assert first.transcripts == again.transcripts
    env = ORACLE
    state, _ = env.start(ROWS[1])
    said = first.transcripts[1].split("\n\n")
    responses = [said[1].removeprefix("Agent 1: "), said[2].removeprefix("Agent 2: ")]
    [chat, _] = env.ask(state, ROWS[1], responses)
    sampling = SamplingConfig(0.7, 1.0, 5, SAMPLING.token_budget)
    [ids] = HF.generate(responder, [responder.encode_prompt(chat)], sampling, [responder_seed("row-1", 0, 0)])
    alone = responder.tokenizer.decode(ids, skip_special_tokens=True).strip()
    assert said[3].startswith(f"Environment: Oracle to agent 1: {alone}\n")


def test_the_responder_is_never_trained_and_its_tokens_are_context(responder):
    before = [p.clone() for p in responder.model.parameters()]
    batch = rollout(oracle_team(responder), ROWS[:1], 2, SAMPLING, HF, score=True, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(before, responder.model.parameters()))
    for turn in batch.turns:  # an agent's mask covers its own sampled tokens only: 4 a round at most
        assert int(turn.response_mask.sum(1).max()) <= ORACLE.max_rounds * SAMPLING.max_new_tokens


def test_an_environment_that_asks_without_a_responder_is_one_line():
    with pytest.raises(ValueError, match=r"^environment oracle asks a responder model questions, but none was "
                                         r"given: pass --env-model NAME"):
        rollout(oracle_team(None), ROWS[:1], 1, SAMPLING, HF, score=False, seed=0)


def test_ask_must_return_chats():
    class Bad(Oracle):
        def ask(self, responses):
            return ["what?"]
    env = Environment(Bad, "bad", 2, (0.0, 1.0))
    with pytest.raises(EnvironmentFault, match=r"^environment bad, row 'row-0': ask returned .*; return a list of "
                                               r"chats"):
        play(env, ROWS[0], [["a", "b"]])


def test_the_probe_scripts_the_responder_and_the_spec_is_refused_without_ask():
    seen, _ = play(ORACLE, ROWS[0], [["a", "b"]] * 2)
    assert seen[1] == "Oracle to agent 1: I cannot say.\nOracle to agent 2: I cannot say."
    methods = {"reset": Oracle.reset, "step": Oracle.step, "get_reward": Oracle.get_reward}
    plain = Environment(type("Plain", (), methods), "plain", 2, (0.0, 1.0))
    with pytest.raises(ValueError, match=r"^--env-model tiny: environment plain asks a responder no questions "
                                         r"\(its class has no ask\)"):
        responder_spec(plain, {}, "tiny")
    assert responder_spec(ORACLE, {"responder": "rules"}, None) is None
    assert responder_spec(ORACLE, {"responder": "tiny"}, None) == "tiny"


class Scored(Oracle):
    """The oracle with a per-round score: the replies heard so far."""

    def turn_score(self) -> float:
        return float(len(self.heard))


def test_per_round_figures_per_agent_and_the_environments_turn_score(responder):
    config = math_team_config(protocol="independent", environment=Environment(Scored, "scored", 2, (0.0, 1.0)))
    config.responder, config.responder_max_tokens = responder, 5
    team = Team([load_agent("tiny", seed=k) for k in range(2)], config)
    batch = rollout(team, ROWS, 2, SAMPLING, HF, score=False, seed=1)
    assert [r["round"] for r in batch.per_round] == [1, 2] and all(r["episodes"] == 6 for r in batch.per_round)
    assert [r["turn_score"] for r in batch.per_round] == [2.0, 4.0]  # 2 replies heard per round
    for k, turn in enumerate(batch.turns):  # the rounds' own tokens add up to the agent's whole own tokens
        total = sum(r["tokens"][k] for r in batch.per_round) * len(batch)
        assert total == pytest.approx(float(turn.response_mask.sum()))
        assert all(0 <= r["cut"][k] <= 1 for r in batch.per_round)
