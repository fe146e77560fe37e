"""Plug-and-play: Stage-0 alignment of a replacement agent and continuing SAT (paper, Section 5, Eqs. (6)-(7))."""
import copy
import json

import pytest
import torch

import plug_and_play
import sat
from logprobs import measure_kl
from records import latest_checkpoint
from rollout import SamplingConfig, rollout
from tasks import arithmetic_problems
from team import Agent, Team, TeamConfig, check_same_vocabulary
from trust_region import quantile

QUIET = dict(log=lambda *_: None)


def small_config(tmp_path, **overrides) -> sat.Config:
    cfg = dict(agents="tiny x2", stages=1, batch_size=32, group_size=4, epochs=1, minibatch_size=16,
               warmup_steps=30, eval_size=16, out=str(tmp_path / "run"), device="cpu")
    cfg.update(overrides)
    return sat.Config(**cfg).apply_preset()


def test_stage0_brings_replacement_inside_delta0(tmp_path):
    torch.manual_seed(0)
    cfg = small_config(tmp_path, stage0_delta=0.05)
    team = Team([Agent.load("tiny", seed=k) for k in range(2)], TeamConfig(protocol="chain"))
    replacement = Agent.load("tiny-3L", seed=9)  # another architecture, same vocabulary
    problems = arithmetic_problems(8, seed=0)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=4)
    before = [copy.deepcopy(a.model.state_dict()) for a in team.agents]
    info = plug_and_play.stage0_align(team, 1, replacement, problems, cfg, sampling, lr=1e-3, **QUIET)
    assert info["kl_quantile_before"] > cfg.stage0_delta  # it really had to move
    assert info["kl_quantile"] <= cfg.stage0_delta and info["passes"] >= 1
    # measure independently on fresh states of the same team
    batch = rollout(team, problems, 4, sampling)
    kl, _ = measure_kl(replacement, team.agents[1].model, batch.turns[1], 1.0, 1 << 14)
    assert quantile(kl, cfg.quantile) <= 3 * cfg.stage0_delta  # new states: inside up to sampling noise
    for agent, state in zip(team.agents, before):  # Stage-0 trains only the replacement
        for name, tensor in agent.model.state_dict().items():
            assert torch.equal(tensor, state[name])


def test_vocabulary_mismatch_is_refused():
    incumbent = Agent.load("tiny", seed=0)
    other = Agent.load("tiny", seed=1)
    other.tokenizer.add_tokens(["<|extra|>"])
    other.model.resize_token_embeddings(len(other.tokenizer))
    with pytest.raises(ValueError) as err:
        check_same_vocabulary(incumbent, other)
    msg = str(err.value)
    assert "vocabularies differ" in msg and "102 tokens" in msg and "103 tokens" in msg and "\n" not in msg
    team = Team([incumbent, Agent.load("tiny", seed=2)])
    with pytest.raises(ValueError, match="vocabularies differ"):
        team.swap(0, other)
    assert team.agents[0] is incumbent


def test_upgrade_run_keeps_others_bit_identical_records_and_resumes(tmp_path):
    sat.run(small_config(tmp_path, stages=1), **QUIET)
    run_dir = tmp_path / "run"
    before = Team.load(latest_checkpoint(run_dir) / "team")
    cfg = sat.parse_args(["--resume", str(run_dir), "--upgrade", "2=tiny-3L", "--stages", "1",
                          "--stage0-delta", "0.05", "--upgrade-warmup-steps", "20"])
    sat.run(cfg, **QUIET)
    upgraded = Team.load(latest_checkpoint(run_dir) / "team")
    assert latest_checkpoint(run_dir).name == "stage_0001_upgraded"
    # the untouched agent is bit-identical; the slot holds the new 3-layer model
    for name, tensor in upgraded.agents[0].model.state_dict().items():
        assert torch.equal(tensor, before.agents[0].model.state_dict()[name])
    assert upgraded.agents[1].model.config.num_hidden_layers == 3
    assert json.loads((latest_checkpoint(run_dir) / "team" / "team.json").read_text())["agents"] == ["tiny", "tiny-3L"]
    events = json.loads((run_dir / "upgrades.json").read_text())
    assert events[0]["slot"] == 2 and events[0]["from"] == "tiny" and events[0]["to"] == "tiny-3L" and events[0]["at_stage"] == 1
    assert events[0]["stage0"]["kl_quantile"] <= 0.05
    assert json.loads((run_dir / "config.json").read_text())["upgrade"] == []
    # continue SAT with the upgraded team: the checkpoint resumes
    more = sat.run(sat.parse_args(["--resume", str(run_dir), "--stages", "2"]), **QUIET)
    assert [r["stage"] for r in more] == [0, 1, 2]
    assert more[-1]["upgrades"][0]["to"] == "tiny-3L"
    assert len(more[-1]["agents"]) == 2


def test_upgrade_needs_resume_and_a_valid_slot(tmp_path, capsys):
    assert sat.main(["--upgrade", "2=tiny", "--stages", "1", "--out", str(tmp_path / "x"), "--warmup-steps", "0",
                     "--batch-size", "8", "--group-size", "4", "--eval-size", "4"]) == 2  # refused before any work
    assert "--upgrade needs --resume" in capsys.readouterr().err
    sat.run(small_config(tmp_path, stages=1), **QUIET)
    assert sat.main(["--resume", str(tmp_path / "run"), "--upgrade", "5=tiny"]) == 2
    assert "out of range" in capsys.readouterr().err
