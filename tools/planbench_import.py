"""Write data/planbench_blocksworld.jsonl from a clone of PlanBench (github.com/karthikv792/LLMs-Planning, MIT).

    git clone https://github.com/karthikv792/LLMs-Planning /tmp/LLMs-Planning
    python tools/planbench_import.py --git-dir /tmp/LLMs-Planning/.git --commit HEAD

One JSON object a line, one per problem file of ``plan-bench/instances/blocksworld/generated_basic/`` in the
order instance-1, instance-2, ...: ``instance`` (the file's name without .pddl), ``objects``, ``init`` and ``goal``
(lists of facts, each a list such as ["on", "a", "b"], as ``harness.planbench.parse_problem`` reads the file), and
``plan``: PlanBench's ground-truth plan of the instance from ``plan-bench/prompts/blocksworld/
task_1_plan_generation.json`` (its lines as written there, e.g. "(unstack yellow orange)", objects by colour), or
null where that file has none (instance-1, the few-shot example).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.planbench import natural_key, parse_problem  # noqa: E402

FOLDER = "plan-bench/instances/blocksworld/generated_basic"
PLANS = "plan-bench/prompts/blocksworld/task_1_plan_generation.json"


def git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", git_dir, *args], check=True, capture_output=True, text=True).stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--git-dir", required=True, help="the .git folder of a PlanBench clone")
    ap.add_argument("--commit", default="HEAD")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "data" / "planbench_blocksworld.jsonl"))
    args = ap.parse_args(argv)
    names = [n for n in git(args.git_dir, "ls-tree", "--name-only", f"{args.commit}:{FOLDER}").split()
             if n.endswith(".pddl")]
    prompts = json.loads(git(args.git_dir, "show", f"{args.commit}:{PLANS}"))["instances"]
    plans = {f"instance-{p['instance_id']}": p["ground_truth_plan"].split("\n") for p in prompts}
    with open(args.out, "w") as f:
        for name in sorted(names, key=lambda n: natural_key(Path(n))):
            instance = name[: -len(".pddl")]
            row = {"instance": instance, **parse_problem(git(args.git_dir, "show", f"{args.commit}:{FOLDER}/{name}"))}
            plan = plans.get(instance)
            row["plan"] = [line for line in plan if line.strip()] if plan else None
            f.write(json.dumps(row) + "\n")
    print(f"{len(names)} instances ({sum(1 for n in names if n[:-5] in plans)} with a plan) -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
