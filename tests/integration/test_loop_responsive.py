"""The event loop never waits on store work: a signal and a job exit are handled while a pass still runs.

The loop never blocks on store work (docs/design.md, "One event loop"). The housekeeping pass (scan, verify,
prune) runs off the loop thread; here it is held on a gate, as a 70B-class `.metadata` being parsed would hold
it, and the test checks the order of events rather than timings: the job is signalled, exits and is reaped
while the pass has not finished.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import psutil

from supervisor.config import load_config
from supervisor.daemon.core import Core
from supervisor.daemon.housekeeping import PassResult
from supervisor.daemon.loop import EventLoop
from supervisor.daemon.system import RealSystem
from supervisor.policy.state import State
from tests.fakes import RecordingLog
from tests.supervise import FAKEJOB, write_config


class TestRealLoop:
    def test_signal_and_job_exit_are_handled_while_a_pass_is_stuck(self, tmp_path: Path) -> None:
        """With a pass held mid-way, SIGTERM reaches the job, the job's exit is reaped, then the stop completes."""
        trapped = tmp_path / "trapped"
        cfg_path = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--steps", "1000", "--step-s", "0.05",
                                           "--trap-term", str(trapped)],
                                "retention_interval_s = 0.5\n[restart]\nbackoff_initial_s = 0.05\n")
        cfg = load_config(cfg_path)
        for d in (cfg.run_dir, cfg.checkpoints.dir):
            d.mkdir(parents=True, exist_ok=True)
        system = RealSystem(prewarm=False)
        core = Core(cfg, system, RecordingLog())
        gate, stuck = threading.Event(), threading.Event()
        real_pass = core.house.run_pass
        calls = 0

        def held_pass(**kw: object) -> PassResult:
            nonlocal calls
            calls += 1
            if calls == 2:  # the first periodic pass, with the job running
                stuck.set()
                gate.wait(60)
            return real_pass(**kw)  # type: ignore[arg-type]

        core.house.run_pass = held_pass  # type: ignore[method-assign]
        seen: dict[str, object] = {}

        def drive() -> None:
            try:
                assert stuck.wait(60), "no second pass"
                # The job traps SIGTERM before its first beat: on a loaded machine the held pass can come first.
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and core.status.step is None:
                    time.sleep(0.01)
                job_pid = core.job.pid if core.job else None
                os.kill(os.getpid(), signal.SIGTERM)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and (core.job is not None or not trapped.exists()):
                    time.sleep(0.01)
                seen.update(job_pid=job_pid, trapped=trapped.exists(), reaped=core.job is None,
                            state=core.status.state, pass_held=not gate.is_set())
                seen["alive"] = job_pid is not None and psutil.pid_exists(job_pid) and \
                    psutil.Process(job_pid).status() != psutil.STATUS_ZOMBIE
            finally:
                gate.set()

        driver = threading.Thread(target=drive, daemon=True)
        driver.start()
        loop = EventLoop(core, system, watch=[(cfg.run_dir, False)])
        try:
            rc = loop.run(lambda: core.begin(None))
        finally:
            gate.set()
            system.close()
            driver.join(10)
        assert seen.get("job_pid") and seen["trapped"] and seen["reaped"] and not seen["alive"], seen
        assert seen["state"] is State.STOPPING and seen["pass_held"], seen
        assert rc == 0 and core.status.state is State.STOPPED

    def test_a_stop_that_came_while_begin_was_busy_launches_nothing(self, tmp_path: Path) -> None:
        """A SIGTERM (or `stop --force`) that arrives while `begin` is still stopping a killed predecessor's orphan
        is handled before the launch pass's result: before, the loop launched a job and killed it straight away."""
        cfg_path = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--steps", "1000", "--step-s", "0.05"])
        cfg = load_config(cfg_path)
        for d in (cfg.run_dir, cfg.checkpoints.dir):
            d.mkdir(parents=True, exist_ok=True)
        system = RealSystem(prewarm=False)
        log = RecordingLog()
        core = Core(cfg, system, log)

        def slow_begin() -> None:
            core.begin(None)  # asks for the launch pass, off the loop
            os.kill(os.getpid(), signal.SIGTERM)  # `stop` while begin is still busy (an orphan's long save)
            deadline = time.monotonic() + 30
            while system._finished.empty() and time.monotonic() < deadline:  # the pass is done by the time it returns
                time.sleep(0.01)

        try:
            rc = EventLoop(core, system, watch=[(cfg.run_dir, False)]).run(slow_begin)
        finally:
            system.close()
        assert rc == 0 and core.status.state is State.STOPPED, core.status
        assert "job_started" not in log.names(), log.names()
