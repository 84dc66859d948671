"""Publishing the supervisor's `Status`: state.json, the history's annotation and sd_notify, in one write.

Beats publish at most every `BEAT_PUBLISH_S` (the latest one always lands, from a timer), everything else at once;
why, and how a failed write is said: docs/design.md, 'Notes for maintainers'.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from supervisor.daemon.events import Event, StatusChanged
from supervisor.daemon.statefile import STATE_FILE, write_status
from supervisor.daemon.system import System
from supervisor.daemon.timers import Timer
from supervisor.host.log import Log
from supervisor.policy.state import Status

__all__ = ["StatePublisher", "BEAT_PUBLISH_S"]

BEAT_PUBLISH_S = 0.5


class StatePublisher:
    def __init__(self, run_dir: Path, system: System, log: Log, annotate: Callable[[Status], None] | None,
                 notify: Callable[[Status], object] | None = None) -> None:
        self.path = run_dir / STATE_FILE
        self.run_dir, self.sys, self.log, self.annotate, self.notify = run_dir, system, log, annotate, notify
        self.write_error: str | None = None  # the last state.json write failed with this
        self._published_mono: float | None = None  # when state.json was last written

    def publish(self, status: Status) -> None:
        self.sys.timers.cancel(Timer.PUBLISH)  # this write carries whatever a held-back beat changed
        self._published_mono = self.sys.monotonic()
        status.updated_at = self.sys.now()
        if self.annotate is not None:  # the history's numbers (goodput, restart latency)
            self.annotate(status)
        try:
            write_status(self.run_dir, status)
        except OSError as exc:  # full, read-only or gone: keep supervising; say so once, not on every beat
            error = f"{exc.strerror or exc}"
            if self.write_error != error:
                self.log.error("state_write_failed", path=str(self.path), error=error)
            self.write_error = error
        else:
            if self.write_error is not None:
                self.log.info("state_write_recovered", path=str(self.path))
            self.write_error = None
        if self.notify is not None:
            self.notify(status)

    def notify_event(self, event: Event) -> None:
        """The bus's subscriber: state.json follows every `StatusChanged`."""
        if isinstance(event, StatusChanged):
            (self.publish_beat if event.beat else self.publish)(event.status)

    def publish_beat(self, status: Status) -> None:
        """Publish a heartbeat's change now, or with the next write due within BEAT_PUBLISH_S."""
        due = None if self._published_mono is None else self._published_mono + BEAT_PUBLISH_S
        if due is None or self.sys.monotonic() >= due:
            self.publish(status)
        elif not self.sys.timers.pending(Timer.PUBLISH):
            self.sys.timers.set(Timer.PUBLISH, due)
