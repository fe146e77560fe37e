"""An environment's multi-round episodes on real vLLM engines (CPU build or CUDA): tiny agents and a tiny responder,
fp32, 2 rows, 2 rounds (``harness.episodes.episode_rollout`` with ``scale.rollout_vllm.VLLMBackend``).

Checked, with the engines started once for the module (each start costs half a minute or more on two CPU cores):
- the draws are coupled by their seeds as the HF backend's are: the same seeds give the same transcripts (the second
  time through the engines' prefix cache), and a changed seed of one row changes that row's episode only;
- the behaviour log-probabilities stay the training forward's: the engines' own log-probabilities of every sampled
  token of every round agree with them (the contexts the engines read are the tokens the training forward reads);
- the frozen responder runs on its own engine: one generate per round answers every episode's questions.
Skipped where vLLM is not installed.
"""
import math

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow  # starts three real vLLM engines

import test_responder  # noqa: E402

import rollout  # noqa: E402
from harness import episodes  # noqa: E402
from harness.environments import Environment  # noqa: E402
from harness.loading import load_agent  # noqa: E402
from harness.math_grading import math_team_config  # noqa: E402
from rollout import SamplingConfig  # noqa: E402
from scale import rollout_vllm as rv  # noqa: E402
from scale.rollout_hf import HF  # noqa: E402
from team import Problem, Team  # noqa: E402

BOUND = 1e-4  # fp32 engine vs fp32 training forward: mean |log pi_vllm - log pi_train| per sampled token
ROWS = [Problem(f"row-{i}", "", "", None, {"seed": i}) for i in range(2)]
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=6)
RULES = "One question each, of six characters at most; the oracle answers every agent in turn. " * 3  # 264 chars:
# with the tiny agents' one token a character, the opening spans two of a CPU engine's 128-token cache blocks


class Oracle(test_responder.Oracle):
    """test_responder's oracle over two rounds, its opening long enough to span two CPU cache blocks."""

    max_rounds = 2

    def reset(self, seed: int, **_) -> str:
        return super().reset(seed) + " " + RULES


class Counting:
    """A backend, counting each generate as (the model asked, how many contexts)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def generate(self, agent, contexts, sampling, seeds):
        self.calls.append((agent, len(contexts)))
        return self.inner.generate(agent, contexts, sampling, seeds)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def engine_device() -> str:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda"


@pytest.fixture(scope="module")
def team_and_engines():
    device = engine_device()
    config = math_team_config(protocol="chain", environment=Environment(Oracle, "oracle", 2, (0.0, 1.0)))
    config.responder = load_agent("tiny", device=device, dtype=torch.float32, seed=7)
    config.responder_max_tokens = 5
    team = Team([load_agent("tiny", device=device, dtype=torch.float32, seed=k) for k in range(2)], config)
    backend = rv.VLLMBackend(n_engines=rv.team_engines(team), seed=0, max_model_len=512, health_logprobs=True)
    yield team, backend
    backend.close()


def one_row_reseeded(monkeypatch, row: int) -> None:
    """Every response seed of ``row`` (each agent, each round) replaced; the other rows' kept."""
    seeds = rollout.response_seeds
    monkeypatch.setattr(episodes, "response_seeds", lambda base, rows, agent, round_=0: [  # the rounds' draws
        s ^ 0x5A5A5A5A if i == row else s for i, s in enumerate(seeds(base, rows, agent, round_))])


def coupling(team, backend, monkeypatch) -> tuple[list[str], list[str], list[str]]:
    """(transcripts under seed 3, again under seed 3, under seed 3 with row 1's seeds changed)."""
    first = rollout.rollout(team, ROWS, 1, SAMPLING, backend, score=False, seed=3).transcripts
    again = rollout.rollout(team, ROWS, 1, SAMPLING, backend, score=False, seed=3).transcripts
    with monkeypatch.context() as patch:
        one_row_reseeded(patch, 1)
        moved = rollout.rollout(team, ROWS, 1, SAMPLING, backend, score=False, seed=3).transcripts
    return first, again, moved


def test_vllm_episodes_are_coupled_by_their_seeds_as_hf_ones_are(team_and_engines, monkeypatch):
    team, engines = team_and_engines
    for backend in (HF, engines):
        first, again, moved = coupling(team, backend, monkeypatch)
        assert first == again, backend.name
        assert moved[0] == first[0] and moved[1] != first[1], backend.name
        assert all(t.count("Oracle to agent") == 2 * 2 for t in first)  # two rounds of two replies
    shares = [engines.prefix_cache_share(agent) for agent in team.agents]
    print(f"\n[vllm rounds] prompt tokens read from the prefix cache, per agent: {[f'{s:.0%}' for s in shares]}")
    assert all(s > 0.3 for s in shares)  # round 2 and the replays re-read earlier prompts from the cache


def test_vllm_behaviour_logprobs_are_the_training_forwards_and_the_responder_answers_once_a_round(
        team_and_engines):
    team, engines = team_and_engines
    backend = Counting(engines)
    batch = rollout.rollout(team, ROWS, 2, SAMPLING, backend, score=True, seed=9)
    asked = [n for model, n in backend.calls if model is team.config.responder]
    assert asked == [len(ROWS) * 2 * len(team)] * 2  # rows x group x agents' questions, in one generate a round
    assert len(backend.calls) == 2 * (len(team) + 1)  # and one generate per agent per round
    health = engines.health(team, batch)
    for turn, gap in zip(batch.turns, health):
        compared = sum(1 for row in turn.sampler_logprobs for v in row if not math.isnan(v))
        assert compared >= int(turn.response_mask.sum()) - len(batch) * 2  # every own token but an eos put back
        assert gap < BOUND, health
