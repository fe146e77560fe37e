"""Episodes: a team that acts, observes and acts again in an environment's rounds (the brief's Section 12).

The state at any token is the transcript so far. Each agent's tokens, in every round, are its actions; what the
environment (or its responder model) writes is context, never a term of the loss, the ratios, the KL or the value
targets. ``episode_rollout`` is ROLLOUT over rounds; ``rollout.rollout`` and ``rollout.regenerate`` reach it
through the environment the team is handed (``harness.environments.Environment.play``), as they reach the
sampler through the backend, so the paper's rollout holds one round and the rounds live beside the environments.
Agent k's response in row i and round r is drawn under ``rollout.response_seeds(seed, N, k, r)[i]`` (common
random numbers, as in one round), and the responder's replies under seeds of their row and round alone.
"""
from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass, field

import torch

from logprobs import TurnTensors, left_pad, right_pad
from reward import score
from rollout import SamplingConfig, TeamBatch, Turn, behaviour_logprobs, response_seeds
from team import Problem, Team

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
