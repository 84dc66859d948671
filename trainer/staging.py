"""A DCP stager for async saves that costs one memcpy of the local shards and nothing else.

`dcp.async_save` must copy the state before training may touch it again ("staging"); that copy is the
part of an async save that stalls training. DCP's stager for a `FileSystemWriter` allocates a new CPU
state dict on every save and builds each DTensor by deep-copying it first (the data is copied twice, and
page faults on fresh memory come on top); measured here it stalled ~8x a plain memcpy of the same bytes.

`CachedStager` keeps one CPU buffer per tensor across saves and wraps each in a DTensor with the
original's sharding spec once, so a save is a walk over the state dict plus `copy_` into memory that is
already there (pinned when CUDA is present, for fast device-to-host copies). The price is one resident
CPU copy of this rank's state between saves. Callers must not stage again while a save that uses the
buffers is still writing: `trainer.checkpoint.Checkpointer` waits for the previous save first.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

__all__ = ["CachedStager"]


class CachedStager(AsyncStager):
    """Stages into CPU buffers reused across saves; synchronous (returns the staged state dict)."""

    _synchronize_after_execute = False  # staging is finished when `stage` returns

    def __init__(self) -> None:
        self._pin = torch.cuda.is_available()
        self._cache: dict[tuple[Any, ...], tuple[Any, Any]] = {}  # path -> (identity of the source layout, staged)

    def _buffer(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self._pin)

    def _tensor(self, key: tuple[Any, ...], src: torch.Tensor) -> torch.Tensor:
        layout = (src.shape, src.dtype)
        hit = self._cache.get(key)
        if hit is None or hit[0] != layout:
            hit = self._cache[key] = (layout, self._buffer(src))
        hit[1].copy_(src)
        return hit[1]

    def _dtensor(self, key: tuple[Any, ...], src: DTensor) -> DTensor:
        local = src._local_tensor
        layout = (src._spec, local.shape, local.dtype)
        hit = self._cache.get(key)
        if hit is None or hit[0] != layout:
            # The DTensor constructor with the source's spec: from_local() would re-derive it at ~0.4 ms a tensor.
            hit = self._cache[key] = (layout, DTensor(self._buffer(local), src._spec, requires_grad=False))
        hit[1]._local_tensor.copy_(local)
        return hit[1]

    @torch.no_grad()
    def _stage(self, obj: Any, key: tuple[Any, ...]) -> Any:
        if isinstance(obj, DTensor):
            return self._dtensor(key, obj)
        if type(obj) in (torch.Tensor, torch.nn.Parameter):
            return self._tensor(key, obj)
        if isinstance(obj, dict):
            return {k: self._stage(v, (*key, k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
            return type(obj)(self._stage(v, (*key, i)) for i, v in enumerate(obj))
        if isinstance(obj, torch.Tensor):  # other tensor subclasses (FSDP1's ShardedTensor): DCP's own copy
            from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

            staged = _create_cpu_state_dict({"t": obj}, pin_memory=self._pin)
            return _copy_state_dict({"t": obj}, staged)["t"]
        return copy.deepcopy(obj)  # small Python values (counters, pickled RNG state, lr schedule)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A training-safe CPU copy of `state_dict` (reusing the buffers of the previous save)."""
        staged: dict[str, Any] = self._stage(state_dict, ())  # a dict in, a dict out
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: `stage` copies synchronously."""

    def close(self) -> None:
        self._cache.clear()
