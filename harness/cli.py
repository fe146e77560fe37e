"""The command line of ``sat.py``: every option is a ``Config`` field, with its help text written there.

``main`` turns a bad option or input into one line on stderr (exit 2 before any work, 1 during the run;
docs/errors.md); under torchrun each rank leaves the group through ``scale.distributed.rank_main``.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import fields
from pathlib import Path

import sat
from harness import run_folder
from harness.config import Config, add_options
from harness.run import resolve, run_resolved
from scale.distributed import rank_main


def parse_args(argv=None) -> Config:
    p = argparse.ArgumentParser(prog="sat.py", description=sat.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                argument_default=argparse.SUPPRESS)
    add_options(p, Config)
    args = vars(p.parse_args(numbers_as_values(sys.argv[1:] if argv is None else argv)))
    if "resume" in args:  # continue with the saved configuration; explicit flags override it
        saved = Path(args["resume"])
        cfg_path = (saved if (saved / "config.json").exists()
                    else run_folder.latest_checkpoint(saved).parent.parent) / "config.json"
        if not cfg_path.exists():
            p.error(f"--resume {saved}: no config.json there; pass the run folder written by sat.py")
        args = {**json.loads(cfg_path.read_text()), "upgrade": [], "overwrite": False, "out": str(cfg_path.parent),
                **args}
    known = {f.name for f in fields(Config)}
    return Config(**{k: v for k, v in args.items() if k in known})


def numbers_as_values(argv: list[str]) -> list[str]:
    """argparse reads "-1e-4" as an option; glue such a negative number to the
    option before it ("--lr=-1e-4") so validation can say what is wrong."""
    out = []
    for tok in argv:
        negative = re.fullmatch(r"-[\d.]+(?:e[-+]?\d+)?|-inf|-nan", tok, re.I)
        if out and out[-1].startswith("--") and "=" not in out[-1] and negative:
            out[-1] = f"{out[-1]}={tok}"
        else:
            out.append(tok)
    return out


@rank_main  # under torchrun: one barrier, the group destroyed, the rank ended (a failed rank aborts the group)
def main(argv=None) -> int:
    try:
        cfg = parse_args(argv)
        resolved = resolve(cfg)
    except (ValueError, FileNotFoundError, RuntimeError) as err:  # refused before any work
        print(f"sat.py: error: {err}", file=sys.stderr)
        return 2
    try:
        run_resolved(resolved)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"sat.py: error: {err}", file=sys.stderr)
        return 1
    return 0
