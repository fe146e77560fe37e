"""The one seam between Algorithm 1 and the processes that run it.

Each agent holds the processes its computation is spread over (``Agent.procs``). The core asks them
only what Algorithm 1 needs from them: which rows of a batch are this process's, a sum or a gather
over processes, a frozen copy pi_j,cur, the agent's parameters to interpolate, a backward pass, the
rollout's rows, lockstep for models whose forwards are collectives. ``OneProcess`` gives the answers
of a single process, so on one process every core function reads as if scale-out did not exist.
``scale.torchrun.Torchrun`` gives torchrun's (FSDP2 shards, seeded rollout blocks, gathers); of the
core and the product wing only ``harness/run.py`` imports it (``resolve`` picks the processes), and
``scale/`` imports the core, never the reverse.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from adapter import copy_sharing_base, own_parameters
from harness import training_state


class OneProcess:
    """Algorithm 1 on one process: every row is this process's, a sum over processes is the value
    itself, nothing waits for anyone."""

    main = True  # this process writes files and speaks

    # -- rows of a batch -------------------------------------------------------------------------------
    def rows(self, n: int) -> tuple[int, int]:
        """(lo, hi): this process's contiguous rows of n, equal shares (all of them here)."""
        return 0, n

    def share(self, n: int) -> tuple[int, int]:
        """(lo, hi): this process's rows of n when shares may differ by one (all of them here)."""
        return 0, n

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over processes."""
        return t

    def gather(self, obj) -> list:
        """[every process's ``obj``], in process order."""
        return [obj]

    def on_main(self, fn):
        """``fn()`` computed once and seen by every process."""
        return fn()

    def barrier(self) -> None:
        """Wait until every process is here."""

    def rollout(self, draw, team, problems: list, group_size: int, sampling, backend, score: bool):
        """ROLLOUT(pi_cur): ``draw`` (``rollout.rollout``) over every problem."""
        return draw(team, problems, group_size, sampling, backend, score)

    # -- models ----------------------------------------------------------------------------------------
    def frozen_copy(self, model: torch.nn.Module) -> torch.nn.Module:
        """A copy that no update touches (the reference pi_j,cur); an adapter's copy shares its base."""
        return copy_sharing_base(model)

    def parameters(self, model: torch.nn.Module) -> list[torch.Tensor]:
        """The parameters an interpolation writes (views: the model reads them at its next forward): the whole
        model's, or its adapter's."""
        return own_parameters(model)

    def release(self, model: torch.nn.Module) -> None:
        """Drop whatever a forward kept gathered, so the next forward reads the current weights."""

    def synced_forwards(self, model: torch.nn.Module) -> bool:
        """Whether ``model``'s forwards are collectives every process makes together (never on one)."""
        return False

    def lockstep(self, model: torch.nn.Module, calls: int, dummy):
        """Around ``calls`` forward calls into ``model``: nothing to match on one process."""
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Gradients of a loss that sums over the rows of every process."""
        loss.backward()

    def average_gradients(self, params) -> None:
        """Gradients of parameters held whole by every process, averaged like the model's."""

    def number(self, x) -> float:
        return float(x)

    def train(self, team, slots, train):
        """``train()`` for the agents in ``slots`` (``update.train_agents``)."""
        return train()

    def trainable(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model a fit trains in place of ``model`` (Stage-0): the model itself."""
        return model

    def write_back(self, trained: torch.nn.Module, model: torch.nn.Module) -> None:
        """``trainable``'s weights into ``model``: the same model here."""

    def kept_masters(self, trained: torch.nn.Module) -> list[torch.Tensor] | None:
        """This process's fp32 master weights of a bf16 ``trainable`` copy (None: the optimizer keeps them)."""
        return None

    # -- the team --------------------------------------------------------------------------------------
    def load_agent(self, load, spec, device: str, dtype: torch.dtype, **kwargs):
        """``load(spec, device, dtype, **kwargs)`` (``harness.loading.load_agent`` or ``load_saved_agent``); ``adopt``
        it next."""
        return load(spec, device, dtype, **kwargs)

    def whole_copy(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """The whole model on the main process, to save (None elsewhere): the model itself here."""
        return model

    def save_state(self, folder, team) -> None:
        """The team's fp32 training state, this process's part of it (``training_state.save``)."""
        training_state.save(folder, team)

    def load_state(self, folder, team) -> None:
        """The team's fp32 training state, saved by any number of processes (``training_state.load``)."""
        training_state.load(folder, team)

    def adopt(self, agents) -> None:
        """These agents computed over these processes from now on (after loading, the warm start, an upgrade)."""
        for agent in agents:
            agent.procs = self

    def describe(self, device: str) -> dict:
        """What a metrics row records of the processes."""
        cuda = device.startswith("cuda") and torch.cuda.is_available()
        return {"world_size": 1, "device_kind": torch.cuda.get_device_name() if cuda else "cpu"}


ONE_PROCESS = OneProcess()
