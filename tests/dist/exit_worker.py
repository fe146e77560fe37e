"""Run by tests/test_distributed.py under torchrun: how a rank ends (``distributed.rank_main``).

- ``ok``: a tiny agent held as FSDP2 shards (they keep the group object alive, as in every sharded run), and a
  last collective on a temporary tensor right before ``main`` returns. Every rank exits 0.
- ``fail``: rank 1 raises while rank 0 waits in a collective: rank 1 reports one line and aborts the group, and
  rank 0's collective fails at once instead of waiting out the group's timeout (30 minutes)."""
import sys

import torch

from scale import distributed
from team import Agent
from harness.loading import load_agent


def main(mode: str) -> None:
    torch.set_num_threads(1)
    distributed.setup("cpu")
    model = distributed.shard_in_place(load_agent("tiny").model)
    model(input_ids=torch.tensor([[1, 2, 3]]))  # a forward through the shards: one all-gather per layer
    if mode == "fail" and distributed.rank() == 1:
        raise ValueError("a failure on rank 1 only")
    distributed.sum_ranks(torch.ones(1000))  # the last collective, on a temporary tensor


if __name__ == "__main__":
    sys.exit(distributed.rank_main(main)(sys.argv[1]))
