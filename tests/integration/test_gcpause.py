"""supervisor/host/gcpause.py: the cyclic collector paused around parses and loads, and put back as it was."""
from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable

from supervisor.host.gcpause import collector_paused


class TestCollectorPaused:
    def test_a_child_forked_while_another_thread_pauses_gets_its_collector_back(self) -> None:
        """Fork while a thread's load holds the pause: that thread does not exist in the child, so the child must
        not keep the collector off for good (nor the pause held by a thread that will never leave it)."""
        held, release = threading.Event(), threading.Event()

        def load() -> None:
            with collector_paused():
                held.set()
                release.wait(timeout=10)

        thread = threading.Thread(target=load)
        thread.start()
        try:
            assert held.wait(timeout=10)
            child_saw = _in_forked_child(_collector_states_in_child)
        finally:
            release.set()
            thread.join(timeout=10)
        assert child_saw == "on, off inside, on after" and gc.isenabled()

    def test_a_child_forked_inside_its_own_pause_turns_it_back_on_as_it_leaves(self) -> None:
        """Fork from inside the pause: the child carries on inside the same block and turns it back on itself."""
        read, write = os.pipe()
        pid = -1
        try:
            with collector_paused():
                pid = os.fork()
                inside = gc.isenabled()
            if pid == 0:
                os.write(write, f"inside {inside}, after {gc.isenabled()}".encode())
        finally:
            if pid == 0:  # the child never returns into pytest
                os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as f:
            child_saw = f.read().decode()
        os.waitpid(pid, 0)
        assert child_saw == "inside False, after True" and gc.isenabled()


def _collector_states_in_child() -> str:
    first = "on" if gc.isenabled() else "off"
    with collector_paused():
        inside = "off inside" if not gc.isenabled() else "on inside"
    return f"{first}, {inside}, {'on after' if gc.isenabled() else 'off after'}"


def _in_forked_child(probe: Callable[[], str]) -> str:
    """What `probe` returns when run in a forked child of this process."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never return into pytest
        try:
            os.close(read)
            os.write(write, probe().encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        with os.fdopen(read, "rb") as f:
            return f.read().decode()
    finally:
        os.waitpid(pid, 0)
