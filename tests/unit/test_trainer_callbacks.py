"""trainer.callbacks: Lightning's and HF Trainer's hooks write the supervisor's heartbeats (no library needed)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from supervisor.contract import parse_heartbeat
from trainer.callbacks import HFBeats, LightningBeats


@pytest.fixture
def beats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FSDP_SUPERVISOR_HEARTBEAT", str(tmp_path / "heartbeat.json"))
    monkeypatch.setenv("FSDP_SUPERVISOR_HEARTBEAT_DIR", str(tmp_path))
    return tmp_path


def read(path: Path):  # type: ignore[no-untyped-def]
    beat, problems = parse_heartbeat(path.read_bytes())
    assert problems == []
    return beat


def flushed(path: Path, step: int):  # type: ignore[no-untyped-def]
    """The rank's beat once it says `step` (a step held back by the throttle is written by its flusher thread)."""
    deadline = time.monotonic() + 30
    while read(path).step != step and time.monotonic() < deadline:
        time.sleep(0.01)
    return read(path)


class FakeTensor:
    def __init__(self, value: float) -> None:
        self.value = value

    def detach(self) -> float:
        return self.value


class TestLightning:
    def test_steps_losses_and_phases(self, beats: Path) -> None:
        """Local rank 0 writes the node's beat, every rank its own; a NaN loss reaches the supervisor as one."""
        cb, trainer = LightningBeats(), SimpleNamespace(global_step=0, global_rank=1, local_rank=0)
        cb.on_train_start(trainer, None)
        trainer.global_step = 1
        cb.on_train_batch_end(trainer, None, {"loss": FakeTensor(2.5)}, None, 0)
        node = read(beats / "heartbeat.json")
        assert (node.step, node.phase, node.loss) == (0, "train", None)  # throttled: the phase change only
        rank = flushed(beats / "rank-1.json", 1)  # the rank's own: 4 a second, a step held back is flushed
        assert (rank.step, rank.loss) == (1, 2.5)
        trainer.global_step = 2
        cb.on_train_batch_end(trainer, None, FakeTensor(float("nan")), None, 1)
        assert read(beats / "heartbeat.json").loss_bad == "nan" and read(beats / "rank-1.json").loss_bad == "nan"
        cb.on_save_checkpoint(trainer, None, {})
        assert read(beats / "heartbeat.json").phase == "save"

    def test_a_skipped_step_reports_no_loss(self, beats: Path) -> None:
        """A step that trained on nothing (a rollback's skip) must not feed its placeholder 0.0 to the guard."""
        cb, trainer = LightningBeats(), SimpleNamespace(global_step=7, global_rank=0, local_rank=0)
        cb.on_train_batch_end(trainer, None, {"loss": FakeTensor(0.0), "skipped": True}, None, 0)
        rank = read(beats / "rank-0.json")
        assert (rank.step, rank.loss, rank.loss_bad) == (7, None, None)

    def test_another_local_rank_writes_only_its_own(self, beats: Path) -> None:
        LightningBeats().on_train_start(SimpleNamespace(global_step=3, global_rank=5, local_rank=1), None)
        assert not (beats / "heartbeat.json").exists() and read(beats / "rank-5.json").step == 3


class TestHF:
    def test_the_logged_loss_is_beaten(self, beats: Path) -> None:
        cb = HFBeats()
        args, state = SimpleNamespace(process_index=0, local_process_index=0), SimpleNamespace(global_step=0)
        cb.on_train_begin(args, state, None)
        state.global_step = 4
        cb.on_step_end(args, state, None)
        cb.on_log(args, state, None, logs={"loss": float("nan"), "learning_rate": 0.1})
        assert read(beats / "heartbeat.json").loss_bad == "nan"
        cb.on_log(args, state, None, logs={"eval_loss": 1.0})  # no training loss: nothing to say
        cb.on_evaluate(args, state, None)
        assert json.loads((beats / "heartbeat.json").read_text())["phase"] == "eval"

    def test_a_logged_step_beats_its_loss(self, beats: Path) -> None:
        """The Trainer calls on_step_end, then on_log for a step it logs: a loss-less beat of the same step and phase
        first would make the heartbeat's throttle drop the loss (measured: the guard saw no normal loss, quarantined
        every save as diverged and gave up)."""
        cb = HFBeats()
        args, state = SimpleNamespace(process_index=0, local_process_index=0), SimpleNamespace(global_step=5)
        cb.on_step_end(args, state, SimpleNamespace(should_log=True))
        cb.on_log(args, state, None, logs={"loss": 4.5})
        assert read(beats / "rank-0.json").loss == 4.5 and read(beats / "heartbeat.json").loss == 4.5
        state.global_step = 6
        cb.on_step_end(args, state, SimpleNamespace(should_log=False))  # a step not logged still beats
        assert flushed(beats / "rank-0.json", 6).loss is None

    def test_the_nan_filter_is_turned_off(self, beats: Path) -> None:
        """HF's default logging_nan_inf_filter logs a NaN step as the window's mean (0.0 with logging_steps=1): the
        guard would never see the divergence. The callback turns it off; a job that already did is left alone."""
        args = SimpleNamespace(process_index=0, local_process_index=0, logging_nan_inf_filter=True)
        HFBeats().on_train_begin(args, SimpleNamespace(global_step=0), None)
        assert args.logging_nan_inf_filter is False
        args = SimpleNamespace(process_index=0, local_process_index=0)  # an older Trainer without it
        HFBeats().on_train_begin(args, SimpleNamespace(global_step=0), None)
        assert not hasattr(args, "logging_nan_inf_filter")

    def test_outside_a_supervisor_nothing_is_written(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv("FSDP_SUPERVISOR_HEARTBEAT", raising=False)
        monkeypatch.delenv("FSDP_SUPERVISOR_HEARTBEAT_DIR", raising=False)
        monkeypatch.chdir(tmp_path)
        HFBeats().on_step_end(SimpleNamespace(process_index=0, local_process_index=0), SimpleNamespace(global_step=1),
                              None)
        assert list(tmp_path.iterdir()) == []
