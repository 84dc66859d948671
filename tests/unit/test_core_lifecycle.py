"""Core lifecycle hardening, replayed through the fake System: stop, orphans, resume consent, failing writes.

Each class guards one defect class of issue 13 (1: a graceful stop escalated by accident, 3: orphan identity,
5: quarantine evidence and fresh-start consent, 6: failing writes, 11: the in-use checkpoint's protection), or
one its second review found (files the job controls, a heartbeat flood, signals nobody handled).
"""
from __future__ import annotations

import errno
import json
import os
import signal
from pathlib import Path

import pytest

from supervisor.daemon import publisher as publisher_module
from supervisor.daemon.core import Core
from supervisor.daemon.statefile import read_status
from supervisor.daemon.timers import Timer
from supervisor.host.identity import run_token, valid_token
from supervisor.policy.state import State, Status
from tests.fakes import FakeSystem, RecordingLog
from tests.helpers import returns_despite_fifo
from tests.unit.test_core import beat, exit_job, make_core


def events(log: RecordingLog, name: str) -> list[dict]:
    return [f for e, f in log.events if e == name]


class TestGracefulStopIsNeverEscalatedByAccident:
    def test_repeated_stop_signals_wait_for_the_save(self, tmp_path: Path) -> None:
        """A retried `stop` (SIGTERM again), a repeated SIGTERM or a SIGINT from elsewhere keeps waiting."""
        core, fake, log = make_core(tmp_path)
        core.begin(None)
        pid = fake.spawned[0].pid
        core.on_signal(signal.SIGTERM)
        deadline = fake.timers.next_deadline()
        for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGINT):  # not from the supervisor's terminal
            core.on_signal(sig)
        assert fake.killed_trees == [] and fake.signals == [(pid, signal.SIGTERM)]
        assert len(events(log, "stop_in_progress")) == 3 and "stop_forced" not in log.names()
        assert fake.timers.pending(Timer.STOP_KILL) and fake.timers.next_deadline() == deadline  # the grace is unchanged
        exit_job(core, fake, 0)  # the emergency checkpoint was written
        assert core.exit_code == 0 and core.status.state is State.STOPPED and core.status.reason == "stopped by signal"

    def test_force_signal_kills_at_once(self, tmp_path: Path) -> None:
        """`stop --force` (SIGUSR2) kills the job tree now, while running or while a graceful stop waits."""
        for first in (None, signal.SIGTERM):
            core, fake, log = make_core(tmp_path / str(first))
            core.begin(None)
            if first is not None:
                core.on_signal(first)
            core.on_signal(signal.SIGUSR2)
            assert fake.killed_trees == [fake.spawned[0].pid] and not fake.timers.pending(Timer.STOP_KILL)
            exit_job(core, fake, -9)
            assert core.exit_code == 0 and core.status.state is State.STOPPED and len(fake.spawned) == 1
            assert core.status.reason == "force-stopped (stop --force)" and "stop_forced" in log.names()

    def test_force_signal_in_backoff_stops_without_a_launch(self, tmp_path: Path) -> None:
        """With no job running, a force stop ends at once with exit 0 and no new launch."""
        core, fake, _ = make_core(tmp_path)
        core.begin(None)
        exit_job(core, fake, 1)
        core.on_signal(signal.SIGUSR2)
        fake.advance(100, core)
        assert core.exit_code == 0 and core.status.state is State.STOPPED and len(fake.spawned) == 1


class TestOrphansAreFoundByToken:
    def test_token_in_the_job_env_and_kept_in_the_run_dir(self, tmp_path: Path) -> None:
        """Every job carries the run dir's token; the next supervisor searches for it even without state.json."""
        from supervisor.host.identity import TOKEN_FILE

        core, fake, _ = make_core(tmp_path)
        core.begin(None)
        token = (core.run_dir / TOKEN_FILE).read_text().strip()
        assert len(token) == 32 and fake.spawned[0].env["FSDP_SUPERVISOR_RUN_TOKEN"] == token
        assert fake.orphan_searches == [(token, core.run_dir)]
        assert json.loads((core.run_dir / "state.json").read_text())["run_token"] == token
        (core.run_dir / "state.json").unlink()
        again = Core(core.cfg, FakeSystem(), RecordingLog())
        again.begin(None)  # no state.json: the search still runs, with the same token
        assert again.sys.orphan_searches == [(token, core.run_dir)]  # type: ignore[attr-defined]

    def test_found_orphans_are_stopped_before_the_launch(self, tmp_path: Path) -> None:
        """Whatever the search finds is stopped first and logged with the job's agent (the oldest) as its pid."""
        from supervisor.host.identity import TOKEN_FILE

        core, fake, log = make_core(tmp_path)
        fake.orphans = [777, 778]
        core.begin(Status(state=State.RUNNING, job_pid=4242, job_create_time=1.0, run_token="a" * 32))
        assert fake.orphan_searches[0][0] == "a" * 32 and fake.orphans_stopped == [777, 778]
        assert log.names().index("orphan_job_stopped") < log.names().index("job_started")
        assert events(log, "orphan_job_stopped")[0]["job_pid"] == 777
        assert (core.run_dir / TOKEN_FILE).read_text().strip() == "a" * 32  # state.json's copy restores the file

    def test_stopping_an_orphan_happens_off_the_loop_and_a_stop_meanwhile_launches_nothing(self, tmp_path: Path) -> None:
        """The orphan's emergency save may take stop_timeout_s: meanwhile the loop runs, a SIGTERM stops the
        supervisor without launching, and nothing is launched before the orphan is gone."""
        import signal

        core, fake, log = make_core(tmp_path)
        fake.orphans, fake.defer_work = [777], True
        core.begin(None)
        assert fake.spawned == [] and fake.orphans_stopped == []  # still stopping it, off the loop
        core.on_signal(signal.SIGTERM)
        assert core.done and core.status.state is State.STOPPED
        fake.finish_work()
        assert fake.spawned == [] and fake.orphans_stopped == [777]

    def test_stop_force_while_an_orphan_saves_kills_it_at_once(self, tmp_path: Path) -> None:
        """`stop --force` during the orphan's grace: the orphan is stopped with no grace (timeout 0), then exit."""
        from supervisor.host.signals import FORCE_STOP_SIGNAL

        core, fake, log = make_core(tmp_path)
        fake.orphans, fake.defer_work = [777], True
        core.begin(None)
        core.on_signal(FORCE_STOP_SIGNAL)
        assert core.done and fake.orphan_timeouts == [0] and "orphan_job_killed" in log.names()
        fake.finish_work()
        assert fake.spawned == [] and fake.orphan_timeouts == [0, core.cfg.health.stop_timeout_s]


class TestQuarantineNeedsEvidenceAndAFreshStartNeedsConsent:
    def test_partial_saves_only_start_fresh(self, tmp_path: Path) -> None:
        """A root holding only partial saves (no .metadata) starts from scratch, as an empty one does."""
        core, fake, _ = make_core(tmp_path)
        (core.cfg.checkpoints.dir / ".tmp-step_00000010-x").mkdir()
        (core.cfg.checkpoints.dir / "step_00000020").mkdir()
        core.begin(None)
        assert fake.spawned[0].argv == ["torchrun", "-m", "trainer"]


class TestEveryWriteCanFail:
    def test_state_json_failures_are_logged_once_and_survived(self, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
        """ENOSPC on every state.json write: the job is still supervised (beats, exit, relaunch); one error line."""
        core, fake, log = make_core(tmp_path)
        real = publisher_module.write_status

        def full(*_a: object) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(publisher_module, "write_status", full)
        core.begin(None)
        for step in (1, 2, 3):
            beat(core, step)
        exit_job(core, fake, 1)
        fake.advance(100, core)
        assert len(fake.spawned) == 2 and core.status.state is State.RUNNING
        assert log.names().count("state_write_failed") == 1
        monkeypatch.setattr(publisher_module, "write_status", real)
        beat(core, 4)
        assert "state_write_recovered" in log.names()
        st = read_status(core.run_dir)
        assert st is not None and st.attempt == 2 and st.step == 4

    def test_run_dir_files_that_cannot_be_made_do_not_stop_the_launch(self, tmp_path: Path) -> None:
        """errors/ and logs/ cannot be created, the heartbeat cannot be removed: logged, the job still starts."""
        core, fake, log = make_core(tmp_path)
        (core.run_dir / "errors").write_text("a file where a dir should be")
        (core.run_dir / "logs").write_text("a file where a dir should be")
        core.heartbeat_path.mkdir()
        core.begin(None)
        assert len(fake.spawned) == 1 and core.status.state is State.RUNNING
        what = {f["what"] for f in events(log, "run_dir_write_failed")}
        assert {"errors dir", "heartbeat"} <= what and any(w.startswith("attempt log") for w in what)

    def test_state_json_never_claims_running_after_exit(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """The final write fails: close() removes state.json rather than leave "running" behind."""
        core, fake, _ = make_core(tmp_path)
        core.begin(None)
        assert read_status(core.run_dir).state is State.RUNNING  # type: ignore[union-attr]
        monkeypatch.setattr(publisher_module, "write_status",
                            lambda *_a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
        core.on_signal(signal.SIGTERM)
        exit_job(core, fake, 0)
        assert core.exit_code == 0
        core.close()
        assert read_status(core.run_dir) is None and "state_removed" in [e for e, _ in core.log.events]  # type: ignore[attr-defined]

    def test_abandon_stops_the_job_and_leaves_a_final_state(self, tmp_path: Path) -> None:
        """The loop failed: the job is stopped (gracefully, by stop_job), state.json says failed and why, exit 1."""
        core, fake, log = make_core(tmp_path)
        core.begin(None)
        assert core.abandon(RuntimeError("boom")) == 1
        assert fake.jobs_stopped == [fake.spawned[0].pid] and "supervisor_failed" in log.names()
        st = read_status(core.run_dir)
        assert st is not None and st.state is State.FAILED and "boom" in (st.reason or "") and st.job_pid is None


class TestFilesTheJobControls:
    def test_fifo_heartbeat_never_blocks_the_loop(self, tmp_path: Path) -> None:
        """`mkfifo $FSDP_SUPERVISOR_HEARTBEAT`: its events and the job's exit are handled, the FIFO is skipped."""
        core, fake, _ = make_core(tmp_path)
        core.begin(None)
        os.mkfifo(core.heartbeat_path)
        returns_despite_fifo(core.heartbeat_path, lambda: core.on_file_event(core.heartbeat_path))
        returns_despite_fifo(core.heartbeat_path, lambda: exit_job(core, fake, 1))
        assert core.status.step is None and core.status.state is State.BACKOFF

    def test_fifo_job_token_never_blocks_the_start(self, tmp_path: Path) -> None:
        """A FIFO planted as job.token: `run` still starts, with a token of its own."""
        fifo = tmp_path / "job.token"
        os.mkfifo(fifo)
        token, _ = returns_despite_fifo(fifo, lambda: run_token(tmp_path))  # type: ignore[misc]
        assert valid_token(token)
