"""Run the real `torchtitan.train.main()` on CPU ranks (gloo): the smallest set of patches it needs.

Launch it where torchtitan's entry point would go:
    torchrun --standalone --nproc-per-node=2 tests/clients/shims/titan_cpu.py --module ... --config ...
Everything after the script name is torchtitan's own command line. Each patch names the torchtitan 0.3.0 /
torch 2.13.0 code it works around; none changes what is saved or how a checkpoint is chosen.
Also needed on CPU, as a flag rather than a patch: `--parallelism.spmd_backend partial_dtensor` (the
default `spmd_types` backend hands plain tensors to `fully_shard(dp_mesh_dims=...)`, which refuses them).
"""
from __future__ import annotations

import os
import sys
import types

import torch
import torch.distributed as dist
import torch.nn.attention.flex_attention as flex
from torch.distributed.fsdp import FSDPModule


def _stub_triton_kernels() -> None:
    """torchtitan.models.common imports the MoE expert-parallel kernels, which `import triton` at module
    level; a CPU-only torch has no triton. The llama3 model never calls them."""
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    stub = types.ModuleType(name)

    def missing(attr: str):  # module __getattr__ (PEP 562): any kernel name resolves to a function that fails
        if attr.startswith("__"):  # but not dunders: inspect and importlib probe __file__, __spec__, ...
            raise AttributeError(attr)

        def fail(*_args: object, **_kwargs: object) -> None:
            raise RuntimeError(f"{name}.{attr} needs triton and a GPU")

        return fail

    stub.__getattr__ = missing  # type: ignore[method-assign]
    sys.modules[name] = stub  # installed before torchtitan is imported, so its `from ... import` finds it


class _CpuDevice:
    """torchtitan.tools.utils picks `torch.cuda` when no accelerator is found ("or 'cuda'"); torch.cpu lacks
    the memory-monitor calls torchtitan.components.metrics.DeviceMemoryMonitor makes, so they are answered
    here (no peak-memory figures on CPU) and everything else falls through to torch.cpu."""

    def __getattr__(self, attr: str) -> object:
        return getattr(torch.cpu, attr)  # set_device, synchronize, device_count, ...

    @staticmethod
    def get_device_name(device: object = None) -> str:
        return "cpu"

    @staticmethod
    def current_device() -> int:  # torch.cpu's returns "cpu"; dist.barrier(device_ids=[...]) needs an int
        return 0

    @staticmethod
    def get_device_properties(device: object = None) -> types.SimpleNamespace:
        return types.SimpleNamespace(name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def memory_stats(device: object = None) -> dict[str, int]:
        return {}  # DeviceMemoryMonitor.get_peak_stats reads it with .get(key, -1)

    @staticmethod
    def reset_peak_memory_stats(device: object = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


def _sum_instead_of_premul_sum() -> None:
    """torchtitan.distributed.fsdp.disable_fsdp_gradient_division sets a divide factor of 1.0; FSDP2 then
    reduce-scatters with ReduceOp.PREMUL_SUM(1.0), which gloo refuses. Forcing SUM-for-comms makes FSDP2
    reduce with SUM and post-divide by the same 1.0: the same gradients."""
    original = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self: FSDPModule, factor: float) -> None:
        original(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor  # type: ignore[method-assign]


def main() -> None:
    _stub_triton_kernels()
    # FlexAttention refuses requires_grad inputs on CPU in eager mode (flex_attention._validate_device);
    # its eager math path does run forward and backward, so the check is dropped.
    flex._validate_device = lambda query, key, value: None
    import torchtitan.tools.utils as titan_utils

    titan_utils.device_type, titan_utils.device_module = "cpu", _CpuDevice()  # before modules copy them
    import torchtitan.models.common.attention as attention

    # FlexAttention._compiled_flex_attn and create_attention_mask are torch.compile'd (inductor would need a
    # C++ toolchain and minutes per shape on CPU): run the eager functions instead.
    attention.FlexAttention._compiled_flex_attn = staticmethod(flex.flex_attention)
    attention._compiled_create_block_mask = flex.create_block_mask
    _sum_instead_of_premul_sum()
    if not hasattr(dist, "set_timeout"):
        # torchtitan.distributed.utils.set_pg_timeouts calls torch.distributed.set_timeout, which torch 2.13
        # has only under its private name.
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout  # type: ignore[attr-defined]
    from torchtitan.train import main as titan_main

    titan_main()  # reads sys.argv[1:]: torchtitan's own flags


if __name__ == "__main__":
    main()
