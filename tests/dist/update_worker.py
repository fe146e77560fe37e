"""Run by tests/test_distributed.py under torchrun: one agent update (one
AdamW step on one minibatch, Eq. (5)) unsharded in this process, then the
same update with the agent sharded by FSDP2 over the ranks; rank 0 writes the
largest parameter difference as JSON to argv[1]."""
import copy
import json
import sys
import weakref

import torch

from harness.config import Config

import sat
from rollout import SamplingConfig, rollout
from scale import distributed
from scale.rollout_hf import HF
from scale.sharded_update import train_sharded
from scale.torchrun import Torchrun
from harness.tasks import arithmetic_problems
from harness.math_grading import math_team_config
from team import Agent, Team
from harness.run import trust_regions_for
from update import TrainStats, train_agents
from advantage import build_inputs
from harness.loading import load_agent

torch.set_num_threads(1)
torch.manual_seed(0)
team = Team([load_agent("tiny", seed=0)], math_team_config())
batch = rollout(team, arithmetic_problems(8, seed=0), 4, SamplingConfig(temperature=1.0, max_new_tokens=4), HF)
batch.rewards = (torch.arange(len(batch)) % 3 == 0).float()  # a reward with signal in every group
cfg = Config(agents="tiny", epochs=1, minibatch_size=len(batch), kl_check_every=0, device="cpu").apply_preset()
inputs = build_inputs(batch, 0, [], cfg.core())
before = [p.detach().clone() for p in team.agents[0].model.parameters()]


def one_update(t: Team) -> TrainStats:
    torch.manual_seed(1)  # the same minibatch permutation
    ref = copy.deepcopy(t.agents[0].model)
    regions = trust_regions_for(cfg, 1)
    return train_sharded(t, 0, lambda: train_agents(t, [0], {0: inputs}, cfg.core(), regions, {}, {0: ref})[0])


def main() -> None:
    plain = Team([Agent(team.agents[0].spec, copy.deepcopy(team.agents[0].model), team.agents[0].tokenizer)], math_team_config())
    stats_plain = one_update(plain)  # before setup(): one process, no FSDP
    distributed.setup("cpu")
    sharded = Team([Agent(team.agents[0].spec, copy.deepcopy(team.agents[0].model), team.agents[0].tokenizer)], math_team_config())
    Torchrun.current().adopt(sharded.agents)
    stats_sharded = one_update(sharded)
    diff = max(float((a - b).abs().max())
               for a, b in zip(plain.agents[0].model.parameters(), sharded.agents[0].model.parameters()))
    step = max(float((a - b).abs().max()) for a, b in zip(plain.agents[0].model.parameters(), before))
    # The layer-by-layer gather of a sharded model (what a weight push from FSDP shards uses):
    # the union is the whole state, and each group is gone (weakrefs dead) once the next comes.
    whole = dict(plain.agents[0].model.named_parameters())
    seen, sizes, leaked, prev = {}, [], 0, []
    for group in distributed.full_weights_by_layer(distributed.shard_model(plain.agents[0].model)):
        leaked += sum(r() is not None for r in prev)
        seen.update((n, bool(torch.equal(t, whole[n]))) for n, t in group)
        sizes.append(sum(t.numel() * t.element_size() for _, t in group))
        prev = [weakref.ref(t) for _, t in group]
        del group
    layer_bytes = sum(p.numel() * p.element_size() for p in plain.agents[0].model.base_model.layers[0].parameters())
    if distributed.is_main():
        json.dump({"layers_union_names": sorted(seen) == sorted(whole), "layers_union_equal": all(seen.values()),
                   "layers_groups": len(sizes), "layers_leaked": leaked, "layers_max_group_bytes": max(sizes[1:]),
                   "layers_root_bytes": sizes[0], "layer_bytes": layer_bytes,
                   "n_layers": len(plain.agents[0].model.base_model.layers),
                   "world": distributed.world(), "max_param_diff": diff, "max_step": step,
                   "loss": [stats_plain.loss, stats_sharded.loss],
                   "grad_norm": [stats_plain.grad_norm, stats_sharded.grad_norm],
                   "steps": [stats_plain.inner_steps, stats_sharded.inner_steps]}, open(sys.argv[1], "w"))


if __name__ == "__main__":
    sys.exit(distributed.rank_main(main)())
