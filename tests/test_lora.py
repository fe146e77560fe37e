"""--lora: agents as PEFT LoRA adapters on one shared base.

What must hold: agents of one base hold one copy of its tensors; training one agent never moves another's policy;
the trust region's quantities (per-state KL, the line search's fractions and verdicts) are those of the dense model
the adapter stands for; a rejected step restores the adapter bit for bit; a checkpoint holds adapters that load
unchanged in PEFT; each bad input is one line."""
import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from test_sat import small_config, strip_timing

import harness.cli
import harness.run
from adapter import LoraSettings, copy_sharing_base, own_parameters
from harness import evaluation, lora
from harness.config import VLLM_MAX_LORA_RANK, Config, parse_agents
from harness.loading import load_agents, load_saved_agents, load_saved_team, save_agent
from harness.math_grading import math_team_config
from harness.processes import ONE_PROCESS
from harness.run_folder import latest_checkpoint
from trust_region import backtracking_line_search, interpolate_parameters, kl_quantile, per_state_kl

SETTINGS = LoraSettings(rank=4, alpha=32.0, targets=("all-linear",))


def tiny_adapters(n: int = 3, settings: LoraSettings = SETTINGS, dtype: torch.dtype = torch.float32):
    """``n`` tiny agents of one base (2 layers), each with its own adapter."""
    return load_agents(parse_agents(f"tiny-2L x{n}"), "cpu", dtype, list(range(n)), settings)


def base_tensors(model) -> dict[str, int]:
    """{name: storage pointer} of every tensor of ``model`` that is not its adapter's."""
    own = {id(p) for p in own_parameters(model)}
    named = list(model.named_parameters()) + list(model.named_buffers())
    return {n: t.untyped_storage().data_ptr() for n, t in named if id(t) not in own}


def inputs(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 90, (3, 12), generator=g)  # [b, L] token ids


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits  # [b, L, V]


@torch.no_grad()
def perturb(model, scale: float, seed: int) -> None:
    """Move an adapter off B = 0 (a fresh adapter is the base exactly)."""
    g = torch.Generator().manual_seed(seed)
    for p in own_parameters(model):
        p.add_(scale * torch.randn(p.shape, generator=g))


def merged(model) -> torch.nn.Module:
    """The dense model an adapter stands for: a whole copy with every LoRA layer merged into its base weight."""
    from peft.tuners.lora import LoraLayer

    dense = copy.deepcopy(model)
    for module in dense.modules():
        if isinstance(module, LoraLayer):
            module.merge()
    return dense


def test_agents_of_one_base_hold_one_copy_of_it_and_pi_cur_shares_it_too():
    agents = tiny_adapters(3)
    shared = [base_tensors(a.model) for a in agents]
    assert shared[0] and shared[0] == shared[1] == shared[2]  # the same storages, name by name
    reference = copy_sharing_base(agents[0].model)
    assert base_tensors(reference) == shared[0]
    own = [{p.untyped_storage().data_ptr() for p in own_parameters(m)} for m in [a.model for a in agents] + [reference]]
    assert all(own[i].isdisjoint(own[j]) for i in range(4) for j in range(i))  # each adapter its own
    n_own, n_all = len(own_parameters(agents[0].model)), len(list(agents[0].model.parameters()))
    assert 0 < n_own < n_all and all(not p.requires_grad for p in agents[0].model.parameters())


def test_training_agent_one_never_changes_agent_twos_policy():
    agents, ids = tiny_adapters(2), inputs()
    before = [logits(a.model, ids) for a in agents]
    base_before = {n: t.clone() for n, t in agents[0].model.state_dict().items() if ".lora_" not in n}
    opt = agents[0].start_training(1e-2)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        agents[0].model(input_ids=ids).logits.logsumexp(-1).mean().backward()
        opt.step()
    agents[0].freeze()
    assert not torch.equal(logits(agents[0].model, ids), before[0])  # agent 1 did move
    assert torch.equal(logits(agents[1].model, ids), before[1])  # agent 2 did not, bit for bit
    after = agents[0].model.state_dict()
    assert all(torch.equal(after[n], t) for n, t in base_before.items())  # the shared base is untouched


def test_an_adapter_agent_starts_as_its_base_exactly():
    agents = tiny_adapters(1)
    base = load_agents(parse_agents("tiny-2L"), "cpu", torch.float32, [0])[0]
    assert torch.equal(logits(agents[0].model, inputs()), logits(base.model, inputs()))  # B = 0


def test_kl_and_line_search_of_an_adapter_are_the_dense_merged_models():
    """The per-state KL measured through adapters equals the one of the merged dense models, at every fraction
    the line search tries, and the search reaches the same verdict on the same fractions. In float64, so that the
    merge's rounding (a few 1e-7 of the logits in float32) stays far below the tolerance."""
    agent, ids = tiny_adapters(1, dtype=torch.float64)[0], inputs(1)
    perturb(agent.model, 0.02, seed=1)  # pi_cur: an adapter that has trained
    reference = ONE_PROCESS.frozen_copy(agent.model)
    perturb(agent.model, 0.05, seed=2)  # the proposal
    params, anchor = ONE_PROCESS.parameters(agent.model), ONE_PROCESS.parameters(reference)
    proposal = [p.detach().clone() for p in params]

    def kl_of(new, cur) -> torch.Tensor:  # [M] per-state KL over every position
        vocab = new.config.vocab_size
        return per_state_kl(logits(new, ids).reshape(-1, vocab), logits(cur, ids).reshape(-1, vocab))

    dense_ref = merged(reference)
    pairs = []

    def step_to(frac: float) -> None:
        interpolate_parameters(params, anchor, proposal, frac)

    def measure() -> float:
        through_adapter, dense = kl_of(agent.model, reference), kl_of(merged(agent.model), dense_ref)
        pairs.append((through_adapter, dense))
        return kl_quantile(through_adapter, 0.9), kl_quantile(dense, 0.9)

    full = kl_quantile(kl_of(agent.model, reference), 0.9)
    delta = full / 5  # the proposal lands outside: the search backtracks
    by_adapter = backtracking_line_search(step_to, measure, delta, quantile_of=lambda m: m[0])
    by_dense = backtracking_line_search(step_to, measure, delta, quantile_of=lambda m: m[1])
    assert by_adapter.backtracks >= 1 and by_adapter.accepted
    assert [t.fraction for t in by_adapter.history] == [t.fraction for t in by_dense.history]
    for a, b in zip(by_adapter.history, by_dense.history):
        assert a.kl_quantile == pytest.approx(b.kl_quantile, rel=1e-9)
    for through_adapter, dense in pairs:
        assert torch.allclose(through_adapter, dense, rtol=1e-9, atol=1e-15)
        assert through_adapter.max() > 0


def test_a_rejected_step_restores_the_adapter_bit_for_bit():
    agent, ids = tiny_adapters(1)[0], inputs(2)
    perturb(agent.model, 0.02, seed=3)
    reference = ONE_PROCESS.frozen_copy(agent.model)
    before_logits, before = logits(agent.model, ids), [p.clone() for p in own_parameters(agent.model)]
    perturb(agent.model, 0.05, seed=4)
    params, anchor = ONE_PROCESS.parameters(agent.model), ONE_PROCESS.parameters(reference)
    proposal = [p.detach().clone() for p in params]
    vocab = agent.model.config.vocab_size
    search = backtracking_line_search(
        lambda f: interpolate_parameters(params, anchor, proposal, f),
        lambda: per_state_kl(logits(agent.model, ids).reshape(-1, vocab), before_logits.reshape(-1, vocab)),
        delta=0.0, max_backtracks=2, quantile_of=lambda kl: kl_quantile(kl, 1.0))
    assert not search.accepted and all(t.kl_quantile > 0 for t in search.history)
    assert all(torch.equal(p, b) for p, b in zip(own_parameters(agent.model), before))
    assert torch.equal(logits(agent.model, ids), before_logits)


def test_a_saved_adapter_is_the_adapter_alone_and_loads_back_and_in_peft(tmp_path):
    from peft import PeftModel

    agents = tiny_adapters(2)
    for k, a in enumerate(agents):
        perturb(a.model, 0.03, seed=10 + k)
        save_agent(a, tmp_path / f"agent_{k}")
    files = sorted(p.name for p in (tmp_path / "agent_0").iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors", "agent.json"]  # no base weights
    loaded = load_saved_agents([tmp_path / "agent_0", tmp_path / "agent_1"], "cpu", torch.float32)
    assert base_tensors(loaded[0].model) == base_tensors(loaded[1].model)  # one base again
    ids = inputs(3)
    for a, b in zip(agents, loaded):
        assert torch.equal(logits(a.model, ids), logits(b.model, ids))
    base = load_agents(parse_agents("tiny-2L"), "cpu", torch.float32, [0])[0].model
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "agent_1"))  # PEFT's own loader, unchanged
    assert torch.allclose(logits(peft_model, ids), logits(agents[1].model, ids), atol=1e-6)


def test_targets_the_model_lacks_are_one_line():
    with pytest.raises(ValueError) as err:
        tiny_adapters(1, LoraSettings(rank=2, alpha=32.0, targets=("q_proj", "w_in")))
    assert str(err.value) == ("--lora-targets w_in: agent 'tiny-2L' has no such linear layer; choose from "
                              "down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj (or all-linear)")
    named = tiny_adapters(1, LoraSettings(rank=2, alpha=32.0, targets=("q_proj", "v_proj")))[0]
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, _ in named.model.named_parameters()
            if ".lora_" in n} == {"q_proj", "v_proj"}


@pytest.mark.parametrize("argv,line", [
    (["--lora", "0"], "--lora must be >= 1 (got 0): it is the adapter's rank, e.g. --lora 16; drop --lora to "
                      "train whole weights"),
    (["--lora-alpha", "8"], "--lora-alpha applies to adapters: add --lora RANK, or drop the option"),
    (["--lora", "4", "--lora-alpha", "0"], "--lora-alpha must be > 0 (got 0.0)"),
    (["--lora", "4", "--shard-rollouts"], "--lora runs on one process: launch with python, not torchrun, and drop "
                                          "--shard-rollouts (one GPU holds a team of adapters on a shared base: "
                                          "python -m scale.memory ... --lora R)"),
])
def test_bad_lora_options_are_one_line(argv, line, capsys):
    assert harness.cli.main(argv) == 2
    assert capsys.readouterr().err.strip() == f"sat.py: error: {line}"


def test_lora_with_vllm_is_refused_only_above_the_ranks_vllm_serves():
    from scale.vllm_lora import VLLM_LORA_RANKS, engine_lora_rank, lora_rank_error

    Config(lora=VLLM_MAX_LORA_RANK, backend="vllm").apply_preset().validate()  # served: no error
    cfg = Config(lora=VLLM_MAX_LORA_RANK + 1, backend="vllm").apply_preset()
    with pytest.raises(ValueError) as err:
        cfg.validate()
    assert str(err.value) == lora_rank_error(VLLM_MAX_LORA_RANK + 1)  # the config and the engine say one thing
    assert VLLM_LORA_RANKS[-1] == VLLM_MAX_LORA_RANK
    assert [engine_lora_rank(r) for r in (1, 2, 8, 9, 16, 64, 65, 512)] == [1, 8, 8, 16, 16, 64, 128, 512]
    with pytest.raises(ValueError, match="up to rank 512"):
        engine_lora_rank(513)
    upgrade = Config(lora=8, backend="vllm", upgrade=["2=tiny"]).apply_preset()
    with pytest.raises(ValueError, match="^--upgrade with --lora --backend vllm: .*--backend hf$"):
        upgrade.validate()


def test_vllm_serves_one_engine_per_base_with_room_for_every_adapter():
    """The LoRA engines' sizing (``scale.vllm_lora``, no vLLM needed): one engine per distinct base, room for every
    agent's adapter; a team mixing adapters and whole models, and a stale or never-loaded adapter, get one line."""
    from harness.loading import load_agent
    from harness.math_grading import math_team_config
    from scale.vllm_lora import check_adapter_in_sync, lora_bases, lora_engine_kwargs
    from scale.vllm_weights import plain_name
    from team import Team

    def team(members):
        return Team(members, math_team_config(protocol="chain"))

    agents = tiny_adapters(3)
    other = load_agents(parse_agents("tiny"), "cpu", torch.float32, [7], SETTINGS)  # a base of its own
    assert lora_bases(team(agents)) == 1 and lora_bases(team(agents[:2] + other)) == 2
    assert lora_bases(team([load_agent("tiny")])) is None  # whole models: one engine per agent
    with pytest.raises(ValueError, match="mixes adapter agents and whole models"):
        lora_bases(team(agents[:1] + [load_agent("tiny")]))
    assert lora_engine_kwargs(3, 4) == dict(enable_lora=True, max_lora_rank=8, max_loras=3, max_cpu_loras=3)
    check_adapter_in_sync(2, 2, "a")
    for served in (None, 1):
        with pytest.raises(RuntimeError, match="refusing to sample from a stale adapter"):
            check_adapter_in_sync(served, 2, "a")
    layer = "model.layers.0.self_attn.qkv_proj"
    assert plain_name(f"{layer}.base_layer.weight") == f"{layer}.weight"  # an engine's LoRA wrapper, named as loaded


def test_lora_settings_reach_the_peft_config():
    settings = lora.lora_settings(8, 16.0, "q_proj, v_proj")
    assert settings == LoraSettings(rank=8, alpha=16.0, targets=("q_proj", "v_proj"))
    config = lora.peft_config(settings)
    assert (config.r, config.lora_alpha, sorted(config.target_modules), config.lora_dropout) == (8, 16.0,
                                                                                                ["q_proj", "v_proj"], 0)
    assert lora.lora_settings(None, 32.0, "all-linear") is None


@pytest.mark.slow  # a straight run of 3 stages and a resumed twin: about a minute on two busy cores
def test_a_resumed_lora_run_equals_a_straight_one_and_its_checkpoint_holds_adapters(tmp_path):
    lora_run = dict(lora=4, warmup_steps=20)
    straight = harness.run.run(small_config(tmp_path / "a", stages=3, **lora_run), log=lambda *_: None)
    harness.run.run(small_config(tmp_path / "b", stages=2, **lora_run), log=lambda *_: None)
    resumed_cfg = harness.cli.parse_args(["--resume", str(tmp_path / "b" / "run"), "--stages", "3"])  # its --lora
    resumed = harness.run.run(resumed_cfg, log=lambda *_: None)
    assert strip_timing(resumed) == strip_timing(straight)
    assert any(a["kl_quantile"] > 0 for r in straight[1:] for a in r["agents"])  # the adapters did move
    team = tmp_path / "a" / "run" / "checkpoints" / "stage_0003" / "team"
    assert sorted(p.name for p in team.iterdir()) == ["agent_0", "agent_1", "base_0", "team.json"]
    assert not (team / "agent_0" / "model.safetensors").exists()  # the warm-started tiny base once, adapters apart
    with pytest.raises(ValueError, match="holds LoRA adapters: resume it with --lora 4 --lora-alpha 32.0"):
        harness.run.resolve(harness.cli.parse_args(["--resume", str(tmp_path / "a" / "run"), "--lora", "8"]))
    check_exported_adapter(tmp_path / "a" / "run", tmp_path / "export")
    data = tmp_path / "two.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{k}+1", "answer": str(k + 1)}) + "\n" for k in range(2)))
    out = tmp_path / "ev"
    assert evaluation.main(["--ckpt", str(tmp_path / "a" / "run"), "--data", str(data), "--k", "2", "--max-new-tokens",
                           "4", "--device", "cpu", "--out", str(out)]) == 0
    assert set(json.loads((out / "summary.json").read_text())["benchmarks"]) == {"two"}


@pytest.mark.parametrize("targets", [("all-linear",), ("q_proj", "down_proj")])
def test_the_planner_counts_an_adapter_as_peft_builds_it(targets):
    from scale import memory

    agent = tiny_adapters(1, LoraSettings(rank=3, alpha=32.0, targets=targets))[0]
    built = sum(p.numel() for p in own_parameters(agent.model))
    assert memory.adapter_parameters(agent.model.config, 3, targets) == built


def test_the_planner_holds_one_base_and_adapter_sized_training_state():
    from scale import memory

    config = memory.QWEN3_DIMS["qwen3-4b"]
    full = memory.estimate_memory(config, 3, backend="hf")
    adapters = memory.estimate_memory(config, 3, backend="hf", lora_rank=64)
    base, adapter = memory.count_parameters(config), memory.adapter_parameters(config, 64)
    assert adapters["weights"] == 2 * (base + 3 * adapter) and full["weights"] == 2 * 3 * base
    assert adapters["master_weights"] == 4 * adapter and adapters["reference"] == 2 * adapter
    assert adapters["trust_region_copies"] == 2 * 2 * adapter
    assert adapters["activations"] == full["activations"] and adapters["kv_cache"] == full["kv_cache"]
    assert adapters["peak_training"] < full["peak_training"] / 2


def test_the_planner_prints_the_lora_table_and_refuses_what_lora_cannot_run(capsys):
    from scale import memory

    memory.main(["--model", "qwen3-4b", "--rows", "2", "--max-seq-len", "33792", "--lora", "64"])
    out = capsys.readouterr().out
    assert "--lora 64: one base shared by the 3 agents, each a LoRA adapter of 132.1 M parameters" in out
    memory.main(["--model", "qwen3-4b", "--rows", "2", "--max-seq-len", "33792", "--lora", "64", "--gpus", "1,2,8"])
    rows = capsys.readouterr().out.splitlines()  # one process a run: every row is the one-GPU plan
    assert "sat.py refuses torchrun with --lora" in rows[0] and len(rows) == 5
    assert [r.split()[:5] for r in rows[2:]] == [[n, "41.0", "34.5", "1.5", n] for n in ("1", "2", "8")]
    with pytest.raises(SystemExit):
        memory.main(["--lora", "64", "--stage0", "qwen3-8b"])
    assert "--lora with --stage0: the planner has no Stage-0 plan of adapters" in capsys.readouterr().err


def check_exported_adapter(run, out):
    """tools/export_adapter.py: agent 2 of ``run`` as a folder PEFT loads unchanged, on the base its config names."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from export_adapter import main

    assert main([str(run), "--agent", "2", "--out", str(out)]) == 0
    base = AutoModelForCausalLM.from_pretrained(json.loads((out / "adapter_config.json").read_text())
                                                ["base_model_name_or_path"])
    exported = PeftModel.from_pretrained(base, str(out))
    team = load_saved_team(latest_checkpoint(run) / "team")
    assert torch.allclose(logits(exported, inputs(4)), logits(team.agents[1].model, inputs(4)), atol=1e-6)
    assert main([str(run), "--agent", "3", "--out", str(out)]) == 2  # a two-agent team


def random_states(rows: int, seed: int):
    """Stage-0 states of random token rows (4 context, 6 response tokens) over the tiny vocabulary's letters."""
    import stage0_states

    g = torch.Generator().manual_seed(seed)
    ctx, resp = torch.randint(5, 90, (rows, 4), generator=g), torch.randint(5, 90, (rows, 6), generator=g)
    return stage0_states.Stage0States(ctx, torch.ones_like(ctx), ctx, torch.ones_like(ctx), resp, torch.ones_like(resp))


def test_stage0_fits_the_fresh_adapter_alone_and_leaves_the_shared_base_and_other_agents_bit_exact():
    import plug_and_play

    incumbent, new, other = tiny_adapters(3)
    perturb(incumbent.model, 0.05, seed=1)  # a trained incumbent, away from the base
    perturb(other.model, 0.05, seed=2)
    ids = inputs(5)
    base_before = {n: t.clone() for n, t in new.model.state_dict().items() if ".lora_" not in n}
    kept = [logits(m, ids) for m in (incumbent.model, other.model)]
    # delta_0 beyond reach in 5 passes: Stage-0 pulls the adapter toward pi_cur all the way (t(s) -> 0), then says so
    settings = plug_and_play.Stage0Settings(1e-3, 0.99, 3e-3, 5, 0.5, temperature=1.0, rows_per_step=8,
                                            token_budget=4096)
    with pytest.raises(plug_and_play.Stage0Unreachable) as err:
        plug_and_play.fit_stage0(new.model, incumbent.model, random_states(4, 3), random_states(2, 4), settings)
    record = err.value.fit.record
    assert record["kl_quantile"] < 0.6 * record["kl_quantile_before"]  # the adapter did the work (0.062 -> ~0.02)
    after = new.model.state_dict()
    assert all(torch.equal(after[n], t) for n, t in base_before.items())  # the base, bit for bit
    assert any(p.abs().sum() > 0 for n, p in new.model.named_parameters() if "lora_B" in n)  # B left 0
    assert all(torch.equal(logits(m, ids), k) for m, k in zip((incumbent.model, other.model), kept))
    assert not any(p.requires_grad for p in new.model.parameters())


def test_an_upgrade_with_lora_shares_a_base_the_team_holds_and_loads_its_own_otherwise():
    team_agents = tiny_adapters(3)
    team = harness.run.Team(team_agents, math_team_config())
    loaded = []

    def load_base(spec, seed):
        loaded.append(spec.name)
        return load_agents([spec], "cpu", torch.float32, [seed])[0]

    same = lora.replacement_agent(team, parse_agents("tiny-2L")[0], SETTINGS, 51, load_base)
    assert loaded == [] and base_tensors(same.model) == base_tensors(team_agents[0].model)
    assert torch.equal(logits(same.model, inputs(6)), logits(team_agents[0].model, inputs(6)))  # B = 0: the base
    warmed = []
    own = lora.replacement_agent(team, parse_agents("tiny-2L")[0], SETTINGS, 51, load_base, warm_base=warmed.append)
    assert loaded == ["tiny-2L"] and warmed == [own.base] and own.adapter.base_trained
    assert set(base_tensors(own.model).values()).isdisjoint(base_tensors(team_agents[0].model).values())
    other = lora.replacement_agent(team, parse_agents("tiny-3L")[0], SETTINGS, 52, load_base)
    assert loaded == ["tiny-2L", "tiny-3L"] and other.model.config.num_hidden_layers == 3


@pytest.mark.slow  # a run, an upgrade with Stage-0 and a resumed stage: minutes on two busy cores
def test_an_upgrade_of_an_adapter_team_leaves_the_others_bit_exact_and_resumes(tmp_path):
    """Slot 2 gets a fresh adapter on the team's own (warm-started) base: Stage-0 trains that adapter while agent 1,
    which sits on the same base tensors, stays bit for bit what it was."""
    harness.run.run(small_config(tmp_path, stages=1, lora=4, warmup_steps=20), log=lambda *_: None)
    run_dir = tmp_path / "run"
    before = load_saved_team(latest_checkpoint(run_dir) / "team")
    harness.run.run(harness.cli.parse_args(["--resume", str(run_dir), "--upgrade", "2=tiny", "--stages", "1",
                                            "--stage0-delta", "0.005", "--upgrade-warmup-steps", "0"]),
                    log=lambda *_: None)
    team_dir = latest_checkpoint(run_dir) / "team"
    assert latest_checkpoint(run_dir).name == "stage_0001_upgraded"
    assert sorted(p.name for p in team_dir.iterdir()) == ["agent_0", "agent_1", "base_0", "team.json"]
    upgraded = load_saved_team(team_dir)
    assert base_tensors(upgraded.agents[0].model) == base_tensors(upgraded.agents[1].model)  # one base still
    ids = inputs(7)
    assert torch.equal(logits(upgraded.agents[0].model, ids), logits(before.agents[0].model, ids))
    saved = upgraded.agents[0].model.state_dict()
    assert all(torch.equal(saved[n], t) for n, t in before.agents[0].model.state_dict().items())
    event = json.loads((run_dir / "upgrades.json").read_text())[0]
    # delta_0 below where the fresh adapter starts (0.0127 here): Stage-0 fits it in (0.0044 after 46 passes)
    assert event["to"] == "tiny" and event["stage0"]["kl_quantile_before"] > 0.005 >= event["stage0"]["kl_quantile"]
    more = harness.run.run(harness.cli.parse_args(["--resume", str(run_dir), "--stages", "2"]), log=lambda *_: None)
    assert [r["stage"] for r in more] == [0, 1, 2] and more[-1]["upgrades"][0]["to"] == "tiny"
