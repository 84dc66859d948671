"""What a run's history adds up to: goodput, restart latency, steps lost (a pure fold over history records).

`Fold` reads records one at a time; `summarize(records)` is the fold of a whole file. The daemon keeps one
`Fold` up to date as it writes and `report` folds the file, so status, metrics and report say the same. A
record that does not fit the schema (a hand edit, a newer version) is skipped field by field, never trusted.
Every number's definition: docs/history.md, 'What the numbers mean'.
"""
from __future__ import annotations

import json
from collections import Counter, deque
from collections.abc import Callable, Iterable
from itertools import accumulate
from typing import Any, ClassVar

from supervisor.checkpoints.integrity import CORRUPT_PREFIX
from supervisor.history.losses import LOSS_PARTS, Ledger, Loss
from supervisor.history.records import VERSION, _record, is_failure
from supervisor.history.views import (
    MAX_INT,
    AttemptView,
    Mark,
    Sample,
    Summary,
    read_int,
    read_num,
    read_str,
    read_time,
)
from supervisor.policy.attempt import REACHED_BY_HEARTBEAT, REACHED_BY_RANKS

__all__ = ["Fold", "AttemptView", "Sample", "Mark", "Summary", "Loss", "summarize", "fold_lines", "RECENT_LOSSES",
           "LOSS_PARTS"]

RECENT_LOSSES = 40  # samples behind `status`'s sparkline
_MAX_STRAGGLER_MARKS = 200  # straggler records kept for the report (a flapping rank writes many)
_CLOCK_STEP_S = 60.0  # records are written in time order give or take a heartbeat: further back, the clock stepped


class Fold:
    """The running summary of a history; with `keep=True` it also keeps what the HTML page draws.

    `recent` (the daemon's): only the latest `recent` attempts, recoveries and losses are kept, the totals run on, so
    that a month of restarts costs the daemon no memory; every record costs the same time whatever came before it.
    """

    def __init__(self, *, keep: bool = False, recent: int | None = None) -> None:
        self.keep, self.recent = keep, recent
        self.attempts: list[AttemptView] = []  # the latest `recent`
        self.count = self.last_number = 0  # attempts in all, the highest number
        self._steps = 0  # steps_trained over all attempts
        self._startup_s = 0.0  # startup_s of the attempts no longer kept
        self._by_number: dict[int, AttemptView] = {}
        self.sessions: list[list[float]] = []  # [start, end] of each supervisor run
        self._sessions_folded = 0  # sessions of a `folded` record's attempts
        self._open = False
        self._wall = 0.0  # wall seconds up to the last record (the current session: to its last record)
        self._session_t = 0.0  # the current session's newest record time (since the clock last stepped back)
        self.first_t: float | None = None
        self.last_t: float | None = None
        self.failures = 0
        self.exit_reasons: Counter[str] = Counter()
        self.restart_latency_s: list[float] = []
        self.ledger = Ledger(self._seconds_per_step, recent)  # steps and time lost per failure
        self.stragglers: list[Mark] = []  # straggler records, the latest _MAX_STRAGGLER_MARKS
        self.train_s = 0.0  # sum over attempts
        self.save_s = 0.0
        self._pending_failure_at: float | None = None  # detection of the first failure not yet recovered
        self.restart_s = 0.0  # a failed attempt's end to the next launch, within one supervisor run
        self._failed_at: float | None = None  # the end of the last attempt, when it failed and nothing launched since
        self.commits = 0
        self.quarantines = self.corrupt = 0  # corrupt: quarantined because its bytes failed their checksums
        self.last_step: int | None = None
        self.recent_loss: deque[float] = deque(maxlen=RECENT_LOSSES)
        self._recent_step: int | None = None  # the step of the newest loss in recent_loss
        self.marks: list[Mark] = []  # keep=True only
        self.end_state: str | None = None
        self.end_reason: str | None = None

    # ---- reading records -------------------------------------------------------------------------------------
    def add_all(self, records: Iterable[dict[str, Any]]) -> Fold:
        for rec in records:
            self.add(rec)
        return self

    def add(self, rec: dict[str, Any]) -> None:
        """Take one record in (a record that is not a dict with a finite `t` and a `kind` is ignored)."""
        t, kind = read_time(rec, "t"), read_str(rec, "kind")
        if t is None or kind is None:
            return
        self.first_t = t if self.first_t is None else min(self.first_t, t)
        self.last_t = t if self.last_t is None else max(self.last_t, t)
        self._session(t, kind)
        handler = self._HANDLERS.get(kind)
        if handler is not None:
            handler(self, t, rec)

    def _session(self, t: float, kind: str) -> None:
        if kind == "supervisor_start" or not self._open:
            self.sessions.append([t, t])
            self._open = True
            self._pending_failure_at = None  # the supervisor that saw it is gone: its recovery was cut short
            self._failed_at = None  # time between supervisor runs is no one's
            self._session_t = t
        else:
            self.sessions[-1][1] = max(self.sessions[-1][1], t)
            if t > self._session_t:
                self._wall += t - self._session_t
            if t > self._session_t or t < self._session_t - _CLOCK_STEP_S:  # not just written a little late
                self._session_t = t
        if kind == "supervisor_end":
            self._open = False

    def _attempt(self, t: float, rec: dict[str, Any]) -> AttemptView | None:
        number = read_int(rec, "attempt")
        if number is None:
            return None
        a = self._by_number.get(number)
        if a is None:  # its start was never written (e.g. a disk that was full then): begin it here
            a = self._new_attempt(number, t, None, None, boundary=False)
        a.last_t = max(a.last_t, t)
        return a

    def _new_attempt(self, number: int, t: float, resumed_from: str | None, resumed_step: int | None,
                     *, boundary: bool = True) -> AttemptView:
        prev = self.attempts[-1] if self.attempts else None
        a = AttemptView(number=number, started=t, resumed_from=resumed_from, resumed_step=resumed_step, last_t=t)
        self.attempts.append(a)
        self._by_number[number] = a
        self.count, self.last_number = self.count + 1, max(self.last_number, number)
        if self.recent is not None and len(self.attempts) > self.recent:
            old = self.attempts.pop(0)
            self._startup_s += self._startup(old, None)
            if self._by_number.get(old.number) is old:
                del self._by_number[old.number]
        self.ledger.relaunched(prev if boundary else None, a)
        return a

    def _seconds_per_step(self, a: AttemptView) -> float:
        if a.steps_trained > 0:
            return a.train_s / a.steps_trained
        return self.train_s / self._steps if self._steps > 0 else 0.0

    def _on_start(self, t: float, rec: dict[str, Any]) -> None:
        number = read_int(rec, "attempt")
        if number is not None:
            self._new_attempt(number, t, read_str(rec, "resumed_from"), read_int(rec, "resumed_step"))
            if self._failed_at is not None:
                self.restart_s += max(0.0, t - self._failed_at)
            self._failed_at = None

    def _set_counters(self, a: AttemptView, rec: dict[str, Any]) -> None:
        train, save = read_num(rec, "train_s"), read_num(rec, "save_s")
        if train is not None and train >= a.train_s:
            self.train_s += train - a.train_s
            a.train_s = train
        if save is not None and save >= a.save_s:
            self.save_s += save - a.save_s
            a.save_s = save

    def _note_step(self, a: AttemptView, step: int | None) -> None:
        if step is not None:
            before = a.steps_trained
            a.max_step = step if a.max_step is None else max(a.max_step, step)
            self._steps += a.steps_trained - before
            self.last_step = step

    def _on_beat(self, t: float, rec: dict[str, Any]) -> None:
        a, step = self._attempt(t, rec), read_int(rec, "step")
        if a is None or step is None:
            return
        self._note_step(a, step)
        self._set_counters(a, rec)
        if a.trained_at is None and step > (a.resumed_step or 0) and rec.get("phase") != "load":
            a.trained_at = t
        loss = read_num(rec, "loss")
        # One per step: a step's eval and save beats repeat its loss, and so does a resumed attempt's first beat at the
        # step it resumed (a load beat's loss is the checkpoint's, nothing measured now).
        if loss is not None and rec.get("phase") != "load":
            if self._recent_step == step:
                self.recent_loss.pop()
            self.recent_loss.append(loss)
            self._recent_step = step
        if self.keep:
            a.samples.append(Sample(t, step, loss, read_num(rec, "val_loss")))

    def _on_first_step(self, t: float, rec: dict[str, Any]) -> None:
        a = self._attempt(t, rec)
        if a is None:
            return
        a.first_step_at = t if a.first_step_at is None else a.first_step_at
        self._note_step(a, read_int(rec, "step"))
        self.ledger.trained(a, read_int(rec, "from_step"))
        if self._pending_failure_at is not None:
            self.restart_latency_s.append(max(0.0, t - self._pending_failure_at))
            if self.recent is not None:
                del self.restart_latency_s[:-self.recent]
            self._pending_failure_at = None

    def _on_exit(self, t: float, rec: dict[str, Any]) -> None:
        a = self._attempt(t, rec)
        if a is None or a.reason is not None:
            return
        at = read_time(rec, "at")
        a.ended = at if at is not None else t
        a.reason = read_str(rec, "reason") or "unknown"
        a.code, a.signal, a.detail = read_int(rec, "code"), read_str(rec, "signal"), read_str(rec, "detail")
        self._note_step(a, read_int(rec, "max_step"))
        self._set_counters(a, rec)
        a.progress_at, a.detected_at = read_time(rec, "progress_at"), read_time(rec, "detected_at")
        ranks = rec.get("hung_ranks")
        if isinstance(ranks, list):
            a.hung_ranks = [r for r in ranks[:64] if type(r) is int and 0 <= r < MAX_INT]
        by = rec.get("reached_by")
        a.reached_by = by if by in (REACHED_BY_RANKS, REACHED_BY_HEARTBEAT) else None
        self.ledger.exited(a)
        self.exit_reasons[a.reason] += 1
        if is_failure(a.reason):
            self.failures += 1
            self._failed_at = a.ended
            if self._pending_failure_at is None:
                self._pending_failure_at = a.ended

    def _on_first_beat(self, t: float, rec: dict[str, Any]) -> None:
        a = self._attempt(t, rec)
        if a is not None and a.first_beat_at is None:
            a.first_beat_at = t
            self.ledger.fill(a)

    def _on_hang(self, t: float, rec: dict[str, Any]) -> None:
        a = self._attempt(t, rec)
        if a is None:
            return
        ranks = rec.get("ranks")
        named = [r for r in ranks[:64] if isinstance(r, dict)] if isinstance(ranks, list) else []
        a.hung_ranks = [r["rank"] for r in named if type(r.get("rank")) is int and 0 <= r["rank"] < MAX_INT]
        a.stacks = read_str(rec, "stacks")
        if self.keep:
            why = "; ".join(f"rank {r.get('rank')}: {r.get('why')}" for r in named if isinstance(r.get("why"), str))
            self.marks.append(Mark(read_time(rec, "at") or t, "hang", a.stacks, read_int(rec, "step"), why or None))

    def _on_straggler(self, t: float, rec: dict[str, Any]) -> None:
        rank, flagged = read_int(rec, "rank"), rec.get("flagged")
        if rank is None or not isinstance(flagged, bool):
            return
        step_s, others = read_num(rec, "step_s"), read_num(rec, "others_s")
        detail = (f"rank {rank} {'is' if flagged else 'no longer'} a straggler"
                  + (f": {step_s:.3g} s/step, others {others:.3g}" if step_s is not None and others is not None else ""))
        self.stragglers.append(Mark(t, "straggler" if flagged else "straggler_cleared", None, rank, detail))
        del self.stragglers[:-_MAX_STRAGGLER_MARKS]

    def _on_mark(self, t: float, rec: dict[str, Any]) -> None:
        kind = rec["kind"]
        if kind == "checkpoint_committed":
            self.commits += 1
        elif kind == "quarantined" and (read_str(rec, "reason") or "").startswith(CORRUPT_PREFIX):
            self.corrupt += 1  # its bytes failed their checksums: not counted among `quarantines`
        elif kind == "quarantined":
            self.quarantines += 1
        if self.keep:
            path, step = read_str(rec, "path") or read_str(rec, "to_checkpoint"), read_int(rec, "step")
            self.marks.append(Mark(t, kind, path, step if step is not None else read_int(rec, "from_step"),
                                   read_str(rec, "reason") or read_str(rec, "why")))

    def _on_end(self, t: float, rec: dict[str, Any]) -> None:
        self.end_state, self.end_reason = read_str(rec, "state"), read_str(rec, "reason")
        self._pending_failure_at = None  # supervision ended mid-recovery: nothing was waiting to recover
        self._failed_at = None

    def _on_folded(self, t: float, rec: dict[str, Any]) -> None:
        """The totals of the attempts compaction cut (`fold_lines`): the running ones go on from them."""
        for table, obj in ((_FOLDED, self), (_FOLDED_LEDGER, self.ledger)):
            for key, attr in table.items():
                setattr(obj, attr, getattr(obj, attr) + type(getattr(obj, attr))(read_num(rec, key) or 0))
        reasons, parts = rec.get("exit_reasons"), rec.get("time_lost_s")
        for k, v in (reasons.items() if isinstance(reasons, dict) else ()):
            if type(v) is int and 0 < v < MAX_INT:
                self.exit_reasons[k] += v
        for k in LOSS_PARTS:
            self.ledger.dropped[k] += read_num(parts, k) or 0.0 if isinstance(parts, dict) else 0.0

    _HANDLERS: ClassVar[dict[str, Callable[[Fold, float, dict[str, Any]], None]]] = {
        "attempt_start": _on_start,
        "beat": _on_beat,
        "first_step": _on_first_step,
        "first_beat": _on_first_beat,
        "hang": _on_hang,
        "straggler": _on_straggler,
        "attempt_exit": _on_exit,
        "checkpoint_committed": _on_mark,
        "quarantined": _on_mark,
        "retention_deleted": _on_mark,
        "diverged": _on_mark,
        "rolled_back": _on_mark,
        "supervisor_end": _on_end,
        "folded": _on_folded,
    }

    # ---- the numbers -----------------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """The last session has no supervisor_end (running, or killed)."""
        return self._open

    def wall_s(self, now: float | None = None) -> float:
        if self._open and now is not None and self.sessions:
            return self._wall + max(0.0, now - self._session_t)
        return self._wall

    def productive_s(self) -> float:
        return max(0.0, self.train_s - self.ledger.lost_s)

    def goodput(self, now: float | None = None) -> float | None:
        """None while nothing ran, and for a job that never reported a step (its training time is unknown)."""
        wall = self.wall_s(now)
        return min(1.0, self.productive_s() / wall) if wall > 0 and self.last_step is not None else None

    def startup_s(self, now: float | None = None) -> float:
        """Each attempt's launch to its first new step, or to its end (or now, or its last record) without one."""
        return self._startup_s + sum(self._startup(a, now) for a in self.attempts)

    def _startup(self, a: AttemptView, now: float | None) -> float:
        end = min((x for x in (a.first_step_at, a.trained_at) if x is not None), default=a.ended)
        if end is None:
            end = now if now is not None and self._open and a is self.attempts[-1] else a.last_t
        return max(0.0, end - a.started)

    def parts(self, now: float | None = None) -> dict[str, float]:
        """Where the supervisor's wall time went (the module docstring has each part); they add up to `wall_s`."""
        wall, productive = self.wall_s(now), self.productive_s()
        known = {"productive_s": productive, "startup_s": self.startup_s(now), "restart_s": self.restart_s,
                 "lost_s": self.train_s - productive, "checkpoint_overhead_s": self.save_s}
        return {"wall_s": wall, **known, "other_s": max(0.0, wall - sum(known.values()))}

    @property
    def steps_lost(self) -> list[int]:
        return self.ledger.steps_lost

    @property
    def losses(self) -> list[Loss]:
        return self.ledger.losses

    def time_lost_totals(self) -> dict[str, float]:
        return self.ledger.totals()

    def totals(self) -> dict[str, Any]:
        """What a `folded` record carries (`fold_lines`), as of the last record."""
        return {**{k: getattr(self, a) for k, a in _FOLDED.items()},
                **{k: getattr(self.ledger, a) for k, a in _FOLDED_LEDGER.items()},
                "sessions": len(self.sessions) + self._sessions_folded, "startup_s": self.startup_s(),
                "exit_reasons": dict(self.exit_reasons), "time_lost_s": self.time_lost_totals()}

    def summary(self, now: float | None = None) -> Summary:
        """The numbers as of the last record, or as of `now` for a session still running."""
        parts = self.parts(now)
        return Summary(
            attempts=self.count,
            failures=self.failures,
            wall_s=parts["wall_s"],
            productive_s=parts["productive_s"],
            goodput=self.goodput(now),
            restart_latency_s=list(self.restart_latency_s),
            steps_lost=list(self.steps_lost),
            steps_lost_total=self.ledger.steps_lost_total,
            checkpoint_overhead_s=self.save_s,
            startup_s=parts["startup_s"],
            restart_s=parts["restart_s"],
            lost_s=parts["lost_s"],
            other_s=parts["other_s"],
            exit_reasons=dict(self.exit_reasons),
            checkpoints_committed=self.commits,
            quarantines=self.quarantines,
            corrupt=self.corrupt,
            sessions=len(self.sessions) + self._sessions_folded,
            last_step=self.last_step,
            losses=[x.copy() for x in self.losses],
            time_lost_s=self.time_lost_totals(),
        )


_FOLDED = {"attempts": "count", "failures": "failures", "sessions": "_sessions_folded", "checkpoints_committed": "commits",
           "quarantines": "quarantines", "corrupt": "corrupt", "steps": "_steps", "wall_s": "_wall", "train_s": "train_s",
           "save_s": "save_s", "startup_s": "_startup_s", "restart_s": "restart_s"}  # `folded` keys -> Fold attributes
_FOLDED_LEDGER = {"steps_lost": "steps_lost_total", "lost_s": "lost_s"}


def fold_lines(data: bytes, max_bytes: int) -> bytes:
    """Whole lines cut to at most `max_bytes` (whole attempts, the latest two at least) behind one
    `folded` record that carries the totals of what was cut, so that every total `summarize` gives stays the same."""
    lines = data.split(b"\n")[:-1]
    pos = list(accumulate((len(x) + 1 for x in lines), initial=0))
    cuts = [i for i, x in enumerate(lines)  # where an attempt starts (not the last one's)
            if i and b'"attempt_start"' in x and (_record(x) or {}).get("kind") == "attempt_start"][:-1]
    if pos[-1] <= max_bytes or not cuts:
        return data
    cut = next((i for i in cuts if pos[-1] - pos[i] <= max_bytes - 1024), cuts[-1])
    kept = [r for r in map(_record, lines[cut:]) if r is not None]
    head: dict[str, Any] = {"v": VERSION, "t": kept[0]["t"] if kept else 0, "kind": "folded"}
    whole = Fold().add_all(r for r in map(_record, lines) if r is not None).totals()
    rest = Fold().add_all([head, *kept]).totals()
    for k, v in whole.items():
        head[k] = ({x: round(n - rest[k].get(x, 0), 3) for x, n in v.items()} if isinstance(v, dict)
                   else round(v - rest[k], 3))
    return json.dumps(head, separators=(",", ":")).encode() + b"\n" + b"".join(x + b"\n" for x in lines[cut:])


def summarize(records: Iterable[dict[str, Any]], now: float | None = None) -> Summary:
    """The summary of a whole history (see the module docstring for each number's definition)."""
    return Fold().add_all(records).summary(now)
