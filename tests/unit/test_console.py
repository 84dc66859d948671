"""The console `run` prints (short events, the progress line, the job's echo), hangups, bounded job output."""
from __future__ import annotations

import io
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor.daemon.loop import Echo
from supervisor.observe.console import Console, Progress, progress_text, render_event
from supervisor.observe.lines import CUT_MARK, MAX_LINE, LineSplitter, last_frame, tail_lines
from supervisor.policy.state import State, Status
from tests.helpers import returns_despite_fifo


def file_console(tty: bool) -> tuple[Console, Callable[[], str]]:
    """A Console writing into a temp file (told it is a terminal or not) and a function returning what it wrote."""
    f = tempfile.TemporaryFile()
    return Console(f.fileno(), tty=tty), lambda: (f.seek(0), f.read().decode())[1]


class TestLines:
    def test_last_frame_is_what_a_terminal_leaves(self) -> None:
        """`\\r` redraws leave the last non-empty frame; `\\r\\n` endings are not a frame."""
        assert last_frame(b"\r 10%\r 20%\r 30%") == b" 30%"
        assert last_frame(b"a\rb\r") == b"b"
        assert last_frame(b"plain\r") == b"plain"

    def test_splitter_keeps_one_capped_frame(self) -> None:
        """Megabytes of frames without a newline leave one frame in memory; the newline prints the last one."""
        s = LineSplitter()
        for i in range(2000):
            assert s.feed(b"".join(b"\r%08d" % (i * 100 + j) + b"x" * 91 for j in range(100))) == []
            assert len(s.partial) <= 101
        assert s.frame == b"00199999" + b"x" * 91
        assert s.feed(b" done\nnext") == [b"00199999" + b"x" * 91 + b" done"]
        assert s.frame == b"next"

    def test_splitter_cuts_a_huge_line_once(self) -> None:
        """A line over 64 KiB is shown cut with a marker; the rest of it is dropped up to its newline."""
        s = LineSplitter()
        out = []
        for _ in range(40):
            out += s.feed(b"y" * 10000)
        out += s.feed(b"yyy\nafter\n")
        assert out == [b"y" * MAX_LINE + CUT_MARK, b"after"]
        assert s.feed(b"z" * (MAX_LINE + 5) + b"\n") == [b"z" * MAX_LINE + CUT_MARK]

    @pytest.mark.parametrize("size", [0, 1, 5, 65535, 65536, 65537, 200_000])
    def test_tail_matches_splitlines(self, size: int) -> None:
        """The last n lines, across block boundaries, with and without a final newline."""
        text = b"".join(b"line %d %s\n" % (i, b"x" * (i % 97)) for i in range(size // 50 + 1))[:size]
        lines = text.split(b"\n")
        if lines[-1] == b"":
            lines.pop()
        for n in (0, 1, 3, 50):
            assert tail_lines(io.BytesIO(text), n) == (lines[-n:] if n else [])

    def test_tail_of_40_mb_with_few_newlines_reads_a_bounded_amount(self) -> None:
        """`logs --job -n 10` on 40 MB of `\\r` frames reads about (n + 1) * 64 KiB, not the whole file."""
        frames = b"".join(b"\r%10d |" % i + b"#" * 88 for i in range(100_000))  # 10 MB
        data = io.BytesIO(b"start\n" + frames * 4 + b" done\n")

        class Counting(io.BufferedReader):
            read_bytes = 0

            def read(self, size: int | None = -1) -> bytes:  # type: ignore[override]
                out = super().read(size)
                Counting.read_bytes += len(out)
                return out

        got = tail_lines(Counting(data), 10)  # type: ignore[arg-type]
        assert Counting.read_bytes <= 12 * MAX_LINE
        assert got[-1].endswith(b"     99999 |" + b"#" * 88 + b" done") and got[0].startswith(b"... ")
        assert len(got) == 1


class TestRender:
    def test_event_line_is_short(self) -> None:
        """Time as HH:MM:SS, the event, the fields that matter; never run_dir, argv or env."""
        ev = {"event": "job_started", "level": "info", "ts": "2026-01-02T03:04:05.6Z", "attempt": 2, "pid": 41,
              "resumed_from": "/w/ckpts/step_00000100", "argv": ["torchrun", "x"] * 30, "env": {"A": "b"},
              "run_dir": "/w/.fsdp-supervisor", "log": "/w/.fsdp-supervisor/logs/attempt-0002.log"}
        line = render_event(ev, tty=True, cwd="/w")
        assert re.fullmatch(r"\d\d:\d\d:\d\d job_started attempt=2 pid=41 resumed_from=ckpts/step_00000100", line)

    def test_unknown_event_shows_a_few_fields_and_warns(self) -> None:
        """An event without a table entry shows its first four fields; a warning is tagged."""
        ev = {"event": "new_thing", "level": "warning", "ts": "2026-01-02T03:04:05Z", "run_dir": "/r",
              "a": 1, "b": "two words", "c": None, "d": 4.56789, "e": 5, "f": 6}
        line = render_event(ev, tty=False, cwd="/w")
        assert line.endswith('WARN new_thing a=1 b="two words" d=4.568 e=5') and line.startswith("20")

    def test_progress_text(self) -> None:
        """step, loss, rate, last checkpoint, restarts; the state when not running; nothing before step 1."""
        st = Status(state=State.RUNNING, step=120, loss=1.8312, rate_steps_per_s=11.23, restarts=1,
                    latest_checkpoint={"path": "/c/step_00000100", "step": 100, "mtime": 1.0})
        assert progress_text(st) == "progress step=120 loss=1.831 rate=11.2/s ckpt=step_00000100 restarts=1"
        assert progress_text(Status(state=State.RUNNING)) is None
        assert progress_text(Status(state=State.BACKOFF, step=3)) == "progress state=backoff step=3 ckpt=none restarts=0"


class TestWarnings:
    def test_python_warnings_become_short_events(self, tmp_path: Path) -> None:
        """A library's warning is an event (in the JSON log and on the console), not raw text over the console."""
        import logging
        import warnings

        import structlog

        from supervisor.observe.eventlog import configure

        con, read = file_console(tty=False)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            try:
                configure(tmp_path, max_bytes=1 << 20, backups=1, console=con)
                warnings.warn("a library complains", UserWarning)
            finally:
                for handler in logging.getLogger("fsdp_supervisor").handlers:
                    handler.close()
                logging.getLogger("fsdp_supervisor").handlers.clear()
                structlog.reset_defaults()
        assert re.fullmatch(r'\S+ \S+ WARN python_warning category=UserWarning where=test_console.py:\d+ '
                            r'message="a library complains"\n', read())
        assert '"event": "python_warning"' in (tmp_path / "supervisor.log").read_text()


class TestConsole:
    def test_live_rows_are_redrawn_below_printed_lines(self) -> None:
        """On a terminal, printing erases the live rows, prints, and draws them again (no newline after)."""
        con, read = file_console(tty=True)
        con.show(progress="P1")
        con.show(["hello"], job="[job] 10%")
        con.show(progress="P2")
        assert read() == "P1" + "\r\x1b[Jhello\n[job] 10%\nP1" + "\r\x1b[1A\x1b[J[job] 10%\nP2"

    def test_not_a_terminal_no_escapes(self) -> None:
        """A pipe gets plain lines only: no live rows, no escape sequences."""
        con, read = file_console(tty=False)
        con.show(["one"], job="[job] frame", progress="p")
        con.show(progress="q")
        assert read() == "one\n"

    def test_dead_pipe_is_swallowed(self) -> None:
        """EPIPE marks the console dead instead of raising; later writes are no-ops."""
        r, w = os.pipe()
        os.close(r)
        con = Console(w, tty=False)
        con.show(["x"])
        con.show(["y"])
        assert con.dead
        os.close(w)

    def test_summary_every_ten_seconds_when_news(self) -> None:
        """Not a terminal: a line as soon as there is a step, then at most every 10 s and only when it changed."""
        con, read = file_console(tty=False)
        now = [1000.0]
        st = Status(state=State.RUNNING)
        prog = Progress(con, lambda: st, clock=lambda: now[0])
        prog.tick()
        st.step, st.loss = 5, 2.0
        prog.tick()
        for _ in range(9):
            now[0] += 1
            st.step += 1
            prog.tick()
        now[0] += 1
        prog.tick()
        now[0] += 30
        prog.tick()  # nothing new since
        st.state = State.STOPPED
        prog.finish()  # nor at the end (a new state alone is no news: the events say it)
        lines = read().splitlines()
        assert [line.split(" ", 2)[2] for line in lines] == [
            "progress step=5 loss=2 ckpt=none restarts=0", "progress step=14 loss=2 ckpt=none restarts=0"]


class TestEcho:
    def test_frames_are_a_live_row_and_reads_are_bounded(self, tmp_path: Path) -> None:
        """Whole lines print with [job]; \\r frames update one live row; one call reads at most CHUNK bytes."""
        log = tmp_path / "attempt-0001.log"
        log.write_bytes(b"hello\n" + b"".join(b"\r%7d" % i for i in range(300_000)))  # 2.4 MB
        con, read = file_console(tty=True)
        echo = Echo(con)
        calls = 1
        while echo.pump(log):
            calls += 1
        assert calls == 3 and echo.offset == log.stat().st_size
        out = read()
        assert out.startswith("[job] hello\n") and out.endswith("[job]  299999") and out.count("\n") == 1
        with open(log, "ab") as f:
            f.write(b" done\n")
        echo.pump(log)
        assert read().endswith("[job]  299999 done\n")

    def test_a_fifo_in_place_of_the_log_is_skipped(self, tmp_path: Path) -> None:
        """The job replaced its attempt log with a FIFO: the echo shows nothing and never blocks the loop."""
        fifo = tmp_path / "attempt-0001.log"
        os.mkfifo(fifo)
        con, read = file_console(tty=True)
        assert returns_despite_fifo(fifo, lambda: Echo(con).pump(fifo)) is False and read() == ""

    def test_a_large_backlog_is_skipped_with_a_note(self, tmp_path: Path) -> None:
        """More than BEHIND bytes behind: jump to the end and say where the rest is."""
        log = tmp_path / "attempt-0001.log"
        log.write_bytes(b"x" * 100 + b"\n" + b"old\n" * 3_000_000 + b"new\n")
        con, read = file_console(tty=False)
        echo = Echo(con)
        while echo.pump(log):
            pass
        out = read()
        assert "of output not shown here" in out and out.endswith("[job] old\n[job] new\n") and len(out) < 5 << 20

    def test_control_sequences_are_shown_not_executed(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """A title set, a screen clear and a bell reach the terminal as text; the job's colors stay, reset after."""
        monkeypatch.delenv("NO_COLOR", raising=False)
        log = tmp_path / "attempt-0001.log"
        log.write_bytes(b"\x1b]0;owned\x07\x1b[2J\x1b[31mred\x1b[0m\x07\n\x1b[Hframe")
        con, read = file_console(tty=True)
        echo = Echo(con)
        echo.pump(log)
        echo.drain()
        out = read()
        assert "[job] ^[]0;owned^G^[[2J\x1b[31mred\x1b[0m^G\x1b[0m\n" in out
        assert "[job] ^[[Hframe" in out and "\x1b]" not in out and "\x1b[2J" not in out and "\x07" not in out


class TestOffATerminal:
    """What `run > out.log` shows that a terminal's echo would have (issue 22, item 4)."""

    EXITED = {"event": "job_exited", "level": "info", "ts": "2026-01-02T03:04:05Z", "attempt": 2, "reason": "crash",
              "code": 1, "detail": "rank 0: exitcode 2: python: can't open file 'x.py'",
              "last_output": ["loading", "\x1b[2J\x1b[31mred\x1b[0m", "python: can't open file 'x.py'"]}

    def test_a_failures_last_output_follows_its_exit_line(self) -> None:
        """Off a terminal, the job's last lines (controls shown, not executed) below job_exited; on one, none."""
        lines = render_event(self.EXITED, tty=False, cwd="/w").split("\n")
        assert lines[0].endswith("job_exited attempt=2 reason=crash code=1 "
                                 """detail="rank 0: exitcode 2: python: can't open file 'x.py'\"""")
        assert lines[1:] == ["  [job] loading", "  [job] ^[[2Jred", "  [job] python: can't open file 'x.py'"]
        assert "\n" not in render_event(self.EXITED, tty=True, cwd="/w")

    def test_a_last_line_that_is_the_detail_is_not_repeated(self) -> None:
        ev = {**self.EXITED, "last_output": ["python: can't open file 'x.py'"]}
        assert "\n" not in render_event(ev, tty=False, cwd="/w")

    def test_the_attempts_log_is_named_off_a_terminal(self) -> None:
        ev = {"event": "job_started", "level": "info", "ts": "2026-01-02T03:04:05Z", "attempt": 1, "pid": 7,
              "log": "/w/.fsdp-supervisor/logs/attempt-0001.log"}
        assert render_event(ev, tty=False, cwd="/w").endswith("pid=7 log=.fsdp-supervisor/logs/attempt-0001.log")

    def test_a_long_path_is_never_cut(self) -> None:
        log = "/very/long/" + "d" * 120 + "/.fsdp-supervisor/logs/attempt-0001.log"
        ev = {"event": "job_started", "level": "info", "ts": "2026-01-02T03:04:05Z", "attempt": 1, "pid": 7, "log": log}
        assert render_event(ev, tty=False, cwd="/w").endswith(f"log={log}")

    def test_a_reason_or_a_root_cause_is_never_cut(self) -> None:
        reason = "crash loop: 3 consecutive failed attempts without progress (max_no_progress_restarts=3); last: crash"
        ev = {"event": "gave_up", "level": "error", "ts": "2026-01-02T03:04:05Z", "reason": reason, "attempts": 3,
              "detail": "x" * 250}
        line = render_event(ev, tty=False, cwd="/w")
        assert f'reason="{reason}"' in line and "x" * 250 in line and "…" not in line
