"""Run an Accelerate training script with its FSDP plugin honoured on CPU ranks: one patch.

    torchrun --standalone --nproc-per-node=2 tests/clients/shims/accelerate_cpu.py SCRIPT [ARGS...]

Accelerate 1.16.0 only switches `distributed_type` to FSDP on GPU-like backends
(accelerate.state.AcceleratorState.__init__: the FSDP branch sits under `MULTI_GPU, MULTI_XPU, ...`); on
gloo it stays MULTI_CPU, `prepare()` still wraps the model with FSDP2, but `save_state()` takes the
non-FSDP path and fails on the sharded parameters. Nothing else is patched.
"""
from __future__ import annotations

import runpy
import sys

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

_original_init = AcceleratorState.__init__


def _init(self: AcceleratorState, *args: object, fsdp_plugin: object = None, **kwargs: object) -> None:
    _original_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP  # what the GPU branch sets
        self.fsdp_plugin = fsdp_plugin  # ... together with the plugin
        # every later AcceleratorState() re-copies PartialState's shared dict over its own: the GPU branch
        # writes the type there too (state.py: PartialState._shared_state["distributed_type"] = ...)
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP


AcceleratorState.__init__ = _init  # type: ignore[method-assign]

if __name__ == "__main__":
    script, sys.argv = sys.argv[1], sys.argv[1:]  # the script sees its own argv, as under plain torchrun
    runpy.run_path(script, run_name="__main__")
