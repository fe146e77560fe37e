"""Run by tests/test_distributed.py under torchrun: Stage-0 of a plug-and-play
upgrade (paper Sec. 5, Eqs. (6)-(7)) of agent 2 of a tiny team, first in this
process alone (before the process group exists), then with the replacement
FSDP2-sharded over the ranks (``plug_and_play.fit_stage0``); rank 0 writes the
comparison as JSON to argv[1].

The micro-batches (``--minibatch-size`` 23 over 24 fit rows) are one of 23
rows, shared 12 + 11, then one of a single row, which leaves rank 1 without
rows: it runs with weight 0 so both ranks make the same FSDP2 calls.

Third, the same Stage-0 with every model sharded (``--shard-frozen``): the
team (the incumbent pi_cur), the replacement and pi_pre as FSDP2 shards, the
trainable copy built shard by shard, each rank writing its shards back; the
measurements' forwards are collectives over rank shares of unequal size
(dummy forwards keep them matched)."""
import copy
import json
import sys

import torch

from harness.config import Config

import sat
from plug_and_play import Stage0Fit, stage0_align
from rollout import SamplingConfig
from scale import distributed
from scale.rollout_hf import HF
from scale.torchrun import Torchrun
from harness.tasks import arithmetic_problems
from harness.math_grading import math_team_config
from team import Agent, Team
from harness.loading import load_agent

torch.set_num_threads(1)
cfg = Config(agents="tiny x2", batch_size=32, group_size=4, minibatch_size=23, device="cpu", stage0_delta=0.05,
             stage0_fit_tol=50.0, stage0_max_passes=30, rollout_blocks=4, shard_rollouts=True).apply_preset()
sampling = SamplingConfig(temperature=1.0, max_new_tokens=4)
torch.manual_seed(0)
team = Team([load_agent("tiny", seed=k) for k in range(2)], math_team_config(protocol="chain"))
raw = load_agent("tiny-3L", seed=9)  # another architecture, same vocabulary: outside delta_0 at the start
problems = arithmetic_problems(8, seed=0)  # 6 fit problems (24 rows), 2 held out


KEYS = ("kl_quantile_before", "heldout_kl_quantile_before", "kl_quantile", "heldout_kl_quantile", "kl_mean", "fit_mean")


def same_fit(a, b) -> bool:
    """The same Stage-0 fit states (contexts, responses and masks of both models)."""
    fields = ("ctx_new", "cmask_new", "ctx_cur", "cmask_cur", "resp", "rmask")
    return all(torch.equal(getattr(a, k), getattr(b, k)) for k in fields)


def upgrade(shard: bool = False) -> tuple[dict, Stage0Fit, Agent]:
    torch.manual_seed(1)  # the rollout seed drawn from the global RNG: the same on every rank and for any N
    new = Agent(raw.spec, copy.deepcopy(raw.model), raw.tokenizer)
    distributed.broadcast_module(new.model)
    if shard:
        new.model = distributed.shard_in_place(new.model)
    fitted = stage0_align(team, 1, new, problems, cfg, sampling, lr=1e-3, log=lambda *_: None, backend=HF)
    return fitted.record, fitted, new


def main() -> None:
    Torchrun.current(n_blocks=cfg.rollout_blocks).adopt(team.agents)  # before setup(): one process, seeded blocks
    one = upgrade()
    distributed.setup("cpu")
    Torchrun.current(n_blocks=cfg.rollout_blocks).adopt(team.agents)
    two = upgrade()
    flat = [torch.cat([p.detach().flatten() for p in agent.model.parameters()]) for agent in (raw, one[2], two[2])]
    on_ranks = distributed.gather_objects(flat[2])  # the replacement as every rank holds it
    Torchrun.current(shard_frozen=True, n_blocks=cfg.rollout_blocks).adopt(team.agents)  # held as shards
    three = upgrade(shard=True)
    held_as_shards = (distributed.is_sharded(three[2].model)
                      and all(distributed.is_sharded(a.model) for a in team.agents))
    whole3 = distributed.whole_copy_on_main(three[2].model)  # gathered layer by layer on rank 0
    if distributed.is_main():
        (i3, t3, _), t1 = three, one[1]
        flat3 = torch.cat([p.detach().flatten() for p in whole3.parameters()])
        sharded = {"held_as_shards": held_as_shards, "same_states": same_fit(t1.states, t3.states),
                   "passes": i3["passes"], "retargeted": i3["retargeted"],
                   "same_retargeted_states": bool(torch.equal(t1.t < t1.t_exact, t3.t < t3.t_exact)),
                   **{k: i3[k] for k in KEYS},
                   "max_param_diff": float((flat[1] - flat3).abs().max()),
                   "mean_param_diff": float((flat[1] - flat3).abs().mean())}
        (i1, t1, _), (i2, t2, _) = one, two
        fit1, fit2 = t1.states, t2.states
        json.dump({"world": distributed.world(), "same_states": same_fit(fit1, fit2), "rows": len(fit1),
                   "states": [i1["states"], i2["states"]],
                   "passes": [i1["passes"], i2["passes"]], "retargeted": [i1["retargeted"], i2["retargeted"]],
                   "same_retargeted_states": bool(torch.equal(t1.t < t1.t_exact, t2.t < t2.t_exact)),
                   "t_max_diff": float((t1.t - t2.t).abs().max()),
                   "t_exact_max_diff": float((t1.t_exact - t2.t_exact).abs().max()),
                   **{k: [i1[k], i2[k]] for k in KEYS},
                   "ranks_equal": all(torch.equal(w, on_ranks[0]) for w in on_ranks),
                   "max_step": float((flat[1] - flat[0]).abs().max()),
                   "max_param_diff": float((flat[1] - flat[2]).abs().max()),
                   "mean_step": float((flat[1] - flat[0]).abs().mean()),
                   "mean_param_diff": float((flat[1] - flat[2]).abs().mean()),
                   "sharded": sharded},
                  open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    sys.exit(distributed.rank_main(main)())
