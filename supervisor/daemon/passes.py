"""When housekeeping passes run: one at a time, requests during one coalesced into one more, results dated.

A pass runs off the loop; whatever needs the root's state waits for one. This owns the root's *generation*, the
running and wanted passes, and when the last one finished. A failed pass is never a result: docs/design.md,
'The picture' and 'Notes for maintainers'.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path

from supervisor.daemon.housekeeping import Housekeeper, PassResult
from supervisor.daemon.system import System

__all__ = ["PassScheduler", "FRESH_PASS_S"]

FRESH_PASS_S = 2.0  # a pass this recent, with no file event since it began, still tells the truth


class PassScheduler:
    def __init__(self, house: Housekeeper, system: System, on_done: Callable[[PassResult | BaseException], None]) -> None:
        self.house, self.sys, self._on_done = house, system, on_done
        self.generation = 0  # file events under the checkpoint root so far (and changes we made there)
        self.running = False
        self._wanted = False
        self._may_delete = False  # whether the coalesced follow-up pass may run retention
        self._done_mono: float | None = None

    def changed(self) -> None:
        """The root changed (a file event, a quarantine): the last pass no longer describes it."""
        self.generation += 1

    def request(self, protect: Sequence[Path], *, may_delete: bool = True, settled: bool = False) -> None:
        """Run a pass off the loop, or one more after the running one.

        `may_delete=False` (file events): retention runs only if the pass finds a new commit. `settled`: no save
        can be in flight (Housekeeper.run_pass).
        """
        if self.running:
            self._wanted = True
            self._may_delete = self._may_delete or may_delete
            return
        self.running, self._wanted, self._may_delete = True, False, False
        generation, protect = self.generation, list(protect)
        known = self.house.latest.path if self.house.latest else None
        work = functools.partial(self.house.run_pass, generation=generation, protect=protect, may_delete=may_delete,
                                 unless_newest=known, settled=settled)
        self.sys.run_off_loop(work, self._on_done)

    def finished(self, outcome: PassResult | BaseException) -> PassResult:
        """Note that the running pass ended; a crashed pass becomes a failed result (it costs a pass, no more)."""
        self.running = False
        if isinstance(outcome, BaseException):  # a bug in the store must cost a pass, not the supervisor
            outcome = PassResult(self.generation, error=f"{type(outcome).__name__}: {outcome}")
        # Only a successful pass can be reused: a failed one leaves nothing fresh (not the success before it).
        self._done_mono = self.sys.monotonic() if outcome.error is None else None
        return outcome

    def follow_up(self, protect: Sequence[Path], *, settled: bool = False) -> None:
        """Run the pass that was asked for while the last one ran, if any (`settled`: as of now)."""
        if self._wanted:
            self.request(protect, may_delete=self._may_delete, settled=settled)

    def fresh(self) -> PassResult | None:
        """The last pass, if it still tells the truth: finished within FRESH_PASS_S, no change since it began."""
        last, done = self.house.last, self._done_mono
        if last is None or done is None or self.running or last.generation != self.generation:
            return None
        return last if self.sys.monotonic() - done <= FRESH_PASS_S else None
