"""This rank's own time for a training step, for the per-rank heartbeat's `step_s` (straggler detection).

Ranks that train in lockstep finish every step together: the wall time between two steps is the same on
every rank, whoever was slow. What differs is when each rank *arrives* at the step's closing collective (the
loss all-reduce): the rank that is slow gets there last, the others wait there. So the time measured here is
from the start of the step to that arrival. Waits inside the step (FSDP's all-gathers) still count, so a rank
that is slow before the first of them makes the others look as slow as itself: a straggler is seen when its
slowness is in the stretch after the step's last collective (the optimizer step, for FSDP2), and missed
otherwise, never the other way round. On a GPU the two points are CUDA events (no extra synchronisation: they
are read after the loss's `.item()` has synchronised the stream).
"""
from __future__ import annotations

import time
from typing import Any

__all__ = ["StepTimer"]


class StepTimer:
    def __init__(self, device: Any) -> None:
        self.cuda = getattr(device, "type", "cpu") == "cuda"
        self._start: Any = None
        self._end: Any = None

    def start(self) -> None:
        """The step begins."""
        self._start, self._end = self._mark(), None

    def arrived(self) -> None:
        """This rank reached the step's closing collective."""
        self._end = self._mark()

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self) -> float | None:
        """Start to arrival, once both happened (and, on a GPU, completed); else None."""
        if self._start is None or self._end is None:
            return None
        if not self.cuda:
            return float(self._end - self._start)
        try:
            return float(self._start.elapsed_time(self._end)) / 1000.0
        except RuntimeError:  # not completed yet: no number rather than a sync
            return None
