"""A diagnostic, off by default: how late the event loop runs a 10 ms tick, written to a file at exit.

The loop never blocks on store work (docs/design.md, "One event loop"). To measure it (bench/loop_stall.py), set
`FSDP_SUPERVISOR_LOOP_PROBE=/path/probe.json` in the environment of `fsdp-supervisor run`: the loop then
also runs a tick every 10 ms and records how late each one ran (a tick that runs 80 ms after its deadline
means the loop could not react to anything for 80 ms). At exit the file gets
`{"interval_s", "clock": "monotonic", "max_late_s", "samples": [[monotonic time, lateness s], ...]}`
(the most recent 100,000 ticks). Without the variable nothing is added to the loop.
"""
from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path

__all__ = ["LoopProbe", "PROBE_ENV", "INTERVAL_S"]

PROBE_ENV = "FSDP_SUPERVISOR_LOOP_PROBE"
INTERVAL_S = 0.01
_KEEP = 100_000  # ~17 minutes of ticks: bounded memory however long the diagnostic run lasts


class LoopProbe:
    """Call `tick()` every INTERVAL_S from the loop; `write()` once at exit."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self.clock = path, clock
        self.due: float | None = None
        self.max_late = 0.0
        self.samples: deque[tuple[float, float]] = deque(maxlen=_KEEP)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> LoopProbe | None:
        path = env.get(PROBE_ENV)
        return cls(Path(path)) if path else None

    def tick(self) -> None:
        now = self.clock()
        if self.due is not None:
            late = max(0.0, now - self.due)
            self.max_late = max(self.max_late, late)
            self.samples.append((round(now, 6), round(late, 6)))
        self.due = now + INTERVAL_S  # the loop re-arms the tick right after this call returns

    def write(self) -> None:
        doc = {"interval_s": INTERVAL_S, "clock": "monotonic", "max_late_s": round(self.max_late, 6),
               "samples": list(self.samples)}
        try:
            self.path.write_text(json.dumps(doc))
        except OSError:
            pass  # a diagnostic must never turn a clean exit into a failed one
