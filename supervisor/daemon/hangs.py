"""Every rank watched, and the hang path: when an attempt counts as hung, what is kept, and the fast kill.

`Core` owns the attempt; this part owns its heartbeat sources, the hang timers and the evidence. The path as
users see it: docs/operations.md, 'Hangs and stragglers'; the invariants (re-read before judging, frozen time is
nobody's): docs/design.md, 'Notes for maintainers'.
"""
from __future__ import annotations

import os
import signal
from collections.abc import Callable

from supervisor.config import Config
from supervisor.contract import MAX_RANK_FILES, RANK_HEARTBEAT_DIR, Beat, Phase, rank_of_heartbeat
from supervisor.daemon.events import Bus, HangRecorded, StragglerChanged
from supervisor.daemon.evidence import count_dumps, read_rank_beats, read_span
from supervisor.daemon.system import System
from supervisor.daemon.timers import Timer
from supervisor.host.atomic import write_atomic
from supervisor.host.log import Log
from supervisor.policy.attempt import REACHED_BY_HEARTBEAT, REACHED_BY_RANKS, RunningAttempt, apply_beat, hang_timeout
from supervisor.policy.ranks import STUCK_STATES, RankWatch
from supervisor.policy.state import Status

__all__ = ["Hangs", "RANK_POLL_S", "STACKS_MAX_BYTES"]

RANK_POLL_S = 1.0  # how often the per-rank folder is read (bounded: supervisor/contract.py's limits)
DUMP_POLL_S = 0.1  # how often the job's output is checked for the stack dumps asked for
STACKS_MAX_BYTES = 256 * 1024  # of the job's output after SIGUSR1, kept as the attempt's stack dumps
_TIMERS = (Timer.HANG, Timer.HANG_DUMPS, Timer.HANG_TERM, Timer.HANG_KILL, Timer.RANKS)


class Hangs:
    def __init__(self, cfg: Config, system: System, log: Log, bus: Bus, status: Status, *,
                 refresh: Callable[[], None], publish: Callable[[], None],
                 loss: Callable[[RunningAttempt, int | None, Beat], None] = lambda job, rank, beat: None) -> None:
        self.cfg, self.sys, self.log, self.bus, self.status = cfg, system, log, bus, status
        self.loss = loss  # every new beat, for the divergence guard (daemon/divergence.py)
        self.refresh = refresh  # Core reads the node's heartbeat file (and tells us through `seen`)
        self.publish = publish  # a status change to write (held back like a beat's)
        self.folder = cfg.run_dir / RANK_HEARTBEAT_DIR
        self.watch = RankWatch()
        self._startup_from = 0.0  # the startup allowance counts from here (the launch; later after a freeze)
        self._dump: tuple[int, int] | None = None  # (output offset at SIGUSR1, processes expected to dump)
        self._grace = cfg.health.hang_kill_grace_s  # SIGTERM -> SIGKILL of the hang being stopped

    # ---- an attempt's lifetime ---------------------------------------------------------------------------
    def prepare(self) -> None:
        """Before a launch: the per-rank folder exists (owner-only) and holds no stale beat (a stale beat is no
        progress). Only names of the contract's pattern are removed, at most as many as a look reads. OSError."""
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        with os.scandir(self.folder) as entries:
            stale = [e.path for _, e in zip(range(4 * MAX_RANK_FILES), entries) if rank_of_heartbeat(e.name) is not None]
        for path in stale:
            os.unlink(path)

    def started(self, job: RunningAttempt) -> None:
        """A new attempt runs: fresh sources, the startup allowance, the first look at the ranks in a second."""
        self.watch, self._dump = RankWatch(), None
        self._startup_from = job.started_mono
        self.status.ranks, self.status.stragglers = [], []
        self._arm(job)
        self.sys.timers.every(Timer.RANKS, RANK_POLL_S, self.sys.monotonic())

    def ended(self, job: RunningAttempt) -> None:
        """The attempt's process ended: a last look at its ranks (the step each reached), then nothing is due."""
        self._read(job)
        self.cancel()
        self.status.ranks, self.status.stragglers = [], []

    def cancel(self) -> None:
        for t in _TIMERS:
            self.sys.timers.cancel(t)

    # ---- heartbeats --------------------------------------------------------------------------------------
    def seen(self, job: RunningAttempt, rank: int | None, beat: Beat) -> bool:
        """A beat of `rank`'s source (None: the node's file); True when it is progress."""
        if not self.watch.see(rank, beat, self.sys.monotonic()):
            return False
        self.loss(job, rank, beat)
        if beat.phase != Phase.LOAD and (job.max_step is None or beat.step >= job.max_step):  # load: not trained here
            if job.max_step is None or beat.step > job.max_step:
                job.max_step, job.progress_at, job.reached_by = beat.step, self._stepped_at(job, beat), None
            if job.reached_by != REACHED_BY_RANKS:  # a rank's own file is written every step: exact
                job.reached_by = REACHED_BY_RANKS if rank is not None else REACHED_BY_HEARTBEAT
        self._arm(job)
        return True

    def _stepped_at(self, job: RunningAttempt, beat: Beat) -> float:
        """When the job made `beat`'s step: its own clock when that lies between the last progress seen (or the
        launch) and now, so a hang that began while nobody read the files (a suspended supervisor, a look a second
        apart) is timed from the job's last step; otherwise when we read it."""
        now = self.sys.now()
        since = job.progress_at if job.progress_at is not None else now - (self.sys.monotonic() - job.started_mono)
        return beat.time if beat.time is not None and since <= beat.time <= now else now

    def on_ranks_timer(self, job: RunningAttempt) -> None:
        """Every RANK_POLL_S: read the ranks' beats, look for stragglers, show both."""
        changed = self._read(job)
        factor = self.cfg.health.straggler_factor
        for change in self.watch.look(factor) if factor > 0 else []:
            self.bus.publish(StragglerChanged(job, change))
            changed = True
        self.status.stragglers = self.watch.stragglers()
        if changed:
            self._show()
            self.publish()
        if not job.hang:
            self.sys.timers.every(Timer.RANKS, RANK_POLL_S, self.sys.monotonic())

    def _read(self, job: RunningAttempt) -> bool:
        got = read_rank_beats(self.folder)
        if (got.problems or got.dropped) and not job.ranks_warned:
            job.ranks_warned = True  # once per attempt: a bad writer beats every step
            self.log.warning("heartbeat_invalid", attempt=job.number, problems=got.problems[:3],
                             ranks_ignored=got.dropped, folder=str(self.folder))
        changed = False
        for rank, beat in got.beats.items():
            changed = self.seen(job, rank, beat) or changed
        if changed and None not in self.watch.sources:  # no node file: the ranks' beats are the job's step
            top = max(got.beats.values(), key=lambda b: b.step)
            apply_beat(self.status, top, self.sys.now(), job.rate)
        return changed

    def _show(self) -> None:
        now, wall = self.sys.monotonic(), self.sys.now()
        self.status.ranks = [
            {"rank": s.rank, "step": s.beat.step, "phase": s.beat.phase, "at": round(wall - (now - s.changed), 3),
             "step_s": None if s.step_s is None else round(s.step_s, 4), "straggler": s.straggler}
            for s in self.watch.ranks()]

    # ---- when it counts as hung --------------------------------------------------------------------------
    def _due(self) -> float | None:
        if self.watch.sources:
            return self.watch.deadline(self.cfg.health)
        allowance = hang_timeout(self.cfg.health, None, startup=True)
        return None if allowance is None else self._startup_from + allowance

    def _arm(self, job: RunningAttempt) -> None:
        if job.hang or job.stopping:
            return
        due = self._due()
        self.status.hang_detection = self.watch.describe(self.cfg.health)
        if due is None:
            self.sys.timers.cancel(Timer.HANG)
        else:
            self.sys.timers.set(Timer.HANG, due)

    def on_hang(self, job: RunningAttempt) -> None:
        """The HANG timer fired: read every source again, then judge the attempt hung unless it progressed."""
        now = self.sys.monotonic()
        self.refresh()
        self._read(job)
        if job.hang or job.stopping:
            return
        due = self._due()
        if due is None or due > now:  # progress since (or detection turned off): the timer is set again
            self._arm(job)
            return
        self._hung(job, now)

    def postpone(self, by: float) -> None:
        """The supervisor did not run for `by` seconds: every allowance goes on where it stood (the loop has
        postponed the timers too)."""
        self.watch.postpone(by)
        self._startup_from += by

    def _hung(self, job: RunningAttempt, now: float) -> None:
        job.hang = True
        self.sys.timers.cancel(Timer.RANKS)
        states = self.sys.worker_states(job.pid)
        culprits = self.watch.culprits({rank: state for rank, (_, state) in states.items()})
        job.hung_ranks = [(c.rank, c.why) for c in culprits]
        job.detected_at = self.sys.now()
        idle = self.watch.idle(now)
        idle = round(idle if idle is not None else now - self._startup_from, 1)
        beat = job.beat
        step = job.max_step if job.max_step is not None else beat.step if beat else None  # every rank's, as last_hang
        self.log.error("hang_detected", attempt=job.number, step=step,
                       phase=beat.phase if beat else None, idle_s=idle,
                       ranks=[f"rank {r}: {why}" for r, why in job.hung_ranks] or "not known")
        offset = _size(job.log_path)
        dumped = self.sys.signal_workers(job.pid, signal.SIGUSR1)
        stuck = {pid for pid, state in states.values() if state in STUCK_STATES}
        expected = sum(1 for pid in dumped if pid not in stuck)  # a stopped process cannot dump before SIGCONT
        self._dump = (offset, expected)
        self.log.info("stack_dump_requested", workers=dumped, log=str(job.log_path))
        self.status.last_hang = {"attempt": job.number, "at": job.detected_at, "step": job.max_step, "idle_s": idle,
                                 "ranks": [{"rank": r, "why": why} for r, why in job.hung_ranks], "stacks": None}
        self.publish()
        if expected == 0:  # every worker asked is stopped (kill at once), or none handles SIGUSR1 (wait the grace)
            self.on_term(job, dumped=bool(dumped))
            return
        self.sys.timers.set(Timer.HANG_TERM, now + self.cfg.health.stack_dump_wait_s)
        self.sys.timers.set(Timer.HANG_DUMPS, now + DUMP_POLL_S)

    def on_dumps(self, job: RunningAttempt) -> None:
        """Have the stack dumps landed? Then stop now rather than at the end of stack_dump_wait_s."""
        if self._dump is None:
            return
        offset, expected = self._dump
        if count_dumps(job.log_path, offset) >= expected:
            self.on_term(job, dumped=True)
        else:
            self.sys.timers.set(Timer.HANG_DUMPS, self.sys.monotonic() + DUMP_POLL_S)

    def on_term(self, job: RunningAttempt, dumped: bool = False) -> None:
        """Keep the dumps, SIGTERM the agent, and SIGKILL everything hang_kill_grace_s later: at once when every
        worker that can run has `dumped` (nothing more will come from a rank stuck in a collective)."""
        if self._dump is None or not job.hang:
            return
        offset, _ = self._dump
        self._dump = None
        for t in (Timer.HANG_DUMPS, Timer.HANG_TERM):
            self.sys.timers.cancel(t)
        job.stacks = self._keep_stacks(job, offset)
        job.stopping = True
        self.sys.send_signal(job.pid, signal.SIGTERM)
        grace = self._grace = 0.0 if dumped else self.cfg.health.hang_kill_grace_s
        self.sys.timers.set(Timer.HANG_KILL, self.sys.monotonic() + grace)
        self.bus.publish(HangRecorded(job, (self.status.last_hang or {}).get("idle_s")))
        if self.status.last_hang is not None:
            self.status.last_hang["stacks"] = job.stacks
        self.log.warning("hang_stopping", attempt=job.number, kill_after_s=grace, stacks=job.stacks)
        self.publish()

    def on_kill(self, job: RunningAttempt) -> None:
        killed = self.sys.kill_job_tree(job.pid)
        self.log.warning("job_killed", attempt=job.number, after_s=self._grace,
                         processes=len(killed), reason="hang")

    def _keep_stacks(self, job: RunningAttempt, offset: int) -> str | None:
        """What the job wrote since SIGUSR1 (its stack dumps), as `errors/attempt-NNNN.stacks.txt`; its path."""
        data = read_span(job.log_path, offset, STACKS_MAX_BYTES)
        if not data:
            return None
        path = job.error_file.with_name(f"attempt-{job.number:04d}.stacks.txt")
        try:
            write_atomic(path, data, durable=False, mode=0o600)
        except OSError as exc:
            self.log.warning("run_dir_write_failed", what="stack dumps", error=f"{exc.strerror or exc}", path=str(path))
            return None
        return str(path)


def _size(path: os.PathLike[str] | None) -> int:
    try:
        return os.stat(path).st_size if path is not None else 0
    except OSError:
        return 0
