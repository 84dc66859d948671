"""Heartbeats for PyTorch Lightning and Hugging Face `transformers.Trainer` jobs: one line in the user's script.

    from trainer.callbacks import hf_callback, lightning_callback
    pl.Trainer(..., callbacks=[lightning_callback()])        # Lightning
    transformers.Trainer(..., callbacks=[hf_callback()])       # HF Trainer

Each rank writes its own heartbeat (step, phase, loss) and local rank 0 the node's (trainer/heartbeat.py), so the
supervisor gets hang detection and the divergence guard. Outside a supervisor nothing is written. Neither library
is imported here until its factory is called: the hooks below are plain methods on the library's own objects
(Lightning: `trainer.global_step`, `global_rank`, `local_rank`; HF: `state.global_step`, `args.process_index`,
`args.local_process_index`, the `loss` of `on_log`). HF's Trainer reports its loss only every `logging_steps`
(a mean since the last log): set `logging_steps=1` for the guard to see every step; and it replaces a NaN or
infinite loss by the window's mean (`logging_nan_inf_filter`, on by default: a diverged run logs 0.0 at every step),
so the HF callback turns that filter off when training begins. Neither callback can make its library skip data after
a rollback (`FSDP_SUPERVISOR_SKIP_STEPS`): docs/clients.md says what a script does. A Lightning `training_step` that
trains on nothing returns `{"loss": ..., "skipped": True}`: no loss is reported for it.
"""
from __future__ import annotations

import logging
from typing import Any

from trainer.heartbeat import Heartbeat

__all__ = ["LightningBeats", "HFBeats", "lightning_callback", "hf_callback"]


def _loss(value: Any) -> float | None:
    """A float from a tensor, a number or Lightning's `{"loss": tensor}`; None when there is none."""
    if isinstance(value, dict):
        value = None if value.get("skipped") else value.get("loss")  # a step that trained on nothing says nothing
    if value is None:
        return None
    try:
        return float(value.detach()) if hasattr(value, "detach") else float(value)  # NaN too: the guard wants it
    except (TypeError, ValueError, RuntimeError):
        return None


class _Beats:
    _heartbeat: Heartbeat | None = None
    _step = 0

    def _beat(self, local_rank: int, global_rank: int, step: int, phase: str, loss: float | None = None) -> None:
        if self._heartbeat is None:
            self._heartbeat = Heartbeat.from_env(local_rank, global_rank=global_rank)
        self._step = step
        self._heartbeat.beat(step, phase, loss)


class LightningBeats(_Beats):
    """Lightning's hooks (mixed into a `lightning.pytorch.Callback` by `lightning_callback`)."""

    def _at(self, trainer: Any, phase: str, loss: float | None = None) -> None:
        self._beat(trainer.local_rank, trainer.global_rank, trainer.global_step, phase, loss)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._at(trainer, "train")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._at(trainer, "train", _loss(outputs))

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._at(trainer, "eval")

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
        self._at(trainer, "save")


class HFBeats(_Beats):
    """transformers' TrainerCallback hooks (mixed into a `TrainerCallback` by `hf_callback`)."""

    def _at(self, args: Any, state: Any, phase: str, loss: float | None = None) -> None:
        self._beat(args.local_process_index, args.process_index, state.global_step, phase, loss)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if getattr(args, "logging_nan_inf_filter", False):  # read at every step: the guard must see the NaN
            args.logging_nan_inf_filter = False
            logging.getLogger(__name__).warning("logging_nan_inf_filter turned off: the divergence guard reads the "
                                                "logged loss, NaN included")
        self._at(args, state, "train")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not getattr(control, "should_log", False):  # else on_log beats this step with its loss: a beat of the same
            self._at(args, state, "train")  # step and phase now would make the heartbeat drop that one (throttle)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        loss = _loss((logs or {}).get("loss"))
        if loss is not None:
            self._at(args, state, "train", loss)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._at(args, state, "eval")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._at(args, state, "save")


def lightning_callback() -> Any:
    """A `lightning.pytorch.Callback` that writes the supervisor's heartbeats (imports Lightning)."""
    from lightning.pytorch.callbacks import Callback  # type: ignore[import-not-found, unused-ignore]

    return type("SupervisorHeartbeat", (LightningBeats, Callback), {})()


def hf_callback() -> Any:
    """A `transformers.TrainerCallback` that writes the supervisor's heartbeats (imports transformers)."""
    from transformers import TrainerCallback  # type: ignore[import-not-found, unused-ignore]

    return type("SupervisorHeartbeat", (HFBeats, TrainerCallback), {})()
