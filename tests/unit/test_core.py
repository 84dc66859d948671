"""Core state machine: scripted histories replayed through a fake System (no processes, fake time)."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from supervisor.config import load_config
from supervisor.daemon.core import Core
from supervisor.daemon.statefile import read_status
from supervisor.observe.statusview import render_status
from supervisor.policy.state import State, Status
from tests.fakes import FakeSystem, RecordingLog
from tests.jobs.dcp_files import write_checkpoint, write_trainer_checkpoint

BASE = """
[job]
command = ["torchrun", "-m", "trainer"]
{job}
[checkpoints]
dir = "ckpts"
{checkpoints}
[restart]
backoff_jitter = 0
{restart}
[health]
stop_timeout_s = 30
stack_dump_wait_s = 2
{health}
"""


def make_core(tmp_path: Path, restart: str = "", health: str = "", checkpoints: str = "keep_last = 0", job: str = "",
              ) -> tuple[Core, FakeSystem, RecordingLog]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg_path = tmp_path / "job.toml"
    cfg_path.write_text(BASE.format(restart=restart, health=health, checkpoints=checkpoints, job=job))
    cfg = load_config(cfg_path)
    for d in (cfg.run_dir, cfg.checkpoints.dir):
        d.mkdir(parents=True, exist_ok=True)
    fake, log = FakeSystem(), RecordingLog()
    return Core(cfg, fake, log), fake, log


def exit_job(core: Core, fake: FakeSystem, code: int) -> None:
    core.on_job_exit(fake.spawned[-1].pid, code)


def beat(core: Core, step: int, phase: str = "train") -> None:
    core.heartbeat_path.write_text(json.dumps({"step": step, "time": 0, "phase": phase, "loss": 1.0}))
    core.on_file_event(core.heartbeat_path)


class TestLaunch:
    def test_first_launch_without_checkpoint(self, tmp_path: Path) -> None:
        """No checkpoint: argv is the command alone; the contract's variables are in the env."""
        core, fake, log = make_core(tmp_path)
        core.begin(None)
        sp = fake.spawned[0]
        assert sp.argv == ["torchrun", "-m", "trainer"]
        assert sp.env["FSDP_SUPERVISOR_ATTEMPT"] == "1"
        assert sp.env["FSDP_SUPERVISOR_HEARTBEAT"] == str(core.heartbeat_path)
        assert sp.env["FSDP_SUPERVISOR_RUN_DIR"] == str(core.run_dir)
        assert sp.env["TORCHELASTIC_ERROR_FILE"].endswith("attempt-0001.json")
        assert sp.env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "86430"  # torchrun's grace: our stop_timeout_s + a day
        assert sp.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
        assert core.status.state is State.RUNNING and "job_started" in log.names()

    def test_orphan_stopped_before_launch(self, tmp_path: Path) -> None:
        """The job of a killed supervisor (found by its token) is stopped before the first spawn."""
        core, fake, log = make_core(tmp_path)
        fake.orphans = [4242]
        prev = Status(state=State.RUNNING, job_pid=4242, job_create_time=1.0, job_cmdline=["torchrun"])
        core.begin(prev)
        assert fake.orphans_stopped == [4242] and len(fake.spawned) == 1
        assert log.names().index("orphan_job_stopped") < log.names().index("job_started")


class TestRestarts:
    def test_crash_loop_exactly_four_launches_then_exit_3(self, tmp_path: Path) -> None:
        """Always failing with no progress: 1 + max_no_progress_restarts launches, backoff 1,2,4 s, exit 3."""
        core, fake, log = make_core(tmp_path)
        core.begin(None)
        delays = []
        while not core.done:
            exit_job(core, fake, 1)
            if core.done:
                break
            delays.append(core.sys.timers.next_deadline() - fake.clock)
            fake.advance(delays[-1], core)
        assert len(fake.spawned) == 4 and delays == [1, 2, 4]
        assert core.exit_code == 3 and core.status.state is State.FAILED
        assert "gave_up" in log.names() and "crash loop" in (core.status.reason or "")

    def test_history_with_healthy_run_resets_backoff(self, tmp_path: Path) -> None:
        """start, crash, crash, healthy 10 min, crash, SIGTERM: delays 1, 2, 0 and a clean exit 0."""
        core, fake, _ = make_core(tmp_path)
        core.begin(None)
        exit_job(core, fake, 1)
        assert fake.advance(1, core) == ["launch"]
        exit_job(core, fake, 1)
        assert fake.advance(1.5, core) == [] and fake.advance(0.5, core) == ["launch"]
        fake.advance(601, core)
        exit_job(core, fake, -9)
        assert core.sys.timers.next_deadline() - fake.clock == 0  # a healthy attempt's failure: at once
        fake.advance(0, core)
        core.on_signal(signal.SIGTERM)
        assert fake.signals[-1] == (fake.spawned[-1].pid, signal.SIGTERM)
        exit_job(core, fake, 0)
        assert core.exit_code == 0 and core.status.state is State.STOPPED and len(fake.spawned) == 4

    def test_policy_never(self, tmp_path: Path) -> None:
        """policy=never: the first failure gives up with exit 3."""
        core, fake, _ = make_core(tmp_path, restart='policy = "never"')
        core.begin(None)
        exit_job(core, fake, 1)
        assert core.exit_code == 3 and len(fake.spawned) == 1

    def test_success_completes(self, tmp_path: Path) -> None:
        """Exit 0 ends with state completed and exit code 0."""
        core, fake, _ = make_core(tmp_path)
        core.begin(None)
        exit_job(core, fake, 0)
        assert core.exit_code == 0 and core.status.state is State.COMPLETED


class TestNumbers:
    """What status and the events count (issue 22, item 6)."""

    def test_the_rate_is_the_attempts_own_and_gone_once_it_ended(self, tmp_path: Path) -> None:
        """Steps over the job's own times; once the job has exited there is no rate (it was 133 step/s after a
        completion)."""
        core, fake, _ = make_core(tmp_path)
        core.begin(None)
        for step in range(0, 41, 10):
            core.heartbeat_path.write_text(json.dumps({"step": step, "time": 1000.0 + step / 10, "phase": "train"}))
            core.on_file_event(core.heartbeat_path)
        assert core.status.rate_steps_per_s == pytest.approx(10.0)
        exit_job(core, fake, 0)
        assert core.status.state is State.COMPLETED and core.status.rate_steps_per_s is None
        assert read_status(core.run_dir).rate_steps_per_s is None  # type: ignore[union-attr]

    @pytest.mark.parametrize("code", [0, 1])
    def test_completed_and_gave_up_count_the_runs_attempts(self, tmp_path: Path, code: int) -> None:
        """A run resumed by a second `run`: its attempt 2 completes as `attempts=2`, not this session's 1."""
        core, fake, log = make_core(tmp_path, restart='policy = "never"')
        core.begin(Status(state=State.STOPPED, attempt=1))
        exit_job(core, fake, code)
        event = "completed" if code == 0 else "gave_up"
        assert [kw["attempts"] for name, kw in log.events if name == event] == [2]


class TestStopAndHang:
    def test_second_ctrl_c_in_own_terminal_kills(self, tmp_path: Path) -> None:
        """SIGINT -> SIGTERM to the agent only; a second SIGINT typed in the supervisor's terminal kills at once."""
        core, fake, log = make_core(tmp_path)
        fake.terminal = True
        core.begin(None)
        pid = fake.spawned[0].pid
        core.on_signal(signal.SIGINT)
        assert fake.signals == [(pid, signal.SIGTERM)] and core.status.state is State.STOPPING
        core.on_signal(signal.SIGINT)
        assert fake.killed_trees == [pid] and "stop_forced" in log.names()
        exit_job(core, fake, -9)
        assert core.exit_code == 0 and core.status.state is State.STOPPED and len(fake.spawned) == 1
        assert core.status.reason == "force-stopped (second Ctrl+C)"

    def test_stop_timeout_kills(self, tmp_path: Path) -> None:
        """A job that ignores SIGTERM is SIGKILLed after stop_timeout_s."""
        core, fake, _ = make_core(tmp_path)
        core.begin(None)
        core.on_signal(signal.SIGTERM)
        assert fake.advance(29, core) == [] and fake.killed_trees == []
        assert fake.advance(1, core) == ["stop_kill"] and fake.killed_trees == [fake.spawned[0].pid]

    def test_signal_in_backoff_stops_at_once(self, tmp_path: Path) -> None:
        """A stop request while waiting to relaunch ends immediately with exit 0 and no new launch."""
        core, fake, _ = make_core(tmp_path)
        core.begin(None)
        exit_job(core, fake, 1)
        core.on_signal(signal.SIGTERM)
        fake.advance(100, core)
        assert core.exit_code == 0 and core.status.state is State.STOPPED and len(fake.spawned) == 1

    def test_hang_detected_dumps_stacks_then_stops(self, tmp_path: Path) -> None:
        """Heartbeat idle for hang_timeout_s in train: SIGUSR1 to workers, then SIGTERM, then relaunch."""
        core, fake, log = make_core(tmp_path, health="hang_timeout_s = 10")
        core.begin(None)
        pid = fake.spawned[0].pid
        beat(core, 5)
        fake.advance(9, core)
        beat(core, 6)  # progress re-arms the timer
        assert fake.advance(9.5, core) == []
        assert fake.advance(0.5, core) == ["hang"]
        assert fake.worker_signals == [(pid, signal.SIGUSR1)] and "hang_detected" in log.names()
        assert fake.advance(2, core) == ["hang_term"] and fake.signals == [(pid, signal.SIGTERM)]
        exit_job(core, fake, 1)
        assert core.status.last_exit.reason == "hang" and core.status.state is State.BACKOFF

    def test_save_phase_gets_save_timeout(self, tmp_path: Path) -> None:
        """While the heartbeat says save, the longer save_timeout_s applies."""
        core, fake, _ = make_core(tmp_path, health="hang_timeout_s = 10\nsave_timeout_s = 100")
        core.begin(None)
        beat(core, 5, phase="save")
        assert "hang" not in fake.advance(99, core)  # the beat's held-back state.json write fires on the way
        assert fake.advance(1, core) == ["hang"]

    def test_no_heartbeat_no_hang_detection(self, tmp_path: Path) -> None:
        """A job that never writes a heartbeat is never declared hung (startup_timeout_s off)."""
        core, fake, _ = make_core(tmp_path, health="hang_timeout_s = 10")
        core.begin(None)
        assert "hang" not in fake.advance(10_000, core) and not fake.worker_signals



class TestWorkersLeftByTheAgent:
    """Slurm signals every process of a step: torchrun, signalled again, exits before its workers finish saving."""

    WORKER = (7001, "python")

    def stopping_with_workers_left(self, tmp_path: Path, after_s: float = 0) -> tuple[Core, FakeSystem, RecordingLog]:
        core, fake, log = make_core(tmp_path)
        core.begin(None)
        core.on_signal(signal.SIGTERM)
        fake.advance(after_s, core)
        fake.left_behind = [self.WORKER]
        exit_job(core, fake, 1)
        return core, fake, log

    def test_the_workers_finish_their_emergency_save(self, tmp_path: Path) -> None:
        """The agent exits during a graceful stop: its workers are not killed; the stop ends when the last one exits."""
        core, fake, log = self.stopping_with_workers_left(tmp_path)
        assert not core.done and core.status.state is State.STOPPING and fake.left_behind == [self.WORKER]
        assert "waiting_for_workers" in log.names() and "survivors_killed" not in log.names()
        fake.left_behind = []
        core.on_job_exit(self.WORKER[0], 0)
        assert core.exit_code == 0 and core.status.state is State.STOPPED and len(fake.spawned) == 1
        assert "survivors_killed" not in log.names() and core.status.last_exit.reason == "stopped"

    def test_they_get_only_the_rest_of_stop_timeout_s(self, tmp_path: Path) -> None:
        """Workers still saving when stop_timeout_s (counted from the SIGTERM) runs out are killed, and the stop ends."""
        core, fake, log = self.stopping_with_workers_left(tmp_path, after_s=10)
        assert fake.advance(19, core) == [] and not core.done
        assert fake.advance(1, core) == ["stop_kill"] and fake.left_behind == []
        assert core.exit_code == 0 and core.status.state is State.STOPPED
        assert {"job_killed", "survivors_killed"} <= set(log.names()) and fake.killed_trees == []

    def test_stop_force_kills_them_at_once(self, tmp_path: Path) -> None:
        """`stop --force` while the workers save: they are killed now (no exit of the agent is left to wait for)."""
        core, fake, log = self.stopping_with_workers_left(tmp_path)
        core.on_signal(signal.SIGUSR2)
        assert core.exit_code == 0 and fake.left_behind == [] and "survivors_killed" in log.names()
        assert core.status.reason == "force-stopped (stop --force)"

    def test_without_a_stop_they_are_killed_at_once(self, tmp_path: Path) -> None:
        """A crash of the agent (no stop asked) leaves nothing worth waiting for: its workers are killed as before."""
        core, fake, log = make_core(tmp_path)
        core.begin(None)
        fake.left_behind = [self.WORKER]
        exit_job(core, fake, 1)
        assert fake.left_behind == [] and "survivors_killed" in log.names() and core.status.state is State.BACKOFF


class TestStatusFile:
    def test_state_json_fields(self, tmp_path: Path) -> None:
        """state.json is written on each change (a beat's within BEAT_PUBLISH_S) and carries the documented fields."""
        core, fake, _ = make_core(tmp_path)
        core.begin(None)
        beat(core, 7)
        fake.advance(0.5, core)
        doc = json.loads((core.run_dir / "state.json").read_text())
        for key in ("state", "pid", "job_pid", "attempt", "restarts", "started_at", "last_exit", "step", "step_at",
                    "resumed_from", "latest_checkpoint", "disk_free_bytes", "quarantined", "updated_at"):
            assert key in doc, key
        assert doc["state"] == "running" and doc["step"] == 7 and doc["attempt"] == 1
        exit_job(core, fake, 1)
        st = read_status(core.run_dir)
        assert st is not None and st.state is State.BACKOFF and st.last_exit.reason == "crash" and st.restarts == 1


class TestBeatPublishing:
    def test_a_burst_of_beats_writes_state_json_once_then_the_latest(self, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
        """A job beating on every step (hundreds a second) cost an fsynced state.json write per beat (the loop was
        busy ~70% of the time at 250 beats/s); now at most one per BEAT_PUBLISH_S, and the last beat lands."""
        import supervisor.daemon.publisher as publisher_module

        writes: list[int | None] = []
        real = publisher_module.write_status
        monkeypatch.setattr(publisher_module, "write_status", lambda d, st: (writes.append(st.step), real(d, st)))
        core, fake, _ = make_core(tmp_path)
        core.begin(None)
        fake.advance(1, core)
        writes.clear()
        for step in range(1, 101):
            beat(core, step)
        assert writes == [1]  # the first at once (the last write was a second ago), the rest held back
        fake.advance(0.5, core)
        assert writes == [1, 100]
        assert json.loads((core.run_dir / "state.json").read_text())["step"] == 100


class TestJobPicksItsOwnCheckpoint:
    """resume_args without {checkpoint} (transformers' resume_from_checkpoint=True, Accelerate's load_state()):
    the job loads the highest checkpoint-N itself, complete or not."""

    def _crash_during_a_save(self, tmp_path: Path, job: str, checkpoints: str = "keep_last = 3"
                             ) -> tuple[Core, FakeSystem, RecordingLog, Path]:
        core, fake, log = make_core(tmp_path, checkpoints=checkpoints, job=job)
        root = core.cfg.checkpoints.dir
        write_trainer_checkpoint(root, 10)
        core.begin(None)
        write_trainer_checkpoint(root, 20, upto="optimizer_0")  # the attempt's save, cut by its crash
        exit_job(core, fake, 1)
        fake.advance(core.sys.timers.next_deadline() - fake.clock, core)
        return core, fake, log, root

    def test_the_cut_save_it_would_load_goes_before_the_relaunch(self, tmp_path: Path) -> None:
        """The job is down, so nothing is in flight: checkpoint-20 goes before attempt 2, which then picks 10."""
        core, fake, log, root = self._crash_during_a_save(tmp_path, "resume_args = []")
        assert len(fake.spawned) == 2
        assert sorted(p.name for p in root.iterdir()) == ["checkpoint-10"]
        gone = [f for e, f in log.events if e == "retention_deleted"]
        assert [Path(f["path"]).name for f in gone] == ["checkpoint-20"] and "would load" in gone[0]["reason"]

    def test_with_the_supervisors_pick_the_cut_save_waits(self, tmp_path: Path) -> None:
        """With {checkpoint} the job loads what it is told: the cut save waits for partial_max_age_s as before."""
        _, fake, _, root = self._crash_during_a_save(tmp_path, 'resume_args = ["--resume", "{checkpoint}"]')
        assert fake.spawned[1].argv[-1] == str(root / "checkpoint-10")
        assert sorted(p.name for p in root.iterdir()) == ["checkpoint-10", "checkpoint-20"]

    def test_a_node_that_does_not_prune_clears_nothing(self, tmp_path: Path) -> None:
        """prune = false (every node but one of a multi-node job): nothing is deleted here."""
        _, fake, _, root = self._crash_during_a_save(tmp_path, "resume_args = []", "prune = false")
        assert len(fake.spawned) == 2
        assert sorted(p.name for p in root.iterdir()) == ["checkpoint-10", "checkpoint-20"]


class TestAutoHangs:
    def test_default_config_detects_a_hang_after_hang_min_s(self, tmp_path: Path) -> None:
        """No hang setting at all: after enough steps, silence of hang_min_s (60 s) is a hang, not before."""
        core, fake, log = make_core(tmp_path)
        core.begin(None)
        for step in range(1, 16):
            beat(core, step)
            fake.advance(1, core)
        assert "hang" not in fake.advance(58, core)
        assert "hang" in fake.advance(2, core) and "hang_detected" in log.names()

    def test_without_beats_status_says_detection_is_off(self, tmp_path: Path) -> None:
        """A job that never beats: no hang, and `status` says why detection is off."""
        core, fake, _ = make_core(tmp_path)
        core.begin(None)
        assert "hang" not in fake.advance(10_000, core)
        assert "does not beat" in (core.status.hang_detection or "")
        assert "does not beat" in render_status(core.status, running=True, now=fake.now())


class TestCheckpointsElsewhere:
    """Issue 35 item 1 through Core: the idle root's warning, and the search before a fresh relaunch."""

    def test_saves_that_never_reach_the_root_warn_once_in_log_and_status(self, tmp_path: Path) -> None:
        core, fake, log = make_core(tmp_path)
        core.begin(None)
        for step in (5, 10, 15, 20):
            beat(core, step - 1)
            beat(core, step, "save")
        assert log.names().count("checkpoint_root_idle") == 1
        assert "said `save` 3 times" in (core.status.root_idle or "")

    def test_a_fresh_relaunch_after_a_failure_gives_up_on_checkpoints_elsewhere(self, tmp_path: Path) -> None:
        core, fake, log = make_core(tmp_path)
        core.begin(None)
        write_trainer_checkpoint(tmp_path / "elsewhere", 7)
        exit_job(core, fake, 1)
        fake.advance(5, core)  # the backoff
        assert core.exit_code == 3 and len(fake.spawned) == 1 and "checkpoints_elsewhere" in log.names()
        assert str(tmp_path / "elsewhere") in (core.status.reason or "")


def test_job_started_says_which_newer_checkpoint_the_resume_skipped_and_why(tmp_path: Path) -> None:
    """Issue 35 item 10: the newest dir is torn: the job resumes from the one before, and `job_started` names it."""
    core, fake, log = make_core(tmp_path)
    write_checkpoint(tmp_path / "ckpts", 10)
    torn = write_checkpoint(tmp_path / "ckpts", 20)
    next(p for p in torn.iterdir() if p.suffix == ".distcp").unlink()
    core.begin(None)
    started = next(fields for event, fields in log.events if event == "job_started")
    assert started["resumed_step"] == 10 and len(started["skipped"]) == 1, started
    assert started["skipped"][0].startswith(f"{torn}: torn"), started["skipped"]
