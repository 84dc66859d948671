"""Unit tests of trainer.stopping: the signal flag, the repeat rule and the handler bookkeeping."""
from __future__ import annotations

import signal

from tests.unit.test_trainer_stopping import FakeClock, make


class TestShouldStop:
    def test_without_process_group_returns_the_local_flag(self) -> None:
        """Outside a distributed job the agreement is just this process's flag."""
        stop = make(FakeClock(), [])
        assert stop.should_stop() is False
        stop.handle(signal.SIGTERM)
        assert stop.should_stop() is True
