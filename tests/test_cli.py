"""Tests for supervisor.cli across commands: odd input is one line and an exit code, a closed stdout is quiet."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.checkpoints.testing import write_checkpoint
from supervisor.errors import EXIT_BROKEN_PIPE
from supervisor.runlock import LOCK_FILE
from supervisor.state import Status, write_status
from tests.helpers import REPO
from tests.supervise import cli

CONFIG = '[job]\ncommand = ["true"]\n[checkpoints]\ndir = "ckpts"\n'


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A config with state.json, a supervisor.log and one checkpoint, as after a run."""
    (tmp_path / "job.toml").write_text(CONFIG)
    run_dir = tmp_path / ".fsdp-supervisor"
    run_dir.mkdir()
    write_status(run_dir, Status(pid=1, attempt=1, step=10))
    line = {"ts": "2026-01-01T00:00:00Z", "level": "info", "event": "job_started", "attempt": 1}
    (run_dir / "supervisor.log").write_text((json.dumps(line) + "\n") * 100)
    write_checkpoint(tmp_path / "ckpts", 10)
    return tmp_path


def one_line(out: subprocess.CompletedProcess[str], code: int, needle: str) -> None:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == code and len(lines) == 1 and needle in lines[0], (out.returncode, out.stderr)


class TestBrokenPipe:
    # The handler sits in cli.main, around every command: three that print a lot stand for all of them.
    @pytest.mark.parametrize("args", [["status"], ["logs"], ["checkpoints", "list", "--json", "-c"]],
                             ids=lambda a: " ".join(a))
    def test_closed_stdout_exits_141_quietly(self, project: Path, args: list[str]) -> None:
        """`cmd | head` that stopped reading: exit 141 (128 + SIGPIPE) and no traceback or 'Exception ignored'."""
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader is gone before the first write: every write fails with EPIPE
        try:
            out = subprocess.run([sys.executable, "-m", "supervisor", *args, *([] if args[-1] == "-c" else ["-c"]),
                                  str(project / "job.toml")], stdout=write_end, stderr=subprocess.PIPE, text=True,
                                 timeout=60, cwd=REPO)
        finally:
            os.close(write_end)
        assert out.returncode == EXIT_BROKEN_PIPE and out.stderr == "", out.stderr


class TestOddInput:
    """The sweep of issue 13 class 10: each is exit 2 and one line on stderr, for every command that reads it."""

    # One command per kind of file (they all read it through load_config): five processes, not twenty-five.
    @pytest.mark.parametrize(("command", "make", "needle"), [
        (["run"], lambda d: d / "missing.toml", "config file not found"),
        (["status"], lambda d: d, "is a directory, not a config file"),
        (["logs"], lambda d: (d / "bad.toml").write_bytes(b"\xff\xfe[job]") and d / "bad.toml", "not UTF-8 text"),
        (["stop"], lambda d: (d / "huge.toml").write_text("#" * (2 * 2**20)) and d / "huge.toml", "larger than 1024 KiB"),
        (["checkpoints", "list"], lambda d: (d / "deep.toml").write_text("x = " + "[" * 50_000) and d / "deep.toml",
         "nested too deeply"),
    ], ids=["run-missing", "status-directory", "logs-utf8", "stop-huge", "list-deep"])
    def test_bad_config_file(self, tmp_path: Path, command: list[str], make, needle: str) -> None:  # type: ignore[no-untyped-def]
        """A config that is missing, a directory, not UTF-8, huge or absurdly nested."""
        one_line(cli(*command, "-c", str(make(tmp_path))), 2, needle)

    @pytest.mark.parametrize(("args", "needle"), [
        (["logs", "-n", "-5"], "-n/--lines: '-5' is negative"),
        (["stop", "--timeout", "nan"], "--timeout: 'nan' is not a finite number"),
    ], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
    def test_bad_numbers(self, project: Path, args: list[str], needle: str) -> None:
        """Negative or non-numeric counts and timeouts are usage errors naming the flag."""
        one_line(cli(*args, "-c", str(project / "job.toml")), 2, needle)

    def test_lock_name_taken_by_a_directory(self, project: Path) -> None:
        """`run` when something else sits under the run dir's lock name: exit 2 naming the run dir, no traceback."""
        (project / ".fsdp-supervisor" / LOCK_FILE).mkdir()
        one_line(cli("run", "-c", str(project / "job.toml")), 2, "[supervisor.run_dir] cannot lock")
