"""Rank-0 progress: a tqdm bar when stderr is a terminal, else a log line every `log_every` steps."""
from __future__ import annotations

import sys
import time
from typing import Any

from supervisor.host.log import Log

__all__ = ["Progress"]


class Progress:
    """Reports step, loss, tokens/s and s/step; silent on ranks other than 0."""

    def __init__(self, *, rank: int, start: int, total: int, tokens_per_step: int, log_every: int,
                 log: Log, stream: Any = None) -> None:
        self.enabled = rank == 0
        self.total, self.tokens_per_step, self.log_every, self.log = total, tokens_per_step, log_every, log
        self._mark_step, self._mark_time = start, time.perf_counter()
        self._bar = None
        stream = stream or sys.stderr
        if self.enabled and stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, file=stream, unit="step", dynamic_ncols=True)

    def update(self, step: int, loss: float) -> None:
        """Called after every optimizer step; `step` counts steps done."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            return
        if step % self.log_every and step != self.total:
            return
        now = time.perf_counter()
        steps, seconds = step - self._mark_step, now - self._mark_time
        self._mark_step, self._mark_time = step, now
        if steps <= 0:
            return
        self.log.info("train", step=step, loss=round(loss, 5),
                      tokens_per_s=round(steps * self.tokens_per_step / seconds),
                      s_per_step=round(seconds / steps, 4))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
