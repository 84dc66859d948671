"""Heartbeats for the supervisor: one file per node with the step, phase and loss, and one small file per rank.

The supervisor judges liveness by them (docs/design.md, the job contract); the record's schema and its
validation live in `supervisor.contract`. Local rank 0 of every node rewrites `FSDP_SUPERVISOR_HEARTBEAT`
atomically (every node runs its own supervisor), at most once a second and on every phase change. When the
supervisor names a per-rank folder (`FSDP_SUPERVISOR_HEARTBEAT_DIR`), every rank also keeps `rank-<RANK>.json`
there, rewritten in place on every step (one `pwrite` of a fixed-size record, a few microseconds): the
supervisor then knows the step each rank reached, names the rank that hung and sees a straggler. Use it from
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

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

from supervisor.contract import ENV_HEARTBEAT, ENV_HEARTBEAT_DIR, PHASES, heartbeat_record, rank_heartbeat_name
from supervisor.host.atomic import write_atomic

__all__ = ["Heartbeat", "RankBeat", "HEARTBEAT_ENV", "PHASES"]

HEARTBEAT_ENV = ENV_HEARTBEAT  # kept for scripts that import it from here


class RankBeat:
    """One rank's own heartbeat file, rewritten in place: one `pwrite` of a fixed-size record per new step.

    No temporary file and no rename (those cost ~50 us and an inotify event each): the record is padded to
    `SIZE` bytes so a shorter one never leaves a tail, and JSON readers ignore the padding. A step or phase
    change is written at once; the same step again at most every `min_interval_s` (a long evaluation or save
    stays visibly alive). A write that fails turns the file off: a heartbeat must never cost a training run.
    """

    SIZE = 128

    def __init__(self, path: str | os.PathLike[str], *, min_interval_s: float = 1.0) -> None:
        self.path = Path(path)
        self.min_interval_s = min_interval_s
        self.last_error: OSError | None = None
        self._fd: int | None = None
        self._last: tuple[int, str] | None = None
        self._last_write = -math.inf

    def beat(self, step: int, phase: str, now: float, step_s: float | None = None, loss: float | None = None) -> bool:
        """Record `step` (and this step's loss: the divergence guard reads it); returns whether the file was rewritten."""
        if self.last_error is not None or ((step, phase) == self._last and now - self._last_write < self.min_interval_s):
            return False
        text = f'{{"step":{int(step)},"time":{now:.3f},"phase":"{phase}"'
        if step_s is not None and math.isfinite(step_s) and step_s >= 0:
            text += f',"step_s":{step_s:.6g}'
        if loss is not None:  # a diverged loss as the contract's word ("nan", "inf"): JSON has no NaN
            text += f',"loss":{loss:.6g}' if math.isfinite(loss) else f',"loss":"{"nan" if math.isnan(loss) else "inf"}"'
        data = (text + "}").ljust(self.SIZE - 1).encode() + b"\n"
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            os.pwrite(self._fd, data, 0)
            if len(data) > self.SIZE:  # never with the fields above; a longer record must not leave a stale tail
                os.ftruncate(self._fd, len(data))
        except OSError as exc:
            self.last_error = exc
            self.close()
            return False
        self._last, self._last_write = (step, phase), now
        return True

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


class Heartbeat:
    """The node's heartbeat file (atomically, on every phase change and at most every `min_interval_s`) and,
    when `rank_path` is given, this rank's own file (every step)."""

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
        if not (force or due or fresh_eval or phase != self._last_phase or (bad and not self._last_bad)):
            return False
        record = heartbeat_record(step, phase, time=now, loss=loss, val_loss=self.val_loss,
                                  checks_loads=Heartbeat.checks_loads)
        try:
            # No fsync: a beat lost in a crash is replaced by the next one within a second.
            write_atomic(self.path, json.dumps(record).encode(), durable=False)
        except OSError as exc:
            # A heartbeat we cannot write must not kill a training run; the supervisor sees it go stale.
            self.last_error = exc
            return False
        self._last_phase, self._last_write, self._last_bad = phase, now, bad
        return True

    def close(self) -> None:
        """Release this rank's file (the process exiting does it too)."""
        if self.rank_file is not None:
            self.rank_file.close()
