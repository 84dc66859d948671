"""TEST-ONLY: a process with trainer.stackdump installed, in a state a test names, for SIGUSR1 to dump.

`python tests/jobs/stackdump_probe.py MODE`: installs the dump thread (stderr), starts the threads of MODE,
prints `ready` on stdout and then:
- `blocked`: a thread named `worker-sleeping` sleeps; the main thread blocks in `os.read` (a C call that releases
  the GIL, as a rank in a collective does) until stdin closes.
- `churn`: threads are started and end all the time, and one thread named `busy-recursing` recurses and returns
  (frames pushed and popped) while the main thread computes; it prints `done` after 3 s.
- `fork`: forks once (as a DataLoader worker is forked); the child prints its pid; both wait for stdin to close.
- `gil`: switch interval 10 s, then the main thread raises SIGUSR1 itself and spins in Python for 3 s holding the
  GIL: the dump thread cannot take it, so faulthandler's fallback must dump.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

from trainer import stackdump


def recurse(n: int) -> int:
    return 0 if n == 0 else 1 + recurse(n - 1)


def main(mode: str) -> None:
    stackdump.install()
    if mode == "blocked":
        threading.Thread(target=time.sleep, args=(600,), name="worker-sleeping", daemon=True).start()
        print("ready", flush=True)
        while os.read(0, 1):
            pass
    elif mode == "churn":
        stop = time.monotonic() + 3

        def spin() -> None:
            while time.monotonic() < stop:
                recurse(50)

        threading.Thread(target=spin, name="busy-recursing", daemon=True).start()
        print("ready", flush=True)
        while time.monotonic() < stop:
            t = threading.Thread(target=recurse, args=(20,))
            t.start()
            t.join()
        print("done", flush=True)
    elif mode == "fork":
        pid = os.fork()
        if not pid:  # once forked (the hook ran): only then may the test signal the child
            print(f"ready child={os.getpid()}", flush=True)
        while os.read(0, 1):
            pass
        if pid:
            os.waitpid(pid, 0)
    elif mode == "gil":
        sys.setswitchinterval(10)
        print("ready", flush=True)
        signal.raise_signal(signal.SIGUSR1)
        end = time.monotonic() + 3
        while time.monotonic() < end:
            pass
        sys.setswitchinterval(0.005)
        time.sleep(1)  # the dump thread's own dump, late
        print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
