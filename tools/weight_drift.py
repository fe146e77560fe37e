"""How far an agent's weights moved between two checkpoints, and how much of that a bf16 copy keeps.

    python tools/weight_drift.py RUN/checkpoints/stage_0000 RUN/checkpoints/stage_0004 --agent 0

Reads ``sharded/agent_K`` of both checkpoints: the fp32 weights of a float32 agent, or the fp32 master weights
of a bf16 agent (``team.MasterWeightAdamW``; a bf16 agent that has not trained yet saves its bf16 weights). The
policy a bf16 agent samples and trains is round(master) to bf16, so an update smaller than half a bf16 rounding
step stays in the master. Prints the share of weights that changed in fp32 and after rounding to bf16, the mean
and largest fp32 change, and how the bf16-rounded change compares with the fp32 one (cosine, length ratio).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.training_state import single_process_quiet  # noqa: E402


def drift(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, float]:
    """Change from ``before`` to ``after`` over the floating-point tensors both hold with one shape."""
    names = [n for n, t in before.items() if n in after and t.is_floating_point() and t.shape == after[n].shape]
    if not names:
        raise ValueError("the two checkpoints share no weight tensor of the same name and shape")
    count = changed = changed_bf16 = 0
    largest = total = dot = norm32 = norm16 = 0.0
    for n in names:
        a, b = before[n].double().flatten(), after[n].double().flatten()  # [numel]
        d32 = b - a  # [numel]
        d16 = after[n].bfloat16().double().flatten() - before[n].bfloat16().double().flatten()  # [numel]
        count += a.numel()
        changed += int((d32 != 0).sum())
        changed_bf16 += int((d16 != 0).sum())
        total += float(d32.abs().sum())
        largest = max(largest, float(d32.abs().max()))
        dot, norm32, norm16 = dot + float(d32 @ d16), norm32 + float(d32 @ d32), norm16 + float(d16 @ d16)
    return {"weights": count, "changed": changed / count, "changed_bf16": changed_bf16 / count,
            "mean_abs_change": total / count, "max_abs_change": largest,
            "cosine_bf16_fp32": dot / (norm32 * norm16) ** 0.5 if norm32 and norm16 else float("nan"),
            "length_ratio_bf16_fp32": (norm16 / norm32) ** 0.5 if norm32 else float("nan")}


def agent_weights(checkpoint: Path, agent: int) -> dict[str, torch.Tensor]:
    """{name: tensor} of one agent's ``sharded/agent_K`` (DCP, written by any number of processes)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = Path(checkpoint) / "sharded" / f"agent_{agent}"
    if not folder.is_dir():
        raise SystemExit(f"error: {folder} does not exist; pass a checkpoints/stage_XXXX folder of a sat.py run")
    with tempfile.TemporaryDirectory() as tmp, single_process_quiet():
        path = os.path.join(tmp, "state.pt")
        dcp_to_torch_save(str(folder), path)
        return torch.load(path, weights_only=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("before", type=Path, help="a checkpoints/stage_XXXX folder")
    p.add_argument("after", type=Path, help="a later checkpoints/stage_XXXX folder")
    p.add_argument("--agent", type=int, default=0, help="the 0-based agent (default 0)")
    args = p.parse_args(argv)
    d = drift(agent_weights(args.before, args.agent), agent_weights(args.after, args.agent))
    print(f"agent {args.agent}, {d['weights']} weights: changed {d['changed']:.2%} in fp32, {d['changed_bf16']:.2%} "
          f"after rounding to bf16; mean |change| {d['mean_abs_change']:.2e}, largest {d['max_abs_change']:.2e}; "
          f"the bf16-rounded change against the fp32 one: cosine {d['cosine_bf16_fp32']:.3f}, length "
          f"{d['length_ratio_bf16_fp32']:.2f}x")


if __name__ == "__main__":
    main()
