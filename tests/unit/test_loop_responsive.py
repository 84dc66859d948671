"""The event loop never waits on store work, replayed through a fake System: what waits for a pass, what
coalesces, and the watchdog noise filter. The real loop with a pass held on a gate:
tests/integration/test_loop_responsive.py.
"""
from __future__ import annotations

import signal
from pathlib import Path

from supervisor.daemon.timers import Timer
from supervisor.policy.state import State
from tests.unit.test_core import exit_job, make_core


class TestWithFakeSystem:
    def test_stop_while_the_launch_pass_runs_launches_nothing(self, tmp_path: Path) -> None:
        """SIGTERM before the first pass says what to resume: no job is started, the supervisor stops."""
        core, fake, log = make_core(tmp_path)
        fake.defer_work = True
        core.begin(None)
        assert core.status.state is State.STARTING and not fake.spawned
        core.on_signal(signal.SIGTERM)
        assert core.exit_code == 0 and core.status.state is State.STOPPED
        fake.finish_work()  # the pass result arrives after the stop: ignored
        assert not fake.spawned and core.status.state is State.STOPPED

    def test_exit_is_judged_only_after_the_pass(self, tmp_path: Path) -> None:
        """A job exit waits for its pass (did the attempt commit?); a SIGTERM meanwhile turns it into a stop."""
        core, fake, log = make_core(tmp_path)
        core.begin(None)
        fake.defer_work = True
        exit_job(core, fake, 1)
        assert "job_exited" not in log.names() and core.job is None and core.ended is not None
        core.on_signal(signal.SIGTERM)
        assert core.status.state is State.STOPPING and not core.done
        fake.finish_work()
        assert core.status.state is State.STOPPED and core.exit_code == 0 and len(fake.spawned) == 1
        assert log.names().index("job_exited") < log.names().index("stopped")

    def test_requests_during_a_pass_coalesce_into_one_more(self, tmp_path: Path) -> None:
        """Three file-event scans during one pass cost one follow-up pass, not three."""
        core, fake, _ = make_core(tmp_path)
        core.begin(None)
        fake.defer_work = True
        for _ in range(3):
            core.on_timer(Timer.SCAN)
        assert len(fake.pending_work) == 1
        assert fake.finish_work() == 2


class TestWatchdogShutdownNoise:
    def test_the_inotify_stop_race_is_not_printed_other_watchdog_errors_are(self) -> None:
        """watchdog's 'queue_events() called when the thread is inactive' after our own observer.stop() is
        dropped (it printed over the console as `run` exited); its other errors still get through."""
        import logging

        import supervisor.daemon.loop  # noqa: F401  (installs the filter)
        log = logging.getLogger("watchdog.observers.inotify")

        def record(msg: str) -> logging.LogRecord:
            return log.makeRecord(log.name, logging.ERROR, __file__, 1, msg, (), None)

        assert not log.filter(record("InotifyEmitter.queue_events() called when the thread is inactive"))
        assert log.filter(record("inotify watch limit reached"))


class TestWakeUps:
    """The loop wakes for what it acts on, and its periodic work of one interval shares one wake-up."""

    def test_the_supervisor_s_own_writes_to_the_run_dir_wake_nothing(self, tmp_path: Path) -> None:
        """state.json, the history and the log (each write several inotify events) are dropped on the watcher's
        thread; the heartbeat's arrival (rename or in place), a commit under the root and a lost dir are not."""
        import queue

        from watchdog.events import DirDeletedEvent, DirModifiedEvent, FileCreatedEvent, FileModifiedEvent, FileMovedEvent

        from supervisor.daemon.loop import _Forward

        core, _, _ = make_core(tmp_path)
        run, root = core.run_dir, core.house.root
        sink: queue.SimpleQueue[Path] = queue.SimpleQueue()
        lost: queue.SimpleQueue[Path] = queue.SimpleQueue()
        wakes: list[int] = []
        fwd = _Forward(sink, lambda: wakes.append(1), lost, {run, root}, core.cares)
        quiet = [FileCreatedEvent(str(run / ".state.json.1a2b.tmp")), FileModifiedEvent(str(run / "history.jsonl")),
                 FileMovedEvent(str(run / ".state.json.1a2b.tmp"), str(run / "state.json")),
                 FileModifiedEvent(str(run / "supervisor.log")), DirModifiedEvent(str(run)),
                 FileCreatedEvent(str(run / ".heartbeat.json.9f.tmp"))]
        for event in quiet:
            fwd.on_any_event(event)
        assert wakes == [] and sink.empty()
        heard = [FileMovedEvent(str(run / ".heartbeat.json.9f.tmp"), str(run / "heartbeat.json")),
                 FileModifiedEvent(str(run / "heartbeat.json")), FileMovedEvent(str(root / ".tmp-step_5"),
                                                                              str(root / "step_5"))]
        for event in heard:
            fwd.on_any_event(event)
        assert len(wakes) == 3
        got = [sink.get_nowait() for _ in range(4)]
        assert got == [run / "heartbeat.json"] * 2 + [root / ".tmp-step_5", root / "step_5"] and sink.empty()
        fwd.on_any_event(DirDeletedEvent(str(run)))
        assert len(wakes) == 4 and lost.get_nowait() == run

    def test_periodic_timers_of_one_interval_share_a_wake_up(self) -> None:
        """`every` puts a timer on the interval's grid: armed at different moments, due at the same one."""
        from supervisor.daemon.timers import Tick, Timers

        timers = Timers()
        timers.every(Tick(0), 1.0, 100.2)
        timers.every(Timer.RANKS, 1.0, 100.7)
        timers.every(Tick(1), 0.5, 100.7)
        assert timers.pop_due(101.0) == [Timer.RANKS, Tick(0), Tick(1)]
