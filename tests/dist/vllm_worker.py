"""Run by tests/test_vllm_engine.py, with one process (plain python) and under
``torchrun --nproc-per-node 2``: the vLLM backend on several ranks.

Two tiny agents (seeds 1 and 2, fp32, vLLM on CPU or CUDA) roll out 4 problems x 4 in 4
seeded blocks with ``--backend vllm`` (``rollout.rollout_in_blocks``: rank r
generates blocks r, r + N, ... in its own engines, every rank receives the
union). Then agent 1 is "promoted" to new weights (a fixed perturbation) and,
under torchrun, its FSDP2 shards are pushed into each rank's engine one layer
at a time (``distributed.full_weights_by_layer`` -> ``rollout_vllm.sync_from_layers``);
with one process the plain push (``sync_weights``, by layer too). Each rank
then scores fixed responses with its engine before (stale) and after the push
against the training model. Rank 0 writes JSON to argv[1]: the batch's
response ids and rewards, the sampler-vs-trainer health of the whole batch
(``rollout.after_rollout``, every block's rows), and the score gaps of every rank.
"""
import json
import sys
from pathlib import Path

import torch

import distributed
import rollout_vllm as rv
from logprobs import batched_response_logprobs, left_pad, right_pad
from rollout import SamplingConfig, after_rollout, rollout_in_blocks
from tasks import arithmetic_problems
from team import Agent, Team, TeamConfig


def gap(reg, agent, contexts, responses, check=True) -> float:
    """Mean |engine log-prob - training log-prob| (temperature 1) of fixed responses."""
    engine_lp = reg.score(agent, contexts, responses, check=check)
    tok = agent.tokenizer
    ctx, cmask = left_pad(contexts, tok.pad_token_id)
    resp, rmask = right_pad(responses, tok.pad_token_id)
    hf = batched_response_logprobs(agent.model, (ctx, cmask, resp, rmask), 1.0, 1 << 14)
    return rv.logprob_health(engine_lp, hf, rmask)


def main(out_path: str) -> None:
    torch.set_num_threads(1)
    distributed.setup("cpu")
    team = Team([Agent.load("tiny", dtype=torch.float32, seed=k) for k in (1, 2)], TeamConfig(protocol="chain"))
    reg = rv.configure(n_engines=2, seed=0, max_model_len=256, health_logprobs=True)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=12, backend="vllm")
    batch = rollout_in_blocks(team, arithmetic_problems(4, seed=1), 4, sampling, seed=7, n_blocks=4)
    health = after_rollout(team, batch, sampling)  # the engines' log-probs of the whole batch vs the training model's
    agent = team.agents[1]
    contexts = [c[m.bool()].tolist() for c, m in zip(batch.turns[1].context_ids, batch.turns[1].context_mask)][:8]
    responses = [r[m.bool()].tolist() for r, m in zip(batch.turns[1].response_ids, batch.turns[1].response_mask)][:8]
    before = gap(reg, agent, contexts, responses)
    with torch.no_grad():  # the promotion: new weights, the same on every rank
        g = torch.Generator().manual_seed(5)
        for p in agent.model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g) * p.abs().mean())
    stale = gap(reg, agent, contexts, responses, check=False)
    if distributed.active():
        sharded = distributed.shard_model(agent.model)  # fp32: the FSDP2 copy holds the agent's weights
        rv.sync_from_layers(agent, distributed.full_weights_by_layer(sharded, dtype=torch.float32))
        pushed = "shards, by layer"
    else:
        rv.sync_weights(agent)
        pushed = "plain, by layer"
    after = gap(reg, agent, contexts, responses)
    gaps = distributed.gather_objects({"before": before, "stale": stale, "after": after})
    if distributed.is_main():
        rows = [[r[m.bool()].tolist() for r, m in zip(t.response_ids, t.response_mask)] for t in batch.turns]
        Path(out_path).write_text(json.dumps({"world": distributed.STATE.world, "responses": rows,
                                              "rewards": batch.rewards.tolist(), "gaps": gaps, "pushed": pushed,
                                              "health": health}))
    rv.shutdown()
    distributed.barrier()
    distributed.teardown()


if __name__ == "__main__":  # vLLM spawns its engine processes: guard the entry point
    main(sys.argv[1])
