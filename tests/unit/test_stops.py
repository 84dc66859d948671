"""The stop controller (supervisor/daemon/stops.py) on its own: what each stop does to the attempt and what it asks
Core to do next, through the fake System. Whole histories through Core are in test_core.py and test_core_lifecycle.py."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest

from supervisor.config import load_config
from supervisor.daemon.stops import Stops
from supervisor.daemon.timers import Timer
from supervisor.host.signals import FORCE_STOP_SIGNAL
from supervisor.policy.attempt import RunningAttempt
from supervisor.policy.state import State, Status
from tests.fakes import FakeSystem, RecordingLog

GRACE = 30.0


def make(tmp_path: Path, state: State = State.RUNNING) -> tuple[Stops, FakeSystem, RecordingLog, list[str]]:
    """The controller, and what it asked of Core (`hang` asked, `publish`, `finish`, `end_attempt`) in order."""
    cfg_path = tmp_path / "job.toml"
    cfg_path.write_text(f'[job]\ncommand = ["torchrun"]\n[checkpoints]\ndir = "ckpts"\n[health]\nstop_timeout_s = {GRACE}\n')
    fake, log, asked = FakeSystem(), RecordingLog(), list[str]()
    status = Status(pid=1)
    for s in {State.RUNNING: [State.RUNNING], State.STOPPING: [State.RUNNING, State.STOPPING],
              State.BACKOFF: [State.RUNNING, State.BACKOFF]}[state]:
        status.transition(s)
    stops = Stops(load_config(cfg_path), fake, log, status, cancel_hang=lambda: asked.append("hang"),
                  publish=lambda: asked.append("publish"), finish=lambda: asked.append("finish"),
                  end_attempt=lambda j, code: asked.append(f"end_attempt {code}"))
    return stops, fake, log, asked


def job(pid: int = 500) -> RunningAttempt:
    return RunningAttempt(number=1, pid=pid, started_mono=0.0, resumed_from=None, resumed_step=None, error_file=Path("e"),
               log_path=Path("l"), oom_before=None)


class TestSignals:
    def test_a_stop_terminates_the_agent_with_the_whole_grace(self, tmp_path: Path) -> None:
        """SIGTERM to the agent only; its kill is due stop_timeout_s later; the run is STOPPING."""
        stops, fake, _, asked = make(tmp_path)
        j = job()
        stops.on_signal(signal.SIGTERM, j, exit_pending=False)
        assert asked == ["publish"]
        assert fake.signals == [(500, signal.SIGTERM)] and j.stopping and stops.status.state is State.STOPPING
        assert fake.timers.pending(Timer.STOP_KILL) and fake.timers.next_deadline() == fake.clock + GRACE

    @pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
    def test_a_repeat_only_waits(self, tmp_path: Path, signum: int) -> None:
        """Asking again (systemd, Slurm, a retried `stop`, a SIGINT off the terminal) never cuts the save short."""
        stops, fake, log, asked = make(tmp_path, State.STOPPING)
        stops.on_signal(signum, job(), exit_pending=False)
        assert asked == []
        assert fake.signals == [] and fake.killed_trees == [] and "stop_in_progress" in log.names()
        assert ("hangup" in log.names()) == (signum == signal.SIGHUP)  # a hangup is said, and does nothing more

    def test_a_hangup_stops_gracefully(self, tmp_path: Path) -> None:
        """SIGHUP (the terminal closed) is a graceful stop like SIGTERM, and the log says it was a hangup."""
        stops, fake, log, asked = make(tmp_path)
        stops.on_signal(signal.SIGHUP, job(), exit_pending=False)
        assert asked == ["publish"] and fake.signals == [(500, signal.SIGTERM)] and "hangup" in log.names()

    def test_nothing_running_is_stopped_at_once(self, tmp_path: Path) -> None:
        """In backoff there is nothing to save: the run finishes as stopped."""
        stops, fake, _, asked = make(tmp_path, State.BACKOFF)
        stops.on_signal(signal.SIGTERM, None, exit_pending=False)
        assert asked == ["finish"]
        assert stops.reason == "stopped by signal" and fake.signals == []


class TestForce:
    def test_force_kills_the_tree_and_says_why(self, tmp_path: Path) -> None:
        """stop --force: the job's tree is killed now, a hang's own timers too; the reason names the force."""
        stops, fake, _, asked = make(tmp_path, State.STOPPING)
        j = job()
        stops.on_signal(FORCE_STOP_SIGNAL, j, exit_pending=False)
        assert asked == ["hang", "publish"]
        assert fake.killed_trees == [500] and stops.reason == "force-stopped (stop --force)"

    def test_a_second_ctrl_c_in_the_terminal_forces(self, tmp_path: Path) -> None:
        """Only a Ctrl+C typed at the supervisor's own terminal escalates a stop in progress."""
        stops, fake, _, asked = make(tmp_path, State.STOPPING)
        fake.terminal = True
        stops.on_signal(signal.SIGINT, job(), exit_pending=False)
        assert asked == ["hang", "publish"]
        assert fake.killed_trees == [500] and stops.reason == "force-stopped (second Ctrl+C)"

    def test_force_with_workers_left_by_their_agent_ends_the_attempt(self, tmp_path: Path) -> None:
        """The agent already exited: nothing to wait for, ending the attempt kills what it left."""
        stops, fake, _, asked = make(tmp_path, State.STOPPING)
        j = job()
        j.agent_exit = 1
        stops.on_signal(FORCE_STOP_SIGNAL, j, exit_pending=False)
        assert asked == ["hang", "end_attempt 1"]
        assert fake.killed_trees == []

    def test_force_before_the_first_launch_kills_the_predecessors_job(self, tmp_path: Path) -> None:
        """A killed supervisor's job still saving when `stop --force` comes: no grace left for it either."""
        stops, fake, log, asked = make(tmp_path)
        fake.orphans = [77]
        stops.stop_orphans(tmp_path, "t" * 32)  # the off-loop work, not run yet
        stops.on_signal(FORCE_STOP_SIGNAL, None, exit_pending=False)
        assert asked == ["finish"]
        assert fake.orphan_timeouts == [0] and "orphan_job_killed" in log.names()


class TestTheStopsEnd:
    def test_workers_the_agent_left_keep_the_rest_of_the_grace(self, tmp_path: Path) -> None:
        """torchrun exited first (Slurm signalled it too): its workers still saving are waited for, not killed."""
        stops, fake, log, asked = make(tmp_path)
        j = job()
        stops.on_signal(signal.SIGTERM, j, exit_pending=False)
        fake.left_behind = [(501, "python")]
        assert stops.agent_exited(j, 1) is True and j.agent_exit == 1 and "waiting_for_workers" in log.names()
        stops.on_kill_timer(j)
        assert asked == ["publish", "end_attempt 1"]

    def test_no_wait_without_a_requested_stop(self, tmp_path: Path) -> None:
        """A crash (no stop asked for) or a hang's kill: the attempt ends when its agent does."""
        stops, fake, _, asked = make(tmp_path)
        fake.left_behind = [(501, "python")]
        assert stops.agent_exited(job(), 1) is False

    def test_the_kill_timer_kills_a_live_agents_tree(self, tmp_path: Path) -> None:
        """stop_timeout_s is over and the agent still runs: its tree is killed; its exit ends the attempt."""
        stops, fake, log, asked = make(tmp_path)
        stops.on_kill_timer(job())
        assert asked == [] and fake.killed_trees == [500] and "job_killed" in log.names()
