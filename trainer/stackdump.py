"""SIGUSR1 stack dumps written by a thread of their own, never from inside the signal handler.

faulthandler.register(SIGUSR1, all_threads=True) walks every thread's frames from the C signal handler while
those threads run, and once crashed a rank (SIGSEGV) whose async save thread was mid-call. Here Python's own C
handler only writes the signal's number to a pipe (`signal.set_wakeup_fd`); a daemon thread blocked on that
pipe wakes, takes the GIL like any other thread (so no thread moves its frames meanwhile), and writes every
thread's stack (`sys._current_frames()`, formatted by `traceback`) to stderr with one `os.write` per thread.

- The pipe wakes the dump thread even while the main thread is blocked in a C call that released the GIL (a
  collective, I/O, a sleep): the hung rank the supervisor asks is dumped, not only a healthy one.
- The shape stays faulthandler's: `Thread 0x...` per thread and one `Current thread 0x...` header per process
  (the dump thread's own, written last): the supervisor counts those headers to know that a process dumped.
- Fallback: when the main thread runs the Python-level handler while the dump thread has yet to take the GIL for
  the signal, it arms `faulthandler.dump_traceback_later(FALLBACK_S)`; the dump thread cancels it as soon as it
  has the GIL. A dump thread that cannot get the GIL within that time (a thread holding it in a stuck C call)
  thus still yields faulthandler's dump, which is safe then: no thread can move its frames without the GIL. A
  process whose GIL was held since before the signal runs no Python at all (neither handler nor thread): it
  writes no dump.
- Forked children (DataLoader workers) inherit the handler; `os.register_at_fork` gives each its own pipe and
  dump thread. The signal mask is never touched.
- A wakeup fd set before `install` (asyncio's) still gets every signal number: the dump thread forwards them.
  One set after it (an asyncio loop's signal handler) keeps them; the handler then wakes the dump thread itself,
  and takes the wakeup fd back once unset (the loop closed).
"""
from __future__ import annotations

import atexit
import faulthandler
import os
import select
import signal
import sys
import threading
import traceback
from types import FrameType
from typing import Any

__all__ = ["FALLBACK_S", "install", "uninstall"]

FALLBACK_S = 1.0  # the dump thread's wait for the GIL before faulthandler dumps instead
THREAD_NAME = "trainer-stack-dump"


class _Dumper:
    def __init__(self, out_fd: int, previous_handler: Any, previous_wakeup: int) -> None:
        self.out_fd = out_fd
        self.previous_handler = previous_handler
        self.previous_wakeup = previous_wakeup  # forwarded every byte; -1: none
        self.previous_id = _file_id(previous_wakeup)  # while still this file: its owner may close it, and the number
        # be reused by a file of the job's that the bytes would go into
        self.busy = False  # from the thread's taking the GIL after a wake-up to its dump written
        self.armed = False  # faulthandler's timer is ours: only then cancelled (a user's own dump_traceback_later
        # is replaced by an armed fallback, never cancelled by another signal's wake-up)
        self.lock = threading.RLock()  # the handler's look-then-arm against the thread's take-then-cancel (re-entrant:
        # a second signal's handler may run inside the first's, in the same thread)
        self.read_fd, self.write_fd = os.pipe()  # not inherited by exec'd children (PEP 446)
        os.set_blocking(self.write_fd, False)  # set_wakeup_fd requires it; a full pipe drops bytes, never blocks
        self.thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stop the dump thread (it reads the end of the pipe) and release the pipe."""
        os.close(self.write_fd)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            os.close(self.read_fd)

    def _run(self) -> None:
        while True:
            try:
                _readable(self.read_fd, None)  # the GIL is released here, not while waiting for it
                with self.lock:  # the GIL is had: faulthandler's fallback is not needed (armed before, or never)
                    self.busy = True
                    if self.armed:
                        faulthandler.cancel_dump_traceback_later()
                        self.armed = False
                data = os.read(self.read_fd, 4096)
            except OSError:
                return
            if not data:
                return  # closed: uninstalled
            if self.previous_wakeup >= 0 and _file_id(self.previous_wakeup) == self.previous_id:
                _write(self.previous_wakeup, data)
            if signal.SIGUSR1 in data:
                self._dump()
            self.busy = False

    def _dump(self) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        native = {t.ident: t.native_id for t in threading.enumerate()}
        me = threading.get_ident()
        frames = sys._current_frames()
        _write(self.out_fd, f"Stack dump of process {os.getpid()} (SIGUSR1), {len(frames)} threads:\n".encode())
        for ident, frame in sorted(frames.items(), key=lambda kv: kv[0] != threading.main_thread().ident):
            if ident == me:
                continue
            head = f'Thread 0x{ident:016x} "{names.get(ident, "?")}" tid {native.get(ident, "?")} (most recent call last):\n'
            _write(self.out_fd, (head + "".join(traceback.format_stack(frame)) + "\n").encode(errors="replace"))
        del frames
        _write(self.out_fd, f'Current thread 0x{me:016x} "{THREAD_NAME}" (wrote this dump)\n\n'.encode())


def _file_id(fd: int) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd) if fd >= 0 else None
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if st else None


def _readable(fd: int, timeout_ms: int | None) -> bool:
    """poll, not select: select raises ValueError for an fd above 1023 (a job with many files open), from the
    handler into the training itself. A poll object of its own per call: one is not for two threads at once."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout_ms))


def _write(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:
        pass  # stderr closed or a full non-blocking pipe: a dump is never worth an exception in the job


_dumper: _Dumper | None = None
_fork_hook = False


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """Python-level handler (main thread): arm faulthandler's fallback while the dump thread has yet to take the GIL
    for a signal (its byte unread); the thread cancels it once it has the GIL."""
    d = _dumper
    if d is None:
        return
    with d.lock:
        if not d.busy and not _readable(d.read_fd, 0):  # its byte went elsewhere, or the thread already dumped
            theirs = signal.set_wakeup_fd(-1)  # a wakeup fd set after install (asyncio's add_signal_handler) or
            signal.set_wakeup_fd(d.write_fd if theirs < 0 else theirs, warn_on_full_buffer=False)  # unset (its
            if theirs != d.write_fd:  # remove_signal_handler): taken back when unset; the thread woken from here
                _write(d.write_fd, bytes([signum]))
        if not d.busy and _readable(d.read_fd, 0):
            faulthandler.dump_traceback_later(FALLBACK_S, repeat=False, file=d.out_fd)
            d.armed = True


def install(out: Any = None) -> None:
    """Dump every thread's stack to `out` (a file with a fileno, or an fd; default stderr) on SIGUSR1.

    Main thread only (like signal.signal); a second call changes nothing.
    """
    global _dumper, _fork_hook
    if _dumper is not None:
        return
    out_fd = _fileno(sys.stderr if out is None else out)
    previous = signal.getsignal(signal.SIGUSR1)
    _dumper = _Dumper(out_fd, previous, -1)
    _dumper.previous_wakeup = signal.set_wakeup_fd(_dumper.write_fd, warn_on_full_buffer=False)
    _dumper.previous_id = _file_id(_dumper.previous_wakeup)
    signal.signal(signal.SIGUSR1, _on_signal)
    if not _fork_hook:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        atexit.register(_ignore_at_exit)
        _fork_hook = True


def uninstall() -> None:
    """Give SIGUSR1 and the wakeup fd back to what they were before `install`."""
    global _dumper
    if _dumper is None:
        return
    dumper, _dumper = _dumper, None
    signal.signal(signal.SIGUSR1, dumper.previous_handler if dumper.previous_handler is not None else signal.SIG_DFL)
    signal.set_wakeup_fd(dumper.previous_wakeup)
    if dumper.armed:
        faulthandler.cancel_dump_traceback_later()
    dumper.close()


def _ignore_at_exit() -> None:
    """An ending interpreter resets Python-level handlers to SIG_DFL: a SIGUSR1 then killed a process that was
    exiting 0. Ignored from here on (and no longer caught: the supervisor signals only processes that catch it)."""
    if _dumper is not None and signal.getsignal(signal.SIGUSR1) is _on_signal:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) has the handler but neither the dump thread nor a pipe of its own.

    After a fork the forking thread is the child's main thread, so the wakeup fd can be set here.
    """
    global _dumper
    parent, _dumper = _dumper, None
    if parent is None:
        return
    try:
        _dumper = _Dumper(parent.out_fd, parent.previous_handler, -1)
        signal.set_wakeup_fd(_dumper.write_fd, warn_on_full_buffer=False)
    except (OSError, RuntimeError, ValueError) as exc:  # no fds or threads left: no dumps, no byte into a reused fd
        signal.set_wakeup_fd(-1)
        _write(parent.out_fd, f"trainer: no SIGUSR1 stack dumps in forked process {os.getpid()}: {exc}\n".encode())
    for fd in (parent.read_fd, parent.write_fd):  # the parent's pipe: a byte written to it would wake the parent
        os.close(fd)


def _fileno(out: Any) -> int:
    if isinstance(out, int):
        return out
    try:
        return int(out.fileno())
    except (AttributeError, OSError, ValueError):
        return 2  # a replaced sys.stderr (pytest's capture): the process's own
