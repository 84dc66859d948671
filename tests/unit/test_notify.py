"""sd_notify: the Notifier on its own, and a real supervisor talking to a real AF_UNIX datagram socket."""
from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.observe.notify import Notifier
from supervisor.policy.state import State, Status
from tests.supervise import FAKEJOB, Supervisors, launches, stop, supervisors, wait_for, write_config  # noqa: F401

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
