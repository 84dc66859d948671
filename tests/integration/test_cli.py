"""Tests for supervisor.cli.app across commands: odd input is one line and an exit code, a closed stdout is quiet."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.daemon.statefile import write_status
from supervisor.errors import EXIT_BROKEN_PIPE
from supervisor.host.runlock import LOCK_FILE
from supervisor.policy.state import State, Status
from tests.helpers import REPO
from tests.supervise import cli
from tests.unit.test_cli import project  # noqa: F401  (a fixture, taken as an argument)


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
        one_line(cli("run", "-c", str(project / "job.toml")), 2,  # refused by the run dir's check, before the lock
                 f"[supervisor.run_dir] {project / '.fsdp-supervisor' / LOCK_FILE} is not a plain file")


def _read_lines(p: subprocess.Popen[bytes], n: int, buf: bytearray, timeout: float = 30) -> list[str]:
    """The next `n` lines `p` prints (fewer if it is silent for `timeout` seconds); `buf` keeps what is left over."""
    import select

    assert p.stdout is not None
    fd = p.stdout.fileno()
    while buf.count(b"\n") < n and select.select([fd], [], [], timeout)[0]:
        data = os.read(fd, 1 << 16)
        if not data:
            break
        buf += data
    lines = bytes(buf).split(b"\n")[:n] if buf.count(b"\n") >= n else bytes(buf).split(b"\n")[:-1]
    del buf[:sum(len(line) + 1 for line in lines)]
    return [line.decode() + "\n" for line in lines]


class TestLogsJob:
    def test_follow_prints_an_attempts_last_lines_before_the_next_attempt(self, project: Path) -> None:
        """`logs -f --job`: a crash's last words written just before the next attempt starts are not lost."""
        logs = project / ".fsdp-supervisor" / "logs"
        logs.mkdir()
        (logs / "attempt-0001.log").write_text("first\n")
        p = subprocess.Popen([sys.executable, "-m", "supervisor", "logs", "-c", str(project / "job.toml"), "--job", "-f"],
                             stdout=subprocess.PIPE, bufsize=0, cwd=REPO)
        buf = bytearray()
        try:
            assert _read_lines(p, 1, buf) == ["first\n"]
            with open(logs / "attempt-0001.log", "a") as f:
                f.write("Traceback...\nRuntimeError: last words")  # the last one without its newline
            (logs / "attempt-0002.log").write_text("attempt 2\n")
            assert _read_lines(p, 3, buf) == ["Traceback...\n", "RuntimeError: last words\n", "attempt 2\n"]
        finally:
            p.kill()
            p.communicate()

    def test_the_newest_attempt_by_number_and_a_fifo_never_blocks(self, project: Path) -> None:
        """attempt-10000.log is newer than attempt-9999.log; a FIFO planted as the newest log prints nothing."""
        logs = project / ".fsdp-supervisor" / "logs"
        logs.mkdir()
        (logs / "attempt-9999.log").write_text("old\n")
        (logs / "attempt-10000.log").write_text("new\n")
        r = cli("logs", "-c", str(project / "job.toml"), "--job", "-n", "1")
        assert r.returncode == 0 and r.stdout == "new\n", r.stdout + r.stderr
        os.mkfifo(logs / "attempt-10001.log")
        r = cli("logs", "-c", str(project / "job.toml"), "--job", "-n", "1", timeout=30)
        assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr


_HOLDER = """
import signal, sys, time
from pathlib import Path
from supervisor.host.runlock import RunLock
lock = RunLock(Path(sys.argv[1]))
lock.acquire()
def term(signum, frame):
    Path(sys.argv[2]).write_text("term")
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
print("locked", flush=True)
time.sleep(60)
"""


class TestStop:
    def test_stale_stopping_state_of_a_killed_supervisor_still_signals_the_live_one(self, project: Path) -> None:
        """state.json says `stopping` for a SIGKILLed predecessor while a new supervisor (still starting, not yet
        rewriting state.json) holds the lock: `stop` must signal the new one, not wait for a stop nobody began."""
        run_dir = project / ".fsdp-supervisor"
        write_status(run_dir, Status(pid=1, state=State.STOPPING, attempt=1))  # the killed one's last words
        termed = project / "termed"
        holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(run_dir), str(termed)], stdout=subprocess.PIPE,
                                  text=True, cwd=REPO)
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
            r = cli("stop", "-c", str(project / "job.toml"), "--timeout", "10")
            assert r.returncode == 0 and "already stopping" not in r.stdout, (r.stdout, r.stderr)
            assert termed.read_text() == "term"
        finally:
            holder.kill()
            holder.communicate()
