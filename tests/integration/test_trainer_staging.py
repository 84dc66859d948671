"""CachedStager: a training-safe copy of the state per async save, in buffers reused from save to save."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Shard, distribute_tensor  # noqa: E402

from trainer.staging import CachedStager  # noqa: E402


@pytest.fixture(scope="module")
def mesh() -> Iterator[object]:
    """A one-process gloo world (no port) and its 1-D CPU mesh."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _state(mesh: object) -> dict:
    w = distribute_tensor(torch.arange(12, dtype=torch.float32).reshape(4, 3), mesh, [Shard(0)])
    return {"model": {"w": w, "b": torch.ones(3)}, "optim": {"step": torch.tensor(5.0), "lr": [0.1, 0.2]},
            "train": {"step": 7, "blob": b"rng"}}


class TestCachedStager:
    def test_copy_is_equal_and_independent(self, mesh: object) -> None:
        """The staged state equals the source and does not change when training mutates the source."""
        state = _state(mesh)
        staged = CachedStager().stage(state)
        w = staged["model"]["w"]
        assert isinstance(w, DTensor) and w.placements == state["model"]["w"].placements
        assert torch.equal(w.full_tensor(), state["model"]["w"].full_tensor())
        state["model"]["w"].to_local().add_(100)
        state["model"]["b"].zero_()
        state["optim"]["lr"].append(0.3)
        assert w.full_tensor()[0, 0].item() == 0.0 and staged["model"]["b"].sum().item() == 3.0
        assert staged["optim"] == {"step": torch.tensor(5.0), "lr": [0.1, 0.2]}
        assert staged["train"] == {"step": 7, "blob": b"rng"}

    def test_buffers_reused_and_refreshed(self, mesh: object) -> None:
        """A second save reuses the same buffers and carries the new values."""
        stager, state = CachedStager(), _state(mesh)
        first = stager.stage(state)
        state["model"]["w"].to_local().mul_(2)
        second = stager.stage(state)
        assert second["model"]["w"] is first["model"]["w"] and second["model"]["b"] is first["model"]["b"]
        assert second["model"]["w"].to_local()[1, 0].item() == 6.0

    def test_new_shape_gets_a_new_buffer(self, mesh: object) -> None:
        """A tensor whose shape changed between saves is staged into a fresh buffer of the new shape."""
        stager, state = CachedStager(), _state(mesh)
        first = stager.stage(state)
        state["model"]["b"] = torch.ones(5)
        second = stager.stage(state)
        assert second["model"]["b"] is not first["model"]["b"] and second["model"]["b"].shape == (5,)
