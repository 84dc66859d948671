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
