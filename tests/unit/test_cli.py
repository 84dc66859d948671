"""Tests for supervisor.cli.app across commands: odd input is one line and an exit code, a closed stdout is quiet."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from supervisor.daemon.statefile import write_status
from supervisor.policy.state import Status
from tests.jobs.dcp_files import write_checkpoint

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


class TestLogsFollowLosesNothing:
    def test_a_line_appended_between_the_tail_and_the_follow_is_shown_once(
            self, project: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
        """`logs -f --job`: the follow goes on from where the tail ended, not from wherever the end is by then
        (a crash's traceback written in that gap was lost)."""
        from supervisor.cli import commands

        log = project / ".fsdp-supervisor" / "logs" / "attempt-0001.log"
        log.parent.mkdir()
        log.write_text("first\n")
        real_tail = commands.tail_lines

        def tail_then_append(*a, **kw):  # type: ignore[no-untyped-def]
            out = real_tail(*a, **kw)
            with open(log, "a") as f:
                f.write("Traceback: last words\n")
            return out

        def stop_following(_s: float) -> None:
            raise KeyboardInterrupt  # the user's Ctrl+C, once the follow has read what there was

        monkeypatch.setattr(commands, "tail_lines", tail_then_append)
        monkeypatch.setattr(commands.time, "sleep", stop_following)
        args = argparse.Namespace(config=str(project / "job.toml"), job=True, follow=True, lines=50)
        assert commands.cmd_logs(args) == 0
        assert capsys.readouterr().out == "first\nTraceback: last words\n"


class TestLogsFollowRotation:
    def test_a_live_log_truncated_by_its_rotation_is_followed_from_its_start(
            self, project: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
        """`logs -f --job`: the cap truncates the live attempt log in place; what the job writes next is shown."""
        from supervisor.cli import commands

        log = project / ".fsdp-supervisor" / "logs" / "attempt-0001.log"
        log.parent.mkdir()
        log.write_text("a long line before the rotation\n")
        sleeps = iter([lambda: log.write_text("after\n")])  # the rotation: same file, truncated, then written

        def sleep(_s: float) -> None:
            next(sleeps, lambda: (_ for _ in ()).throw(KeyboardInterrupt))()

        monkeypatch.setattr(commands.time, "sleep", sleep)
        args = argparse.Namespace(config=str(project / "job.toml"), job=True, follow=True, lines=50)
        assert commands.cmd_logs(args) == 0
        assert capsys.readouterr().out == "a long line before the rotation\nafter\n"


class TestLogsJobControlSequences:
    @pytest.mark.parametrize("tty", [False, True])
    def test_shown_not_executed(self, project: Path, tty: bool, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
        """`logs --job` prints a clipboard write, a title set and a screen clear as text; colors only on a tty."""
        from supervisor.cli import commands

        monkeypatch.delenv("NO_COLOR", raising=False)
        monkeypatch.setattr(commands.sys.stdout, "isatty", lambda: tty)
        log = project / ".fsdp-supervisor" / "logs" / "attempt-0001.log"
        log.parent.mkdir()
        log.write_bytes(b"\x1b]52;c;aGk=\x07\x1b]0;t\x07\x1b[2J\x1b[32mok\x1b[0m\n")
        args = argparse.Namespace(config=str(project / "job.toml"), job=True, follow=False, lines=5)
        assert commands.cmd_logs(args) == 0
        colored = "\x1b[32mok\x1b[0m\x1b[0m" if tty else "ok"
        assert capsys.readouterr().out == f"^[]52;c;aGk=^G^[]0;t^G^[[2J{colored}\n"


    def test_the_supervisor_log_shows_them_too(self, project: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """`logs`: an event field holding the job's text (a root cause) prints its escapes as text."""
        from supervisor.cli import commands

        line = {"ts": "2026-01-01T00:00:00Z", "level": "error", "event": "job_exited", "detail": "\x1b]0;t\x07\x1b[2J"}
        (project / ".fsdp-supervisor" / "supervisor.log").write_text(json.dumps(line) + "\n")
        args = argparse.Namespace(config=str(project / "job.toml"), job=False, follow=False, lines=5)
        assert commands.cmd_logs(args) == 0
        out = capsys.readouterr().out
        assert "detail=^[]0;t^G^[[2J" in out and "\x1b" not in out and "\x07" not in out

class TestEntryPoint:
    def test_the_console_script_target_is_callable(self) -> None:
        """pyproject's `fsdp-supervisor = "fsdp_supervisor_entry:main"` names a function."""
        import importlib
        import re

        from tests.helpers import REPO

        target = re.search(r'^fsdp-supervisor = "([\w.]+):(\w+)"$', (REPO / "pyproject.toml").read_text(), re.M)
        assert target is not None, "pyproject.toml names no fsdp-supervisor script"
        main = getattr(importlib.import_module(target[1]), target[2])
        assert callable(main) and not isinstance(main, type(importlib))
