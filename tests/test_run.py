"""`fsdp-supervisor run/status/logs/stop` against real processes (a torch-free fake job): fast integration tier."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.supervise import FAKEJOB, Supervisors, cli, launches, stop, supervisors, wait_for, write_config  # noqa: F401

pytestmark = pytest.mark.integration
FAST = "\n[restart]\nbackoff_initial_s = 0.05\nbackoff_max_s = 0.2\n"


def state(tmp_path: Path) -> dict:
    try:
        return json.loads((tmp_path / ".fsdp-supervisor" / "state.json").read_text())
    except (OSError, ValueError):
        return {}


class TestLifecycle:
    def test_crash_loop_exit_3_after_four_launches(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """A job that always fails without progress is launched 1 + 3 times, then the supervisor exits 3."""
        marker = tmp_path / "launches"
        cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--exit", "7", "--marker", str(marker)], FAST)
        p = supervisors.start(cfg)
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 3, out
        assert len(launches(marker)) == 4
        st = state(tmp_path)
        assert st["state"] == "failed" and st["last_exit"]["code"] == 7 and "crash loop" in st["reason"]
        assert "gave_up" in (tmp_path / ".fsdp-supervisor" / "supervisor.log").read_text()

    def test_completed_job_exits_0(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """Exit 0 from the job: the supervisor exits 0 with state completed and the step from the heartbeat.

        A state.json temp file left by a killed supervisor is removed."""
        cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--steps", "5"], FAST)
        torn = tmp_path / ".fsdp-supervisor" / ".state-k1ll3d.tmp"
        torn.parent.mkdir()
        torn.write_text('{"state": "runn')
        p = supervisors.start(cfg)
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, out
        st = state(tmp_path)
        assert st["state"] == "completed" and st["attempt"] == 1
        assert list(torn.parent.glob(".state-*")) == []

    def test_timers_beyond_epolls_range(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """Timers weeks or years away (epoll waits at most ~24 days) do not break the loop."""
        cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--sleep", "1.5"],
                           "retention_interval_s = 1e9\n[health]\nstartup_timeout_s = 3e6\n" + FAST)
        p = supervisors.start(cfg)
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, out
        assert state(tmp_path)["state"] == "completed"

    def test_sigterm_stops_job_gracefully(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """SIGTERM to the supervisor reaches the job once; both exit cleanly, state stopped, no relaunch."""
        trap = tmp_path / "got-term"
        marker = tmp_path / "launches"
        cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--sleep", "60", "--trap-term", str(trap),
                                      "--marker", str(marker)], FAST)
        p = supervisors.start(cfg)
        wait_for(lambda: state(tmp_path).get("state") == "running", 60, "running")
        wait_for(lambda: launches(marker), 60, "job start")
        rc, out = stop(p, signal.SIGTERM)
        assert rc == 0, out
        assert trap.read_text() == str(int(signal.SIGTERM))
        st = state(tmp_path)
        assert st["state"] == "stopped" and len(launches(marker)) == 1

    def test_stop_timeout_then_kill(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """A job ignoring SIGTERM is SIGKILLed after stop_timeout_s; the supervisor still exits 0."""
        marker = tmp_path / "launches"
        cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--sleep", "120", "--ignore-term",
                                      "--marker", str(marker)], FAST + "\n[health]\nstop_timeout_s = 1\n")
        p = supervisors.start(cfg)
        wait_for(lambda: launches(marker), 60, "job start")
        job_pid = launches(marker)[0]["pid"]
        rc, out = stop(p, signal.SIGINT)
        assert rc == 0, out
        assert not psutil.pid_exists(job_pid) or psutil.Process(job_pid).status() == psutil.STATUS_ZOMBIE

    def test_leaked_grandchild_is_killed(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """A daemonized grandchild of the job does not survive the attempt (subreaper + sweep)."""
        leak = tmp_path / "leak.pid"
        cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--leak", str(leak)], FAST)
        p = supervisors.start(cfg)
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, out
        pid = int(leak.read_text())
        supervisors.track(pid)
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert "survivors_killed" in (tmp_path / ".fsdp-supervisor" / "supervisor.log").read_text()

    def test_resume_args_from_newest_complete(self, tmp_path: Path, supervisors: Supervisors, make_checkpoint) -> None:  # type: ignore[no-untyped-def]
        """The job is launched with --resume <absolute path of the newest complete checkpoint>."""
        make_checkpoint(tmp_path / "ckpts", "epoch_3")
        make_checkpoint(tmp_path / "ckpts", "epoch_12")
        marker = tmp_path / "launches"
        cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--marker", str(marker)], FAST)
        p = supervisors.start(cfg)
        p.communicate(timeout=60)
        argv = launches(marker)[0]["argv"]
        assert argv[-2:] == ["--resume", str(tmp_path / "ckpts" / "epoch_12")]


class TestOneJobPerRunDir:
    def test_second_supervisor_exits_2(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """A second `run` on the same run dir exits 2 naming the first one's pid, launching nothing."""
        marker = tmp_path / "launches"
        cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--sleep", "60", "--trap-term", str(tmp_path / "t"),
                                      "--marker", str(marker)], FAST)
        first = supervisors.start(cfg)
        wait_for(lambda: launches(marker), 60, "job start")
        r = cli("run", "-c", str(cfg))
        assert r.returncode == 2 and f"pid {first.pid}" in r.stderr and len(r.stderr.strip().splitlines()) == 1
        assert len(launches(marker)) == 1
        assert stop(first)[0] == 0

    def test_orphan_of_killed_supervisor_is_stopped_first(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """SIGKILL the supervisor: the next `run` stops the orphaned job before launching a new one."""
        marker = tmp_path / "launches"
        trap = tmp_path / "got-term"
        cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--sleep", "60", "--trap-term", str(trap),
                                      "--marker", str(marker)], FAST)
        first = supervisors.start(cfg)
        wait_for(lambda: launches(marker), 60, "job start")
        old_job = launches(marker)[0]["pid"]
        supervisors.track(old_job)
        first.kill()
        first.wait()
        assert psutil.pid_exists(old_job)
        second = supervisors.start(cfg)
        wait_for(lambda: len(launches(marker)) == 2, 60, "second launch")
        assert trap.exists(), "old job was not asked to stop before the new launch"
        assert not psutil.pid_exists(old_job) or psutil.Process(old_job).status() == psutil.STATUS_ZOMBIE
        assert stop(second)[0] == 0


class TestCommands:
    def test_status_logs_stop(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """status (human and JSON), logs and stop work against a live supervisor."""
        cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--steps", "100000", "--step-s", "0.02",
                                      "--trap-term", str(tmp_path / "t")], FAST)
        p = supervisors.start(cfg)
        wait_for(lambda: (state(tmp_path).get("step") or 0) > 3, 60, "steps")
        r = cli("status", "-c", str(cfg), "--json")
        doc = json.loads(r.stdout)
        assert r.returncode == 0 and doc["state"] == "running" and doc["supervisor_running"] is True
        r = cli("status", "-c", str(cfg))
        assert "state: running" in r.stdout and "step" in r.stdout and "free disk" in r.stdout
        r = cli("logs", "-c", str(cfg), "-n", "5")
        assert "job_started" in r.stdout
        r = cli("stop", "-c", str(cfg), "--timeout", "30")
        assert r.returncode == 0, r.stderr
        p.wait(timeout=30)
        assert p.returncode == 0
        r = cli("status", "-c", str(cfg))
        assert "stopped" in r.stdout and "not running" in r.stdout

    @pytest.mark.parametrize(
        ("extra", "needle"),
        [("\n[restart]\npolicy = 'maybe'\n", "restart.policy"), ("\n[helth]\n", "[helth] unknown key")],
    )
    def test_bad_config_exit_2_nothing_launched(self, tmp_path: Path, extra: str, needle: str) -> None:
        """A bad config exits 2 with one line naming the key; no run dir is created."""
        cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB)], extra)
        r = cli("run", "-c", str(cfg))
        assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1
        assert "Traceback" not in r.stderr and not (tmp_path / ".fsdp-supervisor").exists()

    def test_missing_program_exit_2(self, tmp_path: Path) -> None:
        """A command whose program does not exist is a config error, not a crash loop."""
        cfg = write_config(tmp_path, ["no-such-program-xyz"])
        r = cli("run", "-c", str(cfg))
        assert r.returncode == 2 and "job.command" in r.stderr


class TestTerminal:
    def test_job_output_echoed_with_prefix_on_a_tty(self, tmp_path: Path) -> None:
        """Run in a terminal, the supervisor echoes the job's lines prefixed with [job] (and still logs them)."""
        import pty
        import subprocess

        cfg = write_config(tmp_path, [sys.executable, "-c", "print('hello from the job', flush=True)"], FAST)
        leader, follower = pty.openpty()
        p = subprocess.Popen([sys.executable, "-m", "supervisor", "run", "-c", str(cfg)], stdin=follower,
                             stdout=follower, stderr=follower, start_new_session=True)
        os.close(follower)
        out = b""
        try:
            while True:
                try:
                    chunk = os.read(leader, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                out += chunk
        finally:
            p.wait(timeout=60)
            os.close(leader)
        assert p.returncode == 0
        assert b"[job] hello from the job" in out
        assert b"hello from the job" in (tmp_path / ".fsdp-supervisor" / "logs" / "attempt-0001.log").read_bytes()
