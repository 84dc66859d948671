"""What a checkpoint holds, as DCP `Stateful` objects: model, optimizer, progress counters and RNG.

Model and optimizer go through `torch.distributed.checkpoint.state_dict`, which gives the same sharded,
wrapper-free keys for FSDP2 (DTensor) and FSDP1 (SHARDED_STATE_DICT, ShardedTensor), so DCP can reshard on
load and the export sees plain parameter names.
"""
from __future__ import annotations

import pickle
import random
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

__all__ = ["ModelState", "OptimizerState", "Progress", "RngState", "seed_rank_rngs", "full_model_weights"]


class ModelState(Stateful):
    """The model's sharded state dict (FSDP1 or FSDP2)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerState(Stateful):
    """The optimizer's sharded state dict, keyed by parameter name (loads into a fresh optimizer)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


@dataclass
class Progress(Stateful):
    """Counters that say where training is: optimizer steps done, next global sample, last loss."""

    step: int = 0
    sample_index: int = 0  # global index of the next sample: independent of the world size
    loss: float | None = None
    world_size: int = 1  # of the run that saved; a mismatch on resume skips the RNG restore
    seed: int = 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key, value in state_dict.items():
            setattr(self, key, value)


class RngState(Stateful):
    """This rank's RNG states under `rank_<r>`: every rank saves and restores only its own key."""

    def __init__(self, rank: int) -> None:
        self.key = f"rank_{rank}"

    def state_dict(self) -> dict[str, Any]:
        states: dict[str, Any] = {
            # Pickled by us: DCP would try to flatten the nested tuples of random.getstate().
            "python": pickle.dumps(random.getstate()),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            states["cuda"] = torch.cuda.get_rng_state()
        return {self.key: states}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        states = state_dict[self.key]
        random.setstate(pickle.loads(states["python"]))
        torch.set_rng_state(states["torch"])
        if "cuda" in states and torch.cuda.is_available():
            torch.cuda.set_rng_state(states["cuda"])


def seed_rank_rngs(seed: int, rank: int) -> None:
    """Fresh-start RNG streams that differ per rank and depend only on (seed, rank)."""
    random.seed(f"{seed}-{rank}")
    torch.manual_seed(seed * 65_537 + rank + 1)


def full_model_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the unsharded model on CPU, with plain names, on rank 0 (other ranks may get `{}`: ignore it).

    The state-dict API gathers FSDP2's DTensors, or runs FSDP1's FULL_STATE_DICT, and offloads to CPU as it
    goes, so the full model never sits in accelerator memory. Gathering copies bits: the result equals an
    export of a checkpoint saved at the same step.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    # FSDP1 whose parameters already live on the CPU segfaults in FULL_STATE_DICT's offload_to_cpu (torch
    # 2.13, gloo): there every rank gathers the (already CPU) full model instead, and only rank 0 uses it.
    on_cpu = next(model.parameters()).device.type == "cpu"
    offload = not (isinstance(model, FullyShardedDataParallel) and on_cpu)
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))
    # Typed for any state dict (ints, lists, nested dicts); a model's full one maps names to tensors.
    return cast("dict[str, torch.Tensor]", weights)
