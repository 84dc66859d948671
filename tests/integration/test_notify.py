"""sd_notify: the Notifier on its own, and a real supervisor talking to a real AF_UNIX datagram socket."""
from __future__ import annotations

import json
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.supervise import FAKEJOB, Supervisors, launches, stop, supervisors, wait_for, write_config  # noqa: F401
from tests.unit.test_notify import (
    _NOTIFY_ENV,
    Receiver,
    receiver,  # noqa: F401  (a fixture, taken as an argument)
)

FAST = "\n[restart]\nbackoff_initial_s = 0.05\nbackoff_max_s = 0.2\n"


class TestLiveSupervisor:
    @pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
    def test_ready_status_watchdog_stopping(self, tmp_path: Path, supervisors: Supervisors, abstract: bool) -> None:
        """READY once launched, STATUS on changes, WATCHDOG at about the requested pace, STOPPING on SIGTERM."""
        address = f"@fsdp-sv-{uuid.uuid4().hex}" if abstract else str(tmp_path / "notify.sock")
        r = Receiver(address)
        try:
            cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--steps", "20", "--step-s", "0.05",
                                          "--sleep", "60", "--trap-term", str(tmp_path / "t")], FAST)
            p = supervisors.start(cfg, env={"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "400000"})
            wait_for(lambda: r.seen("READY=1"), 60, "READY=1")
            state = json.loads((tmp_path / ".fsdp-supervisor" / "state.json").read_text())
            assert state["state"] == "running" and state["job_pid"], "READY=1 before the first launch"
            wait_for(lambda: any("step 20" in m for _, m in r.seen("STATUS=")), 60, "STATUS with step 20")
            t0 = time.monotonic()
            time.sleep(2.0)
            pings = [t for t, _ in r.seen("WATCHDOG=1") if t0 <= t <= t0 + 2.0]
            assert 3 <= len(pings) <= 40, f"{len(pings)} WATCHDOG=1 in 2 s at a 0.2 s interval"
            assert r.seen("STATUS=running, attempt 1")
            assert not r.seen("STOPPING=1")
            rc, out = stop(p, signal.SIGTERM)
            assert rc == 0, out
            wait_for(lambda: r.seen("STOPPING=1"), 5, "STOPPING=1")
            assert r.seen("STATUS=stopped")
        finally:
            r.close()

    def test_stopping_sent_when_the_stop_begins(self, tmp_path: Path, supervisors: Supervisors,
                                                receiver: Receiver) -> None:
        """STOPPING=1 arrives while the job is still being stopped, not only when the supervisor exits."""
        marker = tmp_path / "launched"
        cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--sleep", "120", "--ignore-term",
                                      "--marker", str(marker)], FAST + "\n[health]\nstop_timeout_s = 60\n")
        p = supervisors.start(cfg, env={"NOTIFY_SOCKET": receiver.address})
        wait_for(lambda: launches(marker), 60, "job start")
        p.send_signal(signal.SIGTERM)
        wait_for(lambda: receiver.seen("STOPPING=1"), 20, "STOPPING=1")
        assert p.poll() is None, "the supervisor had already exited"
        rc, out = stop(p, signal.SIGUSR2)  # `stop --force` kills the job at once (a second SIGTERM would wait)
        assert rc == 0, out

    def test_job_does_not_inherit_notify_socket(self, tmp_path: Path, supervisors: Supervisors,
                                                receiver: Receiver) -> None:
        """The job's environment has no NOTIFY_SOCKET or WATCHDOG_USEC (only the supervisor talks to systemd)."""
        out = tmp_path / "env.json"
        script = "import json, os, sys; json.dump({k: os.environ.get(k) for k in sys.argv[2:]}, open(sys.argv[1], 'w'))"
        cfg = write_config(tmp_path, [sys.executable, "-c", script, str(out), *_NOTIFY_ENV], FAST)
        p = supervisors.start(cfg, env={"NOTIFY_SOCKET": receiver.address, "WATCHDOG_USEC": "400000"})
        p.communicate(timeout=60)
        assert p.returncode == 0
        assert json.loads(out.read_text()) == dict.fromkeys(_NOTIFY_ENV)

    def test_stalled_systemd_does_not_freeze_supervision(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """With a notify socket nobody reads and a fast watchdog, the supervisor still runs the job to the end."""
        r = Receiver(str(tmp_path / "stalled.sock"), read=False)
        try:
            cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--steps", "30", "--step-s", "0.03"], FAST)
            p = supervisors.start(cfg, env={"NOTIFY_SOCKET": r.address, "WATCHDOG_USEC": "20000"})
            out, _ = p.communicate(timeout=60)
            assert p.returncode == 0, out
        finally:
            r.close()
