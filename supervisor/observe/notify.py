"""sd_notify by hand (the `sdnotify` package is unmaintained): READY, STATUS, WATCHDOG, STOPPING.

Silent when NOTIFY_SOCKET is unset. Abstract socket names (`@...`) are supported.
"""
from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable

from supervisor.observe.statusview import one_line
from supervisor.policy.state import State, Status

__all__ = ["Notifier"]


class Notifier:
    def __init__(self, address: str, watchdog_usec: int | None) -> None:
        self.address = "\0" + address[1:] if address.startswith("@") else address
        self.watchdog_usec = watchdog_usec
        self._last_status: str | None = None
        self._ready_sent = False
        self._stopping_sent = False
        # Non-blocking: a unix datagram send blocks while the reader's queue is full (10 by default); a stalled
        # reader must never freeze the event loop, so a message is dropped instead.
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)

    @classmethod
    def from_env(cls) -> Notifier | None:
        # Taken out of our environment (like sd_notify's unset_environment): the job inherits os.environ and
        # must not talk to systemd or think it owns our watchdog.
        addr = os.environ.pop("NOTIFY_SOCKET", "")
        usec = os.environ.pop("WATCHDOG_USEC", "")
        wd_pid = os.environ.pop("WATCHDOG_PID", "")
        if not addr:
            return None
        wd = int(usec) if usec.isdigit() and (not wd_pid or wd_pid == str(os.getpid())) else None
        return cls(addr, wd)

    def send(self, message: str) -> None:
        with contextlib.suppress(OSError):  # systemd gone or socket full: never let notification break supervision
            self.sock.sendto(message.encode(), self.address)

    def ready(self) -> None:
        if not self._ready_sent:
            self._ready_sent = True
            self.send("READY=1")

    def status(self, st: Status) -> None:
        """Called on every publish: READY=1 once the first launch is done (or failed), then STATUS= on change."""
        if st.state is not State.STARTING:
            self.ready()
        line = one_line(st)
        if line != self._last_status:
            self._last_status = line
            self.send(f"STATUS={line}")
        if st.state is State.STOPPING:
            self.stopping()  # as the stop begins: the job's emergency save may take stop_timeout_s

    def stopping(self) -> None:
        if not self._stopping_sent:
            self._stopping_sent = True
            self.send("STOPPING=1")

    def ticks(self, healthy: Callable[[], bool]) -> list[tuple[float, Callable[[], None]]]:
        """WATCHDOG=1 every half WATCHDOG_USEC, sent from the main loop so a stuck loop stops the pings."""
        if not self.watchdog_usec:
            return []

        def ping() -> None:
            if healthy():
                self.send("WATCHDOG=1")

        return [(self.watchdog_usec / 2e6, ping)]
