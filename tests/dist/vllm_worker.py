"""Run by tests/test_vllm_engine.py, with one process (plain python) and under
``torchrun --nproc-per-node 2``: the vLLM backend on several ranks.

One tiny agent (seed 1, fp32, vLLM on CPU or CUDA) rolls out 4 problems x 4 in 4
seeded blocks with ``--backend vllm`` (``scale.torchrun.rollout_in_blocks``: rank r
generates blocks r, r + N, ... in its own engine, every rank receives the
union). Under torchrun the agent is then held as FSDP2 shards
(``Torchrun.adopt``, as ``--shard-frozen``): each rank's engine
receives the shards one layer at a time (``VLLMBackend.sync``, every
rank at once, as ``sat.py`` does after sharding) and the same block rollout is
drawn again, through the sharded agent (every rank runs as many blocks).
Then the agent is "promoted" to new weights (a fixed perturbation, written into
each rank's shards) and its engines take the new shards one layer at a time
(``sync``: the ranks agree it is stale, ``distributed.full_weights_by_layer``
-> ``vllm_ranks.push_layers``); with one process the plain push (by layer too).
Each rank then scores fixed responses with its engine before (stale) and after
the push against the training model. Rank 0 writes JSON to argv[1]: both
batches' response ids and rewards, the sampler-vs-trainer health of each
(``VLLMBackend.health``, every block's rows), and the score gaps of every rank.
"""
import json
import sys
from pathlib import Path

import torch

from logprobs import TurnTensors, batched_response_logprobs, left_pad, right_pad
from rollout import SamplingConfig
from scale import distributed
from scale import rollout_vllm as rv
from scale.torchrun import Torchrun, rollout_in_blocks
from harness.tasks import arithmetic_problems
from harness.math_grading import math_team_config
from team import Agent, Team
from harness.loading import load_agent


def gap(reg, agent, contexts, responses, check=True) -> float:
    """Mean |engine log-prob - training log-prob| (temperature 1) of fixed responses."""
    engine_lp = reg.score(agent, contexts, responses, check=check)
    tok = agent.tokenizer
    ctx, cmask = left_pad(contexts, tok.pad_token_id)
    resp, rmask = right_pad(responses, tok.pad_token_id)
    hf = batched_response_logprobs(agent.model, TurnTensors(ctx, cmask, resp, rmask), 1.0, 1 << 14)
    return rv.logprob_health(engine_lp, hf, rmask)


def rows_of(batch) -> list:
    return [[r[m.bool()].tolist() for r, m in zip(t.response_ids, t.response_mask)] for t in batch.turns]


def main(out_path: str) -> None:
    torch.set_num_threads(1)
    distributed.setup("cpu")
    team = Team([load_agent("tiny", dtype=torch.float32, seed=1)], math_team_config(protocol="chain"))
    Torchrun.current().adopt(team.agents)
    reg = rv.VLLMBackend(n_engines=1, seed=0, max_model_len=256, health_logprobs=True)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=12)
    problems = arithmetic_problems(4, seed=1)
    batch = rollout_in_blocks(team, problems, 4, sampling, seed=7, n_blocks=4, backend=reg)
    reg.sleep()
    health = reg.health(team, batch)  # the engines' log-probs of the whole batch vs the training model's
    result = {"world": distributed.world(), "responses": rows_of(batch), "rewards": batch.rewards.tolist(),
              "health": health}
    if distributed.active():  # --shard-frozen: the agents as shards, the engines fed from them, the same rollout
        Torchrun.current(shard_frozen=True).adopt(team.agents)
        for a in team.agents:
            reg.sync(a)  # every rank at once (a collective), as sat.py after adopting the team
        sharded = rollout_in_blocks(team, problems, 4, sampling, seed=7, n_blocks=4, backend=reg)
        reg.sleep()
        result.update(sharded_responses=rows_of(sharded), sharded_rewards=sharded.rewards.tolist(),
                      sharded_health=reg.health(team, sharded),
                      sharded=[distributed.is_sharded(a.model) for a in team.agents])
    agent = team.agents[0]
    contexts = [c[m.bool()].tolist() for c, m in zip(batch.turns[0].context_ids, batch.turns[0].context_mask)][:8]
    responses = [r[m.bool()].tolist() for r, m in zip(batch.turns[0].response_ids, batch.turns[0].response_mask)][:8]
    before = gap(reg, agent, contexts, responses)
    with torch.no_grad():  # the promotion: new weights, the same on every rank (each rank perturbs its shards)
        g = torch.Generator().manual_seed(5)
        for p in agent.model.parameters():
            whole = 0.1 * torch.randn(p.shape, generator=g) * distributed.full(p).abs().mean()
            distributed.local_rows(p).add_(distributed.local_rows(whole)[: distributed.local_rows(p).shape[0]])
    distributed.reshard(agent.model)
    stale = gap(reg, agent, contexts, responses, check=False)
    reg.sync(agent)  # sharded: the ranks agree it is stale, each pushes from the shards by layer
    result["pushed"] = "shards, by layer" if distributed.is_sharded(agent.model) else "plain, by layer"
    after = gap(reg, agent, contexts, responses)
    result["gaps"] = distributed.gather_objects({"before": before, "stale": stale, "after": after})
    if distributed.is_main():
        Path(out_path).write_text(json.dumps(result))
    reg.close()


if __name__ == "__main__":  # vLLM spawns its engine processes: guard the entry point
    sys.exit(distributed.rank_main(main)(sys.argv[1]))
