"""What a run writes in ``--out``: atomic checkpoints and resume, metrics.jsonl, samples.jsonl, the progress plot.

A run folder holds

    config.json            the run's configuration
    metrics.jsonl          one object per stage (stage 0 = before training; ``harness.records``)
    samples.jsonl          what the agents said: a few joint trajectories of each stage's rollout
    progress.png           held-out accuracy per stage, the measured change and its lower bound
    upgrades.json          plug-and-play events, if any
    latest.json            points at the newest complete checkpoint
    checkpoints/stage_XXXX team/ (a Hugging Face folder per agent: what eval_aime.py
                           and the vLLM engines load) + sharded/agent_K (the agents'
                           fp32 training state, torch.distributed.checkpoint: each
                           rank writes its shards) + state.pt (controllers, value
                           heads, RNGs: plain data, read as data only) +
                           checksums.json (size and sha256 of every file)

Every write goes through a temporary file or folder and a rename, so a crash
leaves the previous checkpoint intact and resumable; a damaged file is caught
by its checksum when the folder is read, and a state.pt that would run code
when unpickled is refused (``read_state``). Resuming from a stage folder keeps
the run's metrics of stages 0..k and continues from there; a run folder that
holds a run is never overwritten without --overwrite.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException

from harness.loading import load_saved_agent, load_saved_agents, read_team, save_agent, save_team_meta
from harness.processes import ONE_PROCESS, OneProcess
from harness.training_state import optimizer_skeleton
from team import Agent, Team
from trust_region import QuantileController


def write_stage_folder(folder: Path, stage: int, team: Team, controllers, value_heads, rng: random.Random,
                       extra: dict, step_sizes: dict | None = None) -> None:
    """Every file of one checkpoint. Every process writes its part of the fp32 training state
    (``training_state``); the main process writes the agents' Hugging Face folders (whole models, one at a time),
    state.pt and checksums.json (the size and sha256 of every file, verified by ``load_checkpoint``). state.pt
    holds plain data only (numbers, strings, lists, tuples, dicts, tensors), so ``read_state`` loads it with
    ``torch.load(weights_only=True)``."""
    procs = team.procs
    procs.save_state(folder / "sharded", team)  # every process
    for k, agent in enumerate(team.agents):
        whole = procs.whole_copy(agent.model)  # the model itself, or gathered from shards on the main process
        if procs.main:
            save_agent(agent if whole is agent.model else Agent(agent.spec, whole, agent.tokenizer),
                       folder / "team" / f"agent_{k}")
        del whole
    if not procs.main:
        return
    save_team_meta(team, folder / "team")
    state = {"stage": stage, "controllers": {k: c.state_dict() for k, c in controllers.items()},
             "step_sizes": {k: s.state_dict() for k, s in (step_sizes or {}).items()},
             "value_heads": {k: v.state_dict() for k, v in value_heads.items()},
             "python_rng": rng.getstate(), "torch_rng": torch.get_rng_state(),
             "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
             "numpy_rng": numpy_rng_state(),
             "optimizers": {k: optimizer_skeleton(a) for k, a in enumerate(team.agents)
                            if a.saved_optimizer_state is not None},
             **extra}
    torch.save(state, folder / "state.pt")
    (folder / CHECKSUMS).write_text(json.dumps(folder_digests(folder), indent=1))


def numpy_rng_state() -> tuple:
    """NumPy's global RNG state in plain types (its name, the 624 keys as a list of ints, the position, the
    Gaussian flag and cached value), the form state.pt keeps."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return name, keys.tolist(), int(pos), int(has_gauss), float(cached)


def set_numpy_rng_state(state) -> None:
    """Restore NumPy's global RNG from ``numpy_rng_state``'s tuple."""
    name, keys, pos, has_gauss, cached = state
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def unwritten_checkpoint(out: Path, final: Path, err: Exception) -> str:
    """One line for a checkpoint that could not be written: what failed, the free space, what to resume from."""
    if isinstance(err, CheckpointException) and err.failures:  # the sharded state's writer wraps each rank's error
        err = next(iter(err.failures.values()))[0]
    free = shutil.disk_usage(out).free / 2**30
    cause = (str(err).strip().splitlines() or [""])[0]
    if (out / "latest.json").exists():
        then = f"resume from its last complete checkpoint (stage {stage_key(latest_checkpoint(out))[0]}) with " \
               f"--resume {out}"
    else:
        then = "rerun it with --overwrite (no checkpoint of this run is complete)"
    return (f"could not write checkpoint {final} ({type(err).__name__}: {cause}); {free:.1f} GiB free on its "
            f"disk: free space or choose another --out, then {then}")


def save_checkpoint(out: Path, stage: int, team: Team, controllers, value_heads, rng: random.Random, extra: dict,
                    suffix: str = "", step_sizes: dict | None = None) -> Path:
    """Write checkpoints/stage_XXXX via a temporary folder and a rename, then
    point latest.json at it (also via rename): a crash leaves the previous
    checkpoint intact. A write that fails (a full disk, a quota) removes the
    partial folder and raises one line naming the checkpoint, the free space
    and the run's last complete checkpoint to resume from. Pruning keeps the
    new folder and the one before it in stage order; folders of later stages
    (a future discarded by resuming from an earlier stage folder) are removed."""
    root = out / "checkpoints"
    final = root / f"stage_{stage:04d}{suffix}"
    tmp = root / f".stage_{stage:04d}{suffix}.tmp"
    procs = team.procs
    if procs.main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    procs.barrier()  # the folder exists before any process writes its part
    try:
        write_stage_folder(tmp, stage, team, controllers, value_heads, rng, extra, step_sizes)
    except (Exception, CheckpointException) as err:  # a full disk comes as each writer's own error
        if procs.main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(unwritten_checkpoint(out, final, err)) from err
    if not procs.main:
        procs.barrier()
        return final
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    atomic_write(out / "latest.json", json.dumps({"stage": stage, "path": final.name}))
    folders = sorted((p for p in root.glob("stage_*") if p.is_dir()), key=stage_key)
    keep = [p for p in folders if stage_key(p) <= stage_key(final)][-2:]
    for old in folders:
        if old not in keep:
            shutil.rmtree(old, ignore_errors=True)
    procs.barrier()
    return final


def write_samples(out: Path, stage: int, samples: list[dict]) -> None:
    """samples.jsonl: every stage's samples; a resumed run's later stages are replaced, as in metrics.jsonl."""
    path = out / "samples.jsonl"
    kept = [line for line in (path.read_text().splitlines() if path.exists() else [])
            if line.strip() and json.loads(line)["stage"] < stage]
    atomic_write(path, "".join(line + "\n" for line in kept + [json.dumps(s) for s in samples]))


def stage_key(folder: Path) -> tuple[int, str]:
    """Order of stage folders: by stage number, then suffix (stage_0005 < stage_0005_upgraded < stage_0006)."""
    m = re.fullmatch(r"stage_(\d+)(.*)", folder.name)
    return (int(m.group(1)), m.group(2)) if m else (-1, folder.name)


CHECKSUMS = "checksums.json"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def folder_digests(folder: Path) -> dict[str, list]:
    """{relative path: [size, sha256]} of every file under folder but checksums.json."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != CHECKSUMS)
    return {p.relative_to(folder).as_posix(): [p.stat().st_size, file_sha256(p)] for p in files}


def previous_stage_hint(folder: Path) -> str:
    """Where to resume instead of a damaged stage folder."""
    siblings = sorted((p for p in folder.parent.glob("stage_*") if p.is_dir() and stage_key(p) < stage_key(folder)),
                      key=stage_key)
    if siblings:
        return f"resume from the previous stage folder instead: --resume {siblings[-1]}"
    return "no earlier stage folder is left next to it; start a new run with --overwrite"


def verify_checkpoint(folder: Path) -> dict[str, list] | None:
    """Check every file of a stage folder against checksums.json; one-line
    RuntimeError naming the first damaged file. None for a folder written
    before checksums existed (nothing to check against)."""
    path = folder / CHECKSUMS
    if not path.exists():
        return None
    try:
        expected = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        raise RuntimeError(f"checkpoint {folder} is damaged: {CHECKSUMS} is unreadable; "
                           f"{previous_stage_hint(folder)}") from None
    for rel, (size, digest) in expected.items():
        f = folder / rel
        what = ("is missing" if not f.is_file() else f"has {f.stat().st_size} bytes, {size} were written (truncated)"
                if f.stat().st_size != size else "does not match its checksum (corrupted)"
                if file_sha256(f) != digest else None)
        if what:
            raise RuntimeError(f"checkpoint {folder} is damaged: {rel} {what}; {previous_stage_hint(folder)}")
    return expected


def run_folder_of(checkpoint: Path) -> Path | None:
    """The run folder a stage folder belongs to (RUN for RUN/checkpoints/stage_XXXX), else None."""
    checkpoint = Path(checkpoint)
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None


# What sat.py writes into a run folder; a folder holding any of them holds a run.


RUN_FILES = ("metrics.jsonl", "latest.json", "config.json", "checkpoints", "progress.png", "upgrades.json")


def check_out_folder(out: Path, resume_run: Path | None, overwrite: bool) -> list[Path]:
    """Refuse to write a run into a folder that holds another run, unless it is
    the run being resumed or --overwrite is given; returns what --overwrite will
    delete (``clear_run_files``, called once the rest of the input is valid)."""
    out = Path(out)
    held = [name for name in RUN_FILES if (out / name).exists()]
    same = resume_run is not None and out.resolve() == Path(resume_run).resolve()
    if overwrite and same:
        raise ValueError(f"--overwrite would delete the run being resumed ({out}); "
                         "drop --overwrite, or pass a new --out")
    if not held or same:
        return []
    if not overwrite:
        raise ValueError(f"--out {out} already holds a run ({', '.join(held)}); continue it with --resume {out}, "
                         f"pass a new --out, or add --overwrite to replace it")
    return [out / name for name in held]


def clear_run_files(paths: list[Path]) -> None:
    for target in paths:
        shutil.rmtree(target) if target.is_dir() else target.unlink()


def atomic_write(path: Path, text: str) -> None:
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
        raise FileNotFoundError(f"no checkpoint in '{run_dir}': expected latest.json written by sat.py "
                                "(or a checkpoints/stage_XXXX folder)")
    try:
        target = run_dir / "checkpoints" / json.loads(pointer.read_text())["path"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise RuntimeError(f"{pointer} is damaged (not the JSON sat.py writes); pass a stage folder instead "
                           f"({run_dir / 'checkpoints'}/stage_XXXX)") from None
    if not target.is_dir():
        raise FileNotFoundError(f"{pointer} points at {target}, which is missing; "
                                f"pass a stage folder that exists instead ({run_dir / 'checkpoints'}/stage_XXXX)")
    return target


def read_state(folder: Path) -> dict:
    """A stage folder's state.pt, read as data: ``torch.load(weights_only=True)`` rebuilds tensors and plain
    containers only and refuses a pickle that would call anything else before any of it runs. Its checksum
    proves the file intact, not trustworthy: a run folder from elsewhere may carry a pickled callable, which a
    full unpickler would run on ``--resume``. One line names the file either way."""
    try:
        return torch.load(folder / "state.pt", weights_only=True)
    except pickle.UnpicklingError as err:  # a global or an instruction beyond plain data
        named = re.search(r"GLOBAL (\S+)", str(err))
        what = f"it calls {named.group(1)}" if named else "a pickle instruction beyond plain data"
        raise RuntimeError(f"checkpoint {folder} refused: state.pt holds more than data ({what}), and a checkpoint "
                           "is only ever read as data; resume from a stage folder that this version of sat.py "
                           "wrote, or start a new run with a new --out") from None
    except Exception as err:  # a torn or garbled file
        raise RuntimeError(f"checkpoint {folder} is damaged: state.pt does not load ({type(err).__name__}); "
                           f"{previous_stage_hint(folder)}") from None


def load_checkpoint(folder: Path, device: str, dtype: torch.dtype,
                    procs: OneProcess = ONE_PROCESS) -> tuple[Team, dict, random.Random, dict]:
    """Team, saved state, the Python RNG and the controllers of a stage folder;
    restores the torch / numpy / CUDA RNGs so a resumed run continues the
    same random stream as a straight one. The folder is checked against its
    checksums first and state.pt read as data (``read_state``) before any model
    loads; a file that still fails to load is named in one line.
    Each agent is loaded as ``procs`` hold it (torchrun --shard-frozen: straight into shards)."""
    verify_checkpoint(folder)
    state = read_state(folder)
    try:
        folders, team_config = read_team(folder / "team")
        team = Team(load_saved_agents(folders, device, dtype, lambda *a: procs.load_agent(load_saved_agent, *a)),
                    team_config)
    except (ValueError, FileNotFoundError):
        raise
    except Exception as err:  # safetensors / json / tokenizer errors of a damaged file
        raise RuntimeError(f"checkpoint {folder} is damaged: its team/ folder does not load ({type(err).__name__}: "
                           f"{(str(err).splitlines() or [''])[0][:120]}); {previous_stage_hint(folder)}") from None
    rng = random.Random()
    rng.setstate(state["python_rng"])
    torch.set_rng_state(state["torch_rng"])
    set_numpy_rng_state(state["numpy_rng"])
    if state.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    for k, opt_state in state.get("optimizers", {}).items():
        team.agents[int(k)].saved_optimizer_state = opt_state  # moments filled from sharded/ below
    if (folder / "sharded").is_dir():  # the fp32 training state (master weights, moments); older checkpoints lack it
        procs.load_state(folder / "sharded", team)
    controllers = {int(k): QuantileController(**v) for k, v in state["controllers"].items()}
    return team, state, rng, controllers


def record_upgrades(out: Path, events: list[dict]) -> None:
    """Append plug-and-play events to upgrades.json."""
    path = out / "upgrades.json"
    history = json.loads(path.read_text()) if path.exists() else []
    atomic_write(path, json.dumps(history + events, indent=2))


# Metrics keys renamed since a run folder may have been written: old name -> new name (docs/run_folder.md).
RENAMED_METRICS = {"eval_agent_accuracy": "eval_agent_reward"}


def read_metrics(out: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl, any key written under an older name (RENAMED_METRICS) under its current
    one, so that a run resumed across the rename writes one name throughout."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{RENAMED_METRICS.get(k, k): v for k, v in row.items()} for row in rows]


def write_metrics(out: Path, records: list[dict]) -> None:
    atomic_write(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))


def plot_run(out: Path, records: list[dict]) -> None:
    """progress.png: team reward and held-out accuracy per stage; the measured change per stage and since
    stage 0, each beside its paired lower bound and the unpaired one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trained = [r for r in records if r["stage"] > 0]
    evaluated = [r for r in records if "eval_accuracy" in r]  # every stage, or every --eval-every N and the last
    certified = [r for r in trained if "certificate" in r]
    stages = [r["stage"] for r in certified]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    ax1.plot([r["stage"] for r in evaluated], [r["eval_accuracy"] for r in evaluated], "o-",
             label="held-out team accuracy")
    ax1.plot([r["stage"] for r in trained], [r["team_reward"] for r in trained], "s--", label="team reward (rollouts)")
    for k in range(len(evaluated[-1]["eval_agent_reward"])):
        ax1.plot([r["stage"] for r in evaluated], [r["eval_agent_reward"][k] for r in evaluated], ":", alpha=0.6,
                 label=f"agent {k + 1} alone")
    ax1.set_xlabel("stage")
    ax1.set_ylabel("accuracy")
    ax1.set_ylim(0, 1)
    ax1.legend(fontsize=8)
    ax1.set_title("SAT progress")
    confidence = f"{1 - certified[-1]['certificate']['delta_conf']:.0%} confidence"
    for ax, key, title in ((ax2, "certificate", "held-out change per stage and its certificate"),
                           (ax3, "run_certificate", "held-out change since stage 0: the run's certified gain")):
        ax.plot(stages, [r[key]["mean_change"] for r in certified], "k*", label="measured change (paired rows)")
        ax.plot(stages, [r[key]["lower_bound"] for r in certified], "o-", label=f"paired lower bound ({confidence})")
        ax.plot(stages, [r[key]["unpaired_lower_bound"] for r in certified], "x:", alpha=0.6,
                label="unpaired Hoeffding, same draws")
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_xlabel("stage")
        ax.set_title(f"{title} (reward units)", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "progress.png", dpi=110)
    plt.close(fig)
