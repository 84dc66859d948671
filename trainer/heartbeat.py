"""Heartbeats for the supervisor: one file per node with the step, phase and loss, and one small file per rank.

The supervisor judges liveness by them (docs/design.md, the job contract); the record's schema and its
validation live in `supervisor.contract`. Local rank 0 of every node rewrites `FSDP_SUPERVISOR_HEARTBEAT`
atomically (every node runs its own supervisor), at most once a second and on every phase change. When the
supervisor names a per-rank folder (`FSDP_SUPERVISOR_HEARTBEAT_DIR`), every rank also keeps `rank-<RANK>.json`
there, rewritten in place (one `pwrite` of a fixed-size record, a few microseconds) at once on a phase change
or a NaN loss and at most 4 times a second for new steps (`RankBeat`): the supervisor then knows the step each
rank reached, names the rank that hung and sees a straggler. Use it from
your own loop::

    from trainer.heartbeat import Heartbeat

    hb = Heartbeat.from_env(rank=int(os.environ["LOCAL_RANK"]))   # no-op unless the supervisor set it up
    hb.beat(step, "load")
    for step in ...:
        ...
        hb.beat(step, "train", loss=loss)          # the node's file: throttled to once a second
        hb.beat(step, "eval", val_loss=val)        # a phase change is always written at once
        hb.beat(step, "save")

Pass `step_s=` (this rank's own time for the step, without the time it waited for the other ranks) to let
the supervisor flag a straggler in a job whose ranks run in lockstep (docs/operations.md, Stragglers). Work one
rank does alone while the others wait at a barrier (rank 0 saving a full state dict, or evaluating) should beat
"save" or "eval" on that rank: the waiting ranks are then judged by its allowance, not by their own silence.
"""
from __future__ import annotations

import atexit
import json
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

from supervisor.contract import ENV_HEARTBEAT, ENV_HEARTBEAT_DIR, PHASES, heartbeat_record, rank_heartbeat_name
from supervisor.host.atomic import write_atomic

__all__ = ["Heartbeat", "RankBeat", "HEARTBEAT_ENV", "PHASES"]

HEARTBEAT_ENV = ENV_HEARTBEAT  # kept for scripts that import it from here


STEP_INTERVAL_S = 0.25  # a rank's new steps: at most 4 writes a second (docs/operations.md, Heartbeats)
FLUSHER_IDLE_S = 5.0  # the flusher thread ends after this long with nothing held back (a later held step starts one)
BAD_HOLD_S = 2.0  # a non-finite loss stays in a rank's file this long: two of the supervisor's looks (1 s apart)


class RankBeat:
    """One rank's own heartbeat file, rewritten in place: one `pwrite` of a fixed-size record, throttled.

    No temporary file and no rename (those cost ~50 us and an inotify event each): the record is padded to
    `SIZE` bytes so a shorter one never leaves a tail, and JSON readers ignore the padding. What is written when:
    - a phase change, and the first non-finite loss, at once;
    - a new step at most every `step_interval_s` (4 a second: the supervisor looks at the folder once a second, so
      every look still finds a newer step and the gaps "auto" hang detection scales from stay the look's own),
      and the same step again every `min_interval_s` (a long evaluation or save stays visibly alive);
    - what a write carries: its own step and time, the latest loss reported since the last write (a later beat
      without one does not drop it), the mean `step_s` of every step since then (stragglers), and a NaN/inf loss
      if any step since then had one: throttling never hides a NaN. A
      non-finite loss, once written, stays `BAD_HOLD_S` (the supervisor reads the folder once a second): a finite
      one waits, and a record written meanwhile (a phase change, `close`) carries it. A step held back is written
      by a flusher thread at its due time when no later beat comes (a rank blocked in a collective after its last
      step), and at the process's exit (an exception, a loop without `close`): the last step each rank reached
      stays exact, for the steps a failure lost. A write that fails turns the file off: a heartbeat must never cost
      a training run.
    """

    SIZE = 128

    def __init__(self, path: str | os.PathLike[str], *, min_interval_s: float = 1.0,
                 step_interval_s: float = STEP_INTERVAL_S, flush: bool = True) -> None:
        self.path = Path(path)
        self.min_interval_s, self.step_interval_s = min_interval_s, step_interval_s
        self.last_error: OSError | None = None
        self._fd: int | None = None
        self._last: tuple[int, str] | None = None
        self._last_write = -math.inf
        self._last_bad = False
        self._bad_at, self._bad_loss_written = -math.inf, math.nan  # the last NaN/inf written (its hold counts from it)
        # A step held back: (step, phase, its beat's time, loss, bad, when due: on the beats' clock, on the monotonic)
        self._pending: tuple[int, str, float, float | None, bool, float, float] | None = None
        self._sum_s, self._n_s = 0.0, 0  # the step times since the last write
        self._bad_loss: float | None = None  # a NaN/inf loss since the last write
        self._loss: float | None = None  # the latest loss since the last write (a later beat may carry none)
        self._lock = threading.Condition()
        self._flush = flush  # False: a held-back step waits for the next beat or `close` (tests)
        self._flusher: threading.Thread | None = None
        self._closed = False
        self._pid = os.getpid()  # a forked child (a DataLoader worker) never writes its parent's file
        atexit.register(_close_at_exit, weakref.ref(self))

    def beat(self, step: int, phase: str, now: float, step_s: float | None = None, loss: float | None = None) -> bool:
        """Record `step` (and this step's loss: the divergence guard reads it); returns whether the file was rewritten."""
        with self._lock:
            if self.last_error is not None or self._closed:
                return False
            if step_s is not None and math.isfinite(step_s) and step_s >= 0:
                self._sum_s, self._n_s = self._sum_s + step_s, self._n_s + 1
            bad = loss is not None and not math.isfinite(loss)
            if loss is None:  # HF's on_step_end after on_log's loss of a held-back step: that loss is not dropped
                loss = self._loss
            else:
                self._loss = loss
            if bad:
                self._bad_loss = loss
            elif self._bad_loss is not None:  # a NaN since the last write is what this record says
                loss, bad = self._bad_loss, True
            if (step, phase) == self._last and now - self._last_write < self.min_interval_s \
                    and not (bad and not self._last_bad):  # a step's NaN after its own beat: still at once
                return False
            due = self._due(phase, bad)
            if now >= due:
                return self._write(step, phase, now, loss, bad)
            idle, self._pending = self._pending is None, (step, phase, now, loss, bad, due, time.monotonic() + due - now)
            if self._flush and self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_loop, name="heartbeat-flush", daemon=True)
                self._flusher.start()
            elif idle:  # the flusher waits for a step held back (a later one only replaces it: same due time)
                self._lock.notify()
            return False

    def _due(self, phase: str, bad: bool) -> float:
        """When a record of `phase` may be written (the beat's clock)."""
        if self._last is None or phase != self._last[1] or (bad and not self._last_bad):
            return -math.inf
        return self._bad_at + BAD_HOLD_S if self._last_bad and not bad else self._last_write + self.step_interval_s

    def _record(self, step: int, phase: str, now: float, loss: float | None) -> bytes:
        """The fixed-size record, with the mean step time of the steps since the last write."""
        text = f'{{"step":{int(step)},"time":{now:.3f},"phase":"{phase}"'
        if self._n_s:
            text += f',"step_s":{self._sum_s / self._n_s:.6g}'
        if loss is not None:  # a diverged loss as the contract's word ("nan", "inf"): JSON has no NaN
            text += f',"loss":{loss:.6g}' if math.isfinite(loss) else f',"loss":"{"nan" if math.isnan(loss) else "inf"}"'
        return (text + "}").ljust(self.SIZE - 1).encode() + b"\n"

    def _write(self, step: int, phase: str, now: float, loss: float | None, bad: bool, at: float | None = None) -> bool:
        """Write the record of the beat made at `now`; the next one counts its interval from `at` (a held-back
        step is written at its due time, not its own: at most 4 writes a second). Within a written NaN's hold the
        record carries it."""
        when = max(now, at or now)
        carried = not bad and self._last_bad and when < self._bad_at + BAD_HOLD_S
        if carried:
            loss, bad = self._bad_loss_written, True
        data = self._record(step, phase, now, loss)
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            os.pwrite(self._fd, data, 0)
            if len(data) > self.SIZE:  # never with the fields above; a longer record must not leave a stale tail
                os.ftruncate(self._fd, len(data))
        except OSError as exc:
            self.last_error = exc
            self._close_fd()
            return False
        self._last, self._last_write, self._last_bad = (step, phase), when, bad
        if bad and not carried:
            self._bad_at, self._bad_loss_written = when, loss if loss is not None else math.nan
        self._pending, self._sum_s, self._n_s, self._bad_loss, self._loss = None, 0.0, 0, None, None
        return True

    def _flush_loop(self) -> None:
        """Write a held-back step at its due time when no later beat wrote it (real time: the beat's clock is wall
        time, and the step was recorded with its own)."""
        with self._lock:
            while not self._closed and self.last_error is None:
                if self._pending is None:
                    if not self._lock.wait(FLUSHER_IDLE_S) and self._pending is None:
                        break  # idle: a heartbeat dropped without `close` is then collected, thread and file
                    continue
                step, phase, made, loss, bad, due, due_mono = self._pending
                if (wait := due_mono - time.monotonic()) > 0:
                    self._lock.wait(wait)
                else:
                    self._write(step, phase, made, loss, bad, at=due)
            self._flusher = None

    def close(self) -> None:
        """Write a step still held back, then release the file (the process exiting releases it too)."""
        with self._lock:
            if self._pending is not None and self.last_error is None and not self._closed and os.getpid() == self._pid:
                step, phase, made, loss, bad, _, _ = self._pending
                self._write(step, phase, made, loss, bad)
            self._closed = True
            self._lock.notify()
            self._close_fd()

    def __del__(self) -> None:  # a heartbeat dropped without `close` (made anew each epoch) leaks no descriptor
        if getattr(self, "_fd", None) is not None:
            self._close_fd()

    def _close_fd(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def _close_at_exit(ref: weakref.ref[RankBeat]) -> None:
    """At the interpreter's exit: write a step still held back (the flusher, a daemon thread, stops unwritten)."""
    beat = ref()
    if beat is not None and beat._pid == os.getpid():  # a forked child: its copy of the lock may be held forever
        beat.close()


class Heartbeat:
    """The node's heartbeat file (atomically, on every phase change and at most every `min_interval_s`) and,
    when `rank_path` is given, this rank's own file (`RankBeat`: up to 4 times a second)."""

    # Does this process load checkpoints with `trainer.checkpoint.load_checkpoint`, which checks the manifest's
    # checksums as it reads? Said in every beat once true (`checks_loads`): only then does the supervisor skip its own
    # read of such a resume point before a relaunch (one read, not two). Set by the reference trainer at start and
    # by every `load_checkpoint`; a script that saves with the library but loads with plain `dcp.load` never sets it.
    checks_loads = False

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        *,
        min_interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        rank_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.path = Path(path) if path else None
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._last_phase: str | None = None
        self._last_write = -math.inf
        self._last_bad = False
        self.val_loss: float | None = None  # the latest evaluation, repeated in every beat after it
        self.local_tier: str | None = None  # why the node-local tier fails now (status: degraded); None: it works
        self._last_tier: str | None = None
        self.last_error: OSError | None = None
        self.rank_file = RankBeat(rank_path, min_interval_s=min_interval_s) if rank_path else None

    @classmethod
    def from_env(cls, rank: int = 0, *, global_rank: int | None = None, **kwargs: object) -> Heartbeat:
        """The heartbeats the supervisor asked for: the node's file when `rank` (the local rank) is 0, and this
        rank's own file (named by `global_rank`, default `$RANK`) on every rank; a no-op outside a supervisor."""
        path = os.environ.get(ENV_HEARTBEAT) if rank == 0 else None
        folder = os.environ.get(ENV_HEARTBEAT_DIR)
        if global_rank is None:
            env_rank = os.environ.get("RANK", "")
            global_rank = int(env_rank) if env_rank.isdecimal() else rank
        rank_path = Path(folder) / rank_heartbeat_name(global_rank) if folder else None
        return cls(path, rank_path=rank_path, **kwargs)  # type: ignore[arg-type]

    @property
    def enabled(self) -> bool:
        return self.path is not None or self.rank_file is not None

    def beat(self, step: int, phase: str, loss: float | None = None, *, val_loss: float | None = None,
             force: bool = False, step_s: float | None = None) -> bool:
        """Record progress; returns whether the node's file was rewritten. A new `val_loss` is always written."""
        if phase not in PHASES:
            raise ValueError(f"heartbeat phase must be one of {PHASES}, got {phase!r}")
        fresh_eval = val_loss is not None and val_loss != self.val_loss
        if val_loss is not None:
            self.val_loss = val_loss
        if self.path is None and self.rank_file is None:
            return False
        now = self._clock()
        if self.rank_file is not None:
            self.rank_file.beat(step, phase, now, step_s, loss)
        if self.path is None:
            return False
        due = now - self._last_write >= self.min_interval_s
        bad = loss is not None and not math.isfinite(loss)  # a diverged loss is said at once, the onset exact
        tier = self.local_tier != self._last_tier  # a failing (or recovered) tier is said at once
        if not (force or due or fresh_eval or tier or phase != self._last_phase or (bad and not self._last_bad)):
            return False
        record = heartbeat_record(step, phase, time=now, loss=loss, val_loss=self.val_loss, local_tier=self.local_tier,
                                  checks_loads=Heartbeat.checks_loads)
        try:
            # No fsync: a beat lost in a crash is replaced by the next one within a second.
            write_atomic(self.path, json.dumps(record).encode(), durable=False)
        except OSError as exc:
            # A heartbeat we cannot write must not kill a training run; the supervisor sees it go stale.
            self.last_error = exc
            return False
        self._last_phase, self._last_write, self._last_bad, self._last_tier = phase, now, bad, self.local_tier
        return True

    def close(self) -> None:
        """Release this rank's file (the process exiting does it too)."""
        if self.rank_file is not None:
            self.rank_file.close()
