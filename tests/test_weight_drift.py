"""tools/weight_drift.py: the share of weights an update changed, in fp32 and after rounding to bf16."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from weight_drift import agent_weights, drift, main  # noqa: E402

from harness import training_state  # noqa: E402
from harness.loading import load_agent  # noqa: E402


def test_an_update_below_half_a_bf16_step_changes_no_bf16_weight():
    before = {"w": torch.tensor([1.0, 0.5, 0.25, 2.0]), "step": torch.tensor(3)}  # bf16-representable
    d = drift(before, {"w": before["w"] + 1e-5, "step": torch.tensor(4)})  # half a bf16 step at 0.25 is 2^-10
    assert (d["weights"], d["changed"], d["changed_bf16"]) == (4, 1.0, 0.0)
    assert d["mean_abs_change"] == pytest.approx(1e-5, rel=1e-2) and d["length_ratio_bf16_fp32"] == 0.0


def test_an_update_past_half_a_bf16_step_rounds_to_the_next_bf16_value():
    before = {"w": torch.tensor([1.0, 0.5, 0.25, 2.0])}
    after = {"w": torch.tensor([1.01, 0.5, 0.25, 2.0])}  # 1.01 rounds to 1 + 2^-7
    d = drift(before, after)
    assert (d["changed"], d["changed_bf16"]) == (0.25, 0.25)
    assert d["cosine_bf16_fp32"] == pytest.approx(1.0)
    assert d["length_ratio_bf16_fp32"] == pytest.approx(2 ** -7 / float(after["w"][0] - 1.0), rel=1e-6)


def test_no_shared_tensor_is_an_error():
    with pytest.raises(ValueError, match="share no weight tensor"):
        drift({"a": torch.zeros(2)}, {"b": torch.zeros(2)})


def test_reads_a_saved_agent_and_measures_its_change(tmp_path, capsys):
    agent = load_agent("tiny", device="cpu", dtype=torch.float32, seed=0)
    team = SimpleNamespace(agents=[agent])
    training_state.save(tmp_path / "a" / "sharded", team)
    with torch.no_grad():
        first = next(agent.model.parameters())
        first[0] += 0.5  # one row of one tensor
    training_state.save(tmp_path / "b" / "sharded", team)
    a, b = agent_weights(tmp_path / "a", 0), agent_weights(tmp_path / "b", 0)
    n = sum(p.numel() for p in agent.model.parameters())
    d = drift(a, b)
    assert d["weights"] == n and d["changed"] == pytest.approx(first[0].numel() / n)
    assert d["max_abs_change"] == pytest.approx(0.5, abs=1e-6)
    main([str(tmp_path / "a"), str(tmp_path / "b")])
    assert f"agent 0, {n} weights: changed" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="does not exist"):
        agent_weights(tmp_path / "a", 1)
