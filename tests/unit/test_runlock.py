"""One supervisor per run dir: the lock, who holds it, and names planted under it."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from supervisor.errors import LockedError
from supervisor.host.runlock import LOCK_FILE, RunLock
from tests.helpers import returns_despite_fifo


class TestRunLock:
    def test_second_acquire_is_refused_naming_the_holder(self, tmp_path: Path) -> None:
        """While one RunLock holds the run dir, another is refused with the holder's pid; holder() says it."""
        first = RunLock(tmp_path)
        first.acquire()
        try:
            assert RunLock.holder(tmp_path) == os.getpid()
            with pytest.raises(LockedError, match=str(os.getpid())):
                RunLock(tmp_path).acquire()
        finally:
            first.release()
        assert RunLock.holder(tmp_path) is None

    def test_a_fifo_under_the_lock_name_never_blocks(self, tmp_path: Path) -> None:
        """`status` asks holder(): a FIFO planted as supervisor.lock answers 'nobody' at once; acquire fails cleanly."""
        os.mkfifo(tmp_path / LOCK_FILE)
        assert returns_despite_fifo(tmp_path / LOCK_FILE, lambda: RunLock.holder(tmp_path)) is None
        with pytest.raises(OSError, match="not a regular file"):
            RunLock(tmp_path).acquire()

    def test_survives_the_run_dir_being_removed(self, tmp_path: Path) -> None:
        """`rm -rf` of the run dir: restore() makes it again (owner-only) and locks the new file, so `status` still
        sees the supervisor and a second acquire is refused; nothing happens while the lock file is in place."""
        import shutil
        import stat

        run_dir = tmp_path / "run"
        run_dir.mkdir()
        lock = RunLock(run_dir)
        lock.acquire()
        try:
            assert not lock.restore()
            shutil.rmtree(run_dir)
            assert RunLock.holder(run_dir) is None
            assert lock.restore()
            assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700 and RunLock.holder(run_dir) == os.getpid()
            with pytest.raises(LockedError):
                RunLock(run_dir).acquire()
            assert not lock.restore()
        finally:
            lock.release()
