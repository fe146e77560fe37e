"""Run records: atomic checkpoints, resume, metrics.jsonl, the progress plot.

Paper, Section 4 (the stage certificate) and Section 5 (the violation rate:
the fraction of stages whose measured team reward fell beyond noise). A run
folder holds

    config.json            the run's configuration
    metrics.jsonl          one object per stage (stage 0 = before training)
    progress.png           held-out accuracy per stage, and the certificate terms
    upgrades.json          plug-and-play events, if any
    latest.json            points at the newest complete checkpoint
    checkpoints/stage_XXXX team weights + state.pt (controllers, value heads, RNGs)

Every write goes through a temporary file or folder and a rename, so a crash
leaves the previous checkpoint intact and resumable.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

import distributed
from team import Team
from trust_region import QuantileController


# ---------------------------------------------------------------------------
# Checkpoints (atomic) and resume
# ---------------------------------------------------------------------------
def save_checkpoint(out: Path, stage: int, team: Team, controllers, value_heads, rng: random.Random, extra: dict,
                    suffix: str = "") -> Path:
    """Write checkpoints/stage_XXXX via a temporary folder and a rename, then
    point latest.json at it (also via rename): a crash leaves the previous
    checkpoint intact. Under torchrun rank 0 writes (every rank holds the same
    whole agents between turns) and the others wait for it."""
    root = out / "checkpoints"
    final = root / f"stage_{stage:04d}{suffix}"
    if not distributed.is_main():
        distributed.barrier()
        return final
    tmp = root / f".stage_{stage:04d}{suffix}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    team.save(tmp / "team")
    state = {"stage": stage, "controllers": {k: c.state_dict() for k, c in controllers.items()},
             "value_heads": {k: v.state_dict() for k, v in value_heads.items()},
             "python_rng": rng.getstate(), "torch_rng": torch.get_rng_state(),
             "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
             "numpy_rng": np.random.get_state(),
             "optimizers": {k: a.saved_optimizer_state for k, a in enumerate(team.agents) if a.saved_optimizer_state is not None},
             **extra}
    torch.save(state, tmp / "state.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    atomic_write(out / "latest.json", json.dumps({"stage": stage, "path": final.name}))
    for old in sorted(root.glob("stage_*"))[:-2]:  # keep the last two
        shutil.rmtree(old, ignore_errors=True)
    distributed.barrier()
    return final


def atomic_write(path: Path, text: str) -> None:
    if not distributed.is_main():  # under torchrun rank 0 writes
        return
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def latest_checkpoint(run_dir: str | Path) -> Path:
    """A run folder (uses latest.json) or a stage folder itself."""
    run_dir = Path(run_dir)
    if (run_dir / "state.pt").exists():
        return run_dir
    pointer = run_dir / "latest.json"
    if not pointer.exists():
        raise FileNotFoundError(f"no checkpoint in '{run_dir}': expected latest.json written by sat.py (or a checkpoints/stage_XXXX folder)")
    return run_dir / "checkpoints" / json.loads(pointer.read_text())["path"]


def load_checkpoint(folder: Path, device: str, dtype: torch.dtype) -> tuple[Team, dict, random.Random, dict]:
    """Team, saved state, the Python RNG and the controllers of a stage folder;
    restores the torch / numpy / CUDA RNGs so a resumed run continues the
    same random stream as a straight one."""
    team = Team.load(folder / "team", device=device, dtype=dtype)
    state = torch.load(folder / "state.pt", weights_only=False)
    rng = random.Random()
    rng.setstate(state["python_rng"])
    torch.set_rng_state(state["torch_rng"])
    np.random.set_state(state["numpy_rng"])
    if state.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    controllers = {int(k): QuantileController(**v) for k, v in state["controllers"].items()}
    for k, opt_state in state.get("optimizers", {}).items():
        team.agents[int(k)].saved_optimizer_state = opt_state
    return team, state, rng, controllers


def record_upgrades(out: Path, events: list[dict]) -> None:
    """Append plug-and-play events to upgrades.json."""
    path = out / "upgrades.json"
    history = json.loads(path.read_text()) if path.exists() else []
    atomic_write(path, json.dumps(history + events, indent=2))


# ---------------------------------------------------------------------------
# Metrics and the plot
# ---------------------------------------------------------------------------
def read_metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_metrics(out: Path, records: list[dict]) -> None:
    atomic_write(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))


def plot_run(out: Path, records: list[dict]) -> None:
    """progress.png: team reward and held-out accuracy per stage; certificate terms."""
    if not distributed.is_main():
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = [r["stage"] for r in records if r["stage"] > 0]
    trained = [r for r in records if r["stage"] > 0]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot([r["stage"] for r in records], [r["eval_accuracy"] for r in records], "o-", label="held-out team accuracy")
    ax1.plot(stages, [r["team_reward"] for r in trained], "s--", label="team reward (rollouts)")
    for k in range(len(records[-1]["eval_agent_accuracy"])):
        ax1.plot([r["stage"] for r in records], [r["eval_agent_accuracy"][k] for r in records], ":", alpha=0.6, label=f"agent {k + 1} alone")
    ax1.set_xlabel("stage")
    ax1.set_ylabel("accuracy")
    ax1.set_ylim(0, 1)
    ax1.legend(fontsize=8)
    ax1.set_title("SAT progress")
    for key in ("gain", "occupancy_penalty", "bias_penalty", "sample_penalty", "lower_bound"):
        ax2.plot(stages, [r["certificate"][key] for r in trained], "o-", label=key)
    ax2.plot(stages, [r["measured_change"] for r in trained], "k*", label="measured change (held-out)")
    ax2.axhline(0, color="grey", lw=0.5)
    ax2.set_xlabel("stage")
    ax2.set_title("stage certificate (reward units)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "progress.png", dpi=110)
    plt.close(fig)


def fmt_list(xs) -> str:
    return "[" + ", ".join(f"{x:.2f}" for x in xs) + "]"


def rollout_record(batch, rollout_seconds: float, health=None) -> dict:
    """The stage record's rollout fields: rewards, throughput, lengths."""
    n_agents = len(batch.turns)
    record = {"team_reward": float(batch.rewards.mean()), "agent_reward": batch.agent_correct.mean(1).tolist(),
              "rollout_tokens_per_s": batch.num_tokens / max(rollout_seconds, 1e-9),
              "truncated_fraction": float(torch.stack([t.truncated.float() for t in batch.turns]).mean()),
              "mean_response_tokens": batch.num_tokens / (len(batch) * n_agents)}
    if health is not None:  # mean |log pi_vllm - log pi_train| per agent: sampler numerics, never in the ratios
        record["vllm_logprob_abs_diff"] = health
    return record


STAGE_HEADER = f"{'stage':>5} {'reward':>7} {'eval':>6} {'change':>7} {'kl_q':>14} {'bt':>6} {'acc':>6} {'bound':>8} {'sec':>5}"


def stage_line(rec: dict) -> str:
    """One console line per stage, under STAGE_HEADER."""
    ag = rec["agents"]
    kl_q = "/".join(f"{a['kl_quantile']:.3f}" for a in ag)
    backtracks = "/".join(str(a["backtracks"]) for a in ag)
    accepted = "".join("y" if a["accepted"] else "n" for a in ag)
    return (f"{rec['stage']:>5} {rec['team_reward']:>7.3f} {rec['eval_accuracy']:>6.3f} {rec['measured_change']:>+7.3f} "
            f"{kl_q:>14} {backtracks:>6} {accepted:>6} {rec['certificate']['lower_bound']:>+8.3f} {rec['seconds']:>5.1f}")
