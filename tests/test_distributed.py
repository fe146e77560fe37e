"""Several processes (torchrun, gloo on CPU): the same run for any number of processes.

What must not depend on N (Algorithm 1 run data-parallel): the rollouts and
rewards (seeded blocks), every decision (accept/reject, backtracks, in-loop
stop), and, up to float summation order, the KL quantiles and the losses; a
run checkpointed under one N resumes under another; an FSDP2-sharded update
equals the unsharded one. The torchrun tests start real process groups.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import harness.cli
from harness.loading import load_agent
from harness.math_grading import math_team_config
from harness.processes import ONE_PROCESS
from harness.tasks import arithmetic_problems
from rollout import SamplingConfig, rollout
from scale.rollout_hf import HF
from scale.torchrun import Torchrun, check_config, concat_batches, rollout_in_blocks
from team import Team

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}
# Float tolerance between N = 1 and N = 2: a different micro-batch split and the
# reduce-scatter change the summation order (~1e-7 relative per step); AdamW's
# normalised steps and 2 stages of 4 epochs amplify that to ~1e-2 on the KL
# quantile (measured 1.6e-2 at most), so 5e-2 relative (+ 1e-4 absolute).
RTOL, ATOL = 5e-2, 1e-4
EXACT_STAGE = ("team_reward", "agent_reward", "mean_response_tokens", "truncated_fraction", "eval_accuracy",
               "eval_agent_reward", "order")
EXACT_AGENT = ("accepted", "backtracks", "step_fraction", "early_stopped", "N")
CLOSE_AGENT = ("kl_quantile", "kl_mean", "loss", "surrogate_estimate", "ess")
HANG = 1500  # s: a torchrun run this long is hung (the gloo group's own timeout is 1800 s); runs beside four
# CPU-bound processes took up to ~300 s


# -- without torchrun -------------------------------------------------------------------------
def test_rows_are_shared_evenly_and_uneven_shares_are_refused():
    assert ONE_PROCESS.rows(10) == (0, 10) and Torchrun().rows(10) == (0, 10)
    assert [Torchrun(rank=r, world=2).rows(8) for r in (0, 1)] == [(0, 4), (4, 8)]
    with pytest.raises(ValueError, match="multiples of the number of processes"):
        Torchrun(rank=1, world=2).rows(7)
    assert [Torchrun(rank=r, world=3).share(7) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]


def test_torchrun_refusals_match_docs_errors():
    """docs/errors.md "Under torchrun": each row's flags, resolved as with 2 processes (``Torchrun.join`` applies
    ``check_config`` with the rank count), give its line; the options those refusals once covered pass."""
    import re

    section = (ROOT / "docs" / "errors.md").read_text().split("## Under torchrun", 1)[1]
    rows = re.findall(r"^\| [^|]+ \| `(.*?)` \| `sat.py: error: (.*)` \|$", section, re.M)
    assert len(rows) == 2
    for flags, line in rows:
        cfg = harness.cli.parse_args(flags.split()).apply_preset()
        with pytest.raises(ValueError) as err:
            check_config(cfg, world=2)
        assert str(err.value) == line
    for lifted in (["--keep-optimizer-state"], ["--upgrade", "2=tiny-6L"],  # sharded moments; sharded Stage-0;
                   ["--shard-frozen", "--backend", "vllm"]):  # vLLM engines fed from the shards
        assert check_config(harness.cli.parse_args(lifted).apply_preset(), world=2).shard_rollouts


def test_rollout_blocks_are_seeded_blocks_concatenated():
    """The block rollout equals rolling out each block under its own seed and
    padding the blocks together: rows unchanged, groups distinct and whole."""
    team = Team([load_agent("tiny", seed=k) for k in range(2)], math_team_config(protocol="chain"))
    problems, sampling = arithmetic_problems(5, seed=1), SamplingConfig(temperature=1.0, max_new_tokens=5)
    batch = rollout_in_blocks(team, problems, 3, sampling, seed=7, n_blocks=3, backend=HF)  # blocks of 2, 2, 1 problems
    parts = []
    for b, start in enumerate(range(0, 5, 2)):
        torch.manual_seed(7 + b)
        parts.append(rollout(team, problems[start : start + 2], 3, sampling, HF))
    assert torch.equal(batch.group_ids, torch.arange(5).repeat_interleave(3))
    assert torch.equal(batch.rewards, torch.cat([p.rewards for p in parts]))
    rows = [(p, i) for p in parts for i in range(len(p))]
    for k in range(2):
        turn = batch.turns[k]
        for r, (part, i) in enumerate(rows):
            t = part.turns[k]
            c, c_i, m, m_i = turn.context_mask[r].bool(), t.context_mask[i].bool(), turn.response_mask[r].bool(), \
                t.response_mask[i].bool()
            assert turn.context_ids[r][c].tolist() == t.context_ids[i][c_i].tolist()
            assert turn.response_ids[r][m].tolist() == t.response_ids[i][m_i].tolist()
            assert torch.equal(turn.behaviour_logprobs[r][m], t.behaviour_logprobs[i][m_i])
            assert turn.texts[r] == t.texts[i]
    again = concat_batches(parts, [a.tokenizer.pad_token_id for a in team.agents])
    assert torch.equal(again.turns[1].response_ids, batch.turns[1].response_ids)


# -- torchrun ----------------------------------------------------------------------------------
def run_sat(nproc: int, *args: str) -> None:
    """sat.py with ``args``: under ``torchrun --nproc-per-node nproc``, or (1) in this process, as the command line
    (``harness.cli.main``), which spares a process start (its torch and transformers imports) per run."""
    if nproc == 1:
        assert harness.cli.main(list(args)) == 0, f"sat.py {' '.join(args)} failed"
        return
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd = ["nice", "-n", "10", *launcher, str(ROOT / "sat.py"), *args]
    done = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=HANG)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}"


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def run_worker(worker: str, *paths, timeout: int = 900) -> None:
    """tests/dist/<worker> under ``torchrun --nproc-per-node 2`` (gloo), its outputs to ``paths``."""
    cmd = ["nice", "-n", "10", sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "tests" / "dist" / worker), *map(str, paths)]
    done = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]


WORKERS = {"frozen": ("frozen_worker.py", "frozen.json"), "load": ("load_worker.py", "load.json"),
           "update": ("update_worker.py", "update.json"), "masters": ("master_worker.py", "masters.json", "masters.pt"),
           "stage0": ("stage0_worker.py", "stage0.json")}


@pytest.fixture(scope="module")
def worker_outputs(tmp_path_factory) -> dict[str, list[Path]]:
    """Every tests/dist worker of this file, each under its own ``torchrun --nproc-per-node 2`` (a fresh pair of
    processes: its one-process reference first, then its process group), once for the module; each worker its
    own folder; {name: [its output paths]}."""
    root = tmp_path_factory.mktemp("workers")
    outputs = {}
    for name, (script, *files) in WORKERS.items():
        (root / name).mkdir()
        outputs[name] = [root / name / f for f in files]
        run_worker(script, *outputs[name], timeout=HANG)
    return outputs


def rewind(run: Path, stage: int) -> None:
    """As if the run had been killed after the checkpoint of ``stage``."""
    (run / "latest.json").write_text(json.dumps({"stage": stage, "path": f"stage_{stage:04d}"}))


def assert_same_run(a: dict, b: dict) -> None:
    """Two metrics rows of one stage: rollouts, rewards and decisions identical; floats close."""
    for key in EXACT_STAGE:
        assert a[key] == b[key], (a["stage"], key, a[key], b[key])
    for x, y in zip(a["agents"], b["agents"], strict=True):
        for key in EXACT_AGENT:
            assert x[key] == y[key], (a["stage"], x["agent"], key, x[key], y[key])
        for key in CLOSE_AGENT:
            assert abs(x[key] - y[key]) <= ATOL + RTOL * abs(y[key]), (a["stage"], x["agent"], key, x[key], y[key])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A warm-started base (stage 0, written by 1 process), then 2 stages with 1
    process (--shard-rollouts) and with 2 processes (so "two" is a 1-process
    checkpoint resumed under 2 processes), and the 2-process run rewound to
    stage 1 and resumed under 1 process."""
    root = tmp_path_factory.mktemp("dist")
    run_sat(1, "--agents", "tiny x2", "--stages", "0", "--batch-size", "64", "--group-size", "8",
            "--minibatch-size", "32",
            "--warmup-steps", "100", "--eval-size", "32", "--rollout-blocks", "4", "--device", "cpu", "--seed", "3",
            "--out", str(root / "base"))
    for name in ("one", "two"):
        shutil.copytree(root / "base", root / name)
    run_sat(1, "--resume", str(root / "one"), "--stages", "2", "--shard-rollouts")
    run_sat(2, "--resume", str(root / "two"), "--stages", "2")
    shutil.copytree(root / "two", root / "two_then_one")
    rewind(root / "two_then_one", 1)
    run_sat(1, "--resume", str(root / "two_then_one"), "--stages", "2")
    # one small stage of the options that needed their own handling under torchrun, both at once
    small = ("--stages", "1", "--reuse", "regenerate", "--adv", "gae", "--batch-size", "16", "--minibatch-size", "16")
    for name, nproc, extra in (("small_one", 1, ("--shard-rollouts",)), ("small_two", 2, ())):
        shutil.copytree(root / "base", root / name)
        run_sat(nproc, "--resume", str(root / name), *small, *extra)
    # the same stage with every agent and the reference held as FSDP2 shards (--shard-frozen)
    shutil.copytree(root / "base", root / "small_sharded")
    run_sat(2, "--resume", str(root / "small_sharded"), *small, "--shard-frozen")
    # 32 trajectories, so the stage has a reward signal (with none, AdamW turns float-order noise into steps)
    joint = ("--stages", "1", "--update", "joint", "--batch-size", "32", "--minibatch-size", "16")
    for name, nproc, extra in (("joint_one", 1, ("--shard-rollouts",)), ("joint_two", 2, ())):
        shutil.copytree(root / "base", root / name)
        run_sat(nproc, "--resume", str(root / name), *joint, *extra)
    return root


@pytest.mark.slow  # torchrun
def test_two_processes_match_one(runs):
    one, two = metrics(runs / "one"), metrics(runs / "two")
    assert [r["stage"] for r in two] == [0, 1, 2]
    assert [r["world_size"] for r in one] == [1, 1, 1] and [r["world_size"] for r in two] == [1, 2, 2]
    assert json.loads((runs / "two" / "config.json").read_text())["world_size"] == 2
    for a, b in zip(one[1:], two[1:], strict=True):
        assert_same_run(a, b)
    assert any(r["team_reward"] > 0 for r in two[1:]), "no reward signal: the comparison would be vacuous"


@pytest.mark.slow  # torchrun
def test_regenerate_and_gae_under_two_processes_match_one(runs):
    """One stage with --reuse regenerate and --adv gae. regenerate: rank 0
    redraws the promoted agent's turns and every rank continues from its batch
    and RNG state (``distributed.on_main``), so the later agent trains on the
    same rows in the same order as with one process. gae: the value head is
    whole on every rank and its gradient is averaged over the ranks as FSDP2
    averages the agent's, so the trained value heads agree."""
    one, two = metrics(runs / "small_one"), metrics(runs / "small_two")
    assert [r["world_size"] for r in two] == [1, 2]
    # the batch, then each agent's turn drawn before its step (the step bound's "before") and after it
    assert one[1]["generations"] == two[1]["generations"] == 16 * 2 + 16 * 2 * 2
    assert_same_run(one[1], two[1])
    heads = [torch.load(runs / name / "checkpoints" / "stage_0001" / "state.pt", weights_only=True)["value_heads"]
             for name in ("small_one", "small_two")]
    for k in heads[0]:
        one_w, two_w = heads[0][k]["weight"], heads[1][k]["weight"]
        assert one_w.abs().max() > 1e-3  # trained, from a zero start
        # mean, not max: AdamW turns float-order noise in near-zero gradients into whole steps (max 5% of the
        # largest weight); a head trained on half the rows, or without the average, is far off
        assert (one_w - two_w).abs().mean() <= 1e-2 * one_w.abs().mean()  # measured 8.4e-4
        assert (heads[0][k]["bias"] - heads[1][k]["bias"]).abs().max() <= 1e-2 * (heads[0][k]["bias"] - 0.5).abs().max()


@pytest.mark.slow  # torchrun
def test_frozen_agents_sharded_match_one_process(runs):
    """--shard-frozen: every agent held as FSDP2 shards (generation through
    them, the trained agent written back into its shards, the reference a
    sharded copy, the line search on each rank's shards, regenerate on every
    rank), the same stage as one process with whole agents; its checkpoint
    (HF folders gathered layer by layer) resumes under one process. The run
    resumes from a checkpoint, so its agents are read straight into shards
    (``shard_load``, the path of every non-tiny agent under --shard-frozen)."""
    one, two = metrics(runs / "small_one"), metrics(runs / "small_sharded")
    assert json.loads((runs / "small_sharded" / "config.json").read_text())["shard_frozen"] is True
    assert one[1]["generations"] == two[1]["generations"] == 16 * 2 + 16 * 2 * 2  # as in the test above
    assert_same_run(one[1], two[1])
    assert any(a["backtracks"] for a in two[1]["agents"])  # the line search ran on the shards
    resumed = runs / "sharded_then_one"
    shutil.copytree(runs / "small_sharded", resumed)
    run_sat(1, "--resume", str(resumed), "--stages", "2")
    rows = metrics(resumed)
    assert [r["stage"] for r in rows] == [0, 1, 2] and rows[2]["world_size"] == 1


@pytest.mark.slow  # torchrun
def test_sharded_team_rolls_out_the_one_process_tokens(worker_outputs):
    """Rollouts, regenerate and the exact KL through sharded agents equal one
    process with whole agents, bit for bit, with blocks and calls that do not
    divide evenly over the ranks (dummy blocks and calls keep the collectives
    matched); the HF export gathered layer by layer equals the whole weights."""
    r = json.loads(worker_outputs["frozen"][0].read_text())
    assert r["world"] == 2 and r["rows"] == 10 and r["dummy_calls"] > 0  # uneven: some rank had to pad
    assert r["rollout_same_ids"] and r["rollout_same_rewards"] and r["rollout_logprob_diff"] == 0.0
    assert r["regenerate_same_ids"] and r["regenerate_changed"] and r["regenerate_logprob_diff"] == 0.0
    assert r["eval_same_ids"]
    assert r["kl_n"][0] == r["kl_n"][1] > 0 and r["kl_max"] > 1e-4  # the step moved the agent
    assert r["kl_diff"] <= 1e-6 * r["kl_max"] and r["logp_diff"] <= 1e-6  # measured 0.0 and 0.0
    assert r["export_equal"] and r["export_tied"]


@pytest.mark.slow  # torchrun
def test_agent_loaded_into_shards_equals_whole_then_sharded(worker_outputs):
    """shard_load.load_into_shards (meta model, fully_shard, each rank reads
    its own rows from the safetensors files): the local shards equal
    shard_in_place of the whole-loaded model bit for bit, with Shard(0)
    padding (vocabulary 101, MLP width 37 over 2 ranks), tied and untied
    heads, a bf16 file loaded in fp32, the rotary buffers as from_pretrained
    sets them; no rank reads more than its rows of any tensor, and the logits
    through the shards and of the gathered model equal the whole model's."""
    r = json.loads(worker_outputs["load"][0].read_text())
    assert r["world"] == 2
    for name in ("tied", "untied"):
        m = r[name]
        assert m["local_equal"] and m["buffers_equal"], name
        assert m["read_is_local"] and m["n_reads"] == m["n_params"], name  # one read per parameter, its local rows
        assert m["largest_read_rows_vs_full"] <= 0.52 and m["vocab_rows_of_rank0"] == 51  # ceil(101 / 2), never all
        assert m["numel_read"] == m["numel_whole"], name  # the ranks' reads cover the model exactly once
        assert m["shard_logits_diff"] == 0.0 and m["gathered_logits_diff"] == 0.0, name
    assert r["tied"]["shards_tied"] and r["tied"]["gathered_tied"] and not r["tied"]["has_lm_head_read"]
    assert not r["untied"]["shards_tied"] and r["untied"]["has_lm_head_read"]


def test_shard_load_resolves_folders_and_names_a_missing_hub_model(tmp_path, monkeypatch):
    """A folder is used as it is; a hub name not in the cache, offline, is one line (before any model is built)."""
    from scale import shard_load

    assert shard_load.snapshot_folder(str(tmp_path)) == tmp_path
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(RuntimeError, match=r"could not load model 'nobody/no-such-model' .*huggingface-cli download"):
        shard_load.snapshot_folder("nobody/no-such-model")
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        shard_load.tensor_files(tmp_path)


@pytest.mark.slow  # torchrun
def test_joint_update_under_two_processes_matches_one(runs):
    """--update joint (the baseline): every agent sharded at once, the same
    decisions as with one process."""
    one, two = metrics(runs / "joint_one"), metrics(runs / "joint_two")
    assert [r["world_size"] for r in two] == [1, 2]
    assert one[1]["team_reward"] > 0, "no reward signal: the comparison would be vacuous"
    assert_same_run(one[1], two[1])
    assert two[1]["step_bounds"].startswith("none:")  # no per-step bound for a joint update, as with one process


@pytest.mark.slow  # torchrun
def test_resume_across_process_counts(runs):
    """Checkpointed under N = 2 at stage 1, resumed under N = 1: the run
    continues from stage 1 and its stage 2 is the straight run's. The other
    way round is the "two" run itself: the base's stage-0 checkpoint, written
    by 1 process, resumed under 2, matches the 1-process continuation
    (``test_two_processes_match_one``)."""
    rows, straight = metrics(runs / "two_then_one"), metrics(runs / "two")
    assert [r["stage"] for r in rows] == [0, 1, 2]
    assert rows[1] == straight[1]  # stage 1 kept from the checkpointed run
    assert rows[0]["world_size"] == 1 and rows[1]["world_size"] == 2 and rows[2]["world_size"] == 1
    assert_same_run(rows[2], straight[2])


@pytest.mark.slow  # torchrun
def test_sharded_update_equals_unsharded(worker_outputs):
    """One AdamW step of agent j's objective (Eq. (5)) on the same minibatch:
    FSDP2 over 2 ranks (each computing half the rows) against one process."""
    result = json.loads(worker_outputs["update"][0].read_text())
    assert result["world"] == 2 and result["steps"] == [1, 1]
    assert result["max_step"] > 1e-4  # the update moved the weights
    assert result["max_param_diff"] <= 1e-2 * result["max_step"]  # measured 1.2e-6 against a 3e-4 step
    assert result["grad_norm"][1] == pytest.approx(result["grad_norm"][0], rel=1e-5)
    assert result["loss"][1] == pytest.approx(result["loss"][0], abs=1e-6)
    # full_weights_by_layer: the union is the whole model, exactly; one decoder layer per group; nothing kept
    assert result["layers_union_names"] and result["layers_union_equal"]
    assert result["layers_groups"] == 1 + result["n_layers"]  # the root, then each layer
    assert result["layers_leaked"] == 0
    assert result["layers_max_group_bytes"] == result["layer_bytes"]


@pytest.mark.slow  # torchrun
def test_bf16_masters_kept_across_turns_and_sharded_checkpoint_loads_under_any_n(worker_outputs):
    """A bf16 agent, two turns of one AdamW step at lr 1e-5 (below a bf16
    rounding step for most weights), --keep-optimizer-state: under FSDP2 over
    2 ranks its fp32 master shards and AdamW moments survive the turn as with
    one process (dropping the master loses the sub-rounding progress:
    ``restart``). The sharded checkpoint (torch.distributed.checkpoint, written
    by both ranks) loads back exactly under 2 processes (in the worker) and
    under 1 (here)."""
    result_path, masters_path = worker_outputs["masters"]
    r = json.loads(result_path.read_text())
    assert r["world"] == 2
    assert r["bf16_moved_fraction"] < 0.5  # most steps are below bf16 resolution: only the master holds them
    assert r["restart_mean_diff"] > 0.5 * r["lr"]  # dropping the master would be visible (measured 9.0e-6)
    assert r["turn2_mean_diff"] <= 0.05 * r["restart_mean_diff"]  # kept: measured 7.0e-8
    assert r["turn1_mean_diff"] <= 0.05 * r["restart_mean_diff"]
    assert r["steps"] == [[2.0], [2.0]]  # the moments were kept: the second turn is AdamW's step 2
    assert r["moments_mean_diff"] <= 0.05 * r["moments_mean"]  # bf16 gradients: measured 0.5%
    assert r["loaded_masters_equal"] and r["loaded_weights_equal"] and r["loaded_moments_equal"]  # saved, loaded by 2
    from harness.run_folder import load_checkpoint

    with torch.random.fork_rng():
        team, _, _, _ = load_checkpoint(result_path.parent / "run" / "checkpoints" / "stage_0001", "cpu",
                                        torch.bfloat16)
    saved = torch.load(masters_path)
    assert len(team.agents[0].master_weights) == len(saved["masters"])
    # loaded by 1 process: exact
    assert all(torch.equal(a, b) for a, b in zip(team.agents[0].master_weights, saved["masters"]))
    state = team.agents[0].saved_optimizer_state["state"]
    loaded = [state[i][k] for i in range(len(state)) for k in ("exp_avg", "exp_avg_sq")]
    assert len(loaded) == len(saved["moments"]) and all(torch.equal(a, b) for a, b in zip(loaded, saved["moments"]))


STAGE0_KEYS = ("kl_quantile_before", "heldout_kl_quantile_before", "kl_quantile", "heldout_kl_quantile", "kl_mean",
               "fit_mean")


@pytest.mark.slow  # torchrun
def test_stage0_under_two_processes_matches_one(worker_outputs):
    """Plug-and-play Stage-0 (Eqs. (6)-(7)) with the replacement FSDP2-sharded
    over 2 ranks against one process, same seed (tests/dist/stage0_worker.py):
    the same fit states (seeded rollout blocks), the same pass count and the
    same states retargeted (every decision is taken on gathered per-state
    values), quantiles and weights within float summation order, and every
    rank left holding the same replacement; and the same with the team, the
    replacement and pi_pre held as FSDP2 shards (--shard-frozen)."""
    r = json.loads(worker_outputs["stage0"][0].read_text())
    assert r["world"] == 2 and r["same_states"] and r["rows"] == 24 and r["states"][0] == r["states"][1] > 0
    assert r["kl_quantile_before"][0] > 0.05  # it really had to move (measured 0.068)
    assert r["passes"][0] == r["passes"][1] >= 5  # measured 7, with one retargeting at pass 5
    assert r["same_retargeted_states"] and r["retargeted"][0] == r["retargeted"][1] > 0  # measured 91% of the states
    assert r["t_exact_max_diff"] <= 1e-4 and r["t_max_diff"] <= 1e-4  # bisection on logits equal to ~1e-7
    for key in STAGE0_KEYS:
        one, two = r[key]
        assert abs(one - two) <= 1e-3 * abs(one) + 1e-7, (key, one, two)  # measured 1.2e-5 relative at most (fit mean)
    assert r["kl_quantile"][1] <= 0.05
    assert r["ranks_equal"]  # every rank holds the same replacement after Stage-0, bit for bit
    assert r["max_step"] > 1e-3  # Stage-0 moved the weights
    assert r["max_param_diff"] <= 1e-2 * r["max_step"]  # measured 3.5e-5 against a 1.3e-2 step
    assert r["mean_param_diff"] <= 1e-3 * r["mean_step"]  # measured 1.4e-7 against 3.3e-3
    # --shard-frozen: the team, the replacement and pi_pre as FSDP2 shards, the same Stage-0 as one process
    s = r["sharded"]
    assert s["held_as_shards"] and s["same_states"] and s["passes"] == r["passes"][0] and s["same_retargeted_states"]
    for key in STAGE0_KEYS:
        assert abs(s[key] - r[key][0]) <= 1e-3 * abs(r[key][0]) + 1e-7, (key, s[key], r[key][0])
    assert s["max_param_diff"] <= 1e-2 * r["max_step"] and s["mean_param_diff"] <= 1e-3 * r["mean_step"]


def torchrun_worker(worker: str, *args: str) -> subprocess.CompletedProcess:
    """tests/dist/<worker> under ``torchrun --nproc-per-node 2``, whatever its exit code (a hang: TimeoutExpired)."""
    cmd = ["nice", "-n", "10", sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "tests" / "dist" / worker), *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=HANG)


@pytest.mark.slow  # torchrun
def test_ranks_end_cleanly_and_a_failed_rank_reports_one_line_without_a_hang(tmp_path):
    """``distributed.rank_main``. With the group held by FSDP2 shards and a collective just before the end, both
    ranks exit 0, and neither finalizes its interpreter while gloo's threads live (the state in which a rank
    aborted at exit, at random: tests/dist/exit_worker.py), which a rank whose script simply ended did every time.
    When rank 1 raises while rank 0 waits in a collective, rank 1 prints its error in one line (which rank, where)
    and aborts the group instead of waiting at the last barrier, and the run ends well inside the group's
    30-minute timeout (``HANG``; torchrun may stop rank 0 before it reports); no rank prints a traceback."""
    ok = torchrun_worker("exit_worker.py", "ok", str(tmp_path / "finalized"))
    assert ok.returncode == 0 and "terminate called" not in ok.stderr, ok.stderr[-3000:]
    finalized_with = {p.name: p.read_text() for p in tmp_path.glob("finalized.rank*")}
    assert not any(finalized_with.values()), finalized_with
    done = torchrun_worker("exit_worker.py", "fail")
    assert done.returncode != 0
    lines = done.stderr.splitlines()
    assert "exit_worker.py: error: rank 1 of 2: ValueError: a failure on rank 1 only (exit_worker.py:39)" in lines
    assert 'exit_worker.py", line' not in done.stderr  # no rank's traceback (torchrun's own summary may follow)
