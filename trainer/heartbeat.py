"""Heartbeat file for the supervisor: `{"step", "time", "phase", "loss"}`, rewritten atomically.

The supervisor judges liveness by this file (DESIGN.md, hang detection). One rank per node writes it (local
rank 0: every node runs its own supervisor). Use it from your own loop::

    from trainer.heartbeat import Heartbeat

    hb = Heartbeat.from_env(rank=int(os.environ["LOCAL_RANK"]))   # no-op unless FSDP_SUPERVISOR_HEARTBEAT is set
    hb.beat(step, "load")
    for step in ...:
        ...
        hb.beat(step, "train", loss=loss)          # throttled to once a second
        hb.beat(step, "save")                      # a phase change is always written at once
"""
from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["Heartbeat", "HEARTBEAT_ENV", "PHASES"]

HEARTBEAT_ENV = "FSDP_SUPERVISOR_HEARTBEAT"
PHASES = ("load", "train", "save")


class Heartbeat:
    """Atomically rewrites a small JSON file on every phase change and at most every `min_interval_s`."""

    def __init__(
        self,
        path: str | os.PathLike | None,
        *,
        min_interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path) if path else None
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._last_phase: str | None = None
        self._last_write = -math.inf
        self.last_error: OSError | None = None

    @classmethod
    def from_env(cls, rank: int = 0, **kwargs: object) -> Heartbeat:
        """The heartbeat named by FSDP_SUPERVISOR_HEARTBEAT when `rank` (pass the local rank) is 0; else disabled."""
        path = os.environ.get(HEARTBEAT_ENV) if rank == 0 else None
        return cls(path, **kwargs)  # type: ignore[arg-type]

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def beat(self, step: int, phase: str, loss: float | None = None, *, force: bool = False) -> bool:
        """Record progress; returns whether the file was rewritten."""
        if phase not in PHASES:
            raise ValueError(f"heartbeat phase must be one of {PHASES}, got {phase!r}")
        if self.path is None:
            return False
        now = self._clock()
        due = now - self._last_write >= self.min_interval_s
        if not (force or due or phase != self._last_phase):
            return False
        if loss is not None and not math.isfinite(loss):
            loss = None  # JSON has no NaN; the supervisor reads null as "unknown"
        try:
            self._write({"step": int(step), "time": now, "phase": phase, "loss": loss})
        except OSError as exc:
            # A heartbeat we cannot write must not kill a training run; the supervisor sees it go stale.
            self.last_error = exc
            return False
        self._last_phase, self._last_write = phase, now
        return True

    def _write(self, record: dict[str, object]) -> None:
        # Same-directory temp file + os.replace: readers see the old or the new content, never a torn one.
        assert self.path is not None
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(record, fh)
        os.replace(tmp, self.path)
