"""Run by tests/test_distributed.py under torchrun: the team held as FSDP2
shards (``--shard-frozen``) against the same team whole in one process.

- rollouts (Algorithm 1 line 4, Section 5) in 3 seeded blocks (2, 2 and 1 problems, G = 2) over 2 ranks,
  with a token budget that splits each block's generate and scoring into unequal
  numbers of calls: every rank must make as many calls into a sharded model
  (a dummy block, dummy generate / forward calls, ``synced_gpus``);
- ``regenerate`` run on every rank, as ``--reuse regenerate`` does with sharded agents;
- the reference pi_j,cur as a sharded copy, and the exact per-state KL against
  it after a step, the step applied to this rank's shards only;
- the Hugging Face export gathered layer by layer on rank 0.

Rank 0 writes the comparisons as JSON to argv[1]."""
import copy
import json
import sys

import torch

from logprobs import measure_kl
from rollout import SamplingConfig, regenerate
from scale import distributed
from scale.rollout_hf import HF
from scale.torchrun import Torchrun, rollout_in_blocks
from harness.tasks import arithmetic_problems
from harness.math_grading import math_team_config
from team import Agent, Team
from trust_region import interpolate_parameters
from harness.loading import load_agent

torch.set_num_threads(1)
problems = arithmetic_problems(5, seed=1)
# 2 rows per call: 2 calls per block of 4 rows, 1 for the last
sampling = SamplingConfig(temperature=1.0, max_new_tokens=5, token_budget=60)


def make_team() -> Team:
    return Team([load_agent("tiny", seed=k) for k in range(2)], math_team_config(protocol="chain"))


def step_of(model) -> list[torch.Tensor]:
    """A fixed perturbation of every weight (the 'new' of a line search)."""
    g = torch.Generator().manual_seed(5)
    return [p.detach() + 1e-2 * torch.randn(p.shape, generator=g) for p in model.parameters()]


def one_process(team: Team):
    batch = rollout_in_blocks(team, problems, 2, sampling, seed=7, n_blocks=3, backend=HF)
    torch.manual_seed(11)
    again, _ = regenerate(team, batch, 0, sampling, HF)
    evaluation = rollout_in_blocks(team, problems, 1, sampling, seed=8, n_blocks=3, backend=HF, score=False)
    reference = copy.deepcopy(team.agents[0].model)
    params = list(team.agents[0].model.parameters())
    interpolate_parameters(params, [p.detach().clone() for p in params], step_of(reference), 0.5)
    kl, logp, _ = measure_kl(team.agents[0], reference, batch.turns[0], 1.0, 4096)
    return batch, again, evaluation, kl, logp


def same_turns(a, b) -> bool:
    return all(torch.equal(x.response_ids, y.response_ids) and torch.equal(x.context_ids, y.context_ids)
               for x, y in zip(a.turns, b.turns, strict=True))


def max_diff(a, b) -> float:
    return max(float((x.behaviour_logprobs - y.behaviour_logprobs).abs().max()) for x, y in zip(a.turns, b.turns))


def main(out_path: str) -> None:
    plain_team = make_team()
    plain = one_process(plain_team)  # before setup(): one process, whole models
    distributed.setup("cpu")
    extras = []  # the dummy calls each agreement asked of this rank (observed, not changed)
    agree = distributed.extra_calls
    distributed.extra_calls = lambda n: extras.append(agree(n)) or extras[-1]
    team = make_team()
    whole = [p.detach().clone() for p in team.agents[1].model.parameters()]
    Torchrun.current(shard_frozen=True).adopt(team.agents)  # held as shards, as --shard-frozen
    assert all(distributed.is_sharded(a.model) for a in team.agents)
    batch = rollout_in_blocks(team, problems, 2, sampling, seed=7, n_blocks=3, backend=HF)
    torch.manual_seed(11)
    again, _ = regenerate(team, batch, 0, sampling, HF)  # every rank, the same rows
    evaluation = rollout_in_blocks(team, problems, 1, sampling, seed=8, n_blocks=3, backend=HF, score=False)
    reference = distributed.frozen_copy(team.agents[0].model)
    params = distributed.local_parameters(team.agents[0].model)
    new = step_of(make_team().agents[0].model)  # the same step, whole on every rank (seeded weights)
    new = [distributed.local_rows(n) for n in new]  # this rank's rows of it
    interpolate_parameters(params, [p.detach().clone() for p in params], new, 0.5)
    kl, logp, _ = measure_kl(team.agents[0], reference, batch.turns[0], 1.0, 4096)
    exported = distributed.whole_copy_on_main(team.agents[1].model)
    dummy_calls = sum(distributed.gather_objects(sum(extras)))
    if distributed.is_main():
        p_batch, p_again, p_eval, p_kl, p_logp = plain
        json.dump({"world": distributed.world(), "rows": len(batch), "dummy_calls": dummy_calls,
                   "response_tokens": batch.num_tokens, "rollout_same_ids": same_turns(batch, p_batch),
                   "rollout_same_rewards": torch.equal(batch.rewards, p_batch.rewards),
                   "rollout_logprob_diff": max_diff(batch, p_batch),
                   "regenerate_same_ids": same_turns(again, p_again),
                   "regenerate_logprob_diff": max_diff(again, p_again),
                   "regenerate_changed": not torch.equal(again.turns[0].response_ids, batch.turns[0].response_ids),
                   "eval_same_ids": same_turns(evaluation, p_eval),
                   "kl_n": [kl.numel(), p_kl.numel()], "kl_max": float(p_kl.max()),
                   "kl_diff": float((kl - p_kl).abs().max()),
                   "logp_diff": float((logp - p_logp).abs().max()),
                   "export_equal": all(torch.equal(a, b) for a, b in zip(exported.parameters(), whole, strict=True)),
                   "export_tied": exported.get_output_embeddings().weight is exported.get_input_embeddings().weight},
                  open(out_path, "w"))


if __name__ == "__main__":
    sys.exit(distributed.rank_main(main)(sys.argv[1]))
