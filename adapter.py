"""An agent's own parameters: the whole model, or (``--lora``) its LoRA adapter on a base shared with other agents.

Nothing in the trust region, the per-state KL or the certificate depends on how a policy is
parametrised, so the code path is one. What an agent trains, what the line search interpolates and restores, what
its fp32 masters and AdamW moments cover and what a checkpoint's training state holds are its *own* parameters
(``own_parameters``); the reference pi_cur is a copy that shares whatever is not its own (``copy_sharing_base``).
PEFT (``peft.inject_adapter_in_model``) puts the LoRA layers into the Hugging Face model in place, so the model keeps
its class and every forward (``logprobs``, generation) runs through it unchanged.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraSettings:
    """--lora: a PEFT LoRA adapter of rank ``rank`` on the modules ``targets`` (names, or PEFT's "all-linear"),
    its update scaled by alpha / rank as PEFT scales it."""

    rank: int
    alpha: float
    targets: tuple[str, ...]


@dataclass(frozen=True)
class Adapter:
    """What makes an agent a base plus its own adapter: the adapter's settings, the seed its base was built from (a
    tiny base is rebuilt from it; a loaded base ignores it), and whether the run trained the base itself (the tiny
    warm start, standing in for pretraining: such a base has no other home, so checkpoints carry it)."""

    settings: LoraSettings
    base_seed: int
    base_trained: bool = False


ADAPTER_PARAMETER = ".lora_"  # in the name of every PEFT LoRA parameter (...q_proj.lora_A.default.weight)


def own_named_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) of what an agent trains and the trust region moves: its LoRA adapter's parameters when
    it has one (``--lora``: the base is shared and frozen), else every parameter of the model."""
    named = list(model.named_parameters())
    adapter = [(n, p) for n, p in named if ADAPTER_PARAMETER in n]
    return adapter or named


def own_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters of ``own_named_parameters``."""
    return [p for _, p in own_named_parameters(model)]


def has_adapter(model: torch.nn.Module) -> bool:
    """Whether ``model`` carries a LoRA adapter (``--lora``)."""
    return any(ADAPTER_PARAMETER in n for n, _ in model.named_parameters())


def copy_sharing_base(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` that no update of it touches: a whole copy, or for an adapter model a copy of its
    adapter on the same base tensors (the base is frozen and shared, so pi_cur costs an adapter's bytes)."""
    if not has_adapter(model):
        return copy.deepcopy(model)
    own = {id(p) for p in own_parameters(model)}
    shared = [t for t in list(model.parameters()) + list(model.buffers()) if id(t) not in own]
    return copy.deepcopy(model, memo={id(t): t for t in shared})
