"""The divergence guard's decisions (pure): is the loss in the beats diverging, where did it begin, what next.

`Detector` is fed every new beat of an attempt in the order read. The rules and why a median:
docs/reliability.md, 'The divergence guard'; the onset and what follows: docs/operations.md, 'What happens when
things go wrong'. Abnormal losses never enter the level. daemon/divergence.py carries out what is decided here.
"""
from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from supervisor.checkpoints import CheckpointInfo
from supervisor.contract import Beat

__all__ = ["WINDOW", "MIN_HISTORY", "Diverged", "Detector", "Open", "same_region", "skip_steps", "last_good",
           "diverged_saves"]

WINDOW = 32  # normal losses the level is the median of (one per step)
MIN_HISTORY = 8  # normal losses before the level is their median (until then: factor x their highest)


@dataclass(frozen=True)
class Diverged:
    """What the detector found: the onset, the beat that tripped it (its step and source), its loss and why."""

    onset_step: int
    step: int
    rank: int | None  # None: the node's heartbeat
    loss: float | None  # None for nan/inf
    why: str  # "nan", "inf" or "spike"
    level: float | None = None  # the running level a spike was measured against
    since: int | None = None  # saves from this step on are diverged: the step after the last normal beat seen


class Detector:
    """One attempt's loss watch (a new attempt starts a new one, fed first the loss its resumed checkpoint recorded)."""

    def __init__(self, spike_factor: float, spike_patience: int) -> None:
        self.factor, self.patience = spike_factor, spike_patience
        self._normal: deque[float] = deque(maxlen=WINDOW)
        self._steps: deque[int] = deque(maxlen=WINDOW)  # the steps of `_normal` (not the newest only: one beat
        # that lies a huge step would freeze the level for the rest of the attempt)
        self._stretch: list[tuple[int, int | None, float]] = []  # the abnormal beats in a row: (step, rank, loss)
        self._last_normal: int | None = None  # the newest step seen with a normal loss

    def level(self) -> float | None:
        if not self._normal:
            return None
        return statistics.median(self._normal) if len(self._normal) >= MIN_HISTORY else max(self._normal) * self.factor

    def limit(self) -> float | None:
        """Above it a loss is abnormal: factor x the level for a positive one; measured from the level by its size,
        or by the spread of the normal losses (their interquartile range) when larger, so that a negative loss, or
        one whose median is 0 (most batches exactly 0), is judged on its own scale. None: no scale (all 0) yet."""
        if not self._normal:
            return None
        if len(self._normal) < MIN_HISTORY:
            top = max(self._normal)
            return top + (self.factor ** 2 - 1) * abs(top) if top else None
        q1, _, q3 = statistics.quantiles(self._normal, n=4)
        median = statistics.median(self._normal)
        scale = max(abs(median), q3 - q1)
        return median + (self.factor - 1) * scale if scale else None

    def feed(self, rank: int | None, beat: Beat) -> Diverged | None:
        """Take one new beat; a `Diverged` when this beat makes the loss a divergence, else None."""
        if beat.loss_bad is not None:
            return self._found(rank, beat, None, beat.loss_bad, None)
        loss = beat.loss
        if loss is None:
            return None
        level, limit = self.level(), self.limit()
        if level is None or limit is None or loss <= limit:
            start = self._stretch[0][0] if self._stretch else None
            if start is not None and beat.step <= start:  # older news (a source read late): the stretch goes on
                self._last_normal = max(beat.step, self._last_normal or 0) if beat.step < start else self._last_normal
                return None
            self._stretch, self._last_normal = [], max(beat.step, self._last_normal or 0)
            if beat.step not in self._steps:
                self._normal.append(loss)
                self._steps.append(beat.step)
            return None
        if not self._stretch or beat.step > self._stretch[-1][0]:
            self._stretch.append((beat.step, rank, loss))
        if len(self._stretch) < self.patience:
            return None
        return self._found(rank, beat, loss, "spike", level)

    def _found(self, rank: int | None, beat: Beat, loss: float | None, why: str, level: float | None) -> Diverged:
        onset = min(self._stretch[0][0], beat.step) if self._stretch else beat.step
        since = onset if self._last_normal is None else min(onset, self._last_normal + 1)
        return Diverged(onset, beat.step, rank, loss, why, level, since)


@dataclass(frozen=True)
class Open:
    """A divergence not yet left behind; persisted in the run dir (`divergence.json`) across supervisor restarts."""

    onset_step: int
    step: int
    rank: int | None
    loss: float | None
    why: str
    attempt: int  # the attempt that diverged: its saves from `since` on are `diverged`
    rollbacks: int = 0  # rollbacks already made for this region
    resume_step: int | None = None  # where the last rollback resumed from
    skip: int = 0  # the data steps the last rollback skipped
    since: int | None = None  # Diverged.since (None: the onset)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Any) -> Open:
        """ValueError for anything that is not an `Open` written by us."""
        ints, typed = ("onset_step", "step", "attempt", "rollbacks", "skip"), (("rank", int), ("loss", float),
                                                                             ("resume_step", int), ("since", int))
        if not isinstance(d, dict) or set(d) != set(cls.__dataclass_fields__) or d["why"] not in ("nan", "inf", "spike") \
                or not all(type(d[k]) is int and d[k] >= 0 for k in ints) \
                or not all(d[k] is None or type(d[k]) is t for k, t in typed):
            raise ValueError("not a divergence record")
        return cls(**d)


def same_region(before: Open | None, found: Diverged, skip_after_onset: int) -> bool:
    """A new divergence is the open one again when the run did not get `skip_after_onset` steps past its onset."""
    return before is not None and found.onset_step <= before.onset_step + skip_after_onset


def skip_steps(onset_step: int, resume_step: int, skip_after_onset: int, before: Open | None) -> int:
    """Data steps the rollback skips: (onset - resume) + skip_after_onset; when it resumes from no later than the
    previous rollback of the region did, that rollback's skip is added (the checkpoint knows nothing of it, and
    the same window again would diverge again)."""
    skip = max(0, onset_step - resume_step) + skip_after_onset
    if before is not None and before.resume_step is not None and resume_step <= before.resume_step:
        skip += before.skip
    return skip


def diverged_saves(checkpoints: Sequence[CheckpointInfo], onset_step: int) -> list[CheckpointInfo]:
    """The complete checkpoints saved at or after the onset (their weights had seen the bad step) not yet marked."""
    return [c for c in checkpoints if c.complete and not c.quarantined and (c.step is None or c.step >= onset_step)]


def last_good(checkpoints: Sequence[CheckpointInfo], onset_step: int, keep: int) -> list[CheckpointInfo]:
    """The newest `keep` complete usable checkpoints before the onset, newest first (the first is the last good)."""
    good = [c for c in checkpoints if c.complete and not c.quarantined and c.step is not None and c.step < onset_step]
    return sorted(good, key=lambda c: c.step or 0, reverse=True)[:max(1, keep)]
