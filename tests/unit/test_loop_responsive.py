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
