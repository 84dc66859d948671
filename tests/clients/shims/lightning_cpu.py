"""Run a Lightning script with `FSDPStrategy` on CPU ranks (gloo): one subclass, nothing else.

    torchrun --standalone --nproc-per-node=2 tests/clients/shims/lightning_cpu.py SCRIPT [ARGS...]

Lightning 2.6.6 refuses FSDP without a GPU: `_AcceleratorConnector._check_strategy_and_fallback` raises
"The strategy `fsdp` requires a GPU accelerator" when `type(strategy) is FSDPStrategy` and the accelerator is
not CUDA. The check compares the exact type, so a subclass passes it. The subclass has one job: torch 2.13's
FSDP1 on CPU needs `device_id=torch.device("cpu")`, where `FSDPStrategy._setup_model` passes
`self.root_device.index` (None for the CPU device). It wraps the model itself with the CPU device and hands
the wrapped model to Lightning, whose `_setup_model` leaves an already wrapped model as it is.

The script imports `FSDPStrategy` from `lightning.pytorch.strategies` as users do; this launcher puts the
subclass under that name before the script runs. Saving, loading, `ModelCheckpoint` and Lightning's signal
handling are Lightning's own.
"""
from __future__ import annotations

import runpy
import sys

import lightning.pytorch.strategies as strategies
import torch
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.nn import Module


class CPUFSDPStrategy(strategies.FSDPStrategy):
    """Lightning's FSDPStrategy with the model wrapped for the CPU device."""

    def _setup_model(self, model: Module) -> Module:
        if not any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            model = FullyShardedDataParallel(
                module=model, cpu_offload=self.cpu_offload, mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"), **self.kwargs)
        return super()._setup_model(model)


strategies.FSDPStrategy = CPUFSDPStrategy  # type: ignore[misc]  # what `from lightning.pytorch.strategies import FSDPStrategy` gets

if __name__ == "__main__":
    script, sys.argv = sys.argv[1], sys.argv[1:]  # the script sees its own argv, as under plain torchrun
    runpy.run_path(script, run_name="__main__")
