"""One supervisor per run dir: an flock held for the supervisor's lifetime, with its pid inside.

A run dir deleted under a running supervisor takes the lock file with it, so the supervisor looks at its lock
file every tick (`restore`) and makes the run dir again (docs/operations.md, 'What happens when things go
wrong'). Whatever a second `run` does in between, the claim on the checkpoint root refuses it (claim.py).
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from supervisor.errors import LockedError
from supervisor.host.mounts import identity
from supervisor.host.regularfile import open_regular

__all__ = ["RunLock", "LOCK_FILE"]

LOCK_FILE = "supervisor.lock"


class RunLock:
    """Exclusive, non-blocking; released by the kernel if we die, so a SIGKILLed supervisor never blocks the next."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self.fd: int | None = None
        self._file: tuple[int, int] | None = None  # (st_dev, st_ino) of the lock file we hold

    def acquire(self) -> None:
        """Take the lock or raise LockedError naming the holder; OSError if the lock file cannot be one."""
        self.fd, self._file = self._take()

    def _take(self) -> tuple[int, tuple[int, int]]:
        # something else planted under its name: EINVAL; a symlink (to a victim's file): ELOOP
        fd = open_regular(self.path, os.O_RDWR | os.O_CREAT, follow_symlinks=False)
        try:
            st = os.fstat(fd)
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
        return fd, (st.st_dev, st.st_ino)

    def restore(self) -> bool:
        """Lock again if the lock file (or the whole run dir) was removed or replaced; whether it was re-taken.

        Cheap when nothing happened (one stat); a failure (the dir cannot be made, another `run` holds the new
        file for the moment it takes to be refused) is tried again on the next call.
        """
        if self.fd is None or identity(self.path) == self._file:  # else gone, replaced, or unreadable (retaking fails)
            return False
        try:
            os.makedirs(self.path.parent, mode=0o700, exist_ok=True)
            fd, held = self._take()
        except (OSError, LockedError):
            return False
        os.close(self.fd)
        self.fd, self._file = fd, held
        return True

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    @staticmethod
    def holder(run_dir: Path) -> int | None:
        """pid of the live supervisor holding the lock, or None when nobody holds it."""
        path = run_dir / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)  # a FIFO must not block `status`
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
