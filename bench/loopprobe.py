"""How late the supervisor's event loop runs a 10 ms tick, written to a file at exit (bench/loop_stall.py).

The loop never blocks on store work (docs/design.md, "One event loop"). To measure it, run the supervisor as
`python -m bench.loopprobe run -c CONFIG` (from the repo root) with `FSDP_SUPERVISOR_LOOP_PROBE=/path/probe.json`
in its environment: this launcher gives the loop one more tick, every 10 ms, which records how late it ran (a
tick that runs 80 ms after its deadline means the loop could not react to anything for 80 ms), then runs the
ordinary CLI. At exit the file gets
`{"interval_s", "clock": "monotonic", "max_late_s", "samples": [[monotonic time, lateness s], ...]}`
(the most recent 100,000 ticks). The shipped daemon knows nothing of it.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

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
        with contextlib.suppress(OSError):  # a diagnostic must never turn a clean exit into a failed one
            self.path.write_text(json.dumps(doc))


def main(env: Mapping[str, str] = os.environ) -> int:
    """`fsdp-supervisor` with the probe's tick added to the loop that `run` builds."""
    from supervisor.cli.app import main as cli
    from supervisor.daemon import run

    probe = LoopProbe.from_env(env)
    if probe is None:
        return cli()

    class ProbedLoop(run.EventLoop):
        def __init__(self, *args: Any, ticks: list[tuple[float, Callable[[], None]]], **kwargs: Any) -> None:
            super().__init__(*args, ticks=[*ticks, (INTERVAL_S, probe.tick)], **kwargs)

        def run(self, begin: Callable[[], None]) -> int:
            try:
                return super().run(begin)
            finally:
                probe.write()

    run.EventLoop = ProbedLoop  # type: ignore[misc]
    return cli()


if __name__ == "__main__":
    sys.exit(main())
