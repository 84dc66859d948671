"""A supervisor frozen together with its job (Slurm's `scontrol suspend`, SIGSTOP, a cgroup freezer) and thawed.

Slurm suspends a job by stopping every process of it, the supervisor too, and resumes it minutes or hours later.
None of that time was the job's: on thawing, the supervisor must neither take the frozen heartbeat for a hang nor
take the frozen stop for one that ran out of `stop_timeout_s`. The supervisor is continued a moment before its job
(Slurm continues the processes of a step one by one, in no promised order): whatever it decides on waking, it
decides while the job is still stopped.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil

from tests.supervise import FAKEJOB, Supervisors, launches, supervisors, wait_for, write_config  # noqa: F401

FAST = "\n[restart]\nbackoff_initial_s = 0.05\nbackoff_max_s = 0.2\n"
FROZEN_S = 6.0  # longer than the allowances below


def supervisor_log(tmp_path: Path) -> str:
    try:
        return (tmp_path / ".fsdp-supervisor" / "supervisor.log").read_text()
    except OSError:
        return ""


def step(tmp_path: Path) -> int:
    try:
        return int(json.loads((tmp_path / ".fsdp-supervisor" / "state.json").read_text()).get("step") or 0)
    except (OSError, ValueError):
        return 0


def freeze(supervisor: int) -> None:
    """Stop the supervisor and every process under it for FROZEN_S, then continue it, then (a second later) them."""
    job = psutil.Process(supervisor).children(recursive=True)
    for p in [psutil.Process(supervisor), *job]:
        p.send_signal(signal.SIGSTOP)
    time.sleep(FROZEN_S)
    os.kill(supervisor, signal.SIGCONT)
    time.sleep(1.0)  # the supervisor looks at its timers first (were it slower, the test could only pass)
    for p in job:
        with contextlib.suppress(psutil.NoSuchProcess):  # killed meanwhile: what the tests look for
            p.send_signal(signal.SIGCONT)


class TestFrozenWithItsJob:
    def test_a_suspended_job_is_no_hang(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """Frozen for longer than hang_timeout_s while training: no hang detected, the job trains on, one attempt."""
        cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--steps", "300", "--step-s", "0.05"],
                           FAST + "\n[health]\nhang_timeout_s = 4\n")
        p = supervisors.start(cfg)
        wait_for(lambda: step(tmp_path) >= 10, 60, "the job training")
        freeze(p.pid)
        out, _ = p.communicate(timeout=120)
        log = supervisor_log(tmp_path)
        assert p.returncode == 0 and "hang_detected" not in log, out
        assert "frozen" in log and log.count('"job_started"') == 1

    def test_a_suspended_stop_keeps_its_budget(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """Frozen mid-stop (the emergency save under way) for longer than stop_timeout_s: the save is not cut short."""
        trap, marker = tmp_path / "saved", tmp_path / "launches"
        cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--sleep", "120", "--trap-term", str(trap),
                                      "--stop-delay", "2", "--marker", str(marker)],
                           FAST + "\n[health]\nstop_timeout_s = 4\n")
        p = supervisors.start(cfg)
        wait_for(lambda: launches(marker), 60, "the job's start")
        p.send_signal(signal.SIGTERM)
        wait_for(lambda: '"stopping"' in supervisor_log(tmp_path), 30, "the stop")
        freeze(p.pid)
        out, _ = p.communicate(timeout=60)
        log = supervisor_log(tmp_path)
        assert p.returncode == 0 and "job_killed" not in log, out
        assert trap.read_text() == str(int(signal.SIGTERM)), "the emergency save was cut short"
