"""What each failure cost: steps lost and time lost by phase, as a history's records come in (pure).

`Fold` (supervisor/history/fold.py) feeds the `Ledger` at each attempt boundary and start-up record; the
definitions are docs/history.md's (`steps_lost`, `losses`). A failure's steps lost need the relaunch's resume step: at
its attempt_start when the supervisor chose the checkpoint, at its first_step (`from_step`) when the job picks
its own; a relaunch that never trained leaves it unknown.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from supervisor.history.records import is_failure
from supervisor.policy.attempt import REACHED_BY_HEARTBEAT

if TYPE_CHECKING:
    from supervisor.history.views import AttemptView

__all__ = ["Ledger", "Loss", "LOSS_PARTS"]

LOSS_PARTS = ("detection", "stop", "relaunch", "worker_start", "load", "redo")  # where a failure's time went


@dataclass
class Loss:
    """What one failure followed by a relaunch cost."""

    attempt: int
    reason: str
    reached: int | None  # the step the failed attempt reached
    resumed: int | None  # the step the relaunch resumed from
    steps_lost: int | None
    hung_ranks: list[int]
    seconds: dict[str, float | None]  # LOSS_PARTS -> seconds, None where unknown
    reached_by: str | None = None  # whose beat `reached` is: "heartbeat" (the node's file) makes steps_lost a lower bound

    def copy(self) -> Loss:
        return replace(self, hung_ranks=list(self.hung_ranks), seconds=dict(self.seconds))  # every field, its own lists

    @property
    def at_least(self) -> bool:
        """The step reached is the node heartbeat's, which may lag the job: the steps lost are a lower bound."""
        return self.reached_by == REACHED_BY_HEARTBEAT

    def to_json(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "reason": self.reason, "reached": self.reached, "resumed": self.resumed,
                "steps_lost": self.steps_lost, "reached_by": self.reached_by, "hung_ranks": list(self.hung_ranks),
                "time_lost_s": {k: None if v is None else round(v, 3) for k, v in self.seconds.items()}}


def _span(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else max(0.0, b - a)


class Ledger:
    def __init__(self, seconds_per_step: Callable[[AttemptView], float], recent: int | None = None) -> None:
        self.seconds_per_step, self.recent = seconds_per_step, recent  # recent: losses kept (Fold's)
        self.dropped = dict.fromkeys(LOSS_PARTS, 0.0)  # the seconds of the losses no longer kept
        self.steps_lost_total = 0
        self.steps_lost: list[int] = []
        self.losses: list[Loss] = []
        self.lost_s = 0.0  # training time whose work was redone (productive_s leaves it out)
        self._pending: tuple[AttemptView, AttemptView] | None = None  # (ended, relaunch) until its resume step is known
        self._filling: tuple[AttemptView, Loss] | None = None  # the relaunch whose start-up times the loss still takes

    def relaunched(self, prev: AttemptView | None, a: AttemptView) -> None:
        """Attempt `a` started after `prev` (None: no boundary to account, e.g. a first attempt)."""
        if self._pending is not None:  # the relaunch before ended without its resume step becoming known
            self._resolve(None, known=False)
        self._filling = None
        if prev is not None and (prev.max_step is not None or is_failure(prev.reason)):
            self._pending = (prev, a)
            if a.resumed_step is not None or prev.max_step is None:
                self._resolve(a.resumed_step)

    def trained(self, a: AttemptView, from_step: int | None) -> None:
        """`a` trained its first step beyond `from_step`, the step it resumed from."""
        if self._pending is not None and self._pending[1] is a:
            self._resolve(from_step)
        self.fill(a)

    def exited(self, a: AttemptView) -> None:
        """`a` ended: if it never trained, its resume step stays unknown."""
        if self._pending is not None and self._pending[1] is a:
            self._resolve(None, known=False)

    def fill(self, a: AttemptView) -> None:
        """The relaunch's start-up times, as far as its records tell them so far."""
        if self._filling is None or self._filling[0] is not a:
            return
        loss = self._filling[1]
        loss.seconds["worker_start"] = _span(a.started, a.first_beat_at)
        loss.seconds["load"] = _span(a.first_beat_at if a.first_beat_at is not None else a.started, a.first_step_at)

    def totals(self) -> dict[str, float]:
        """Seconds lost to failures in all, by LOSS_PARTS (unknown parts count 0)."""
        return {part: round(self.dropped[part] + sum(x.seconds.get(part) or 0.0 for x in self.losses), 3)
                for part in LOSS_PARTS}

    def _resolve(self, resumed: int | None, *, known: bool = True) -> None:
        """The relaunch's resume step is known (or never will be): count what the ended attempt's failure lost."""
        assert self._pending is not None
        prev, nxt = self._pending
        self._pending = None
        behind = None
        if known and prev.max_step is not None:
            behind = max(0, prev.max_step - (resumed or 0))
            self.lost_s += behind * self.seconds_per_step(prev)
        if not is_failure(prev.reason):
            return
        if behind is not None:
            self.steps_lost.append(behind)
            self.steps_lost_total += behind
        seen = prev.detected_at if prev.detected_at is not None else prev.ended
        loss = Loss(prev.number, prev.reason or "unknown", prev.max_step, resumed if known else None, behind,
                    list(prev.hung_ranks), {
                        "detection": _span(prev.progress_at, seen), "stop": _span(seen, prev.ended),
                        "relaunch": _span(prev.ended, nxt.started), "worker_start": None, "load": None,
                        "redo": None if behind is None else behind * self.seconds_per_step(prev)}, prev.reached_by)
        self.losses.append(loss)
        if self.recent is not None and len(self.losses) > self.recent:  # the oldest is complete: only its sums stay
            for part, v in self.losses.pop(0).seconds.items():
                self.dropped[part] += v or 0.0
            del self.steps_lost[:-self.recent]
        self._filling = (nxt, loss)
        self.fill(nxt)
