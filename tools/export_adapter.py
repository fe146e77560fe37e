"""One agent of a --lora run as a PEFT adapter folder that ``peft.PeftModel.from_pretrained(base, OUT)`` loads as
it is, with its base named in ``adapter_config.json`` (``base_model_name_or_path``).

    python tools/export_adapter.py runs/sat --agent 2 --out adapters/agent_2        # the latest checkpoint
    python tools/export_adapter.py runs/sat/checkpoints/stage_0005 --agent 1 --out adapters/a1

A checkpoint's ``team/agent_K`` already holds the adapter in PEFT's layout; this copies its two PEFT files and, for a
base the run trained itself (the tiny warm start), that base's folder into ``OUT/base`` with the config pointing at
it. A whole-model agent (a run without --lora) is refused: it is a Hugging Face folder already.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import lora  # noqa: E402
from harness.loading import saved_adapter  # noqa: E402
from harness.run_folder import latest_checkpoint  # noqa: E402

PEFT_FILES = ("adapter_config.json", lora.ADAPTER_WEIGHTS)


def agent_folder(run_or_stage: Path, agent: int) -> Path:
    """``team/agent_{agent-1}`` of a stage folder, or of a run folder's latest checkpoint."""
    stage = run_or_stage if (run_or_stage / "team").is_dir() else latest_checkpoint(run_or_stage)
    folder = stage / "team" / f"agent_{agent - 1}"
    if not folder.is_dir():
        raise ValueError(f"{stage / 'team'} has no agent {agent} (agent_{agent - 1}): the agents are numbered from 1")
    return folder


def export_adapter(run_or_stage: Path, agent: int, out: Path) -> Path:
    """Write agent ``agent`` (1-based) of ``run_or_stage`` into ``out`` as a PEFT adapter folder; returns ``out``."""
    folder = agent_folder(run_or_stage, agent)
    saved = saved_adapter(folder)
    if saved is None:
        raise ValueError(f"{folder} holds a whole model, not an adapter (a run without --lora): load the folder "
                         "itself with transformers")
    out.mkdir(parents=True, exist_ok=True)
    for name in PEFT_FILES:
        shutil.copy2(folder / name, out / name)
    if saved[1].base_trained:  # the run's own base has no other home: it travels with the adapter
        shutil.copytree(folder.parent / lora.base_folder_name(saved[1]), out / "base", dirs_exist_ok=True)
        config = json.loads((out / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = str((out / "base").resolve())
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tools/export_adapter.py", description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="a --lora run folder, or one of its checkpoints/stage_XXXX folders")
    p.add_argument("--agent", type=int, required=True, help="the agent, 1-based")
    p.add_argument("--out", type=Path, required=True, help="the adapter folder to write")
    args = p.parse_args(argv)
    try:
        print(export_adapter(args.run, args.agent, args.out))
    except (ValueError, FileNotFoundError) as err:
        print(f"{p.prog}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
