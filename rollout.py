"""Joint-trajectory generation: the team answers B problems G times each (paper, Section 3; Algorithm 1, ROLLOUT).

A joint trajectory is one response per agent under the team's protocol (independent answers + majority
vote, or a chain in which agent k sees the answers of agents 1..k-1, with an environment their whole
responses), with one team reward shared by every agent's tokens: the team's reward (``reward.Reward``: a
user's function of every agent's response, or the built-in one: chain, 1 if the last answer is right;
independent, the expected correctness of the vote under a uniform tie-break, so that no agent is a dictator).
A team handed an environment (``TeamConfig.environment``) acts over rounds: the environment plays those episodes
(``Environment.play``: ``harness/episodes.py``) with this module's turns, seeds and behaviour log-probabilities.

The behaviour log-probabilities come from the training model's teacher-forced forward at the sampling
temperature, so the sampler's numerics never enter the importance ratios. The sampler is a backend object
the entry point chooses once per run (``scale.rollout_vllm.make_backend``: ``scale.rollout_hf.HFBackend`` or
``scale.rollout_vllm.VLLMBackend``) and hands to ``rollout`` and ``regenerate``; of it they call
``generate(agent, contexts, sampling, seeds)`` and ``last_logprobs(agent)``. Sampling is the tempered softmax
and nothing else; top_p < 1 is for evaluation only (the ratios and the KL use the full softmax).

Common random numbers: every response is sampled under a seed of its own (``response_seeds``: a function of
the call's base seed, the row and the agent), and its randomness is a function of that seed alone, whatever
else is in the batch. Two policies sampled under the same seeds give the same response wherever they agree
closely enough, while each draw keeps exactly its own distribution: the paired certificates (``bounds``) use
that to pair the held-out evaluations of consecutive stages and a step's before/after redraws.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from logprobs import (
    TurnTensors,
    batched_response_logprobs,
    left_pad,
    right_pad,
    turn_forward,
    turn_rows,
)
from reward import agent_scores, counterfactual_baselines, score
from team import Problem, Team

TOP_P_TRAINING_ERROR = ("--top-p {top_p} < 1 cannot be used for training: the sampler would draw from the nucleus "
                        "while the behaviour log-probs, ratios and KL use the full softmax (off by log Z_nucleus, "
                        "tokens outside it never pushed down); train with --top-p 1 (evaluation may use top-p < 1)")


@dataclass
class SamplingConfig:
    temperature: float = 0.8
    top_p: float = 1.0
    max_new_tokens: int = 32768
    token_budget: int = 65536  # max (context + response) tokens in one generate / forward chunk

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"--temperature must be > 0 (got {self.temperature}): SAT needs a stochastic policy")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1] (got {self.top_p})")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1 (got {self.max_new_tokens})")


@dataclass
class Turn:
    """One agent's turn in all N joint trajectories."""

    agent: int
    context_ids: torch.Tensor  # [N, Lc] left-padded
    context_mask: torch.Tensor  # [N, Lc]
    response_ids: torch.Tensor  # [N, Lr] right-padded, includes the eos token when one was sampled
    response_mask: torch.Tensor  # [N, Lr] 1 on generated tokens
    behaviour_logprobs: torch.Tensor  # [N, Lr] log pi_behaviour(a_t|s_t) at the sampling temperature, 0 on padding
    texts: list[str]
    answers: list[str | None]
    truncated: torch.Tensor  # [N] bool: no eos within max_new_tokens
    sampler_logprobs: list[list[float]] | None = None  # [N][len] the engine's own (vLLM), for the health metric

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum())

    @property
    def tensors(self) -> TurnTensors:
        """Its context and response ids and masks, as every teacher-forced forward of the turn reads them."""
        return TurnTensors(self.context_ids, self.context_mask, self.response_ids, self.response_mask)


@dataclass
class TeamBatch:
    problems: list[Problem]  # [N] the problem of each joint trajectory
    group_ids: torch.Tensor  # [N] index of the problem in the rollout call
    turns: list[Turn]  # one per agent, turns[k].agent == k
    team_answers: list[str | None]
    rewards: torch.Tensor  # [N] team reward R, in the reward's own range (team.config.reward.range)
    agent_reward: torch.Tensor = None  # [n_agents, N] each agent's own reward (reward.agent_scores), in R's range
    counterfactual: torch.Tensor | None = None  # [n_agents, N] independent protocol: counterfactual_baselines
    transcripts: list[str] | None = None  # [N] with an environment: each episode, every round, as text
    rounds: list[int] | None = None  # [N] with an environment: the rounds each episode ran
    solved: list[bool] | None = None  # [N] with an environment: its reward at the top of the environment's range
    per_round: list[dict] | None = None  # with an environment: ``harness.episodes.round_stats``, round by round

    def __len__(self) -> int:
        return len(self.problems)

    @property
    def has_own_scores(self) -> bool:
        """Whether ``agent_reward`` holds each agent's own score; an episode's (with an environment) is the team
        reward, as no share of an episode is one agent's (``harness.episodes.score_episodes``)."""
        return self.rounds is None

    @property
    def responses(self) -> int:
        """Responses generated for the batch: one per agent and round of every trajectory."""
        return len(self.turns) * (sum(self.rounds) if self.rounds is not None else len(self))

    @property
    def num_tokens(self) -> int:
        return sum(t.num_tokens for t in self.turns)


# -- Common random numbers ------------------------------------------------------------------------------
SEED_BITS = 62  # seeds and base seeds lie in [0, 2**62)


def rng_devices(device) -> list[int]:
    """The CUDA devices ``torch.random.fork_rng`` must save: the current one for a CUDA device, none otherwise
    (asking a CPU run for ``torch.cuda.current_device()`` would initialise CUDA)."""
    return [torch.cuda.current_device()] if str(device).startswith("cuda") and torch.cuda.is_available() else []


def draw_seed() -> int:
    """A base seed from torch's global generator: a run seeded with --seed draws the same samples."""
    return int(torch.randint(0, 1 << SEED_BITS, ()))


def response_seeds(base: int, rows: int, agent: int, round_: int = 0) -> list[int]:
    """One seed per response of agent ``agent`` in rows 0..rows-1 of a call with base seed ``base``: a hash
    of (base, agent, row) and, after an episode's first round, the round, so the agents of one row (the rows,
    the rounds) draw independent randomness, and a call with the same base, rows and agent draws the same
    randomness whatever the batch around it."""
    tag = "" if round_ == 0 else f":{round_}"
    return [int.from_bytes(hashlib.blake2b(f"{base}:{agent}:{row}{tag}".encode(), digest_size=8).digest(),
                           "little") >> (64 - SEED_BITS) for row in range(rows)]


# -- The joint rollout -----------------------------------------------------------------------------------
@torch.no_grad()
def behaviour_logprobs(agent, tensors: TurnTensors, sampling: SamplingConfig) -> torch.Tensor:
    """log pi(a_t | s_t) at the sampling temperature of one turn [N, Lr], 0 on padding: the training
    model's teacher-forced forward, one call per token-budget chunk. ``tensors``: the turn's
    ``TurnTensors`` or the same four tensors as a plain tuple."""
    tensors = TurnTensors(*tensors)
    calls = -(-len(tensors.context_ids) // turn_rows(tensors, sampling.token_budget))
    dummy = lambda: turn_forward(agent.model, tensors, slice(0, 1), sampling.temperature)  # noqa: E731
    with agent.procs.lockstep(agent.model, calls, dummy):
        return batched_response_logprobs(agent.model, tensors, sampling.temperature, sampling.token_budget)


def agent_turn(team: Team, k: int, contexts: list[list[int]], sampling: SamplingConfig, backend, score: bool,
               seed: int) -> Turn:
    """Agent k answers every context: one batched generate, row i under ``response_seeds(seed, .., k)[i]``,
    then (unless ``score=False``: evaluation needs no log-probabilities) the behaviour log-probabilities."""
    agent = team.agents[k]
    tok = agent.tokenizer
    responses = backend.generate(agent, contexts, sampling, response_seeds(seed, len(contexts), k))
    ctx, cmask = left_pad(contexts, tok.pad_token_id)  # [N, Lc]
    resp, rmask = right_pad(responses, tok.pad_token_id)  # [N, Lr]
    texts = tok.batch_decode(responses, skip_special_tokens=True)
    truncated = torch.tensor([tok.eos_token_id not in r for r in responses])  # [N]
    tensors = TurnTensors(ctx, cmask, resp, rmask)
    logp = behaviour_logprobs(agent, tensors, sampling) if score else torch.zeros(resp.shape)  # [N, Lr]
    agent.procs.release(agent.model)  # nothing kept gathered between turns
    return Turn(k, ctx, cmask, resp, rmask, logp, texts, [team.extract(t) for t in texts], truncated,
                backend.last_logprobs(agent))


def turn_contexts(team: Team, k: int, flat: list[Problem], turns: list[Turn]) -> list[list[int]]:
    """Agent k's context in every trajectory: the problem, and in the chain protocol the answers of
    agents 0..k-1 (``turns[:k]``) of the same trajectory."""
    if team.protocol == "chain":
        return [team.prompt_ids(k, p, [t.answers[i] for t in turns[:k]], [t.texts[i] for t in turns[:k]])
                for i, p in enumerate(flat)]
    return [team.prompt_ids(k, p, []) for p in flat]


def score_team(team: Team, flat: list[Problem], turns: list[Turn], group_ids: torch.Tensor):
    """(team answers, team rewards [N], each agent's own score [n_agents, N], counterfactual baselines
    [n_agents, N] or None) of the joint trajectories, all from the team's reward (``reward.score``)."""
    reward, protocol = team.config.reward, team.protocol
    answers = [[t.answers[i] for t in turns] for i in range(len(flat))]
    texts = [[t.texts[i] for t in turns] for i in range(len(flat))]
    rewards = torch.tensor(score(reward, flat, texts, answers, protocol))  # [N]
    own = agent_scores(reward, flat, texts, answers, protocol)  # [n_agents, N]
    counterfactual = (counterfactual_baselines(reward, flat, texts, answers, protocol, group_ids)
                      if protocol == "independent" else None)  # [n_agents, N]
    return [team.team_answer(a) for a in answers], rewards.float(), own, counterfactual


def rollout(team: Team, problems: list[Problem], group_size: int, sampling: SamplingConfig, backend,
            score: bool = True, seed: int | None = None) -> TeamBatch:
    """G joint trajectories for each of the B problems (paper, Section 3); row b * G + g is sample g of
    problem b, agent k's response in it drawn by ``backend`` under ``response_seeds(seed, N, k)`` (None: a
    seed drawn from torch's global generator). ``score=False`` leaves the behaviour log-probabilities at zero
    (evaluation)."""
    if group_size < 1:
        raise ValueError(f"--group-size must be >= 1 (got {group_size})")
    if score and sampling.top_p < 1:
        raise ValueError(TOP_P_TRAINING_ERROR.format(top_p=sampling.top_p))
    flat = [p for p in problems for _ in range(group_size)]  # [N]
    group_ids = torch.arange(len(problems)).repeat_interleave(group_size)  # [N]
    seed = draw_seed() if seed is None else seed
    if team.config.environment is not None:  # rounds: the environment handed in plays them (harness/episodes.py)
        return team.config.environment.play(team, flat, group_ids, sampling, backend, score, seed)
    turns: list[Turn] = []
    for k in range(len(team)):
        turns.append(agent_turn(team, k, turn_contexts(team, k, flat, turns), sampling, backend, score, seed))
    return TeamBatch(flat, group_ids, turns, *score_team(team, flat, turns, group_ids))


def regenerate(team: Team, batch: TeamBatch, j: int, sampling: SamplingConfig, backend,
               seed: int | None = None) -> tuple[TeamBatch, int]:
    """After agent j's promotion (Algorithm 1, line 12), redraw what depends on it, so the batch is
    exactly on-policy for pi_hat^i of Eq. (1) and needs no importance weights. Independent: agent j's
    turn only (the joint action is a product given the problem). Chain: agent j's turn and every turn
    after it (their contexts hold agent j's answer); earlier turns are draws of unchanged agents. With an
    environment, the whole episode (every later round reacts to agent j's turns); the unchanged agents'
    draws under the same seed repeat wherever their contexts do. Two
    calls with one ``seed`` (a step's before and after draws) share their random numbers row by row.
    Returns the new batch and how many responses were generated."""
    seed = draw_seed() if seed is None else seed
    if team.config.environment is not None:  # every later round reacts to agent j's turns: the whole episode
        new = team.config.environment.play(team, batch.problems, batch.group_ids, sampling, backend, True, seed)
        return new, new.responses
    turns = list(batch.turns)
    redo = range(j, len(team)) if team.protocol == "chain" else [j]
    for k in redo:
        turns[k] = agent_turn(team, k, turn_contexts(team, k, batch.problems, turns), sampling, backend, True, seed)
    new = TeamBatch(batch.problems, batch.group_ids, turns, *score_team(team, batch.problems, turns, batch.group_ids))
    return new, len(redo) * len(batch)
