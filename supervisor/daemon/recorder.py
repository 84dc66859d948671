"""The daemon's side of `history.jsonl`: a subscriber of the run's events, heartbeats sampled, size bounded.

`notify` writes the records of each event the history keeps (schema: supervisor.history.records) and never
looks at the result: a history that cannot be written (full disk, read-only run dir) costs one `history_write_failed`
warning and the records meanwhile, never the supervision (`history_write_recovered` when writes work
again). The recorder also keeps the run's `report.Fold` up to date, loaded from the file at start-up so that
numbers continue across supervisor restarts; `annotate` copies them into `Status` for `status` and metrics.

Start-up reads the file a line at a time, at most `MAX_READ_BYTES`, and only if it is a regular file (a FIFO or
/dev/zero in its place would hang or exhaust the daemon before it supervised anything). Compaction writes the
thinned file to a temporary sibling on a thread while records keep going to the old file, then copies those
records over and renames it into place: a SIGKILL at any moment loses no record; the temp file it may leave is
removed by the next run.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from supervisor import __version__
from supervisor.contract import Beat, Phase
from supervisor.daemon.events import (
    Alarm,
    AlertSent,
    AttemptExited,
    AttemptStarted,
    BeatRead,
    Event,
    Finished,
    HangRecorded,
    PassAbsorbed,
    Quarantined,
    StragglerChanged,
    SupervisorStarted,
)
from supervisor.history.fold import Fold, fold_lines
from supervisor.history.records import (
    COMPACT_BYTES,
    HISTORY_FILE,
    MAX_LINE,
    MAX_READ_BYTES,
    SAMPLE_S,
    VERSION,
    compact_lines,
    iter_file_records,
)
from supervisor.host.atomic import TMP_SUFFIX
from supervisor.host.log import Log
from supervisor.host.regularfile import open_regular
from supervisor.policy.state import ExitInfo, Status

if TYPE_CHECKING:
    from supervisor.policy.restarts import Attempt

__all__ = ["HistoryRecorder"]

RECENT_ATTEMPTS = 100  # attempts, recoveries and losses the daemon's fold keeps (status shows the latest of each)
_MAX_DETAIL = 1000  # characters of an exit's detail kept (the root cause's message is already cut to 300)


@dataclass
class _Live:
    """The attempt whose heartbeats are being read."""

    number: int
    resumed_step: int | None
    prev: tuple[float, int, str | None] | None = None  # (time, step, phase) of the last beat
    train_s: float = 0.0
    save_s: float = 0.0
    written_t: float = float("-inf")  # time of the last beat sample written
    val_loss: float | None = None  # the last evaluation result recorded
    trained: bool = False  # first_step written
    beating: bool = False  # first_beat written
    loaded_step: int | None = None  # the step of its latest `load` beat: where a job that picks its own resumed
    began: bool = False  # a beat in phase train (or without a phase) seen
    pending: dict[str, Any] | None = None  # the newest beat, when it was not written (sampling)


def _guarded(hook: Callable[..., None]) -> Callable[..., None]:
    """A bug in the history must cost records, never the supervision: the first error is logged, later ones not."""

    @functools.wraps(hook)
    def run(self: HistoryRecorder, *args: Any, **kwargs: Any) -> None:
        try:
            hook(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            if not self._broken:
                self._broken = True
                self.log.error("history_failed", hook=hook.__name__, error=f"{type(exc).__name__}: {exc}")

    return run


def _short(x: float | None) -> float | None:
    """Six significant digits: plenty for a plot, a third of the bytes of a full repr."""
    return None if x is None else float(f"{x:.6g}")


def _line(rec: dict[str, Any]) -> bytes:
    return (json.dumps(rec, separators=(",", ":"), allow_nan=False) + "\n").encode()


class HistoryRecorder:
    """Appends history records for one run dir (the run lock is held: nobody else writes it)."""

    def __init__(self, path: Path, *, now: Callable[[], float], log: Log, compact_bytes: int = COMPACT_BYTES) -> None:
        self.path, self.now, self.log = path, now, log
        self.compact_bytes = compact_bytes
        self.fold = Fold(recent=RECENT_ATTEMPTS)
        self.compactions = 0
        self._fd: int | None = None
        self._size = 0
        self._compact_at = compact_bytes
        self._failing = False
        self._torn = False  # a write failed part-way: start the next record on a fresh line
        self._broken = False  # a hook raised (a bug): logged once
        self._live: _Live | None = None
        self._last_attempt: int | None = None
        # Compaction reads, thins and rewrites a few MB: it runs on its own thread (the loop must not stall
        # ~0.1 s) into a temp file; records written meanwhile go to the old file and are copied over at the end.
        self._compactor: threading.Thread | None = None
        self._compacted: tuple[Path, int, int] | str | None = None  # (temp, its size, old bytes it covers) | error
        self.os_write: Callable[[int, memoryview], int] = os.write  # a seam: tests make the disk fill up
        self._load()

    @classmethod
    def for_run_dir(cls, run_dir: Path, *, now: Callable[[], float], log: Log) -> HistoryRecorder:
        return cls(run_dir / HISTORY_FILE, now=now, log=log)

    # ---- the file --------------------------------------------------------------------------------------------
    def _load(self) -> None:
        """Fold what earlier runs wrote, cut off a line torn by a SIGKILL (the next append would join it) and
        remove the temp file of a compaction cut short."""
        try:
            for tmp in self.path.parent.glob(f".{self.path.name}.*{TMP_SUFFIX}"):
                tmp.unlink(missing_ok=True)
            f = open(open_regular(self.path), "rb")  # noqa: SIM115 - entered below: only the open's errors are caught here
        except FileNotFoundError:
            return
        except OSError as exc:
            self._failed(exc)
            return
        with f:
            try:
                self.fold.add_all(r for r in iter_file_records(f) if r is not None)  # one line at a time
            except Exception as exc:  # noqa: BLE001 - a bug in the fold costs the old numbers, never the run
                self._broken = True
                self.log.error("history_failed", hook="load", error=f"{type(exc).__name__}: {exc}")
            self._size = self._cut_torn_tail(f)
        self._last_attempt = self.fold.last_number or None

    def _cut_torn_tail(self, f: BinaryIO) -> int:
        """The file's size once a torn last line is cut off; a tail longer than any record is not ours to cut:
        it stays, and the next record starts on a fresh line."""
        size = os.fstat(f.fileno()).st_size
        start = max(0, size - MAX_LINE - 1)
        f.seek(start)
        tail = f.read()
        if not tail or tail.endswith(b"\n"):
            return size
        newline = tail.rfind(b"\n")
        if newline < 0 and start > 0:
            self._torn = True
            return size
        try:
            os.truncate(self.path, start + newline + 1)
        except OSError as exc:
            self._failed(exc)
            return size
        return start + newline + 1

    def _failed(self, exc: OSError) -> None:
        self._torn = True
        if not self._failing:
            self._failing = True
            self.log.warning("history_write_failed", path=str(self.path), error=exc.strerror or str(exc))

    def _write(self, kind: str, fields: dict[str, Any], *, durable: bool = False, t: float | None = None) -> None:
        rec = {"v": VERSION, "t": round(self.now() if t is None else t, 3), "kind": kind, **fields}
        self.fold.add(rec)  # status keeps its numbers even while the disk refuses the record
        try:
            line = _line(rec)
        except ValueError:  # a non-finite number slipped through: drop the record, never the daemon
            return
        if self._compactor is not None and not self._compactor.is_alive():
            self._finish_compaction()
        self._append(line, durable)

    def _append(self, line: bytes, durable: bool) -> None:
        data = (b"\n" if self._torn else b"") + line
        try:
            if self._fd is None:
                self._fd = open_regular(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW)
            view = memoryview(data)
            while view:
                view = view[self.os_write(self._fd, view):]
            if durable:
                os.fsync(self._fd)
        except OSError as exc:
            self._failed(exc)
            return
        self._torn = False
        if self._failing:
            self._failing = False
            self.log.info("history_write_recovered", path=str(self.path))
        self._size += len(data)
        if self._size > self._compact_at and self._compactor is None:
            self._compact()

    def _compact(self) -> None:
        """Write the `thin`ned file to a temp sibling on a thread; `_finish_compaction` puts it in place.

        The thread reads the file up to its last whole line; records appended meanwhile stay in the old file
        (fsynced as usual) until `_finish_compaction` copies them over, on the loop, just before the rename.
        """
        if self._size > MAX_READ_BYTES:  # not a file this recorder grew: never read it whole
            self._compact_at = 2 * self._size
            self.log.warning("history_compact_failed", path=str(self.path), error=f"larger than {MAX_READ_BYTES} bytes")
            return
        now = self.now()
        tmp = self.path.with_name(f".{self.path.name}.{secrets.token_hex(4)}{TMP_SUFFIX}")

        def work() -> None:
            try:
                with open(open_regular(self.path), "rb") as f:
                    data = f.read(MAX_READ_BYTES)
                covered = data.rfind(b"\n") + 1
                kept = fold_lines(compact_lines(data, now), self.compact_bytes * 3 // 4)  # a torn last line: not kept
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                try:
                    with open(fd, "wb", closefd=False) as out:
                        out.write(kept)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                self._compacted = (tmp, len(kept), covered)
            except Exception as exc:  # noqa: BLE001 - a failed compaction (or a bug in it) costs only itself
                tmp.unlink(missing_ok=True)
                self._compacted = f"{type(exc).__name__}: {exc}"

        self._compacted = None
        self._compactor = threading.Thread(target=work, name="history-compact", daemon=True)
        self._compactor.start()

    def _finish_compaction(self) -> None:
        """Copy what was appended since the thread read the file into its temp file, then rename it into place."""
        assert self._compactor is not None
        self._compactor.join()
        self._compactor = None
        result = self._compacted if self._compacted is not None else "compaction did not finish"
        before = self._size
        if isinstance(result, tuple):
            tmp, kept, covered = result
            try:
                with open(open_regular(self.path), "rb") as f, open(tmp, "ab") as out:
                    f.seek(covered)
                    tail = f.read()
                    out.write(tail)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, self.path)
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                result = exc.strerror or str(exc)
            else:
                self.close()  # the old file is gone: append to the new one
                self._size = kept + len(tail)
                self.compactions += 1
                self.log.info("history_compacted", path=str(self.path), before_bytes=before, after_bytes=self._size)
        if isinstance(result, str):
            self.log.warning("history_compact_failed", path=str(self.path), error=result)
        self._compact_at = max(self.compact_bytes, self._size + self.compact_bytes // 4)  # 2 attempts may not fit

    @property
    def size(self) -> int:
        return self._size

    @property
    def last_attempt(self) -> int:
        return self._last_attempt or 0

    @property
    def compacting(self) -> bool:
        """A compaction is in flight (`close` waits for it and puts the new file in place)."""
        return self._compactor is not None

    def close(self) -> None:
        if self._compactor is not None:  # at exit: let it finish and put the new file in place
            self._finish_compaction()
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.close(fd)

    # ---- hooks -----------------------------------------------------------------------------------------------
    @_guarded
    def notify(self, ev: Event) -> None:
        """The bus's subscriber (daemon/events.py): the records each event the history keeps makes."""
        if isinstance(ev, BeatRead):  # first: the most frequent by far
            self.beat(ev.number, ev.beat)
        elif isinstance(ev, SupervisorStarted):
            self._write("supervisor_start", {"pid": os.getpid(), "version": __version__}, durable=True)
        elif isinstance(ev, AttemptStarted):
            job = ev.job
            self._live, self._last_attempt = _Live(job.number, job.resumed_step), job.number
            self._write("attempt_start", {"attempt": job.number, "resumed_from": job.resumed_from,
                                          "resumed_step": job.resumed_step}, durable=True)
        elif isinstance(ev, AttemptExited):
            job = ev.job
            self.attempt_exit(ev.attempt, ev.info, progress_at=job.progress_at, detected_at=job.detected_at,
                              hung_ranks=job.hung_ranks, reached_by=job.reached_by)
        elif isinstance(ev, HangRecorded):
            job = ev.job
            self._write("hang", {"attempt": job.number, "at": round(job.detected_at or self.now(), 3),
                                 "step": job.max_step, "idle_s": None if ev.idle_s is None else round(ev.idle_s, 1),
                                 "ranks": [{"rank": r, "why": why[:200]} for r, why in job.hung_ranks[:64]],
                                 "stacks": job.stacks}, durable=True)
        elif isinstance(ev, StragglerChanged):
            c = ev.change
            self._write("straggler", {"attempt": ev.job.number, "rank": c.rank, "flagged": c.flagged,
                                      "step_s": _short(c.step_s), "others_s": _short(c.others_s)})
        elif isinstance(ev, PassAbsorbed):
            if (new := ev.committed) is not None:
                self._write("checkpoint_committed", {"attempt": self._last_attempt, "path": str(new.path),
                                                     "step": new.step, "size_bytes": new.size_bytes})
            for d in ev.result.deleted:
                self._write("retention_deleted", {"path": str(d.path), "reason": d.reason, "size_bytes": d.size_bytes})
            for path, reason in ev.result.corrupt:  # `corrupt: ...`: its bytes failed their checksums
                self._write("quarantined", {"path": path, "reason": reason}, durable=True)
        elif isinstance(ev, Quarantined):
            self._write("quarantined", {"path": ev.path, "reason": ev.reason}, durable=True)
        elif isinstance(ev, Finished):
            self._write("supervisor_end", {"state": ev.state.value, "reason": ev.reason}, durable=True)
        elif isinstance(ev, Alarm) and ev.kind in ("diverged", "rolled_back"):
            self._write(ev.kind, {**(ev.fields or {}), "reason": ev.reason}, durable=True)
        elif isinstance(ev, AlertSent):
            self._write("alert", {"event": ev.kind, "outcome": dict(ev.outcome), "ok": not any(ev.outcome.values())})

    def beat(self, number: int, beat: Beat) -> None:
        live, t = self._live, self.now()
        if live is None or live.number != number:
            return
        at = t  # when the beat was made: the job's own clock where it lies between the last beat and now (a
        if live.prev is not None:  # supervisor suspended while the job hung must not count the wait as training)
            if beat.time is not None and live.prev[0] <= beat.time <= t:
                at = beat.time
            dt = max(0.0, at - live.prev[0])
            if live.prev[2] == Phase.SAVE:
                live.save_s += dt
            elif live.prev[2] in (None, Phase.TRAIN) and beat.step > live.prev[1]:
                live.train_s += dt
        began = beat.phase in (None, Phase.TRAIN) and not live.began  # the resume point, for the loss chart
        live.began = live.began or began
        live.prev = (at, beat.step, beat.phase)
        rec: dict[str, Any] = {"attempt": number, "step": beat.step, "phase": beat.phase, "loss": _short(beat.loss),
                               "train_s": round(live.train_s, 3), "save_s": round(live.save_s, 3)}
        evaluated = beat.val_loss is not None and beat.val_loss != live.val_loss
        if evaluated:
            live.val_loss = beat.val_loss
            rec["val_loss"] = _short(beat.val_loss)
        if not live.beating:  # its workers are up: start-up ends, loading begins
            live.beating = True
            self._write("first_beat", {"attempt": number, "step": beat.step, "phase": beat.phase}, t=t)
        if beat.phase == Phase.LOAD:
            live.loaded_step = beat.step
        resumed = live.resumed_step if live.resumed_step is not None else (live.loaded_step or 0)
        first = not live.trained and beat.phase != Phase.LOAD and beat.step > resumed
        if first:
            live.trained = True
            self._write("first_step", {"attempt": number, "step": beat.step, "from_step": resumed}, t=t)
        if evaluated or first or began or t - live.written_t >= SAMPLE_S:
            live.written_t, live.pending = t, None
            self._write("beat", rec, t=t)
        else:
            live.pending = {**rec, "t": t}

    def attempt_exit(self, attempt: Attempt, info: ExitInfo, *, progress_at: float | None = None,
                     detected_at: float | None = None, hung_ranks: Sequence[tuple[int, str]] = (),
                     reached_by: str | None = None) -> None:
        live = self._live if self._live is not None and self._live.number == attempt.number else None
        if live is not None and live.pending is not None:  # where it stood when it ended
            pending = live.pending
            self._write("beat", {k: v for k, v in pending.items() if k != "t"}, t=pending["t"])
        detail = info.detail[:_MAX_DETAIL] if info.detail else info.detail
        self._write("attempt_exit", {
            "attempt": attempt.number, "at": round(info.at, 3), "reason": info.reason, "code": info.code,
            "signal": info.signal, "detail": detail, "max_step": attempt.max_step, "progressed": attempt.progressed,
            "new_checkpoint": attempt.new_checkpoint, "train_s": round(live.train_s, 3) if live else None,
            "save_s": round(live.save_s, 3) if live else None,
            "progress_at": None if progress_at is None else round(progress_at, 3),
            "detected_at": None if detected_at is None else round(detected_at, 3),
            "hung_ranks": [rank for rank, _ in hung_ranks], "reached_by": reached_by,
        }, durable=True)
        if live is not None:
            self._live = None

    @_guarded
    def annotate(self, status: Status) -> None:
        fold = self.fold
        now = self.now()
        goodput = fold.goodput(now)
        status.goodput = None if goodput is None else round(goodput, 4)
        parts = {k: round(v, 3) for k, v in fold.parts(now).items()}  # without beats only the wall time is known
        status.goodput_parts = parts if goodput is not None else {k: v for k, v in parts.items() if k == "wall_s"}
        status.loss_recent = list(fold.recent_loss)
        status.restart_latency_s = [round(x, 3) for x in fold.restart_latency_s]
        status.steps_lost, status.steps_lost_total = list(fold.steps_lost), fold.ledger.steps_lost_total
        status.time_lost_s = fold.time_lost_totals() if fold.last_step is not None else {}  # unknown: left out
        status.last_failure = fold.losses[-1].to_json() if fold.losses else None
