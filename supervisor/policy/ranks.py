"""Every rank watched: what the heartbeats say about progress, a hang's culprit and stragglers (pure).

Sources: the node's heartbeat file (key `None`) and one file per rank (key: its global rank). `RankWatch` gives the
hang `deadline`, the `culprits` and the stragglers (`look`): docs/operations.md, 'Hangs and stragglers'.
"""
from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from supervisor.config import HealthSection
from supervisor.contract import Beat, Phase
from supervisor.policy.attempt import hang_timeout

__all__ = ["RankWatch", "Source", "Culprit", "StragglerChange", "STRAGGLER_LOOKS", "STUCK_STATES", "WAITED_FOR"]

# Work one rank may do alone while the others wait for it at a barrier (their allowance is then the busy rank's).
WAITED_FOR = frozenset({Phase.LOAD, Phase.SAVE, Phase.EVAL})
STEP_GAPS, MIN_GAPS = 256, 10  # recent gaps between training beats kept for "auto", and how many make a p99
STRAGGLER_LOOKS = 3  # consecutive looks above the factor before a rank is flagged (one look a second)
_SMOOTHING = 0.3  # weight of the newest step time in a rank's moving average
# psutil's words for a process that cannot run, and how `status` says it.
STUCK_STATES = {
    "stopped": "stopped (SIGSTOP or SIGTSTP)",
    "tracing-stop": "stopped by a debugger",
    "disk-sleep": "in uninterruptible sleep (I/O)",
    "zombie": "exited, not reaped",
    "dead": "exited",
}


@dataclass
class Source:
    """One heartbeat source: the node's file (rank None) or one rank's own file."""

    rank: int | None
    beat: Beat
    changed: float  # monotonic time its beat last changed
    since: float = -1.0  # when its allowance started: its change, or later when nobody watched (restart)
    step_s: float | None = None  # moving average of the rank's own step time
    above: int = 0  # consecutive looks with step_s above factor x the others' median
    straggler: bool = False


@dataclass(frozen=True)
class Culprit:
    rank: int
    why: str


@dataclass(frozen=True)
class StragglerChange:
    rank: int
    flagged: bool  # True: became a straggler; False: no longer one
    step_s: float | None
    others_s: float | None  # the median of the other ranks' step times


@dataclass
class RankWatch:
    sources: dict[int | None, Source] = field(default_factory=dict)
    dropped: int = 0  # rank files beyond the contract's bound, last look
    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_GAPS))  # seconds between training beats

    def p99(self) -> float | None:
        """The recent p99 of the seconds between a training beat and the next change (any source's), as read: the
        step time "auto" hang detection scales (None until `MIN_GAPS` are known)."""
        ordered = sorted(self.gaps)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if len(ordered) >= MIN_GAPS else None

    def see(self, rank: int | None, beat: Beat, now: float) -> bool:
        """A beat read from `rank`'s source at `now`; True when it changed (progress)."""
        src = self.sources.get(rank)
        if src is None:
            self.sources[rank] = Source(rank, beat, now, now, step_s=beat.step_s)
            return True
        if beat == src.beat:
            return False
        if src.beat.phase in (None, Phase.TRAIN) and beat.step > src.beat.step:
            self.gaps.append(now - src.changed)
        sample = beat.step_s if beat.step_s is not None else _rate(src.beat, beat)
        if sample is not None:
            src.step_s = sample if src.step_s is None else (1 - _SMOOTHING) * src.step_s + _SMOOTHING * sample
        src.beat, src.changed, src.since = beat, now, now
        return True

    def postpone(self, by: float) -> None:
        """Nothing was watched for `by` seconds (the supervisor did not run): every source's allowance goes on
        where it stood (its silence, `idle`, still counts from its last change)."""
        for src in self.sources.values():
            src.since += by

    def deadline(self, health: HealthSection) -> float | None:
        """When the slowest source overstays its allowance (only busy sources count while there is one: the
        others may be waiting for them); None without a source or with hang detection off."""
        p99 = self.p99()
        ends = [(src.beat.phase in WAITED_FOR, src.since + t) for src in self.sources.values()
                if (t := hang_timeout(health, src.beat, startup=False, p99=p99)) is not None]
        busy = [end for waited_for, end in ends if waited_for]
        return min(busy or [end for _, end in ends], default=None)

    def describe(self, health: HealthSection) -> str:
        """What hang detection does now, for `status`."""
        setting, p99 = health.hang_timeout_s, self.p99()
        if not setting or not self.sources:
            return ("off: the job does not beat (no heartbeat yet this attempt); progress is judged by its checkpoints"
                    if setting else "off (hang_timeout_s = 0)")
        if setting != "auto" or p99 is None:
            return (f"after {setting:g} s without progress" if setting != "auto" else
                    f"auto: save_timeout_s ({health.save_timeout_s:g} s) until {MIN_GAPS} steps are seen")
        return f"auto: after {hang_timeout(health, None, startup=False, p99=p99):.0f} s (recent p99 step {p99:.3g} s)"

    def idle(self, now: float) -> float | None:
        """Seconds since the slowest source last changed."""
        return max((now - s.changed for s in self.sources.values()), default=None)

    def ranks(self) -> list[Source]:
        """The per-rank sources, by rank."""
        return sorted((s for s in self.sources.values() if s.rank is not None), key=lambda s: s.rank or 0)

    def culprits(self, states: Mapping[int, str]) -> list[Culprit]:
        """Who hung: workers that cannot run (`states`: rank -> psutil status), else the ranks behind the others."""
        stuck = [Culprit(rank, STUCK_STATES[state]) for rank, state in sorted(states.items()) if state in STUCK_STATES]
        if stuck:
            return stuck
        ranks = self.ranks()
        steps = {s.beat.step for s in ranks}
        if len(steps) < 2:
            return []
        low, high = min(steps), max(steps)
        return [Culprit(s.rank, f"behind: step {low}, others up to {high}")
                for s in ranks if s.rank is not None and s.beat.step == low]

    def look(self, factor: float) -> list[StragglerChange]:
        """One look at the ranks' step times; the stragglers flagged or cleared by it."""
        timed = [s for s in self.ranks() if s.step_s is not None]
        changes: list[StragglerChange] = []
        for src in timed:
            others = [o.step_s for o in timed if o is not src and o.step_s is not None]
            median = statistics.median(others) if others else None
            slow = factor > 0 and median is not None and median > 0 and (src.step_s or 0) > factor * median
            src.above = src.above + 1 if slow else 0
            flagged = src.above >= STRAGGLER_LOOKS or (src.straggler and slow)
            if flagged != src.straggler:
                src.straggler = flagged
                assert src.rank is not None
                changes.append(StragglerChange(src.rank, flagged, src.step_s, median))
        return changes

    def stragglers(self) -> list[int]:
        return [s.rank for s in self.ranks() if s.straggler and s.rank is not None]


def _rate(old: Beat, new: Beat) -> float | None:
    """Seconds per step between two beats of one rank, from the job's own clock; None when it cannot tell."""
    if old.time is None or new.time is None or new.step <= old.step or new.time <= old.time:
        return None
    return (new.time - old.time) / (new.step - old.step)
