"""sd_notify: the Notifier on its own, and a real supervisor talking to a real AF_UNIX datagram socket."""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.observe.notify import Notifier
from supervisor.policy.state import State, Status
from tests.supervise import FAKEJOB, Supervisors, launches, stop, supervisors, wait_for, write_config  # noqa: F401

FAST = "\n[restart]\nbackoff_initial_s = 0.05\nbackoff_max_s = 0.2\n"
_NOTIFY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class Receiver:
    """A bound datagram socket (a path, or an abstract `@name`) drained by a thread into (time, message)."""

    def __init__(self, address: str, read: bool = True) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, str]] = []
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._drain, daemon=True)
        if read:
            self.thread.start()

    def _drain(self) -> None:
        while not self.done.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            with self.lock:
                self.messages.extend((time.monotonic(), line) for line in data.decode().split("\n") if line)

    def seen(self, prefix: str) -> list[tuple[float, str]]:
        with self.lock:
            return [(t, m) for t, m in self.messages if m.startswith(prefix)]

    def close(self) -> None:
        self.done.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        self.sock.close()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in _NOTIFY_ENV:
        monkeypatch.delenv(k, raising=False)


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    r = Receiver(str(tmp_path / "notify.sock"))
    try:
        yield r
    finally:
        r.close()


class TestNotifier:
    def test_silent_without_notify_socket(self, clean_env: None) -> None:
        """No NOTIFY_SOCKET: no notifier at all."""
        assert Notifier.from_env() is None

    def test_env_is_taken_out_for_the_job(self, receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
        """from_env removes NOTIFY_SOCKET/WATCHDOG_* so the job (which inherits os.environ) never sees them."""
        monkeypatch.setenv("NOTIFY_SOCKET", receiver.address)
        monkeypatch.setenv("WATCHDOG_USEC", "400000")
        monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
        n = Notifier.from_env()
        assert n is not None and n.watchdog_usec == 400000
        assert not any(k in os.environ for k in _NOTIFY_ENV)

    def test_watchdog_for_another_pid_is_ignored(self, receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
        """WATCHDOG_PID naming another process: that process owns the watchdog, we send no WATCHDOG=1."""
        monkeypatch.setenv("NOTIFY_SOCKET", receiver.address)
        monkeypatch.setenv("WATCHDOG_USEC", "400000")
        monkeypatch.setenv("WATCHDOG_PID", "1")
        n = Notifier.from_env()
        assert n is not None and n.ticks(lambda: True) == []

    def test_watchdog_tick_every_half_period_only_while_healthy(self, receiver: Receiver) -> None:
        """The tick interval is half WATCHDOG_USEC, and an unhealthy loop sends nothing."""
        n = Notifier(receiver.address, 400000)
        healthy = [True]
        ((interval, ping),) = n.ticks(lambda: healthy[0])
        assert interval == pytest.approx(0.2)
        ping()
        healthy[0] = False
        ping()
        wait_for(lambda: receiver.seen("WATCHDOG=1"), 5, "watchdog ping")
        time.sleep(0.2)
        assert len(receiver.seen("WATCHDOG=1")) == 1

    def test_status_deduplicated_and_stopping_once(self, receiver: Receiver) -> None:
        """READY=1 with the first non-starting status; STATUS= only on a change; STOPPING=1 once."""
        n = Notifier(receiver.address, None)
        n.status(Status(state=State.STARTING))  # before the first launch: not ready yet
        st = Status(state=State.RUNNING, attempt=1)
        n.status(st)
        n.status(st)
        st.transition(State.STOPPING)
        n.status(st)
        n.stopping()
        wait_for(lambda: receiver.seen("STOPPING=1"), 5, "STOPPING=1")
        time.sleep(0.2)
        msgs = [m for _, m in receiver.messages]
        assert msgs == ["STATUS=starting, no checkpoint, restarts 0", "READY=1",
                        "STATUS=running, attempt 1, no checkpoint, restarts 0",
                        "STATUS=stopping, attempt 1, no checkpoint, restarts 0", "STOPPING=1"]

    def test_abstract_socket(self) -> None:
        """An `@name` address reaches the abstract socket of that name."""
        r = Receiver(f"@fsdp-supervisor-test-{uuid.uuid4().hex}")
        try:
            Notifier(r.address, None).ready()
            wait_for(lambda: r.seen("READY=1"), 5, "READY=1")
        finally:
            r.close()

    def test_stalled_reader_never_blocks(self, tmp_path: Path) -> None:
        """A reader that never reads (queue full) makes sends drop, not block the event loop."""
        r = Receiver(str(tmp_path / "stalled.sock"), read=False)
        n = Notifier(r.address, None)
        t = threading.Thread(target=lambda: [n.send(f"STATUS={i}") for i in range(200)], daemon=True)
        try:
            t.start()
            t.join(timeout=10)
            assert not t.is_alive(), "send() blocked on a full socket"
        finally:
            r.close()

    def test_gone_socket_is_harmless(self, tmp_path: Path) -> None:
        """systemd gone (no socket at the path): sending is a silent no-op."""
        Notifier(str(tmp_path / "missing.sock"), None).ready()


@pytest.mark.integration
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
