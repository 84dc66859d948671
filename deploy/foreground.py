"""Run a command in its own process group that owns the terminal, so that Ctrl+C reaches it and not `make`.

`make run` under GNU make: Ctrl+C sends SIGINT to the terminal's foreground process group, make included, and
make then ends with `make: *** [run] Interrupt` and exit 130 whatever its recipe did, although the supervisor
stopped the job gracefully and exited 0. Here the command gets its own process group and the terminal's
foreground; make, no longer in that group, sees no Ctrl+C and exits with the command's status. The terminal is
handed back when the command ends. Without a controlling terminal, or when not in the foreground (`make run &`),
the command just runs. Usage: python deploy/foreground.py COMMAND [ARGS...]
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys


def _terminal() -> int | None:
    """The controlling terminal's fd when our process group is its foreground group, else None."""
    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:
        return None
    try:
        if os.tcgetpgrp(fd) == os.getpgrp():
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _give(fd: int, pgrp: int) -> None:
    """Make `pgrp` the terminal's foreground group (SIGTTOU ignored: we may be in the background by then)."""
    old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        os.tcsetpgrp(fd, pgrp)
    except OSError:
        pass
    finally:
        signal.signal(signal.SIGTTOU, old)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    fd = _terminal()
    if fd is None:
        os.execvp(argv[0], argv)
    mine = os.getpgrp()
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        os.execvp(argv[0], argv)
    with contextlib.suppress(OSError):  # the child did it first, or already exec'd
        os.setpgid(pid, pid)
    _give(fd, pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a stray one (kill -INT to make's group) must not orphan it
    _, status = os.waitpid(pid, 0)
    _give(fd, mine)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
