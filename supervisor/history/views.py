"""An attempt, a sample, a mark and the summary, as the history tells them; and the record field readers.

The value types `Fold` (supervisor/history/fold.py) builds and the report draws. A record is untrusted (a hand
edit, a newer version): each field is read by type, and one that does not fit counts as missing (integers beyond
2**63, non-finite numbers, times outside supervisor.history.records' range).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from supervisor.history.losses import Loss
from supervisor.history.records import is_time

__all__ = ["MAX_INT", "AttemptView", "Sample", "Mark", "Summary", "read_int", "read_time", "read_num", "read_str"]

MAX_INT = 2**63  # no step or attempt number is larger; a larger one would overflow every float it meets


def read_int(rec: dict[str, Any], key: str) -> int | None:
    v = rec.get(key)
    return v if type(v) is int and -MAX_INT < v < MAX_INT else None


def read_time(rec: dict[str, Any], key: str) -> float | None:
    v = rec.get(key)
    return float(v) if is_time(v) else None


def read_num(rec: dict[str, Any], key: str) -> float | None:
    v = rec.get(key)
    if type(v) is int:
        return float(v) if -MAX_INT < v < MAX_INT else None
    return v if type(v) is float and math.isfinite(v) else None


def read_str(rec: dict[str, Any], key: str) -> str | None:
    v = rec.get(key)
    return v if isinstance(v, str) else None


@dataclass(frozen=True)
class Sample:
    """One heartbeat sample of an attempt."""

    t: float
    step: int
    loss: float | None
    val_loss: float | None = None


@dataclass(frozen=True)
class Mark:
    """A point event on the timeline: a commit, a quarantine, a deletion."""

    t: float
    kind: str
    path: str | None = None
    step: int | None = None
    detail: str | None = None


@dataclass
class AttemptView:
    """One attempt as the history tells it."""

    number: int
    started: float
    resumed_from: str | None = None
    resumed_step: int | None = None
    ended: float | None = None  # when the supervisor saw it end; None: running, or its supervisor was killed
    reason: str | None = None
    code: int | None = None
    signal: str | None = None
    detail: str | None = None
    max_step: int | None = None
    train_s: float = 0.0
    save_s: float = 0.0
    first_step_at: float | None = None
    trained_at: float | None = None  # its first beat beyond the resume point (start-up ends there or at first_step)
    first_beat_at: float | None = None  # its first heartbeat: its workers are up
    progress_at: float | None = None  # its step last advanced (attempt_exit)
    detected_at: float | None = None  # its hang was detected (attempt_exit)
    hung_ranks: list[int] = field(default_factory=list)
    reached_by: str | None = None  # whose beat max_step is (attempt_exit; attempt.REACHED_BY_*), None: not said
    stacks: str | None = None  # where its hang's stack dumps were kept
    last_t: float = 0.0  # its last record
    samples: list[Sample] = field(default_factory=list)

    @property
    def steps_trained(self) -> int:
        return 0 if self.max_step is None else max(0, self.max_step - (self.resumed_step or 0))


@dataclass(frozen=True)
class Summary:
    attempts: int
    failures: int
    wall_s: float
    productive_s: float
    goodput: float | None
    restart_latency_s: list[float]
    steps_lost: list[int]
    checkpoint_overhead_s: float
    startup_s: float
    restart_s: float
    lost_s: float
    other_s: float
    exit_reasons: dict[str, int]
    checkpoints_committed: int
    quarantines: int
    sessions: int
    last_step: int | None
    losses: list[Loss] = field(default_factory=list)
    time_lost_s: dict[str, float] = field(default_factory=dict)
    corrupt: int = 0  # checkpoints quarantined because their bytes failed their checksums (not in `quarantines`)
    steps_lost_total: int = 0  # over every failure (`steps_lost` and `losses` of a compacted history: its latest)

    def to_json(self) -> dict[str, Any]:
        """Every field in order, rounded; times that only beats measure are null for a job without them (the HTML
        page's `unknown`), never 0."""
        t: Callable[[float], float | None] = (lambda v: None) if self.last_step is None else (lambda v: round(v, 3))
        doc: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        doc.update({k: t(doc[k]) for k in ("productive_s", "checkpoint_overhead_s", "startup_s", "restart_s", "lost_s",
                                           "other_s")})
        doc.update(wall_s=round(self.wall_s, 3), goodput=None if self.goodput is None else round(self.goodput, 4),
                   restart_latency_s=[round(x, 3) for x in self.restart_latency_s], steps_lost=list(self.steps_lost),
                   exit_reasons=dict(sorted(self.exit_reasons.items())), losses=[loss.to_json() for loss in self.losses],
                   time_lost_s={k: t(v) for k, v in self.time_lost_s.items()})
        return doc
