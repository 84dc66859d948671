"""Graceful stop: SIGTERM/SIGINT set a flag, and every rank agrees at a step boundary to save and exit.

Use it from your own loop::

    from trainer.stopping import GracefulStop

    stop = GracefulStop(group=dist.new_group(backend="gloo", timeout=timedelta(seconds=60)))
    stop.install()                       # also: SIGUSR1 dumps every thread's stack to stderr
    for step in range(start, total):
        train_one_step()
        if stop.should_stop():           # collective: call it on every rank at the same point
            save_checkpoint(...)         # every rank saves the same step
            break
    stop.uninstall()

`should_stop` is a one-element all-reduce (MAX): if any rank was signalled, all ranks stop at the same step.
Give it a gloo group with a short timeout so that a dead peer makes it raise instead of hanging. A second
SIGINT (a person pressing Ctrl+C again, later than `repeat_grace_s` after the first stop signal) exits the
process at once with 128 + SIGINT. A repeated SIGTERM never does: launchers repeat it (Slurm signals every
process of a step, torchrun forwards, systemd and the supervisor send their own), and whoever must end the
process now sends SIGKILL; cutting the emergency save short would only lose it.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

from trainer import stackdump

__all__ = ["GracefulStop"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class GracefulStop:
    """A stop flag set by signals, plus the cross-rank agreement on it."""

    def __init__(
        self,
        group: Any = None,
        *,
        signals: Iterable[int] = STOP_SIGNALS,
        repeat_grace_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        hard_exit: Callable[[int], object] = os._exit,
    ) -> None:
        self.group = group
        self.signals = tuple(signals)
        # A launcher may deliver the same stop twice within milliseconds (e.g. a signal to the whole process
        # tree plus torchrun forwarding it); only a repeat after this window means "stop now".
        self.repeat_grace_s = repeat_grace_s
        self._clock = clock
        self._hard_exit = hard_exit
        self.signum: int | None = None
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        """Whether this process was asked to stop (local; see `should_stop` for the agreed answer)."""
        return self.signum is not None

    def install(self) -> GracefulStop:
        """Take over the stop signals and make SIGUSR1 dump all thread stacks (main thread only)."""
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self.handle)
        stackdump.install()  # a dump thread woken by the signal, never a walk from the handler: trainer/stackdump.py
        return self

    def uninstall(self) -> None:
        """Give the signals back to their previous handlers."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        stackdump.uninstall()

    def handle(self, signum: int, frame: FrameType | None = None) -> None:
        """Signal handler: the first signal sets the flag; a later SIGINT exits at once, a SIGTERM never."""
        now = self._clock()
        if self.signum is None:
            self.signum, self._first_at = signum, now
            return
        if now - self._first_at < self.repeat_grace_s or signum != signal.SIGINT:
            return
        sys.stderr.write("trainer: second stop signal (SIGINT), exiting without saving\n")
        sys.stderr.flush()
        self._hard_exit(128 + signum)

    def should_stop(self) -> bool:
        """Collective: True on every rank if any rank was signalled. Raises if a peer is gone (group timeout)."""
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            return self.requested
        device = "cpu"
        if "nccl" in str(dist.get_backend(self.group)) and "gloo" not in str(dist.get_backend(self.group)):
            device = f"cuda:{torch.cuda.current_device()}"
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())
