"""`make run` in a terminal: Ctrl+C stops the job gracefully and make exits with the supervisor's 0, not 130."""
from __future__ import annotations

import os
import pty
import select
import shutil
import sys
import time
from pathlib import Path

import pytest

from tests.supervise import FAKEJOB, REPO, TAG_ENV, Supervisors, kill_tree, supervisors, write_config  # noqa: F401

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _read_until(fd: int, needle: bytes, timeout: float) -> bytes:
    seen, deadline = b"", time.monotonic() + timeout
    while needle not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the other side closed
                break
            if not chunk:
                break
            seen += chunk
    return seen


def test_ctrl_c_under_make_run_is_the_supervisors_exit(tmp_path: Path, supervisors: Supervisors) -> None:
    cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--steps", "100000", "--step-s", "0.05",
                                  "--trap-term", str(tmp_path / "stopped")])
    venv = Path(sys.executable).parent.parent
    argv = ["make", "-s", "-C", str(REPO), "-o", f"{venv}/.installed", f"VENV={venv}", f"RUN_CONFIG={cfg}", "run"]
    pid, master = pty.fork()  # the child is a session leader with the pty as its controlling terminal
    if pid == 0:
        os.environ[TAG_ENV] = supervisors.tag
        os.execvp(argv[0], argv)
    supervisors.track(pid)
    try:
        out = _read_until(master, b"job_started", 60)
        assert b"job_started" in out, out.decode(errors="replace")[-3000:]
        time.sleep(1)
        os.write(master, b"\x03")  # Ctrl+C, as typed: the terminal sends SIGINT to its foreground process group
        out += _read_until(master, b"\x00never", 60)
        _, status = os.waitpid(pid, 0)
    finally:
        kill_tree(pid)
        os.close(master)
    text = out.decode(errors="replace")
    assert (tmp_path / "stopped").exists(), text[-3000:]  # the job was stopped gracefully (its SIGTERM handler)
    assert os.waitstatus_to_exitcode(status) == 0 and "Interrupt" not in text, text[-3000:]
