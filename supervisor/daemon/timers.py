"""The daemon's one-shot timers: typed keys (the core's `Timer`, the loop's periodic `Tick`) on a monotonic clock."""
from __future__ import annotations

from dataclasses import dataclass

from supervisor.vocabulary import Vocabulary

__all__ = ["Timer", "Tick", "TimerKey", "Timers"]


class Timer(Vocabulary):
    """The core's one-shot timers."""

    LAUNCH = "launch"  # backoff over: launch the next attempt
    HANG = "hang"  # no heartbeat progress within the allowance
    HANG_DUMPS = "hang_dumps"  # stack dumps requested: have they all landed in the job's output yet?
    HANG_TERM = "hang_term"  # the longest wait for the stack dumps is over: SIGTERM the hung job
    HANG_KILL = "hang_kill"  # hang_kill_grace_s after that SIGTERM: SIGKILL the whole job
    RANKS = "ranks"  # look at the per-rank heartbeats again
    STOP_KILL = "stop_kill"  # stop_timeout_s after SIGTERM: SIGKILL
    SCAN = "scan"  # debounced file events under the checkpoint root
    RETENTION = "retention"  # periodic housekeeping pass
    PUBLISH = "publish"  # the latest heartbeat's state.json write, held back (daemon/publisher.py)


@dataclass(frozen=True)
class Tick:
    """The event loop's periodic callback number `index` (sd_notify's watchdog, the progress line, ...)."""

    index: int

    def __str__(self) -> str:
        return f"tick:{self.index}"


TimerKey = Timer | Tick


class Timers:
    """Named one-shot deadlines on a monotonic clock; setting a key again replaces it."""

    def __init__(self) -> None:
        self._deadlines: dict[TimerKey, float] = {}

    def set(self, key: TimerKey, at: float) -> None:
        self._deadlines[key] = at

    def every(self, key: TimerKey, interval: float, now: float) -> None:
        """`key` at the next multiple of `interval` on the clock: periodic work of one interval shares one wake-up."""
        self._deadlines[key] = (now // interval + 1) * interval

    def cancel(self, key: TimerKey) -> None:
        self._deadlines.pop(key, None)

    def postpone(self, by: float) -> None:
        """Move every deadline `by` seconds later (time the daemon spent frozen was nobody's time)."""
        for key in self._deadlines:
            self._deadlines[key] += by

    def pending(self, key: TimerKey) -> bool:
        return key in self._deadlines

    def next_deadline(self) -> float | None:
        return min(self._deadlines.values(), default=None)

    def pop_due(self, now: float) -> list[TimerKey]:
        # Ties at one deadline fire in name order, whatever the key's type.
        due = sorted((kv for kv in self._deadlines.items() if kv[1] <= now), key=lambda kv: (kv[1], str(kv[0])))
        for key, _ in due:
            del self._deadlines[key]
        return [key for key, _ in due]


