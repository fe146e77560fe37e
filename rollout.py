"""Joint-trajectory generation: the team answers B problems G times each (paper, Section 3; Algorithm 1, ROLLOUT).

A joint trajectory is one response per agent under the team's protocol (independent answers + majority
vote, or a chain in which agent k sees the answers of agents 1..k-1, with an environment their whole
responses), with one team reward shared by every agent's tokens: the team's reward (``reward.Reward``: a
user's function of every agent's response, or the built-in one: chain, 1 if the last answer is right;
independent, the expected correctness of the vote under a uniform tie-break, so that no agent is a dictator).

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
import math
import time
import zlib
from dataclasses import dataclass, field

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
    per_round: list[dict] | None = None  # with an environment: ``round_stats``, round by round

    def __len__(self) -> int:
        return len(self.problems)

    @property
    def has_own_scores(self) -> bool:
        """Whether ``agent_reward`` holds each agent's own score; an episode's (with an environment) is the team
        reward, as no share of an episode is one agent's (``score_episodes``)."""
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
    if team.config.environment is not None:
        return episode_rollout(team, flat, group_ids, sampling, backend, score, seed)
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
        new = episode_rollout(team, batch.problems, batch.group_ids, sampling, backend, True, seed)
        return new, new.responses
    turns = list(batch.turns)
    redo = range(j, len(team)) if team.protocol == "chain" else [j]
    for k in redo:
        turns[k] = agent_turn(team, k, turn_contexts(team, k, batch.problems, turns), sampling, backend, True, seed)
    new = TeamBatch(batch.problems, batch.group_ids, turns, *score_team(team, batch.problems, turns, batch.group_ids))
    return new, len(redo) * len(batch)


# -- Episodes: agents that act, observe and act again (an environment's rounds) ----------------------------------
ENVIRONMENT = -1  # the speaker of an environment's observation in ``Episode.said``


@dataclass
class Episode:
    """One joint trajectory over rounds. The state at any token is the transcript so far (the brief's section
    12): each agent's view is its own chat, its turns as the assistant's, everything else (the opening
    observation, the other agents' turns, the environment's answers) as user turns, with token ids kept as
    they were sampled (never re-templated), so the rollout's contexts and the training forward read the same
    sequence."""

    problem: Problem  # the data row, as the environment's reset received it
    opening: Problem  # the same row with the opening observation as its problem text
    state: object  # the environment's object for this trajectory
    ids: list[list[int]]  # per agent: its first prompt, then every token of its view after it
    own: list[list[int]]  # per agent, after the prompt: 1 on its own sampled tokens, 0 on what others wrote
    prompt_len: list[int]  # per agent
    said: list[tuple[int, str]]  # (speaker, text) in order: an agent's index, or ENVIRONMENT
    seen: list[int]  # per agent: the entries of ``said`` already in its view
    ended_with_eos: list[bool]  # per agent: its last turn sampled the eos (else the template's close is added)
    truncated: list[bool]  # per agent: some turn hit --max-new-tokens
    rounds: int = 0
    done: bool = False
    spoken: list[list[tuple[int, bool]]] = field(default_factory=list)  # per round, per agent: (tokens, cut)
    turn_scores: list[float] = field(default_factory=list)  # per round: the environment's turn_score(), if any
    # per agent, aligned with ids[k][prompt_len[k]:]: the engine's own log-prob of each of its sampled tokens, nan on
    # context tokens; None once a turn came from a sampler that gives none (HF), as for the health metric
    engine_logprobs: list[list[float] | None] = field(default_factory=list)


def start_episode(team: Team, problem: Problem) -> Episode:
    state, opening = team.config.environment.start(problem)
    n = len(team)
    return Episode(problem, Problem(problem.id, opening, problem.answer, problem.system, problem.columns), state,
                   [[] for _ in range(n)], [[] for _ in range(n)], [0] * n, [(ENVIRONMENT, opening)], [1] * n,
                   [True] * n, [False] * n, engine_logprobs=[[] for _ in range(n)])


def episode_context(team: Team, e: Episode, k: int) -> list[int]:
    """Agent k's context for its next turn. The first round: its prompt for the opening observation (chain: with
    the earlier agents' whole responses of the round, ``Team.sees_whole_turns``). Later rounds: its view so far,
    then one user turn with what it has not yet seen (chain: everything said since its last turn; independent: up
    to the environment's last observation, so agents of one round answer independently), rendered by its own chat
    template."""
    if e.rounds == 0:
        earlier = [text for speaker, text in e.said[1:]]  # chain: agents 0..k-1 of this round
        e.ids[k] = team.prompt_ids(k, e.opening, [team.extract(t) for t in earlier], earlier)
        e.prompt_len[k] = len(e.ids[k])
        e.seen[k] = len(e.said) if team.protocol == "chain" else 1  # independent: the opening only
        return e.ids[k]
    last_env = max(i for i, (speaker, _) in enumerate(e.said) if speaker == ENVIRONMENT)
    upto = len(e.said) if team.protocol == "chain" else last_env + 1
    entries = [(speaker, text) for speaker, text in e.said[e.seen[k]:upto] if speaker != k]
    delta = team.agents[k].continuation_ids(team.round_text(k, entries, e.rounds + 1), e.ended_with_eos[k],
                                            team.config.enable_thinking)
    e.ids[k] += delta
    e.own[k] += [0] * len(delta)
    if e.engine_logprobs[k] is not None:
        e.engine_logprobs[k] += [math.nan] * len(delta)
    e.seen[k] = upto
    return e.ids[k]


def episode_rollout(team: Team, flat: list[Problem], group_ids: torch.Tensor, sampling: SamplingConfig, backend,
                    score: bool, seed: int) -> TeamBatch:
    """ROLLOUT over rounds: in each round every live episode's agents speak (in order; chain: each seeing the
    round so far), then the environment answers each episode or ends it; an episode still going after
    ``max_rounds`` ends there. Agent k's response in row i and round r is drawn under
    ``response_seeds(seed, N, k, r)[i]``. Then one teacher-forced forward per agent over its whole view gives
    the behaviour log-probabilities of its tokens in every round; the environment's and the other agents'
    tokens are context, masked out of the loss, the ratios, the KL and the value targets (``Turn.response_mask``
    is 1 on the agent's own tokens only)."""
    env, n = team.config.environment, len(team)
    episodes = [start_episode(team, p) for p in flat]
    seconds = []  # per round: (the agents' generates, the responder's generate, the environment's steps)
    for r in range(env.max_rounds):
        live = [i for i, e in enumerate(episodes) if not e.done]
        if not live:
            break
        start = time.perf_counter()
        for k in range(n):
            agent = team.agents[k]
            contexts = [episode_context(team, episodes[i], k) for i in live]
            seeds = response_seeds(seed, len(flat), k, r)
            drawn = backend.generate(agent, contexts, sampling, [seeds[i] for i in live])
            engine = backend.last_logprobs(agent) or [None] * len(live)  # [live][len] vLLM's own, for health
            for i, response, logprobs in zip(live, drawn, engine):
                speak(episodes[i], k, response, agent.tokenizer, logprobs)
        responses = {i: [text for _, text in episodes[i].said[-n:]] for i in live}
        spoken = time.perf_counter()
        replies = responder_replies(team, episodes, responses, r, sampling, backend)
        replied = time.perf_counter()
        for i in live:
            e = episodes[i]
            observation, done = env.step(e.state, e.problem, responses[i], replies.get(i))
            e.said.append((ENVIRONMENT, observation))
            if (score_of := env.turn_score(e.state, e.problem)) is not None:
                e.turn_scores.append(score_of)
            e.rounds += 1
            e.done = done or e.rounds == env.max_rounds
        seconds.append((spoken - start, replied - spoken, time.perf_counter() - replied))
    turns = [episode_turn(team, k, episodes, sampling, backend, score) for k in range(n)]
    transcripts = [transcript(e) for e in episodes]
    answers, rewards, own, counterfactual = score_episodes(team, episodes, turns, transcripts)
    return TeamBatch([e.problem for e in episodes], group_ids, turns, answers, rewards, own, counterfactual,
                     transcripts=transcripts, rounds=[e.rounds for e in episodes],
                     solved=[float(r) >= env.range[1] for r in rewards], per_round=round_stats(episodes, n, seconds))


RESPONDER_TEMPERATURE = 0.7  # the responder's sampling temperature (AR-Bench's response model samples at 0.7)


def responder_seed(row_id: str, round_: int, question: int) -> int:
    """The seed of one responder reply: of its row, round and question alone (crc32, the same in every process),
    so an episode's replies are a function of its row and the responses so far, as the contract asks."""
    return zlib.crc32(f"{row_id}\x00{round_}\x00{question}".encode())


def responder_replies(team: Team, episodes: list[Episode], responses: dict[int, list[str]], round_: int,
                      sampling: SamplingConfig, backend) -> dict[int, list[str]]:
    """The responder model's replies to the questions every live episode's round put to it (``Environment.ask``),
    all in ONE batched generate, episode by episode in order. The responder is frozen and never trained: its
    words reach the agents as the environment's observation, context only."""
    env, responder = team.config.environment, team.config.responder
    asked = {i: env.ask(episodes[i].state, episodes[i].problem, texts) for i, texts in responses.items()}
    flat = [(i, q, chat) for i, chats in asked.items() for q, chat in enumerate(chats)]
    if not flat:
        return {i: [] for i in asked}
    if responder is None:
        raise ValueError(f"environment {env.name} asks a responder model questions, but none was given: pass "
                         "--env-model NAME (any spec --agents takes), or a built-in game's --task-option "
                         "responder=NAME")
    reply_sampling = SamplingConfig(RESPONDER_TEMPERATURE, 1.0, team.config.responder_max_tokens,
                                    sampling.token_budget)
    contexts = [responder.encode_prompt(chat) for _, _, chat in flat]
    seeds = [responder_seed(episodes[i].problem.id, round_, q) for i, q, _ in flat]
    decoded = iter(responder.tokenizer.decode(ids, skip_special_tokens=True).strip()
                   for ids in backend.generate(responder, contexts, reply_sampling, seeds))
    return {i: [next(decoded) for _ in chats] for i, chats in asked.items()}


def speak(e: Episode, k: int, response: list[int], tokenizer, engine_logprobs: list[float] | None = None) -> None:
    """Agent k's sampled turn: its tokens into its view (its own: mask 1), its text into the transcript, and the
    sampling engine's log-probabilities of them where it gave some (vLLM's, for the health metric)."""
    e.ids[k] += response
    e.own[k] += [1] * len(response)
    if engine_logprobs is None or e.engine_logprobs[k] is None:
        e.engine_logprobs[k] = None
    else:
        e.engine_logprobs[k] += list(engine_logprobs[: len(response)])
    e.ended_with_eos[k] = tokenizer.eos_token_id in response
    if k == 0:
        e.spoken.append([])
    e.spoken[-1].append((len(response), not e.ended_with_eos[k]))
    e.truncated[k] = e.truncated[k] or not e.ended_with_eos[k]
    e.said.append((k, tokenizer.decode(response, skip_special_tokens=True)))


def episode_turn(team: Team, k: int, episodes: list[Episode], sampling: SamplingConfig, backend, score: bool) -> Turn:
    """Agent k's tokens in every episode as one Turn: the first prompt as context, the rest of its view as the
    response, its mask 1 on the agent's own tokens only; texts and answers from its last turn; the engine's own
    log-probabilities laid over the response (nan on context) where every turn came with them."""
    agent = team.agents[k]
    pad = agent.tokenizer.pad_token_id
    ctx, cmask = left_pad([e.ids[k][: e.prompt_len[k]] for e in episodes], pad)  # [N, Lc]
    resp, _ = right_pad([e.ids[k][e.prompt_len[k]:] for e in episodes], pad)  # [N, Lr]
    own, _ = right_pad([e.own[k] for e in episodes], 0)  # [N, Lr] 1 on the agent's tokens
    tensors = TurnTensors(ctx, cmask, resp, own)
    logp = behaviour_logprobs(agent, tensors, sampling) if score else torch.zeros(resp.shape)  # [N, Lr]
    agent.procs.release(agent.model)
    texts = [next(text for speaker, text in reversed(e.said) if speaker == k) for e in episodes]
    engine = [e.engine_logprobs[k] for e in episodes]
    return Turn(k, ctx, cmask, resp, own, logp, texts, [team.extract(t) for t in texts],
                torch.tensor([e.truncated[k] for e in episodes]), None if None in engine else engine)


def score_episodes(team: Team, episodes: list[Episode], turns: list[Turn], transcripts: list[str]):
    """``score_team`` for episodes: the team reward R through ``reward.score`` with the environment's reward
    (``env_reward``) and the whole ``transcript`` among the columns. No agent's share of an episode can be
    swapped out of it, so each agent's own score is the team's and there is no counterfactual baseline."""
    env, reward, protocol = team.config.environment, team.config.reward, team.protocol
    extra = {"env_reward": [env.reward(e.state, e.problem) for e in episodes],
             "transcript": transcripts}
    answers = [[t.answers[i] for t in turns] for i in range(len(episodes))]
    texts = [[t.texts[i] for t in turns] for i in range(len(episodes))]
    rewards = torch.tensor(score(reward, [e.opening for e in episodes], texts, answers, protocol, extra)).float()
    return [team.team_answer(a) for a in answers], rewards, rewards.expand(len(turns), -1).clone(), None


ROUND_SECONDS = ("agents_seconds", "responder_seconds", "step_seconds")  # wall time, in round_stats


def round_stats(episodes: list[Episode], n: int, seconds: list[tuple[float, float, float]] | None = None
                ) -> list[dict]:
    """Per round: the episodes still going, and per agent its mean response tokens and the share cut at
    --max-new-tokens; with an environment's ``turn_score``, its mean that round (logged, never trained on);
    with ``seconds`` (per round: the agents' generates, the responder model's, the environment's steps, where a
    rules responder answers), its wall time split so."""
    out = []
    for r in range(max(e.rounds for e in episodes)):
        live = [e for e in episodes if e.rounds > r]
        row = {"round": r + 1, "episodes": len(live),
               "tokens": [sum(e.spoken[r][k][0] for e in live) / len(live) for k in range(n)],
               "cut": [sum(e.spoken[r][k][1] for e in live) / len(live) for k in range(n)]}
        scores = [e.turn_scores[r] for e in live if len(e.turn_scores) > r]
        if scores:
            row["turn_score"] = sum(scores) / len(scores)
        if seconds is not None:
            row.update(zip(ROUND_SECONDS, seconds[r]))
        out.append(row)
    return out


def transcript(e: Episode) -> str:
    """The episode as text: the opening observation, then every turn, named."""
    return "\n\n".join(f"{'Environment' if s == ENVIRONMENT else f'Agent {s + 1}'}: {text}" for s, text in e.said)
