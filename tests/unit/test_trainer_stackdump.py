"""trainer/stackdump.py: SIGUSR1 dumps every thread from a dump thread, never from the signal handler.

Each case runs tests/jobs/stackdump_probe.py in a process of its own (the signal handler and the wakeup fd are
process-wide) and reads what it wrote to stderr.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from supervisor.daemon.evidence import DUMP_MARK
from tests.helpers import wait_for

PROBE = Path(__file__).resolve().parents[1] / "jobs" / "stackdump_probe.py"


class Probe:
    def __init__(self, mode: str, tmp_path: Path, *args: str) -> None:
        self.err = tmp_path / f"{mode}{len(args)}.err"
        with open(self.err, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, str(PROBE), mode, *args], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True)
        assert self.proc.stdout is not None
        self.ready = self.proc.stdout.readline()
        assert self.ready.startswith("ready"), self.text()

    def text(self) -> str:
        return self.err.read_text(errors="replace")

    def dumps(self) -> int:
        return self.err.read_bytes().count(DUMP_MARK)

    def finish(self) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        rc = self.proc.wait(timeout=60)
        self.proc.stdout.close()
        return rc


@pytest.fixture
def probe(tmp_path: Path):  # type: ignore[no-untyped-def]
    started: list[Probe] = []

    def start(mode: str, *args: str) -> Probe:
        started.append(Probe(mode, tmp_path, *args))
        return started[-1]

    yield start
    for p in started:
        if p.proc.poll() is None:
            p.proc.kill()
            p.finish()


class TestStackDump:
    def test_a_main_thread_blocked_in_c_is_dumped_with_every_thread_named(self, probe) -> None:  # type: ignore[no-untyped-def]
        """Blocked in a GIL-releasing call (as in a collective) the main thread is dumped, by name, with the others."""
        p = probe("blocked")

        sent = 0

        def blocked_seen() -> bool:  # the main thread in os.read (it may still be printing `ready` at first)
            nonlocal sent
            if p.dumps() < sent:  # one signal at a time: the last one's dump is not written yet
                return False
            if "os.read(0, 1)" in p.text():
                return True
            os.kill(p.proc.pid, signal.SIGUSR1)
            sent += 1
            return False

        wait_for(blocked_seen, 30, "a dump of the main thread in os.read", interval=0.1)
        text = p.text()
        assert '"MainThread"' in text and '"worker-sleeping"' in text, text
        assert f"Stack dump of process {p.proc.pid} (SIGUSR1)" in text
        assert p.proc.poll() is None  # the process goes on
        time.sleep(1.5)  # past the fallback's delay: it was cancelled, faulthandler wrote nothing
        assert "Timeout" not in p.text() and p.dumps() == sent  # one dump per signal, each one whole
        assert p.finish() == 0

    def test_a_process_with_over_1023_fds_open_dumps_and_lives(self, probe) -> None:  # type: ignore[no-untyped-def]
        """The dump pipe's fds above 1023 (a rank with many files open): select() raised ValueError from the
        handler into the training and killed the dump thread; poll() has no such limit."""
        p = probe("fds")
        for n in (1, 2):
            os.kill(p.proc.pid, signal.SIGUSR1)
            wait_for(lambda: p.dumps() == n or p.proc.poll() is not None, 30, "a dump")  # noqa: B023
            assert p.proc.poll() is None and p.dumps() == n, p.text()[-3000:]
        assert "ValueError" not in p.text() and p.finish() == 0, p.text()[-3000:]

    def test_a_wakeup_fd_of_the_script_s_own_and_its_watchdog_keep_working(self, probe) -> None:  # type: ignore[no-untyped-def]
        """An asyncio loop's signal handler set its wakeup fd after install, then unset it: each SIGUSR1 still
        dumps (none did); a user's faulthandler.dump_traceback_later is not cancelled by another signal."""
        p = probe("aio")
        assert p.proc.stdout is not None and p.proc.stdout.readline() == "done\n", p.text()
        wait_for(lambda: p.text().count("Stack dump of process") == 2, 30, "two dumps")
        assert "Timeout (0:00:01)!" in p.text(), p.text()
        assert p.finish() == 0

    def test_a_process_ending_under_a_storm_of_signals_exits_0(self, probe) -> None:  # type: ignore[no-untyped-def]
        """SIGUSR1 every millisecond while the process exits normally: the interpreter's finalization reset the
        handler to SIG_DFL and the signal killed it (-SIGUSR1 in 60 runs of 60); ignored from atexit on."""
        p = probe("blocked")
        stop = threading.Event()

        def storm() -> None:
            while not stop.is_set() and p.proc.returncode is None:
                p.proc.send_signal(signal.SIGUSR1)  # never to a reused pid: Popen knows once it has reaped
                time.sleep(0.001)

        sender = threading.Thread(target=storm)
        sender.start()
        time.sleep(0.3)
        try:
            rc = p.finish()
        finally:
            stop.set()
            sender.join()
        assert rc == 0, p.text()[-2000:]

    def test_a_closed_wakeup_fd_of_before_gets_no_byte_once_its_number_is_reused(self, probe, tmp_path) -> None:  # type: ignore[no-untyped-def]
        """An asyncio loop's wakeup fd, set before install, gets its signals; once the loop closed it, a file the job
        opened on that number got every signal's byte (b'\\n' per SIGUSR1) written into it."""
        p = probe("reuse", str(tmp_path / "precious.bin"))
        assert p.proc.stdout is not None and p.proc.stdout.readline() == "forwarded=True b'DATA'\n", p.text()
        assert p.finish() == 0

    def test_many_dumps_while_threads_start_end_and_recurse_never_crash(self, probe) -> None:  # type: ignore[no-untyped-def]
        """SIGUSR1 every few milliseconds while frames are pushed and popped and threads come and go."""
        p = probe("churn")
        for _ in range(400):  # with faulthandler.register instead: SIGSEGV in 4 runs of 10 (tests/jobs/stackdump_probe.py)
            assert p.proc.poll() is None, p.text()[-3000:]
            os.kill(p.proc.pid, signal.SIGUSR1)
            time.sleep(0.002)
        wait_for(lambda: p.dumps() >= 1, 30, "a dump")
        assert p.finish() == 0, p.text()[-3000:]
        assert p.dumps() >= 1 and '"busy-recursing"' in p.text()  # repeated signals may share one dump
        assert "Fatal Python error" not in p.text()

    def test_a_forked_child_dumps_its_own_stacks_and_not_its_parent_s(self, probe) -> None:  # type: ignore[no-untyped-def]
        """A forked child (a DataLoader worker) has its own dump thread; its signal does not wake the parent's."""
        p = probe("fork")
        child = int(p.ready.split("child=")[1])
        os.kill(child, signal.SIGUSR1)
        wait_for(lambda: p.dumps() == 1, 30, "the child's dump")
        assert f"Stack dump of process {child} (SIGUSR1)" in p.text()
        os.kill(p.proc.pid, signal.SIGUSR1)
        wait_for(lambda: p.dumps() == 2, 30, "the parent's dump")
        assert f"Stack dump of process {p.proc.pid} (SIGUSR1)" in p.text()
        assert p.finish() == 0

    def test_faulthandler_dumps_when_the_dump_thread_cannot_get_the_gil(self, probe) -> None:  # type: ignore[no-untyped-def]
        """The main thread holds the GIL past the fallback's delay: faulthandler's watchdog dumps meanwhile."""
        p = probe("gil")
        assert p.proc.stdout is not None and p.proc.stdout.readline() == "done\n"
        text = p.text()
        assert "Timeout (0:00:01)!" in text, text
        assert text.index("Timeout (0:00:01)!") < text.index("Stack dump of process")  # then the thread's own
        assert p.finish() == 0

    def test_the_fallback_is_cancelled_once_the_dump_thread_has_the_gil(self, probe) -> None:  # type: ignore[no-untyped-def]
        """Armed as above, but the GIL is free again after 0.2 s: the dump thread's own dump only, no faulthandler."""
        p = probe("gil", "0.2")
        assert p.proc.stdout is not None and p.proc.stdout.readline() == "done\n"
        assert "Timeout" not in p.text() and p.dumps() == 1, p.text()
        assert p.finish() == 0
