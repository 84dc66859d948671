"""TEST-ONLY: a process with trainer.stackdump installed, in a state a test names, for SIGUSR1 to dump.

`python tests/jobs/stackdump_probe.py MODE`: installs the dump thread (stderr), starts the threads of MODE,
prints `ready` on stdout and then:
- `blocked`: a thread named `worker-sleeping` sleeps; the main thread blocks in `os.read` (a C call that releases
  the GIL, as a rank in a collective does) until stdin closes.
- `fds`: as `blocked`, with 1100 more fds open first: the dump pipe's fds are above select()'s 1023.
- `aio`: SIGUSR1 while an asyncio loop's signal handler has its own wakeup fd, again once the loop closed (it
  unset the fd); then a user's own faulthandler.dump_traceback_later(1) and another signal (SIGALRM); `done`.
- `reuse FILE`: an asyncio loop's signal handler (SIGHUP) set before install gets its signal through the dump
  thread; the loop closes, FILE is opened on its old wakeup fd's number, two SIGUSR1: prints `forwarded`, FILE's bytes.
- `churn`: threads are started and end all the time, and one thread named `busy-recursing` recurses and returns
  (frames pushed and popped), until stdin closes.
- `fork`: forks once (as a DataLoader worker is forked); the child prints its pid; both wait for stdin to close.
- `gil [S]`: switch interval 10 s, then the main thread signals itself and spins in Python for S seconds (3)
  holding the GIL: the dump thread cannot take it, so faulthandler's fallback must dump (after 1 s: not with
  S = 0.2, where the dump thread takes the GIL in time and cancels it).
"""
from __future__ import annotations

import asyncio
import faulthandler
import os
import resource
import signal
import sys
import threading
import time

from trainer import stackdump


def recurse(n: int) -> int:
    return 0 if n == 0 else 1 + recurse(n - 1)


def main(mode: str, spin_s: float = 3.0, path: str = "") -> None:  # noqa: C901 (one probe, one branch per mode)
    if mode == "fds":
        resource.setrlimit(resource.RLIMIT_NOFILE, (4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        _held, mode = [os.dup(0) for _ in range(1100)], "blocked"
    if mode == "reuse":
        loop = asyncio.new_event_loop()
        got: list[int] = []
        loop.add_signal_handler(signal.SIGHUP, got.append, 1)
        theirs = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(theirs, warn_on_full_buffer=False)
    stackdump.install()
    if mode == "blocked":
        threading.Thread(target=time.sleep, args=(600,), name="worker-sleeping", daemon=True).start()
        print("ready", flush=True)
        while os.read(0, 1):
            pass
    elif mode == "churn":
        stop = threading.Event()

        def spin() -> None:
            while not stop.is_set():
                recurse(50)

        def until_eof() -> None:
            while os.read(0, 1):
                pass
            stop.set()

        threading.Thread(target=spin, name="busy-recursing", daemon=True).start()
        threading.Thread(target=until_eof, daemon=True).start()
        print("ready", flush=True)
        while not stop.is_set():
            t = threading.Thread(target=recurse, args=(20,))
            t.start()
            t.join()
    elif mode == "fork":
        pid = os.fork()
        if not pid:  # once forked (the hook ran): only then may the test signal the child
            print(f"ready child={os.getpid()}", flush=True)
        while os.read(0, 1):
            pass
        if pid:
            os.waitpid(pid, 0)
    elif mode == "aio":
        async def helper() -> None:
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGHUP, lambda: None)
            os.kill(os.getpid(), signal.SIGUSR1)
            await asyncio.sleep(0.5)
            loop.remove_signal_handler(signal.SIGHUP)

        print("ready", flush=True)
        asyncio.run(helper())
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.5)  # its dump written (an armed fallback would replace the watchdog below)
        signal.signal(signal.SIGALRM, lambda *_: None)
        faulthandler.dump_traceback_later(1.0)
        os.kill(os.getpid(), signal.SIGALRM)
        time.sleep(2)
        print("done", flush=True)
    elif mode == "reuse":
        print("ready", flush=True)
        os.kill(os.getpid(), signal.SIGHUP)
        loop.run_until_complete(asyncio.sleep(0.5))
        loop.remove_signal_handler(signal.SIGHUP)
        loop.close()
        files = [open(path, "ab", buffering=0) for _ in range(8)]
        mine = next(f for f in files if f.fileno() == theirs)
        mine.write(b"DATA")
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.5)
        print(f"forwarded={bool(got)} {open(path, 'rb').read()!r}", flush=True)
    elif mode == "gil":
        sys.setswitchinterval(10)
        print("ready", flush=True)
        os.kill(os.getpid(), signal.SIGUSR1)  # not signal.raise_signal: it lets the GIL go around raise()
        end = time.monotonic() + spin_s
        while time.monotonic() < end:
            pass
        sys.setswitchinterval(0.005)
        time.sleep(1)  # the dump thread's own dump, late
        print("done", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "reuse":
        main("reuse", path=sys.argv[2])
    else:
        main(sys.argv[1], *map(float, sys.argv[2:]))
