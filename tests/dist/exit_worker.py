"""Run by tests/test_distributed.py under torchrun: how a rank ends (``distributed.rank_main``).

- ``ok``: a tiny agent held as FSDP2 shards (they keep the group object, and with it gloo's threads, alive past
  ``destroy_process_group``), and a last collective on a temporary tensor right before ``main`` returns. Every
  rank exits 0 without finalizing its interpreter while gloo's threads live: a gloo thread that frees a
  collective's tensor during finalization must take the GIL, is ended by Python inside a C++ destructor and
  aborts the process ("terminate called without an active exception", exit -6), at random.
  ``FinalizationWitness`` writes <argv[2]>.rank<r> with the gloo threads alive if the interpreter finalizes.
- ``fail``: rank 1 raises while rank 0 waits in a collective: rank 1 reports one line and aborts the group, and
  rank 0's collective fails at once instead of waiting out the group's timeout (30 minutes)."""
import os
import sys

import torch

from scale import distributed
from harness.loading import load_agent


class FinalizationWitness:
    """A global of ``__main__``, so freed only when the interpreter finalizes: then writes the names of this
    process's gloo threads still alive (Linux: /proc/self/task) to ``path``.rank<r>."""

    def __init__(self, path: str):
        self.path, self.listdir, self.open = f"{path}.rank{os.environ.get('RANK', '0')}", os.listdir, open

    def __del__(self):
        names = [self.open(f"/proc/self/task/{t}/comm").read().strip() for t in self.listdir("/proc/self/task")]
        with self.open(self.path, "w") as f:
            f.write(" ".join(n for n in names if "gloo" in n))


def main(mode: str) -> None:
    torch.set_num_threads(1)
    distributed.setup("cpu")
    model = distributed.shard_in_place(load_agent("tiny").model)
    model(input_ids=torch.tensor([[1, 2, 3]]))  # a forward through the shards: one all-gather per layer
    if mode == "fail" and distributed.rank() == 1:
        raise ValueError("a failure on rank 1 only")
    distributed.sum_ranks(torch.ones(1000))  # the last collective, on a temporary tensor


if __name__ == "__main__":
    witness = FinalizationWitness(sys.argv[2]) if len(sys.argv) > 2 else None
    sys.exit(distributed.rank_main(main)(sys.argv[1]))
