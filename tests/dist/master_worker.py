"""Run by tests/test_distributed.py under torchrun: a bf16 agent's fp32 master
weights across two turns (one AdamW step each, lr 1e-5, Eq. (5)) with one
process and with FSDP2 over the ranks, then a sharded checkpoint
(torch.distributed.checkpoint) saved by every rank and loaded back under the
same number of processes. Rank 0 writes the figures as JSON to argv[1] and
the whole masters to argv[2] (for the one-process load in the test)."""
import copy
import json
import random
import sys
from pathlib import Path

import torch

from harness.config import Config

import sat
from harness.run_folder import load_checkpoint, save_checkpoint
from rollout import SamplingConfig, rollout
from scale import distributed
from scale.rollout_hf import HF
from scale.sharded_update import train_sharded
from scale.torchrun import Torchrun
from harness.tasks import arithmetic_problems
from harness.math_grading import math_team_config
from team import Agent, Team
from harness.run import trust_regions_for
from update import train_agents
from advantage import build_inputs
from harness.loading import load_agent

torch.set_num_threads(1)
torch.manual_seed(0)
base = load_agent("tiny", seed=0, dtype=torch.bfloat16)
batch = rollout(Team([base], math_team_config()), arithmetic_problems(8, seed=0), 4,
                SamplingConfig(temperature=1.0, max_new_tokens=4), HF)
batch.rewards = (torch.arange(len(batch)) % 3 == 0).float()  # a reward with signal in every group
cfg = Config(agents="tiny", epochs=1, minibatch_size=len(batch), kl_check_every=0, device="cpu", lr=1e-5,
             keep_optimizer_state=True).apply_preset()
inputs = build_inputs(batch, 0, [], cfg.core())


def turn(t: Team) -> None:
    torch.manual_seed(1)  # the same minibatch permutation
    ref = copy.deepcopy(t.agents[0].model)
    regions = trust_regions_for(cfg, 1)
    train_sharded(t, 0, lambda: train_agents(t, [0], {0: inputs}, cfg.core(), regions, {}, {0: ref})[0])


def masters(agent: Agent) -> list[torch.Tensor]:
    """The whole fp32 masters (gathered from the ranks' shards under torchrun)."""
    if not distributed.active():
        return [m.clone() for m in agent.master_weights]
    return [distributed.full(distributed.as_sharded(m, p.shape)).cpu()
            for m, p in zip(agent.master_shards, agent.model.parameters())]


def moments(agent: Agent) -> list[torch.Tensor]:
    """The whole AdamW moments kept between turns (--keep-optimizer-state), parameter by parameter."""
    state, shapes = agent.saved_optimizer_state["state"], [p.shape for p in agent.model.parameters()]
    return [distributed.full(distributed.as_sharded(state[i][k], shapes[i])).cpu()
            for i in range(len(shapes)) for k in ("exp_avg", "exp_avg_sq")]


def adam_steps(agent: Agent) -> set[float]:
    return {float(st["step"]) for st in agent.saved_optimizer_state["state"].values()}


def fresh() -> Team:
    return Team([Agent(base.spec, copy.deepcopy(base.model), base.tokenizer)], math_team_config())


def max_diff(xs, ys) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(xs, ys, strict=True))


def mean_diff(xs, ys) -> float:
    return sum(float((x - y).abs().sum()) for x, y in zip(xs, ys, strict=True)) / sum(x.numel() for x in xs)


def main() -> None:
    one = fresh()  # before setup(): one process, no FSDP
    turn(one)
    one_a = masters(one.agents[0])
    turn(one)
    one_b = masters(one.agents[0])
    one_moments, one_steps = moments(one.agents[0]), adam_steps(one.agents[0])
    restart = fresh()  # the same two turns with the master dropped in between (what keeping it must avoid)
    turn(restart)
    restart.agents[0].master_weights = None
    turn(restart)
    restart_b = masters(restart.agents[0])
    distributed.setup("cpu")
    procs = Torchrun.current()
    two = fresh()
    procs.adopt(two.agents)
    turn(two)
    two_a = masters(two.agents[0])
    turn(two)
    two_b = masters(two.agents[0])
    two_moments, two_steps = moments(two.agents[0]), adam_steps(two.agents[0])
    out = Path(sys.argv[1]).parent / "run"
    save_checkpoint(out, 1, two, {}, {}, random.Random(0), {})
    loaded, _, _, _ = load_checkpoint(out / "checkpoints" / "stage_0001", "cpu", torch.bfloat16, procs)
    procs.adopt(loaded.agents)
    bf16 = [p.detach() for p in two.agents[0].model.parameters()]
    if distributed.is_main():
        torch.save({"masters": two_b, "moments": two_moments}, sys.argv[2])
        json.dump({"world": distributed.world(), "lr": cfg.lr,
                   "turn1_mean_diff": mean_diff(one_a, two_a), "turn2_mean_diff": mean_diff(one_b, two_b),
                   "turn2_max_diff": max_diff(one_b, two_b), "turn2_mean_step": mean_diff(one_b, one_a),
                   "restart_mean_diff": mean_diff(one_b, restart_b),
                   "steps": [sorted(one_steps), sorted(two_steps)],
                   "moments_mean_diff": mean_diff(one_moments, two_moments),
                   "moments_mean": mean_diff(one_moments, [0 * m for m in one_moments]),
                   "bf16_moved_fraction": sum(int((m.to(torch.bfloat16) != p0).sum())
                                              for m, p0 in zip(one_b, base.model.parameters()))
                   / sum(p.numel() for p in base.model.parameters())}, open(sys.argv[1], "w"))
    loaded_equal = all(torch.equal(x, y) for x, y in zip(masters(loaded.agents[0]), two_b))  # a collective: every rank
    loaded_moments_equal = all(torch.equal(x, y) for x, y in zip(moments(loaded.agents[0]), two_moments))
    weights_equal = all(torch.equal(p, q) for p, q in zip(loaded.agents[0].model.parameters(), bf16))
    if distributed.is_main():
        result = json.loads(Path(sys.argv[1]).read_text())
        result.update(loaded_masters_equal=loaded_equal, loaded_weights_equal=weights_equal,
                      loaded_moments_equal=loaded_moments_equal)
        Path(sys.argv[1]).write_text(json.dumps(result))


if __name__ == "__main__":
    sys.exit(distributed.rank_main(main)())
