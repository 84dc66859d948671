"""The console `run` prints (short events, the progress line, the job's echo), hangups, bounded job output."""
from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from tests.supervise import FAKEJOB, TAG_ENV, Supervisors, cli, launches, supervisors, wait_for, write_config  # noqa: F401

FAST = "\n[restart]\nbackoff_initial_s = 0.05\nbackoff_max_s = 0.2\n"
EVENT_LINE = re.compile(rb"^\d\d:\d\d:\d\d [a-z_]+", re.M)


# ---- real supervisors ----------------------------------------------------------------------------------------

def _state(tmp_path: Path) -> dict:
    try:
        return json.loads((tmp_path / ".fsdp-supervisor" / "state.json").read_text())
    except (OSError, ValueError):
        return {}


class OnPty:
    """`fsdp-supervisor run` on a pseudo-terminal (optionally its controlling one); reads without threads."""

    def __init__(self, supervisors: Supervisors, config: Path, *, controlling: bool = False, nohup: bool = False) -> None:
        import fcntl
        import termios

        self.leader, follower = os.openpty()

        def preexec() -> None:
            if nohup:
                signal.signal(signal.SIGHUP, signal.SIG_IGN)
            if controlling:
                fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen([sys.executable, "-m", "supervisor", "run", "-c", str(config)], stdin=follower,
                                     stdout=follower, stderr=follower, start_new_session=True, preexec_fn=preexec,
                                     env={**os.environ, TAG_ENV: supervisors.tag})
        supervisors.procs.append(self.proc)  # killed, with everything it started, at teardown
        os.close(follower)
        self.out = bytearray()

    def read_until(self, done: Callable[[], object], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, self.out[-3000:].decode(errors="replace")
            if self.leader >= 0 and select.select([self.leader], [], [], 0.05)[0]:
                try:
                    self.out += os.read(self.leader, 65536)
                except OSError:  # EIO: every writer is gone
                    self.close()

    def close(self) -> None:
        if self.leader >= 0:
            os.close(self.leader)
            self.leader = -1


class TestRunConsole:
    def test_terminal_shows_short_events_job_lines_and_a_progress_row(self, tmp_path: Path,
                                                                      supervisors: Supervisors) -> None:
        """On a terminal: [job] lines, HH:MM:SS event lines without run_dir, a progress row redrawn in place."""
        cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--steps", "30", "--step-s", "0.1", "--say"], FAST)
        run = OnPty(supervisors, cfg)
        run.read_until(lambda: run.proc.poll() is not None and run.leader < 0)
        out = bytes(run.out)
        assert run.proc.returncode == 0, out[-3000:]
        assert b"[job] fake step 30" in out and b"run_dir" not in out and b"argv" not in out
        assert re.search(rb"\r\x1b\[J\d\d:\d\d:\d\d progress step=\d+ loss=[\d.]+ ", out)
        assert ({m.split(b" ")[1] for m in EVENT_LINE.findall(out.replace(b"\r\x1b[J", b"\n"))}
                >= {b"job_started", b"completed"})
        assert b"run_dir" in (tmp_path / ".fsdp-supervisor" / "supervisor.log").read_bytes()  # the full events stay

    def test_pipe_gets_a_progress_summary(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """Not a terminal: plain lines, with `progress step=... loss=...` summaries from the heartbeat."""
        cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--steps", "30", "--step-s", "0.1", "--say"], FAST)
        p = supervisors.start(cfg)
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, out
        assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d progress step=\d+ loss=[\d.]+ .*ckpt=none restarts=0$",
                         out, re.M), out
        assert "\x1b" not in out and "run_dir" not in out and "[job]" not in out

    def test_pipe_gets_the_cause_of_a_failure_without_a_traceback(self, tmp_path: Path,
                                                                  supervisors: Supervisors) -> None:
        """`run > out.log`: a note that the job is not echoed, the log file of each attempt, and on a failure with
        no traceback the job's own error line as the cause and its last lines under `job_exited`; the give-up
        reason whole; `status` says the same."""
        job = ("import sys; print('loading data'); print('step 1', flush=True); "
               "print('fatal: dataset /data/shard-00017 not found', file=sys.stderr); sys.exit(2)")
        cfg = write_config(tmp_path, [sys.executable, "-c", job],
                           "\n[restart]\nbackoff_initial_s = 0.05\nbackoff_max_s = 0.2\nmax_no_progress_restarts = 1\n")
        p = supervisors.start(cfg)
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 3, out
        assert "not a terminal: the job's output is not echoed here" in out
        assert re.search(r"each attempt's is in \S*\.fsdp-supervisor/logs/,", out), out  # the run dir's, not RUN_DIR
        assert re.search(r"job_started attempt=1 pid=\d+ log=\S*/.fsdp-supervisor/logs/attempt-0001.log", out), out
        assert re.search(r"job_exited attempt=2 reason=crash code=2 "
                         r"detail=\"fatal: dataset /data/shard-00017 not found\"\n"
                         r"  \[job\] loading data\n  \[job\] step 1\n  \[job\] fatal: dataset", out), out
        gave_up = next(line for line in out.splitlines() if "gave_up" in line)
        assert "…" not in gave_up and 'last: crash" ' in gave_up, gave_up
        status = cli("status", "-c", str(cfg))
        assert "last exit: crash (code 2) fatal: dataset /data/shard-00017 not found" in status.stdout, status.stdout
        assert re.search(r"last output: loading data\n +step 1\n +fatal: dataset", status.stdout), status.stdout

    def test_hangup_stops_gracefully(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """Closing the terminal (SIGHUP): the job gets SIGTERM once (its emergency save), the supervisor exits 0."""
        trap, marker = tmp_path / "got-term", tmp_path / "launches"
        cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--sleep", "60", "--trap-term", str(trap),
                                      "--marker", str(marker), "--steps", "3", "--say"], FAST)
        run = OnPty(supervisors, cfg, controlling=True)
        run.read_until(lambda: launches(marker) and b"[job] fake step 3" in run.out)
        run.close()
        assert run.proc.wait(timeout=60) == 0
        assert trap.read_text() == str(int(signal.SIGTERM)) and len(launches(marker)) == 1
        assert _state(tmp_path)["state"] == "stopped"
        log = (tmp_path / ".fsdp-supervisor" / "supervisor.log").read_text()
        assert '"event": "hangup"' in log and '"event": "stopped"' in log

    def test_vanished_terminal_under_nohup_keeps_supervising(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """SIGHUP ignored (nohup) stays ignored, and writes failing with EIO never kill the daemon: it keeps
        supervising and its events still reach supervisor.log."""
        marker = tmp_path / "launches"
        cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--steps", "40", "--step-s", "0.05", "--say",
                                      "--exit", "1", "--marker", str(marker)], FAST)
        run = OnPty(supervisors, cfg, controlling=True, nohup=True)
        run.read_until(lambda: launches(marker))
        run.close()  # the job still prints and beats; then it fails and is relaunched
        wait_for(lambda: len(launches(marker)) >= 2, 60, "a relaunch after the terminal vanished")
        assert run.proc.poll() is None
        run.proc.send_signal(signal.SIGTERM)
        assert run.proc.wait(timeout=60) == 0
        log = (tmp_path / ".fsdp-supervisor" / "supervisor.log").read_text()
        assert log.count('"event": "job_started"') >= 2 and '"event": "stopped"' in log and "hangup" not in log

    def test_tqdm_frames_cost_bounded_memory(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """40 MB of \\r frames on a terminal: the supervisor's RSS barely grows and the final line is echoed."""
        marker = tmp_path / "launches"
        cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--frames", "400000", "--marker", str(marker),
                                      "--say", "--steps", "1"], FAST)
        run = OnPty(supervisors, cfg)
        sup = psutil.Process(run.proc.pid)
        run.read_until(lambda: launches(marker))
        base = sup.memory_info().rss
        peak = [base]

        def finished() -> bool:
            with contextlib.suppress(psutil.Error):
                peak[0] = max(peak[0], sup.memory_info().rss)
            return run.proc.poll() is not None and run.leader < 0

        run.read_until(finished, timeout=120)
        assert run.proc.returncode == 0
        assert b"399999 |" in run.out and b"[job] fake step 1" in run.out
        assert peak[0] - base < 40 << 20, f"RSS grew {(peak[0] - base) >> 20} MiB"

    def test_logs_job_tail_shows_lines_as_a_terminal_does(self, tmp_path: Path) -> None:
        """`logs --job -n 2` prints the last two lines, each as its last \\r frame."""
        cfg = write_config(tmp_path, ["true"])
        logs = tmp_path / ".fsdp-supervisor" / "logs"
        logs.mkdir(parents=True)
        (logs / "attempt-0001.log").write_bytes(b"old\n")
        (logs / "attempt-0002.log").write_bytes(b"first\nsecond\n" + b"".join(b"\r%d%%" % i for i in range(101)) + b"\nlast")
        r = cli("logs", "-c", str(cfg), "--job", "-n", "2")
        assert r.returncode == 0 and r.stdout == "100%\nlast\n", r.stdout + r.stderr
