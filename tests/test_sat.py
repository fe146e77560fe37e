"""The SAT stage loop on tiny agents: exact KL, backtracking, weights, resume, CLI."""
import copy
import dataclasses
import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import advantage
import harness.cli
import harness.run
import sat
import update
from harness.config import Config
from harness.loading import load_agent
from harness.math_grading import math_team_config
from harness.run_folder import latest_checkpoint
from harness.tasks import arithmetic_problems
from logprobs import measure_kl
from rollout import SamplingConfig, rollout
from scale.rollout_hf import HF
from team import Agent, Team
from trust_region import TrustRegion, quantile

TIMING_KEYS = {"seconds", "rollout_tokens_per_s", "train_tokens_per_s", "generation_seconds", "eval_seconds"}


def small_config(tmp_path, **overrides) -> Config:
    """A run small enough for a test: few warm-start steps, 32 trajectories a stage."""
    cfg = dict(agents="tiny x2", stages=2, batch_size=32, group_size=4, epochs=1, minibatch_size=16,
               warmup_steps=30, eval_size=16, out=str(tmp_path / "run"), device="cpu")
    cfg.update(overrides)
    return Config(**cfg).apply_preset()


def tiny_team_and_batch(protocol: str):
    """Two tiny agents (seeds 0, 1) and one seeded rollout of 6 problems x G = 4."""
    torch.manual_seed(0)
    team = Team([load_agent("tiny", seed=k) for k in range(2)], math_team_config(protocol=protocol))
    batch = rollout(team, arithmetic_problems(6, seed=0), 4, SamplingConfig(temperature=1.0, max_new_tokens=5), HF)
    return team, batch


@pytest.fixture(scope="module")
def team_and_batch():
    return tiny_team_and_batch("chain")


def perturb(model, scale, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


# -- exact per-state KL on the agent's own tokens -------------------------------------
def test_measure_kl_equals_direct_full_vocabulary_sum(team_and_batch):
    team, batch = team_and_batch
    agent = team.agents[1]
    reference = copy.deepcopy(agent.model)
    moved = Agent(agent.spec, copy.deepcopy(agent.model), agent.tokenizer)
    perturb(moved.model, 0.02)
    turn = batch.turns[1]
    kl, new_logp, _ = measure_kl(moved, reference, turn, temperature=0.7, token_budget=64)
    expected, expected_logp = [], torch.zeros_like(turn.behaviour_logprobs)
    for i in range(len(batch)):
        ctx = turn.context_ids[i][turn.context_mask[i].bool()]
        resp = turn.response_ids[i][turn.response_mask[i].bool()]
        ids = torch.cat([ctx, resp])[None]
        with torch.no_grad():
            p = torch.softmax(moved.model(ids).logits[0, len(ctx) - 1 : -1].double() / 0.7, -1)
            q = torch.softmax(reference(ids).logits[0, len(ctx) - 1 : -1].double() / 0.7, -1)
        expected.append((p * (p.log() - q.log())).sum(-1))  # sum_v p_new log(p_new / p_cur)
        expected_logp[i, : len(resp)] = p.log().gather(-1, resp[:, None]).squeeze(-1)
    assert torch.allclose(kl.double(), torch.cat(expected), atol=1e-5)
    assert torch.allclose(new_logp, expected_logp.float(), atol=1e-5)
    assert (kl > 0).all()


# -- backtracking ------------------------------------------------------------------------
def run_trust_region_step(team, batch, scale, cfg, max_backtracks, rule="fixed"):
    j = 1
    agent = team.agents[j]
    original = copy.deepcopy(agent.model)
    reference = copy.deepcopy(agent.model)
    perturb(agent.model, scale)
    inputs = advantage.build_inputs(batch, j, [], cfg.core())
    cfg = dataclasses.replace(cfg, max_backtracks=max_backtracks)
    stats = update.TrainStats(loss=0.0, clip_fraction=0.0, ratio_mean=1.0, ratio_min=1.0, ratio_max=1.0, grad_norm=0.0,
                              train_tokens_per_s=0.0, inner_steps=1, early_stopped=False, step0_log_ratio_max=0.0)
    region = TrustRegion.fresh(cfg.delta, cfg.quantile, cfg.max_backtracks, 0.0, rule, cfg.lr)
    record, _ = sat.trust_region_step(team, j, reference, inputs, stats, cfg.core(), region, batch)
    for p, q in zip(reference.parameters(), original.parameters()):
        assert torch.equal(p, q)  # the line search reads pi_j,cur's parameters as its anchor and never writes them
    return agent, original, record


@pytest.fixture
def stepped(team_and_batch):
    """The shared team and batch; agent 2's weights, which a trust-region step moves, restored afterwards."""
    team, batch = team_and_batch
    saved = copy.deepcopy(team.agents[1].model.state_dict())
    yield team, batch
    team.agents[1].model.load_state_dict(saved)


def test_backtracking_rejects_a_step_that_violates_delta(stepped, tmp_path):
    team, batch = stepped
    cfg = small_config(tmp_path, delta=0.01, temperature=1.0)
    agent, original, record = run_trust_region_step(team, batch, scale=0.5, cfg=cfg, max_backtracks=1)
    assert not record.accepted and record.backtracks == 1
    for p, q in zip(agent.model.parameters(), original.parameters()):
        assert torch.equal(p, q)  # pi_cur restored bit for bit: the violating step is not kept


def test_backtracking_shrinks_until_inside(stepped, tmp_path):
    team, batch = stepped
    cfg = small_config(tmp_path, delta=0.05, temperature=1.0)
    agent, original, record = run_trust_region_step(team, batch, scale=0.02, cfg=cfg, max_backtracks=12)
    assert record.accepted and record.backtracks >= 1
    assert record.kl_quantile <= cfg.delta
    # the parameters left in place really are inside: measure again independently
    kl = measure_kl(agent, original, batch.turns[1], 1.0, 1 << 14)[0]
    assert quantile(kl, cfg.quantile) <= cfg.delta + 1e-9
    assert record.step_fraction == 0.5 ** record.backtracks
    assert "lr" not in record.row()  # a fixed lr is the run's --lr


def test_an_adaptive_step_that_backtracks_lowers_the_agents_lr(stepped, tmp_path):
    team, batch = stepped
    cfg = small_config(tmp_path, delta=0.05, temperature=1.0)
    _, _, record = run_trust_region_step(team, batch, scale=0.02, cfg=cfg, max_backtracks=12, rule="adaptive")
    assert record.accepted and record.backtracks >= 1 and record.lr == cfg.lr
    expected = cfg.lr * record.step_fraction * math.sqrt(0.7 * cfg.delta / record.kl_quantile)  # step_rules.StepSize
    assert record.lr_next == pytest.approx(expected, rel=1e-9) and record.lr_next < record.lr


def test_a_scaled_step_stretches_a_short_proposal_and_shrinks_a_long_one(stepped, tmp_path):
    """--step-size scaled on real forwards: the weights kept lie on the line through pi_cur and the proposal, at
    the multiple the record names, and an independent measurement there is the record's, inside delta."""
    team, batch = stepped
    cfg = small_config(tmp_path, delta=0.05, temperature=1.0)
    proposal = copy.deepcopy(team.agents[1].model)
    agent, original, short = run_trust_region_step(team, batch, scale=0.001, cfg=cfg, max_backtracks=6, rule="scaled")
    perturb(proposal, 0.001)  # the same draw run_trust_region_step applied (perturb seeds itself)
    f = short.step_fraction
    assert short.accepted and 1.0 < f <= 16.0 and short.backtracks == 1  # stretched, checked once more
    for p, c, n in zip(agent.model.parameters(), original.parameters(), proposal.parameters()):
        assert torch.allclose(p, c + f * (n - c), atol=1e-6)
    kl = measure_kl(agent, original, batch.turns[1], 1.0, 1 << 14)[0]
    assert quantile(kl, cfg.quantile) == pytest.approx(short.kl_quantile, rel=1e-5) and short.kl_quantile <= cfg.delta
    team.agents[1].model.load_state_dict(original.state_dict())
    _, _, long = run_trust_region_step(team, batch, scale=0.02, cfg=cfg, max_backtracks=6, rule="scaled")
    assert long.accepted and 0 < long.step_fraction < 1 and long.kl_quantile <= cfg.delta
    assert "lr" not in long.row()


# -- sequence-aware weights ----------------------------------------------------------------
def test_build_inputs_uses_truncated_weights_of_earlier_agents(team_and_batch, tmp_path):
    team, batch = team_and_batch
    cfg = small_config(tmp_path)
    t0 = batch.turns[0]
    g = torch.Generator().manual_seed(3)
    log_rho = torch.randn(t0.response_mask.shape, generator=g) * t0.response_mask  # [N, L]
    inputs = advantage.build_inputs(batch, 1, [(log_rho, t0.response_mask)], cfg.core())
    for i in range(len(batch)):
        toks = log_rho[i][t0.response_mask[i].bool()]
        w = torch.prod(torch.clamp(toks.exp(), max=1.0))  # prod_t min(1, rho_t), brute force
        assert torch.isclose(inputs.log_w[i].exp(), w, rtol=1e-5)
        assert torch.isclose(inputs.log_w_full[i].exp(), toks.exp().prod(), rtol=1e-5)
    # the group baseline is weighted by w: the weighted mean of the raw advantages is 0 per group
    w = inputs.log_w.exp()
    for gid in batch.group_ids.unique():
        sel = batch.group_ids == gid
        assert abs(float((w[sel] * inputs.raw_adv[sel]).sum())) < 1e-5
    first = advantage.build_inputs(batch, 0, [], cfg.core())
    assert torch.equal(first.log_w, torch.zeros(len(batch)))


def test_sequence_ratio_kinds():
    log_ratio = torch.tensor([[0.1, 0.2, 0.0], [0.3, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert torch.allclose(update.sequence_log_ratio(log_ratio, mask, "seq"), torch.tensor([0.3, 0.3]))
    assert torch.allclose(update.sequence_log_ratio(log_ratio, mask, "seq-mean"), torch.tensor([0.15, 0.3]))
    surr, clipped, r = update.clipped_surrogate(log_ratio, mask, torch.tensor([1.0, -1.0]), "seq", 0.2)
    # r = e^0.3 = 1.35 > 1.2: A > 0 takes the clipped value, A < 0 the unclipped (pessimistic) one
    assert torch.allclose(surr, torch.tensor([1.2, -torch.tensor(0.3).exp().item()]))


def test_negative_objective_by_hand():
    """Eq. (5) on two rows with numbers worked by hand: padding carries garbage log-probs that must not count."""
    logp = torch.tensor([[0.1, 0.2, 5.0], [0.3, -7.0, 9.0]])
    behaviour = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    cfg = SimpleNamespace(ratio="seq", eps_clip=0.2, kl_estimator="k2")
    out = update.negative_objective(logp, behaviour, mask, torch.tensor([1.0, -1.0]),
                                    torch.tensor([0.0, math.log(0.5)]), 0.1, cfg)
    e = math.exp(0.3)  # r of both rows, beyond 1 + eps
    policy = -(1.0 * 1.2 + 0.5 * -e) / 2  # w min(r A, clip(r) A): A > 0 clipped, A < 0 not
    penalty = 0.1 * 0.5 * (0.1**2 + 0.2**2 + 0.3**2) / 3  # beta x mean k2 over the three valid tokens
    assert out.loss.item() == pytest.approx(policy + penalty, rel=1e-6)
    assert torch.equal(out.log_ratio, logp * mask)
    assert torch.allclose(out.ratio, torch.tensor([e, e])) and torch.equal(out.clipped, torch.tensor([2.0, 1.0]))


# -- whole runs ------------------------------------------------------------------------------
def strip_timing(records):
    out = []
    for r in records:
        r = {k: v for k, v in r.items() if k not in TIMING_KEYS}
        r["agents"] = [{k: v for k, v in a.items() if k not in TIMING_KEYS} for a in r.get("agents", [])]
        if "per_round" in r:  # an environment's rounds: their wall time split (harness.episodes.ROUND_SECONDS)
            r["per_round"] = [{k: v for k, v in row.items() if not k.endswith("_seconds")} for row in r["per_round"]]
        out.append(r)
    return out


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The module's 2-stage run of ``small_config`` (independent protocol): (its config, its records). The
    end-to-end test checks it, and the resume test continues a copy of it."""
    cfg = small_config(tmp_path_factory.mktemp("default"), protocol="independent")
    return cfg, harness.run.run(cfg, log=lambda *_: None)


@pytest.mark.parametrize("overrides", [
    pytest.param(None, id="overrides0"),  # the module's default_run
    pytest.param(dict(protocol="chain", order="greedy"), marks=pytest.mark.slow),  # over 10 s on two busy cores
    pytest.param(dict(update="joint", order="random"), marks=pytest.mark.slow),  # the fast tier keeps the first
    pytest.param(dict(protocol="chain", reuse="regenerate", ratio="token", adv="gae"), marks=pytest.mark.slow),
])
def test_stage_loop_end_to_end(tmp_path, overrides, request):
    if overrides is None:
        cfg, records = request.getfixturevalue("default_run")
    else:
        cfg = small_config(tmp_path, **overrides)
        records = harness.run.run(cfg, log=lambda *_: None)
    run_dir = Path(cfg.out)
    assert [r["stage"] for r in records] == [0, 1, 2]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["stage"] for line in lines] == [0, 1, 2]
    for rec in records[1:]:
        assert 0.0 <= rec["team_reward"] <= 1.0 and 0.0 <= rec["eval_accuracy"] <= 1.0
        assert set(rec["certificate"]) >= {"lower_bound", "delta_conf", "kind"}
        assert -1.0 <= rec["certificate"]["lower_bound"] <= rec["measured_change"]
        # the paired held-out rows: every evaluation asks the same rows, so the paired mean is the change
        assert len(rec["eval_rewards"]) == rec["eval_n"] == len(records[0]["eval_rewards"])
        assert sum(rec["eval_rewards"]) / rec["eval_n"] == pytest.approx(rec["eval_accuracy"], abs=1e-5)
        run = rec["run_certificate"]
        assert set(run) >= {"lower_bound", "mean_change", "n", "delta_conf", "kind", "upper_bound"}
        assert run["mean_change"] == pytest.approx(rec["eval_accuracy"] - records[0]["eval_accuracy"], abs=1e-5)
        assert -1.0 <= run["lower_bound"] <= run["mean_change"] <= run["upper_bound"] <= 1.0
        assert rec["certified_fall"] == (rec["certificate"]["upper_bound"] < 0)
        assert sorted(rec["order"]) == [1, 2]
        for a in rec["agents"]:
            for key in ("agent", "kl_mean", "kl_quantile", "kl_max", "delta", "beta", "backtracks", "accepted",
                        "surrogate_estimate", "surrogate_ess", "step_bound", "zeta", "N", "clip_fraction"):
                assert key in a
            if a["accepted"]:
                assert a["kl_quantile"] <= cfg.delta  # never keep a violating step
    assert records[1]["run_certificate"]["lower_bound"] == records[1]["certificate"]["lower_bound"]
    assert records[-1]["violation_rate"] == sum(r["violation"] for r in records[1:]) / 2
    assert records[-1]["certified_fall_rate"] == sum(r["certified_fall"] for r in records[1:]) / 2
    assert (run_dir / "progress.png").stat().st_size > 1000
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["stage"] for s in samples] == [1] * cfg.samples + [2] * cfg.samples
    for s in samples:  # what each agent said, its answer as the grader read it, and the team's outcome
        assert len(s["agents"]) == 2 and 0.0 <= s["reward"] <= 1.0
        for a in s["agents"]:
            assert isinstance(a["response"], str) and a["tokens"] >= 1
            assert (a["answer"] == s["gold"]) <= a["correct"] <= (a["answer"] is not None)


@pytest.fixture(scope="module")
def straight_and_resumed(tmp_path_factory, default_run):
    """A straight 4-stage run, and a copy of the module's 2-stage run resumed to 4 stages: (straight folder, its
    records, resumed records). Both tests below read them."""
    root = tmp_path_factory.mktemp("resume")
    straight = harness.run.run(small_config(root / "a", stages=4, protocol="independent"), log=lambda *_: None)
    shutil.copytree(default_run[0].out, root / "b")
    resumed_cfg = harness.cli.parse_args(["--resume", str(root / "b"), "--stages", "4"])
    return root / "a" / "run", straight, harness.run.run(resumed_cfg, log=lambda *_: None)


@pytest.mark.slow  # over half a minute: a straight run and its resumed twin
def test_resume_gives_the_same_metrics_as_a_straight_run(straight_and_resumed):
    _, straight, resumed = straight_and_resumed
    assert strip_timing(resumed) == strip_timing(straight)


@pytest.mark.slow  # over half a minute: a straight run and its resumed twin
def test_gae_resume_gives_the_same_metrics_as_a_straight_run(tmp_path):
    """--adv gae: the value heads (trained in every stage, checkpointed) come back with the checkpoint, and
    building them draws nothing from torch's global RNG, so stage 3 of a resumed run is that of a straight run
    (a shifted draw showed there)."""
    straight = harness.run.run(small_config(tmp_path / "a", stages=3, adv="gae"), log=lambda *_: None)
    harness.run.run(small_config(tmp_path / "b", stages=2, adv="gae"), log=lambda *_: None)
    resumed_cfg = harness.cli.parse_args(["--resume", str(tmp_path / "b" / "run"), "--stages", "3"])
    assert resumed_cfg.adv == "gae"  # the run's own config comes back
    resumed = harness.run.run(resumed_cfg, log=lambda *_: None)
    assert strip_timing(resumed) == strip_timing(straight)


@pytest.mark.slow  # reads the runs of the resume test above
def test_checkpoint_is_atomic_and_latest_points_to_it(straight_and_resumed):
    run_dir = straight_and_resumed[0]
    latest = latest_checkpoint(run_dir)
    assert latest.name == "stage_0004" and (latest / "state.pt").exists()
    assert not list((run_dir / "checkpoints").glob(".*tmp"))


# -- CLI -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,needle", [
    (["--delta", "-1"], "--delta must be > 0"),
    (["--agents", "Qwen3-5B"], "unknown agent 'Qwen3-5B'"),
    (["--batch-size", "30", "--group-size", "8"], "multiple of --group-size"),
    (["--quantile", "1.5"], "--quantile must be in (0, 1]"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--device", "cuda:0"] if not torch.cuda.is_available() else ["--lr", "0"],
     "" if torch.cuda.is_available() else "CUDA is not available"),
])
def test_cli_rejects_bad_options(argv, needle, capsys):
    assert harness.cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sat.py: error:") and needle in err and "\n" not in err


def test_cli_rejects_unknown_choice(capsys):
    with pytest.raises(SystemExit) as exit_info:
        harness.cli.parse_args(["--protocol", "debate"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'debate'" in capsys.readouterr().err


def test_resume_without_checkpoint_is_a_clear_error(tmp_path, capsys):
    assert harness.cli.main(["--resume", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert "no checkpoint in" in err and "\n" not in err.strip()


def test_preset_follows_the_agents_and_the_device(monkeypatch):
    from harness import config
    from harness.config import PAPER_PRESET, REAL_CPU_PRESET, TINY_PRESET, AgentSpec, preset_for

    assert preset_for("tiny x2, tiny-6L", "cuda") is TINY_PRESET and preset_for("tiny x3", "cpu") is TINY_PRESET
    assert preset_for("Qwen3-4B x3", "cuda") is PAPER_PRESET and preset_for("Qwen3-4B, tiny", "cuda:1") is PAPER_PRESET
    real_cpu = {k: v for k, v in preset_for("Qwen3-4B x3", "cpu").items() if k != "threads"}
    assert real_cpu == REAL_CPU_PRESET
    cfg = Config(agents="Qwen3-0.6B x3", device="cpu", lr=3e-6).apply_preset()
    assert (cfg.task, cfg.lr, cfg.gradient_checkpointing) == ("arithmetic-chat", 3e-6, False)  # an option wins
    assert cfg.max_new_tokens == REAL_CPU_PRESET["max_new_tokens"] and cfg.reuse == "regenerate"
    monkeypatch.setattr(config, "parse_agents", lambda agents: [AgentSpec(agents, "gguf", agents)])
    assert preset_for("SmolLM2-135M", "cpu")["task"] == "arithmetic-chat"  # any kind but tiny is a real model


def test_threads_every_core_for_a_real_model_on_cpu_one_for_the_tiny_team(monkeypatch):
    from harness.config import cpu_cores

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert Config(agents="Qwen3-0.6B x3", device="cpu").apply_preset().threads == cpu_cores() >= 1
    assert Config(agents="tiny x3", device="cpu").apply_preset().threads is None  # configure_threads: 1
    assert Config(agents="Qwen3-0.6B x3", device="cpu", threads=1).apply_preset().threads == 1  # the option wins
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert Config(agents="Qwen3-0.6B x3", device="cpu").apply_preset().threads == 3  # then the environment
