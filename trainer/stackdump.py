"""SIGUSR1 -> every thread's stack on stderr, written by a thread of its own while it holds the GIL.

`faulthandler.register(SIGUSR1, all_threads=True)` writes from inside the C signal handler, without the GIL,
walking the frames of threads that keep running meanwhile: it crashed a rank with SIGSEGV while its async save
thread was in the middle of a call (tests/integration/test_trainer_runs.py, `TestSignals`). Here SIGUSR1 is
blocked in this thread and in every thread started after `install()` (they inherit the mask), and a daemon
thread takes it with `sigwait`, then dumps with `faulthandler.dump_traceback` holding the GIL: every other
thread is either parked at the GIL or inside a C call (a collective's wait releases the GIL), so no frame moves
under the walk. A rank hung in a collective still dumps. A thread started before `install()` may still be
handed the signal; then the dump is written by the main thread's handler at its next bytecode.

The output is faulthandler's: the supervisor counts one `Current thread 0x` header per process
(supervisor/daemon/evidence.py); here that header is the dumping thread's, followed by every other thread's.
"""
from __future__ import annotations

import faulthandler
import signal
import sys
import threading
from types import FrameType
from typing import Any, TextIO

__all__ = ["StackDump"]


class StackDump:
    """Install once per process (from the main thread); `uninstall` gives SIGUSR1 back."""

    def __init__(self, file: TextIO | None = None) -> None:
        self.file = file
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._previous: Any = None

    def install(self) -> StackDump:
        self._previous = signal.signal(signal.SIGUSR1, self._in_main)  # a thread started earlier may take it
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # this thread and every later one
        self._thread = threading.Thread(target=self._wait, name="stack-dump", daemon=True)
        self._thread.start()
        return self

    def uninstall(self) -> None:
        if self._thread is None:
            return
        self._stopping = True
        if self._thread.ident is not None:
            signal.pthread_kill(self._thread.ident, signal.SIGUSR1)
        self._thread.join(timeout=5)
        self._thread = None
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
        signal.signal(signal.SIGUSR1, self._previous if self._previous is not None else signal.SIG_DFL)

    def _wait(self) -> None:
        while True:
            signal.sigwait({signal.SIGUSR1})
            if self._stopping:
                return
            self._dump()

    def _in_main(self, signum: int, frame: FrameType | None) -> None:
        self._dump()

    def _dump(self) -> None:
        out = self.file or sys.stderr
        try:
            out.flush()
            faulthandler.dump_traceback(file=out, all_threads=True)
            out.flush()
        except (OSError, ValueError, RuntimeError):  # stderr closed or not a real file: nothing to write to
            pass
