"""`fsdp-supervisor run/status/logs/stop` against real processes (a torch-free fake job): fast integration tier."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.mounts import tmpfs
from tests.supervise import FAKEJOB, Supervisors, cli, launches, stop, supervisors, wait_for, write_config  # noqa: F401

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
        torn = tmp_path / ".fsdp-supervisor" / ".state.json.0badc0de.tmp"  # write_atomic's temp file
        torn.parent.mkdir()
        torn.write_text('{"state": "runn')
        p = supervisors.start(cfg)
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, out
        st = state(tmp_path)
        assert st["state"] == "completed" and st["attempt"] == 1
        assert list(torn.parent.glob(".state.json.*")) == []

    def test_timers_beyond_epolls_range(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """Timers weeks or years away (epoll waits at most ~24 days) do not break the loop."""
        cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--sleep", "1.5"],
                           "retention_interval_s = 2.5e6\n[health]\nstartup_timeout_s = 2.5e6\n" + FAST)
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
        assert r.returncode == 0 and "state: running" in r.stdout and "step" in r.stdout and "free disk" in r.stdout
        r = cli("logs", "-c", str(cfg), "-n", "5")
        assert "job_started" in r.stdout
        r = cli("stop", "-c", str(cfg), "--timeout", "30")
        assert r.returncode == 0, r.stderr
        p.wait(timeout=30)
        assert p.returncode == 0
        r = cli("status", "-c", str(cfg))
        assert "stopped" in r.stdout and "not running" in r.stdout
        assert r.returncode == 3, "systemctl's code for 'not running'"
        r = cli("status", "-c", str(cfg), "--json")
        assert r.returncode == 3 and json.loads(r.stdout)["state"] == "stopped"

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


def supervisor_log(tmp_path: Path) -> str:
    try:
        return (tmp_path / ".fsdp-supervisor" / "supervisor.log").read_text()
    except OSError:
        return ""


def slow_stopper(tmp_path: Path, delay_s: float) -> tuple[Path, Path, Path]:
    """(job.toml, trap file, marker) for a job that takes `delay_s` to write its "emergency checkpoint"."""
    trap, marker = tmp_path / "saved", tmp_path / "launches"
    cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--sleep", "120", "--trap-term", str(trap),
                                  "--stop-delay", str(delay_s), "--marker", str(marker)],
                       FAST + "\n[health]\nstop_timeout_s = 60\n")
    return cfg, trap, marker


class TestStopIsNeverEscalatedByAccident:
    def test_retried_stop_waits_for_the_emergency_save(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """`stop --timeout` running out exits 1 saying the stop is in progress; another SIGTERM and a second `stop`
        wait, and the job's slow emergency save completes."""
        cfg, trap, marker = slow_stopper(tmp_path, 8)  # long enough for two CLI calls on a loaded machine
        p = supervisors.start(cfg)
        wait_for(lambda: launches(marker), 60, "job start")
        r = cli("stop", "-c", str(cfg), "--timeout", "0.5")
        assert r.returncode == 1 and "still stopping" in r.stderr and "nothing was cut short" in r.stderr, r
        p.send_signal(signal.SIGTERM)  # systemd, Slurm or a script repeating the stop
        wait_for(lambda: "stop_in_progress" in supervisor_log(tmp_path), 30, "the repeat to be logged")
        r = cli("stop", "-c", str(cfg), "--timeout", "60")
        assert r.returncode == 0 and "already stopping" in r.stdout, r
        assert trap.read_text() == str(int(signal.SIGTERM)), "the emergency save was cut short"
        assert p.wait(timeout=30) == 0 and state(tmp_path)["state"] == "stopped"
        assert "stop_forced" not in supervisor_log(tmp_path)

    def test_workers_the_agent_left_finish_their_save(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """The agent exits as soon as it has forwarded SIGTERM (torchrun signalled again, as Slurm does to every
        process of a step), leaving its worker mid-save: the worker gets the rest of stop_timeout_s and finishes."""
        trap, marker = tmp_path / "saved", tmp_path / "launches"
        cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--worker", "--sleep", "120", "--trap-term", str(trap),
                                      "--stop-delay", "3", "--marker", str(marker)],
                           FAST + "\n[health]\nstop_timeout_s = 60\n")
        p = supervisors.start(cfg)
        wait_for(lambda: launches(marker), 60, "the worker's start")
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0
        log = supervisor_log(tmp_path)
        assert trap.read_text() == str(int(signal.SIGTERM)), "the worker's emergency save was cut short"
        assert "waiting_for_workers" in log and "survivors_killed" not in log
        assert state(tmp_path)["state"] == "stopped"

    def test_stop_force_kills_at_once(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """`stop --force` while a graceful stop waits: the job is killed now; exit 0, reason says forced."""
        cfg, trap, marker = slow_stopper(tmp_path, 120)
        p = supervisors.start(cfg)
        wait_for(lambda: launches(marker), 60, "job start")
        job = launches(marker)[0]["pid"]
        assert cli("stop", "-c", str(cfg), "--timeout", "0.5").returncode == 1
        r = cli("stop", "-c", str(cfg), "--force", "--timeout", "30")
        assert r.returncode == 0, r
        assert p.wait(timeout=30) == 0 and not trap.exists()
        assert not psutil.pid_exists(job) or psutil.Process(job).status() == psutil.STATUS_ZOMBIE
        st = state(tmp_path)
        assert st["state"] == "stopped" and st["reason"] == "force-stopped (stop --force)"

    def test_second_ctrl_c_in_the_supervisors_terminal_kills(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """Two Ctrl+C typed in the terminal the supervisor runs in: the first stops gracefully, the second kills."""
        import fcntl
        import pty
        import subprocess
        import termios
        import threading

        from tests.supervise import TAG_ENV

        cfg, trap, marker = slow_stopper(tmp_path, 120)
        leader, follower = pty.openpty()

        def own_terminal() -> None:  # a session of its own with the pty as controlling terminal, in the foreground
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        p = subprocess.Popen([sys.executable, "-m", "supervisor", "run", "-c", str(cfg)], stdin=follower,
                             stdout=follower, stderr=follower, preexec_fn=own_terminal,
                             env={**os.environ, TAG_ENV: supervisors.tag})
        supervisors.procs.append(p)  # type: ignore[arg-type]
        os.close(follower)
        drain = threading.Thread(target=lambda: _drain(leader), daemon=True)  # a full pty would block it
        drain.start()
        try:
            wait_for(lambda: launches(marker), 60, "job start")
            os.write(leader, b"\x03")
            wait_for(lambda: state(tmp_path).get("state") == "stopping", 30, "the graceful stop")
            time.sleep(0.3)
            assert p.poll() is None and not trap.exists()
            os.write(leader, b"\x03")
            assert p.wait(timeout=30) == 0
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            os.close(leader)
        assert not trap.exists()
        assert state(tmp_path)["reason"] == "force-stopped (second Ctrl+C)"


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass


class TestOrphanIdentity:
    def test_orphan_of_a_script_job_is_found_without_state_json(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """A `#!` script (the kernel shows [python, script, ...]) orphaned by a SIGKILLed supervisor, state.json
        unreadable: the next `run` still finds it by the run dir's token and stops it before launching."""
        script = tmp_path / "train.py"
        script.write_text(f"#!{sys.executable}\nimport runpy, sys\nsys.path.insert(0, {str(FAKEJOB.parent)!r})\n"
                          f"runpy.run_path({str(FAKEJOB)!r}, run_name='__main__')\n")
        script.chmod(0o755)
        marker, trap = tmp_path / "launches", tmp_path / "got-term"
        cfg = write_config(tmp_path, [str(script), "--sleep", "60", "--trap-term", str(trap), "--marker", str(marker)],
                           FAST)
        first = supervisors.start(cfg)
        wait_for(lambda: launches(marker), 60, "job start")
        old_job = launches(marker)[0]["pid"]
        supervisors.track(old_job)
        assert psutil.Process(old_job).cmdline()[:2] == [sys.executable, str(script)]
        first.kill()
        first.wait()
        (tmp_path / ".fsdp-supervisor" / "state.json").write_text("{")
        second = supervisors.start(cfg)
        wait_for(lambda: len(launches(marker)) == 2, 60, "second launch")
        assert trap.exists(), "the orphaned script job was not asked to stop before the new launch"
        assert not psutil.pid_exists(old_job) or psutil.Process(old_job).status() == psutil.STATUS_ZOMBIE
        assert '"orphan_job_stopped"' in supervisor_log(tmp_path)
        assert stop(second)[0] == 0


class TestNoSilentFreshStart:
    def test_unusable_checkpoint_exits_3_and_launches_nothing(self, tmp_path: Path, make_checkpoint) -> None:  # type: ignore[no-untyped-def]
        """The root's only checkpoint has an unreadable .metadata: exit 3 naming it, the job never starts."""
        bad = make_checkpoint(tmp_path / "ckpts", "step_20")
        (bad / ".metadata").write_bytes(b"not a pickle")
        marker = tmp_path / "launches"
        cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--marker", str(marker)], FAST)
        r = cli("run", "-c", str(cfg))
        assert r.returncode == 3, r.stderr
        st = state(tmp_path)
        assert st["state"] == "failed" and str(bad) in st["reason"] and "allow_fresh_start" in st["reason"]
        assert '"gave_up"' in supervisor_log(tmp_path) and not marker.exists()


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs (unmounted at teardown); skipped where this process may not mount (see test_diskfull.py)."""
    with tmpfs(tmp_path / "tiny", "2m", "the fake-System tests cover failing writes") as mnt:
        yield mnt


class TestFullRunDir:
    def test_full_run_dir_is_survived_and_state_json_never_claims_running(
            self, tmp_path: Path, tiny_tmpfs: Path, supervisors: Supervisors) -> None:
        """The run dir's file system fills mid-run: the supervisor keeps relaunching, stops cleanly with exit 0,
        and leaves no state.json saying `running`."""
        marker = tmp_path / "launches"
        cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--sleep", "0.3", "--exit", "1",
                                      "--marker", str(marker)],
                           f"\n[supervisor]\nrun_dir = {json.dumps(str(tiny_tmpfs / 'run'))}\n"
                           "[restart]\nbackoff_initial_s = 0.05\nbackoff_max_s = 0.1\nmax_no_progress_restarts = 1000\n")
        p = supervisors.start(cfg)
        wait_for(lambda: launches(marker), 60, "job start")
        with open(tiny_tmpfs / "filler", "wb") as f:  # another writer takes every free byte
            st = os.statvfs(tiny_tmpfs)
            os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize)
        filled = len(launches(marker))
        wait_for(lambda: len(launches(marker)) >= filled + 3, 60, "relaunches on the full run dir")
        rc, out = stop(p, signal.SIGTERM)
        assert rc == 0, out[-3000:]
        assert "state_write_failed" in out and "supervisor_failed" not in out
        doc = json.loads(cli("status", "-c", str(cfg), "--json").stdout or "{}")
        assert doc.get("supervisor_running") is False and doc.get("state") in (None, "stopped", "failed"), doc
