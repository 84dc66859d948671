"""The event loop: one thread, one `select`, no busy polling.

Wake-ups come from a single pipe: signal handlers write to it (signal.set_wakeup_fd), and so does the
watchdog observer thread for file events. Timers set the select timeout. Child exits are collected with
waitpid(-1) after every wake-up (SIGCHLD wakes us; as a subreaper we also reap adopted orphans).
"""
from __future__ import annotations

import os
import queue
import selectors
import signal
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from supervisor import procs
from supervisor.core import Core
from supervisor.signals import HANDLED
from supervisor.system import RealSystem

__all__ = ["EventLoop", "Echo"]

_HANDLED = HANDLED  # stop, force stop, child exits (supervisor/signals.py)
_MAX_WAIT_S = 3600.0


class _Forward(FileSystemEventHandler):
    def __init__(self, sink: queue.SimpleQueue[Path], wake: Callable[[], None]) -> None:
        self.sink, self.wake = sink, wake

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in ("opened", "closed_no_write"):
            return
        for p in (event.src_path, getattr(event, "dest_path", "")):
            if p:
                self.sink.put(Path(os.fsdecode(p)))
        self.wake()


class Echo:
    """Copy new bytes of the current attempt's log to our stderr with a prefix (only on a terminal)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.path: Path | None = None
        self.offset = 0
        self.partial = b""

    def pump(self, path: Path | None) -> None:
        if path is None:
            return
        if path != self.path:
            self.path, self.offset, self.partial = path, 0, b""
        try:
            with open(path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        for line in lines:
            self.out.write(f"[job] {line.decode('utf-8', 'replace')}\n")
        self.out.flush()


class EventLoop:
    def __init__(self, core: Core, system: RealSystem, watch: list[tuple[Path, bool]], echo: Echo | None = None,
                 ticks: list[tuple[float, Callable[[], None]]] | None = None) -> None:
        self.core, self.sys, self.watch, self.echo = core, system, watch, echo
        self.ticks = ticks or []  # periodic callbacks (e.g. sd_notify WATCHDOG=1), run from this loop only
        self.signals: deque[int] = deque()
        self.files: queue.SimpleQueue[Path] = queue.SimpleQueue()

    def _wake(self) -> None:  # from any thread
        try:
            os.write(self._wfd, b"\0")
        except (BlockingIOError, OSError):
            pass  # pipe full: a wake-up is already pending

    def run(self, begin: Callable[[], None]) -> int:
        rfd, self._wfd = os.pipe()
        for fd in (rfd, self._wfd):
            os.set_blocking(fd, False)
        old_wakeup = signal.set_wakeup_fd(self._wfd, warn_on_full_buffer=False)
        self.sys.waker = self._wake
        old_handlers = {s: signal.signal(s, lambda n, _f: self.signals.append(n)) for s in _HANDLED}
        observer = Observer()
        handler = _Forward(self.files, self._wake)
        for path, recursive in self.watch:
            observer.schedule(handler, str(path), recursive=recursive)
        observer.start()
        sel = selectors.DefaultSelector()
        sel.register(rfd, selectors.EVENT_READ)
        for i, (interval, _) in enumerate(self.ticks):
            self.sys.timers.set(f"tick:{i}", self.sys.monotonic() + interval)
        try:
            begin()
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
                self._dispatch()
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

    def _dispatch(self) -> None:
        # File events first, so the echo of a job's last lines is not lost when its exit is handled below.
        seen_log = False
        while True:
            try:
                path = self.files.get_nowait()
            except queue.Empty:
                break
            seen_log = seen_log or path.parent.name == "logs"
            self.core.on_file_event(path)
        if self.echo is not None and seen_log:
            self.echo.pump(self.core.job.log_path if self.core.job else self.echo.path)
        for done, result in self.sys.finished_work():  # store passes that ran off this thread
            done(result)
        for pid, code in procs.reap_any():
            if self.echo is not None and self.core.job is not None and pid == self.core.job.pid:
                self.echo.pump(self.core.job.log_path)  # whatever it wrote last
            self.sys.forget(pid, code)
            self.core.on_job_exit(pid, code)
        while self.signals:
            s = self.signals.popleft()
            if s != signal.SIGCHLD:
                self.core.on_signal(s)
        for name in self.sys.timers.pop_due(self.sys.monotonic()):
            if name.startswith("tick:"):
                i = int(name[5:])
                interval, fn = self.ticks[i]
                fn()
                self.sys.timers.set(name, self.sys.monotonic() + interval)
            else:
                self.core.on_timer(name)
