"""Process groups, device choice and FSDP wrapping (FSDP2 `fully_shard` or FSDP1 `FullyShardedDataParallel`)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from trainer.model import Block

__all__ = ["Dist", "choose_device", "init_distributed", "shard_model", "shutdown"]


@dataclass(frozen=True)
class Dist:
    """This process's place in the job and the side groups that keep control traffic off the training group."""

    rank: int
    world_size: int
    device: torch.device
    # gloo, bounded timeout: stop agreement, resume broadcast, barriers (main thread only).
    control: dist.ProcessGroup
    # gloo: DCP save/load coordination; async saves use it from the writer thread, so it is not shared.
    ckpt: dist.ProcessGroup


def choose_device(local_rank: int) -> tuple[torch.device, str]:
    """CUDA + NCCL (with gloo for CPU collectives) when a GPU is there, else CPU + gloo."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count()), "cpu:gloo,cuda:nccl"
    return torch.device("cpu"), "gloo"


def init_distributed(timeout_s: float) -> Dist:
    """Join torchrun's job (env://), or form a one-process group when started without torchrun."""
    timeout = timedelta(seconds=timeout_s)
    device, backend = choose_device(int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:  # `python -m trainer`: a world of one, no rendezvous, no port
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    ckpt = dist.new_group(backend="gloo", timeout=timeout)
    return Dist(dist.get_rank(), dist.get_world_size(), device, control, ckpt)


def shard_model(model: nn.Module, fsdp_version: int, device: torch.device) -> nn.Module:
    """Shard every `Block` and then the root; returns the module to call (FSDP1 wraps, FSDP2 mutates)."""
    if fsdp_version == 2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for module in model.modules():
            if isinstance(module, Block):
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=device,  # explicit: FSDP1 refuses CPU unless told (gloo CPU runs)
        use_orig_params=True,
    )


def shutdown() -> None:
    """Destroy the process group if one exists (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()
