"""The event loop: one thread, one `select`, no busy polling (docs/design.md, 'The picture').

Wake-ups come from one pipe (signal.set_wakeup_fd, the watchdog observer thread); timers set the select timeout;
children are reaped with waitpid(-1) after every wake-up. SIGHUP's rules: docs/design.md, 'Notes for maintainers'.
"""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import selectors
import signal
import time
import warnings
from collections import deque
from collections.abc import Callable
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver, ObservedWatch

from supervisor.daemon.core import Core
from supervisor.daemon.system import LoopSystem
from supervisor.daemon.timers import Tick
from supervisor.host import procs
from supervisor.host.mounts import identity
from supervisor.host.regularfile import open_regular
from supervisor.host.signals import HANDLED
from supervisor.observe.console import Console
from supervisor.observe.humanize import human_bytes
from supervisor.observe.lines import LineSplitter
from supervisor.observe.sanitize import visible
from supervisor.observe.tracefold import TracebackFold

__all__ = ["EventLoop", "Echo"]


def _not_the_stop_race(record: logging.LogRecord) -> bool:
    """watchdog logs an ERROR when its inotify thread reads once more after `observer.stop()`: our own
    shutdown, nothing lost; it printed a stray traceback-looking line over the console as `run` exited."""
    return not str(record.msg).startswith("InotifyEmitter.queue_events() called when the thread is inactive")


logging.getLogger("watchdog.observers.inotify").addFilter(_not_the_stop_race)

_HANDLED = HANDLED  # stop, force stop, child exits (supervisor/host/signals.py)
_MAX_WAIT_S = 3600.0
_FROZEN_S = 1.0  # a select this much later than asked: the daemon did not run meanwhile


class _Forward(FileSystemEventHandler):
    """On the watcher's thread: wakes the loop only for what it acts on (not the supervisor's own writes to the run
    dir: state.json, the history, its log, each of which would wake it several times)."""

    def __init__(self, sink: queue.SimpleQueue[Path], wake: Callable[[], None], lost: queue.SimpleQueue[Path],
                 watched: set[Path], wanted: Callable[[Path], bool]) -> None:
        self.sink, self.wake, self.lost, self.watched, self.wanted = sink, wake, lost, watched, wanted

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in ("opened", "closed_no_write"):
            return
        paths = [Path(os.fsdecode(p)) for p in (event.src_path, getattr(event, "dest_path", "")) if p]
        gone = event.event_type in ("deleted", "moved") and paths[0] in self.watched
        if gone:
            self.lost.put(paths[0])  # a watched dir itself went away: its inotify watch is gone with it
        wanted = [p for p in paths if self.wanted(p)]
        for p in wanted:
            self.sink.put(p)
        if wanted or gone:
            self.wake()


class Echo:
    """Show the current attempt's output on a terminal as `[job] ...` lines, a bounded chunk per call.

    Whole lines are printed as a terminal would show them (their last `\\r` frame); the unfinished line, such
    as a tqdm bar being redrawn, is the console's live `job` row. A backlog of more than `BEHIND` bytes
    is skipped with a note: an echo minutes behind helps no one, and the log file has every byte.
    """

    CHUNK = 1 << 20
    BEHIND = 8 << 20

    def __init__(self, console: Console) -> None:
        self.console = console
        self.path: Path | None = None
        self.offset = 0
        self.lines = LineSplitter()
        self.fold = TracebackFold()  # torchrun's SignalException traceback on a stop: one line, not 27
        self.colors = console.tty and not os.environ.get("NO_COLOR")  # the job's own colors; nothing else of it

    def pump(self, path: Path | None) -> bool:
        """Echo up to CHUNK new bytes of `path`; True when more is already waiting."""
        if path is None or self.console.dead:
            return False
        if path != self.path:
            self._end_line()
            self.path, self.offset, self.lines = path, 0, LineSplitter()
        try:
            with open(open_regular(path), "rb") as f:  # the job may have put a FIFO there: never block the loop on it
                size = os.fstat(f.fileno()).st_size
                if size < self.offset:  # truncated under us: start over
                    self.offset, self.lines = 0, LineSplitter()
                skipped = max(0, size - self.CHUNK - self.offset) if size - self.offset > self.BEHIND else 0
                self.offset += skipped
                if skipped:
                    self.lines = LineSplitter()
                f.seek(self.offset)
                data = f.read(self.CHUNK)
        except OSError:
            return False
        self.offset += len(data)
        out = [f"[job] ... {human_bytes(skipped)} of output not shown here (all of it is in {path})"] if skipped else []
        out += [self._line(t) for t in self.fold.feed([b.decode("utf-8", "replace") for b in self.lines.feed(data)])]
        frame = self.lines.frame
        self.console.show(out, job=self._line(frame.decode("utf-8", "replace")) if frame else None)
        return self.offset < size

    def _line(self, text: str) -> str:
        """A job line as the console may print it: its control sequences shown, not executed (observe/sanitize)."""
        return f"[job] {visible(text, colors=self.colors)}"

    def drain(self, limit: int = 16) -> None:
        """At exit: echo what is left (the backlog is bounded by BEHIND), and leave the last frame as a line."""
        for _ in range(limit):
            if not self.pump(self.path):
                break
        self._end_line()

    def _end_line(self) -> None:
        held = self.fold.flush()
        if held:
            self.console.show([self._line(line) for line in held], job=None)
        frame = self.lines.frame
        if frame:
            self.console.show([self._line(frame.decode("utf-8", "replace"))], job=None)
            self.lines = LineSplitter()


class EventLoop:
    def __init__(self, core: Core, system: LoopSystem, watch: list[tuple[Path, bool]], echo: Echo | None = None,
                 ticks: list[tuple[float, Callable[[], None]]] | None = None) -> None:
        self.core, self.sys, self.watch, self.echo = core, system, watch, echo
        self.ticks = ticks or []  # periodic callbacks (e.g. sd_notify WATCHDOG=1), run from this loop only
        self.signals: deque[int] = deque()
        self.files: queue.SimpleQueue[Path] = queue.SimpleQueue()
        self._echo_more = False  # the echo stopped at its chunk size with more to show
        # Watches by path; a watched dir deleted or replaced (the checkpoint root re-created, the run dir removed)
        # is watched again as soon as it exists again: without that, its commits and heartbeats go unseen.
        self._observer: BaseObserver | None = None
        self._handler: _Forward | None = None
        self._watches: dict[Path, tuple[ObservedWatch | None, bool]] = {}
        self._lost_events: queue.SimpleQueue[Path] = queue.SimpleQueue()
        self._lost: set[Path] = set()
        self._next_rewatch = 0.0
        # (device, inode) of what each watch was put on: a dir moved aside and replaced under the same path (`mv
        # ckpts ckpts.old && cp -a ckpts.old ckpts`) sends the watched dir no event, and its watch follows the old
        # one to its new name. Compared at most once a second.
        self._ids: dict[Path, tuple[int, int] | None] = {}
        self._next_id_check = 0.0

    def _wake(self) -> None:  # from any thread
        with contextlib.suppress(BlockingIOError, OSError):  # pipe full: a wake-up is already pending
            os.write(self._wfd, b"\0")

    def run(self, begin: Callable[[], None]) -> int:
        rfd, self._wfd = os.pipe()
        for fd in (rfd, self._wfd):
            os.set_blocking(fd, False)
        old_wakeup = signal.set_wakeup_fd(self._wfd, warn_on_full_buffer=False)
        self.sys.waker = self._wake
        handled = [*_HANDLED, *([signal.SIGHUP] if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN else [])]
        old_handlers = {s: signal.signal(s, lambda n, _f: self.signals.append(n)) for s in handled}
        # watchdog warns (to stderr, over the console) each time a renamed dir reuses an inotify watch, as every
        # checkpoint commit does (`.tmp-step_N` -> `step_N`); nothing is wrong and the callback stays the same.
        warnings.filterwarnings("ignore", message="Callback with id .* already exists for watch", category=RuntimeWarning)
        observer = self._observer = Observer()
        self._handler = _Forward(self.files, self._wake, self._lost_events, {p for p, _ in self.watch},
                                 lambda p: self.core.cares(p) or (self.echo is not None and p.parent.name == "logs"))
        for path, recursive in self.watch:
            self._ids[path] = identity(path)
            self._watches[path] = (observer.schedule(self._handler, str(path), recursive=recursive), recursive)
        observer.start()
        sel = selectors.DefaultSelector()
        sel.register(rfd, selectors.EVENT_READ)
        for i, (interval, _) in enumerate(self.ticks):
            self.sys.timers.every(Tick(i), interval, self.sys.monotonic())
        try:
            begin()
            began, cpu = self.sys.monotonic(), time.thread_time()
            self._dispatch()
            while not self.core.done:
                deadline = self.sys.timers.next_deadline()
                # Capped: epoll cannot wait ~25 days; a farther timer is simply looked at again later.
                timeout = None if deadline is None else min(_MAX_WAIT_S, max(0.0, deadline - self.sys.monotonic()))
                sel.select(timeout)
                try:
                    while os.read(rfd, 4096):
                        pass
                except BlockingIOError:
                    pass
                # Once a turn, before any timer is popped: the wall time since the last dispatch began, less its
                # CPU time and the wait asked for, is time this process did not run (a freeze can land while the
                # loop waits or while it works: Slurm suspends at any moment, the busiest moment is a stop's).
                now = self.sys.monotonic()
                self._thawed(now - began - (time.thread_time() - cpu) - (timeout or 0.0))
                began, cpu = now, time.thread_time()
                self._dispatch()
            if self.echo is not None:
                self.echo.drain()
            return int(self.core.exit_code or 0)
        finally:
            observer.stop()
            observer.join(timeout=5)
            signal.set_wakeup_fd(old_wakeup)
            for s, h in old_handlers.items():
                signal.signal(s, h)
            sel.close()
            os.close(rfd)
            os.close(self._wfd)

    def _thawed(self, late: float) -> None:
        """The loop's turn took `late` seconds of wall time beyond its CPU time and its wait: this process did not
        run meanwhile, frozen with its job (Slurm's `scontrol suspend` stops every process of a job, a cgroup
        freezer, SIGSTOP, a paused VM) or alone (Ctrl+Z). That was no time of the job's: the hang allowance,
        stop_timeout_s and the backoff go on where they stood. (The loop wakes every second for its ticks, so
        `late` falls short of the freeze by a second at most.) The one answer to a freeze: nothing else checks."""
        if late < _FROZEN_S:
            return
        self.sys.timers.postpone(late)
        self.core.hangs.postpone(late)
        self.core.log.warning("frozen", frozen_s=round(late, 1),
                              note="the supervisor did not run (suspended with its job?): its timers were paused")

    def _keep_watching(self) -> None:
        """Watch again what was deleted or replaced, once it exists again (tried at most once a second)."""
        while True:
            try:
                self._lost.add(self._lost_events.get_nowait())
            except queue.Empty:
                break
        if self.core.watch_stale:
            self.core.watch_stale = False
            self._lost.add(self.core.house.root)
        now = self.sys.monotonic()
        if now >= self._next_id_check:
            self._next_id_check = now + 1.0
            self._lost.update(p for p, known in self._ids.items() if p not in self._lost and identity(p) != known)
        if not self._lost or now < self._next_rewatch or self._observer is None or self._handler is None:
            return
        self._next_rewatch = now + 1.0
        for path in sorted(self._lost):
            old, recursive = self._watches.get(path, (None, True))
            if not os.path.isdir(path):
                continue
            if old is not None:
                with contextlib.suppress(KeyError, OSError):
                    self._observer.unschedule(old)
            try:
                self._ids[path] = identity(path)
                self._watches[path] = (self._observer.schedule(self._handler, str(path), recursive=recursive), recursive)
            except OSError:
                self._watches[path] = (None, recursive)
                continue  # gone again already: the next turn tries once more
            self._lost.discard(path)
            self.core.on_watch_restored(path)

    def _dispatch(self) -> None:
        self._keep_watching()
        # File events first, so the echo of a job's last lines is not lost when its exit is handled below.
        seen_log = False
        while True:
            try:
                path = self.files.get_nowait()
            except queue.Empty:
                break
            seen_log = seen_log or path.parent.name == "logs"
            self.core.on_file_event(path)
        if self.echo is not None and (seen_log or self._echo_more):
            self._pump_echo(self.core.job.log_path if self.core.job else self.echo.path)
        if self.core.job is None:
            # No job yet: a stop must come before a pass's result, which may launch one (`begin` can be busy for
            # a while stopping an orphan: a `stop` meanwhile launched a job only to stop it again).
            self._take_signals()
        for done, result in self.sys.finished_work():  # store passes that ran off this thread
            done(result)
        for pid, code in procs.reap_any():
            if self.echo is not None and self.core.job is not None and pid == self.core.job.pid:
                self._pump_echo(self.core.job.log_path)  # whatever it wrote last
            self.sys.forget(pid, code)
            self.core.on_job_exit(pid, code)
        self._take_signals()  # with a job: after its exit, so that an exit and a stop at once is still a crash
        for key in self.sys.timers.pop_due(self.sys.monotonic()):
            if isinstance(key, Tick):
                interval, fn = self.ticks[key.index]
                fn()
                self.sys.timers.every(key, interval, self.sys.monotonic())
            else:
                self.core.on_timer(key)

    def _take_signals(self) -> None:
        while self.signals:
            s = self.signals.popleft()
            if s != signal.SIGCHLD:
                self.core.on_signal(s)

    def _pump_echo(self, path: Path | None) -> None:
        assert self.echo is not None
        self._echo_more = self.echo.pump(path)
        if self._echo_more:
            self._wake()  # the rest on the next turn, after signals and timers have been looked at
