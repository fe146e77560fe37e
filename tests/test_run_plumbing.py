"""Run plumbing that must not change what a stage computes: the in-loop KL
check and the line search keep every step inside delta, encoded prompts are
cached exactly, the warm start trains each agent on its own stream, the
padding helpers, and the thread policy."""
import random

import pytest
import torch
from test_sat import small_config

import harness.cli
import sat
from harness.loading import load_agent, warm_start
from harness.math_grading import math_team_config
from harness.run import configure_threads, trust_regions_for
from harness.tasks import arithmetic_problems
from logprobs import measure_kl
from rollout import SamplingConfig
from scale.rollout_hf import HF
from team import Agent, Team
from trust_region import kl_quantile


def warm_team(protocol: str, steps: int) -> Team:
    """Two tiny agents warm-started for ``steps`` steps: untrained ones score 0,
    so a stage's update would have no signal and never near delta."""
    team = Team([load_agent("tiny", seed=k) for k in range(2)], math_team_config(protocol=protocol))
    warm_start(team, arithmetic_problems(64, seed=9), steps, 0.5, seed=3, batch=8)
    return team


@pytest.mark.slow  # about a minute: two warm-started stages with a KL check after every step
@pytest.mark.parametrize("protocol", ["independent", "chain"])
def test_in_loop_check_stops_at_delta_and_every_kept_step_is_inside(tmp_path, protocol, monkeypatch):
    """A small radius checked after every gradient step: the check stops an
    agent once it crossed delta, the line search backtracks toward the last
    iterate found inside, and the weights kept lie inside delta, measured
    again here against a copy of each agent taken before the stage."""
    team = warm_team(protocol, 80)
    cfg = small_config(tmp_path, delta=0.02, kl_check_every=1, epochs=2, lr=3e-3, temperature=1.0, protocol=protocol)
    sampling = SamplingConfig(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                              token_budget=cfg.token_budget)
    before = [Agent(a.spec, __import__("copy").deepcopy(a.model), a.tokenizer) for a in team.agents]
    captured = []
    rollout = sat.rollout
    monkeypatch.setattr(sat, "rollout", lambda *a, **kw: captured.append(rollout(*a, **kw)) or captured[-1])
    torch.manual_seed(0)
    run = sat.RunState(team, trust_regions_for(cfg, 2), {}, random.Random(0), HF)
    rec, _ = sat.sat_stage(run, arithmetic_problems(8, seed=2), cfg.core(), sampling)
    assert any(a.train.early_stopped for a in rec.agents)  # the case this test is for
    for j, a in enumerate(rec.agents):
        assert a.kl_quantile <= cfg.delta
        kl = measure_kl(team.agents[j], before[j].model, captured[0].turns[j], cfg.temperature, cfg.token_budget)[0]
        assert kl_quantile(kl, cfg.quantile) <= cfg.delta + 1e-9
        assert a.accepted or kl.abs().max() == 0  # rejected: pi_cur restored exactly


def test_encoded_prompts_are_cached_and_equal_fresh_tokenisation():
    agent = load_agent("tiny")
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    first = agent.encode_prompt(messages)
    fresh = agent.tokenizer(agent.render_prompt(messages), add_special_tokens=False)["input_ids"]
    assert first == fresh and len(agent._prompt_cache) == 1
    first.append(-1)  # a caller extending its copy must not change the cache
    assert agent.encode_prompt(messages) == fresh
    # another prompt, another entry
    assert agent.encode_prompt([{"role": "user", "content": "What is 12 + 31?"}]) != fresh
    assert agent.encode_text("42") == agent.tokenizer("42", add_special_tokens=False)["input_ids"]


def serial_warm_start(team, problems, steps, p_wrong, seed, lr=1e-3, batch=8):
    """The warm start written out as one loop per agent, each step's batch drawn right before it."""
    import random

    from harness.tasks import noisy_label
    from logprobs import left_pad, masked_mean, response_hidden_states, right_pad, token_logprobs_from_hidden
    rng = random.Random(seed)
    for k, agent in enumerate(team.agents):
        opt, tok = agent.start_training(lr), agent.tokenizer
        for _ in range(steps):
            items = [rng.choice(problems) for _ in range(batch)]
            contexts = [team.prompt_ids(k, p, [noisy_label(p.answer, rng, p_wrong) for _ in range(k)]) for p in items]
            targets = [agent.encode_text(noisy_label(p.answer, rng, p_wrong)) + [tok.eos_token_id] for p in items]
            ctx, cmask = left_pad(contexts, tok.pad_token_id)
            resp, rmask = right_pad(targets, tok.pad_token_id)
            logp = token_logprobs_from_hidden(agent.model, response_hidden_states(agent.model, ctx, cmask, resp, rmask),
                                              resp, 1.0)
            opt.zero_grad(set_to_none=True)
            (-masked_mean(logp, rmask)).backward()
            opt.step()
        agent.freeze()


@pytest.mark.parametrize("protocol", ["independent", "chain"])
def test_warm_start_trains_each_agent_on_its_own_stream(protocol):
    problems = arithmetic_problems(40, seed=1)
    teams = [Team([load_agent("tiny", seed=k) for k in range(3)], math_team_config(protocol=protocol))
             for _ in range(2)]
    serial_warm_start(teams[0], problems, 4, 0.5, seed=3)
    warm_start(teams[1], problems, 4, 0.5, seed=3, batch=8)
    start = load_agent("tiny", seed=1).model.state_dict()
    for k in range(3):
        ref, got = teams[0].agents[k].model.state_dict(), teams[1].agents[k].model.state_dict()
        assert any(not torch.equal(ref[n], start[n]) for n in ref) or k != 1  # agent 2 did train
        assert all(torch.equal(ref[n], got[n]) for n in ref)
        assert not teams[1].agents[k].model.training
        assert not any(p.requires_grad for p in teams[1].agents[k].model.parameters())


def test_padding_matches_a_row_by_row_loop():
    """logprobs.left_pad / right_pad (one masked write) against a per-row loop."""
    import random

    from logprobs import left_pad, right_pad
    rng = random.Random(0)
    for _ in range(200):
        seqs = [[rng.randrange(50000) for _ in range(rng.randrange(0, 6))] for _ in range(rng.randrange(1, 6))]
        width = max(len(s) for s in seqs)
        for pad, right in ((left_pad, False), (right_pad, True)):
            w = max(1, width) if right else width
            ids, mask = torch.full((len(seqs), w), 7), torch.zeros((len(seqs), w), dtype=torch.long)
            for i, s in enumerate(seqs):
                cols = slice(0, len(s)) if right else slice(w - len(s), w)
                if s:
                    ids[i, cols], mask[i, cols] = torch.tensor(s), 1
            got = pad(seqs, 7)
            assert torch.equal(got[0], ids) and torch.equal(got[1], mask) and got[0].dtype == got[1].dtype == torch.long


def test_threads_default_to_one_and_follow_the_option(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert configure_threads(None, "cpu") == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert configure_threads(None, "cpu") == 2 and torch.get_num_threads() == 2
        assert configure_threads(1, "cpu") == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_cli_rejects_zero_threads(capsys):
    assert harness.cli.main(["--threads", "0", "--stages", "0"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err


@pytest.mark.slow  # a whole run through sat.py's command line
def test_output_sent_to_a_file_has_the_stage_lines_and_no_progress_bars(tmp_path, capfd):
    """Output that is not a terminal (pytest's capture files, like ``python sat.py > log 2>&1``) gets the stage
    lines but none of the progress bars' carriage-return updates (warm start, stages)."""
    assert harness.cli.main(["--agents", "tiny x2", "--stages", "1", "--batch-size", "16", "--group-size", "4",
                             "--minibatch-size", "16", "--warmup-steps", "20", "--eval-size", "8", "--device", "cpu",
                             "--out", str(tmp_path / "run")]) == 0
    out, err = capfd.readouterr()
    assert "\r" not in out + err
    assert "held-out team accuracy" in out and len(out.splitlines()) > 5  # the stage table and samples
