"""supervisor/host/gcpause.py: the cyclic collector paused around parses and loads, and put back as it was."""
from __future__ import annotations

import gc
import threading

from supervisor.host.gcpause import collector_paused


class TestCollectorPaused:
    def test_off_inside_on_after_even_on_error(self) -> None:
        """Off inside the block; back on after it, also when the block raises."""
        assert gc.isenabled()
        try:
            with collector_paused():
                assert not gc.isenabled()
                raise ValueError("the parse refused its input")
        except ValueError:
            pass
        assert gc.isenabled()

    def test_overlapping_parses_turn_it_back_on_once_both_end(self) -> None:
        """Two threads' parses overlap: the first to finish must not turn the collector back on under the other."""
        with collector_paused():
            with collector_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()
        assert gc.isenabled()

    def test_a_collector_the_user_turned_off_stays_off(self) -> None:
        """A program that disabled the collector itself does not find it enabled by our parse."""
        gc.disable()
        try:
            with collector_paused():
                pass
            assert not gc.isenabled()
        finally:
            gc.enable()

    def test_threads_overlapping_in_any_order_leave_it_on(self) -> None:
        """Threads pausing and leaving in an interleaved order never leave the collector off at the end."""
        inside = threading.Barrier(4)
        seen: list[bool] = []

        def work() -> None:
            with collector_paused():
                inside.wait(timeout=10)
                seen.append(gc.isenabled())

        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        assert seen == [False] * 4 and gc.isenabled()
