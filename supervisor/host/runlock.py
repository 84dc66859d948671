"""One supervisor per run dir: an flock held for the supervisor's lifetime, with its pid inside."""
from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from supervisor.errors import LockedError

__all__ = ["RunLock", "LOCK_FILE"]

LOCK_FILE = "supervisor.lock"


class RunLock:
    """Exclusive, non-blocking; released by the kernel if we die, so a SIGKILLed supervisor never blocks the next."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise LockedError naming the holder; OSError if the lock file cannot be one."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # something else planted under the lock's name
                raise OSError(errno.EINVAL, "not a regular file", str(self.path))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
                raise LockedError(f"another supervisor (pid {holder}) is running on run dir {self.path.parent}") from None
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    @staticmethod
    def holder(run_dir: Path) -> int | None:
        """pid of the live supervisor holding the lock, or None when nobody holds it."""
        path = run_dir / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO planted there must not block `status`
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        except BlockingIOError:
            text = os.read(fd, 64).decode(errors="replace").strip()
            return int(text) if text.isdigit() else None
        finally:
            os.close(fd)
