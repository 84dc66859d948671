"""Heartbeat file for the supervisor: `{"step", "time", "phase", "loss", "val_loss"}`, rewritten atomically.

The supervisor judges liveness by this file (docs/design.md, the job contract); the record's schema and its
validation live in `supervisor.contract`. One rank per node writes it (local rank 0: every node runs its own
supervisor). Use it from your own loop::

    from trainer.heartbeat import Heartbeat

    hb = Heartbeat.from_env(rank=int(os.environ["LOCAL_RANK"]))   # no-op unless FSDP_SUPERVISOR_HEARTBEAT is set
    hb.beat(step, "load")
    for step in ...:
        ...
        hb.beat(step, "train", loss=loss)          # throttled to once a second
        hb.beat(step, "eval", val_loss=val)        # a phase change is always written at once
        hb.beat(step, "save")
"""
from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

from supervisor.contract import ENV_HEARTBEAT, PHASES, heartbeat_record
from supervisor.host.atomic import write_atomic

__all__ = ["Heartbeat", "HEARTBEAT_ENV", "PHASES"]

HEARTBEAT_ENV = ENV_HEARTBEAT  # kept for scripts that import it from here


class Heartbeat:
    """Atomically rewrites a small JSON file on every phase change and at most every `min_interval_s`."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        *,
        min_interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path) if path else None
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._last_phase: str | None = None
        self._last_write = -math.inf
        self.val_loss: float | None = None  # the latest evaluation, repeated in every beat after it
        self.last_error: OSError | None = None

    @classmethod
    def from_env(cls, rank: int = 0, **kwargs: object) -> Heartbeat:
        """The heartbeat named by FSDP_SUPERVISOR_HEARTBEAT when `rank` (pass the local rank) is 0; else disabled."""
        path = os.environ.get(ENV_HEARTBEAT) if rank == 0 else None
        return cls(path, **kwargs)  # type: ignore[arg-type]

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def beat(self, step: int, phase: str, loss: float | None = None, *, val_loss: float | None = None,
             force: bool = False) -> bool:
        """Record progress; returns whether the file was rewritten. A new `val_loss` is always written."""
        if phase not in PHASES:
            raise ValueError(f"heartbeat phase must be one of {PHASES}, got {phase!r}")
        fresh_eval = val_loss is not None and val_loss != self.val_loss
        if val_loss is not None:
            self.val_loss = val_loss
        if self.path is None:
            return False
        now = self._clock()
        due = now - self._last_write >= self.min_interval_s
        if not (force or due or fresh_eval or phase != self._last_phase):
            return False
        record = heartbeat_record(step, phase, time=now, loss=loss, val_loss=self.val_loss)
        try:
            # No fsync: a beat lost in a crash is replaced by the next one within a second.
            write_atomic(self.path, json.dumps(record).encode(), durable=False)
        except OSError as exc:
            # A heartbeat we cannot write must not kill a training run; the supervisor sees it go stale.
            self.last_error = exc
            return False
        self._last_phase, self._last_write = phase, now
        return True
