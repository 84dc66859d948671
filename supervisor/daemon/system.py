"""The one seam between the supervisor's core and the operating system: clock, randomness, processes, timers.

`Core` only ever calls these methods; tests replace `RealSystem` with a fake that records calls and lets
them advance time by hand. Files (checkpoints, heartbeat, state.json) are real files in both cases.
"""
from __future__ import annotations

import contextlib
import os
import queue
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from supervisor.checkpoints.metadata import child as metadata_child
from supervisor.daemon import alerts
from supervisor.daemon.evidence import read_oom_kills
from supervisor.daemon.timers import Timers
from supervisor.host import procs
from supervisor.host.boot import start_ticks, wall_now
from supervisor.host.signals import STOP_SIGNALS
from supervisor.host.spares import Prewarmer, handed_ranks

__all__ = ["System", "LoopSystem", "RealSystem"]

T = TypeVar("T")


class System(Protocol):
    timers: Timers

    def run_off_loop(self, work: Callable[[], T], done: Callable[[T | BaseException], None]) -> None:
        """Run `work` away from the event loop; later call `done(result or exception)` on the loop thread."""

    def now(self) -> float: ...  # wall clock, for humans and files
    def monotonic(self) -> float: ...  # durations and timers
    def file_now(self) -> float: ...  # the wall clock the kernel stamps files with, for their ages (not libfaketime's)
    def random(self) -> float: ...  # jitter in [0, 1)
    def spawn(self, argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], log_path: Path | None) -> tuple[int, float]:
        """Start the job, its output appended to `log_path` (None: the supervisor's own); (pid, its start ticks)."""
    def send_signal(self, pid: int, sig: int) -> None:
        """Send `sig` to `pid`; a stop signal is followed by SIGCONT, so that a stopped process acts on it."""
    def signal_workers(self, pid: int, sig: int) -> list[int]:
        """Send `sig` to the job's processes that handle it (stack dumps: never one it would kill); their pids."""
    def worker_states(self, pid: int) -> dict[int, tuple[int, str]]:
        """The job's workers by rank: (pid, psutil status such as "running", "sleeping", "stopped")."""
    def kill_job_tree(self, pid: int) -> list[tuple[int, str]]:
        """SIGKILL the job's process group and every descendant."""
    def survivors(self) -> list[tuple[int, str]]:
        """Descendants still alive (the job's, not our own helpers): (pid, name) of each, untouched."""
    def reap_survivors(self) -> list[tuple[int, str]]:
        """After an attempt: kill any descendant still alive; return what was killed."""
    def oom_kills(self) -> int | None: ...
    def stop_orphans(self, token: str, run_dir: Path, timeout: float) -> list[int]:
        """Stop every live process of a job this run dir's supervisor started (procs.find_orphans); their pids."""
    def stop_job(self, pid: int, timeout: float) -> list[int]:
        """Outside the event loop (the supervisor is failing): SIGTERM the job, wait, then kill what is left."""
    def on_terminal(self) -> bool:
        """Whether a SIGINT now can be a Ctrl+C typed at the supervisor (it leads its terminal's foreground)."""


class LoopSystem(System, Protocol):
    """What the event loop needs beyond Core's seam: its wake-up, the finished off-loop work, reaped children."""

    waker: Callable[[], None]  # set by the loop: wakes its select() from another thread

    def finished_work(self) -> list[tuple[Callable[[Any], None], Any]]:
        """The `done` callbacks of off-loop work that finished, with their results (to call on the loop)."""
    def forget(self, pid: int, returncode: int) -> None:
        """A child the loop reaped: drop what was kept for it."""


class _Kept(set[int]):  # and, asked at the moment, every process in an alert command's session
    def __contains__(self, pid: object) -> bool:
        return super().__contains__(pid) or (isinstance(pid, int) and alerts.session_of(pid) in alerts.SESSIONS)


class RealSystem:
    """The real thing. Exit statuses are delivered by the event loop's SIGCHLD handling, not here."""

    def __init__(self, prewarm: bool = False, *, warm_workers: bool = False, warm_modules: Sequence[str] = ()) -> None:
        self.timers = Timers()
        self._popen: dict[int, subprocess.Popen[bytes]] = {}
        self.prewarmer: Prewarmer | None = None
        if prewarm:
            from supervisor.observe.eventlog import get_logger  # here: importing this module stays cheap

            self.prewarmer = Prewarmer(get_logger(), workers=warm_workers, modules=warm_modules)
        self._job_log: Path | None = None
        self._launched = 0
        self.waker: Callable[[], None] = lambda: None  # set by the event loop: wakes its select()
        self._finished: queue.SimpleQueue[tuple[Callable[[Any], None], Any]] = queue.SimpleQueue()

    def run_off_loop(self, work: Callable[[], T], done: Callable[[T | BaseException], None]) -> None:
        def run() -> None:
            try:
                result: Any = work()
            except BaseException as exc:  # noqa: BLE001 - handed to `done`, on the loop thread
                result = exc
            self._finished.put((done, result))
            self.waker()

        # A daemon thread: store work is renames and reads, safe to abandon when the supervisor exits.
        threading.Thread(target=run, name="store-pass", daemon=True).start()

    def finished_work(self) -> list[tuple[Callable[[Any], None], Any]]:
        """Completions of `run_off_loop` work, for the event loop to deliver on its own thread."""
        out = []
        while not self._finished.empty():  # only the loop thread takes from it
            out.append(self._finished.get_nowait())
        return out

    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def file_now(self) -> float:
        return wall_now()

    def random(self) -> float:
        return random.random()

    def spawn(self, argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], log_path: Path | None) -> tuple[int, float]:
        # A spare opens the attempt log itself: without one (an unwritable run dir) the launch goes cold.
        self._job_log = log_path  # where a warm agent says which worker took which rank (worker_states)
        self._launched = int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))  # as start ticks
        warm = self.prewarmer.launch(argv, cwd=cwd, env=env, log_path=log_path) if self.prewarmer and log_path else None
        p = warm or procs.spawn(argv, cwd=cwd, env=env, log_path=log_path)
        self._popen[p.pid] = p
        if self.prewarmer is not None and log_path is not None:  # after the job, so that it gets the head start
            self.prewarmer.refill(argv, cwd=cwd, env=env, log_dir=log_path.parent)
        return p.pid, float(start_ticks(p.pid) or 0)  # 0: it has exited already; identity is then moot

    def forget(self, pid: int, returncode: int) -> None:
        """The loop reaped `pid` itself: tell Popen so it never waits on it again."""
        p = self._popen.pop(pid, None)
        if p is not None:
            p.returncode = returncode
        if self.prewarmer is not None:
            self.prewarmer.forget(pid, returncode)

    def close(self) -> None:
        """The supervisor is exiting: the idle prewarm spare goes with it."""
        if self.prewarmer is not None:
            self.prewarmer.close()

    def _keep(self) -> set[int]:
        """Our own children that are not the job's: the idle spare, a `.metadata` parse (metadata_child), an alert's
        command and what it started (its session, asked when each process is looked at: daemon/alerts.py)."""
        spares = self.prewarmer.spare_pids() if self.prewarmer is not None else set()
        return _Kept(set(spares) | metadata_child.running_pids())

    def send_signal(self, pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
            if sig in STOP_SIGNALS:  # a stopped agent (kill -STOP, a debugger) acts on it only once continued
                os.kill(pid, signal.SIGCONT)

    def signal_workers(self, pid: int, sig: int) -> list[int]:
        return procs.signal_catchers(pid, sig)

    def worker_states(self, pid: int) -> dict[int, tuple[int, str]]:
        log = self._job_log if self.prewarmer is not None else None  # read on a hang only, not on a clock
        return procs.worker_states(pid, handed_ranks(log, self._launched) if log is not None else {})

    def kill_job_tree(self, pid: int) -> list[tuple[int, str]]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # the job leads its own session: pgid == pid
        return self.reap_survivors()

    def survivors(self) -> list[tuple[int, str]]:
        with alerts.STARTING:
            return procs.named(procs.descendants(self._keep()))

    def reap_survivors(self) -> list[tuple[int, str]]:
        with alerts.STARTING:  # no alert command starts between the look and the kill
            return procs.kill_descendants(signal.SIGKILL, exclude=self._keep())

    def oom_kills(self) -> int | None:
        return read_oom_kills()

    def stop_orphans(self, token: str, run_dir: Path, timeout: float) -> list[int]:
        found = procs.find_orphans(token, run_dir)
        return procs.stop_processes(found, timeout) if found else []

    def stop_job(self, pid: int, timeout: float) -> list[int]:
        try:
            import psutil

            job = psutil.Process(pid)
            tree = [job, *job.children(recursive=True)]
        except Exception:  # noqa: BLE001 - gone already
            return []
        stopped = procs.stop_processes(tree, timeout)
        procs.reap_any()
        return stopped

    def on_terminal(self) -> bool:
        try:
            fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY | os.O_CLOEXEC)  # ENXIO: no controlling terminal
        except OSError:
            return False
        try:
            return os.tcgetpgrp(fd) == os.getpgrp()
        except OSError:
            return False
        finally:
            os.close(fd)
