"""Trainer.evaluate in one process (a world of one, no torchrun): what the supervisor sees while it runs."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from trainer.args import build_parser  # noqa: E402
from trainer.loop import Trainer  # noqa: E402
from trainer.parallel import Dist  # noqa: E402

SMALL = ["--d-model", "16", "--n-heads", "2", "--n-layers", "1", "--seq-len", "8", "--batch-size", "2"]


class RecordingHeartbeat:
    """Stands in for trainer.heartbeat.Heartbeat: records every beat the trainer asks for."""

    def __init__(self) -> None:
        self.beats: list[tuple[int, str, float | None]] = []
        self.val_loss: float | None = None

    def beat(self, step: int, phase: str, loss: float | None = None, *, val_loss: float | None = None,
             force: bool = False, step_s: float | None = None) -> bool:
        self.beats.append((step, phase, val_loss))
        return True


@pytest.fixture(scope="module")
def world() -> Iterator[Dist]:
    """A one-process gloo world (no port), as `python -m trainer` forms without torchrun."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield Dist(0, 1, torch.device("cpu"), dist.group.WORLD, dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def test_a_long_evaluation_keeps_the_heartbeat_fresh(world: Dist, tmp_path) -> None:
    """Every evaluated batch beats ("eval" phase, throttled by the heartbeat itself): an evaluation longer than
    the supervisor's hang_timeout_s is progress, not a hang; the last beat carries the val_loss."""
    batches = 5
    args = build_parser().parse_args(["--checkpoint-dir", str(tmp_path), "--eval-every", "1",
                                      "--eval-batches", str(batches), *SMALL])
    heartbeat = RecordingHeartbeat()
    trainer = Trainer(args, world, stopper=None, heartbeat=heartbeat)  # type: ignore[arg-type]
    trainer.build()
    val = trainer.evaluate()
    plain = [b for b in heartbeat.beats if b[2] is None]
    assert [phase for _, phase, _ in heartbeat.beats] == ["eval"] * len(heartbeat.beats)
    assert len(plain) == 1 + batches, heartbeat.beats  # one as it starts, one per batch
    assert heartbeat.beats[-1][2] == val


def test_an_emergency_save_records_no_val_loss(world: Dist, tmp_path) -> None:
    """Stopped at step 3 after an evaluation at step 2: the step-3 save's manifest has a loss and no val_loss
    (those weights were never evaluated; repeating step 2's value let keep_best count it twice)."""
    from supervisor.checkpoints.manifest import read_manifest
    from supervisor.layout import step_dir_name
    from trainer.checkpoint import Checkpointer

    class Stopped:
        signum = 15

    args = build_parser().parse_args(["--checkpoint-dir", str(tmp_path), "--eval-every", "2", *SMALL])
    trainer = Trainer(args, world, stopper=Stopped(), heartbeat=RecordingHeartbeat())  # type: ignore[arg-type]
    trainer.build()
    trainer.saver = Checkpointer(tmp_path, process_group=world.ckpt, control_group=world.control, async_save=False)
    trainer.progress.step, trainer.progress.loss, trainer.val_loss = 3, 2.5, 1.25
    assert trainer._stop() == 0
    manifest = read_manifest(tmp_path / step_dir_name(3))
    assert manifest is not None and manifest.metrics == {"loss": 2.5}
