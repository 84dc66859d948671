"""Unit tests of trainer.stopping: the signal flag, the repeat rule and the handler bookkeeping."""
from __future__ import annotations

import os
import signal

from trainer.stopping import GracefulStop


class FakeClock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def make(clock: FakeClock, exits: list[int]) -> GracefulStop:
    return GracefulStop(repeat_grace_s=1.0, clock=clock, hard_exit=exits.append)


class TestHandle:
    def test_first_signal_only_sets_the_flag(self) -> None:
        """The first SIGTERM asks for a graceful stop and does not exit."""
        exits: list[int] = []
        stop = make(FakeClock(), exits)
        assert not stop.requested
        stop.handle(signal.SIGTERM)
        assert stop.requested and stop.signum == signal.SIGTERM and exits == []

    def test_duplicate_within_grace_is_ignored(self) -> None:
        """The same stop delivered twice within the grace window (launcher forwarding) is one stop."""
        clock, exits = FakeClock(), []
        stop = make(clock, exits)
        stop.handle(signal.SIGINT)
        clock.now += 0.2
        stop.handle(signal.SIGTERM)
        assert exits == []

    def test_second_sigint_exits_at_once_with_128_plus_signum(self) -> None:
        """A Ctrl+C after the grace window exits immediately, non-zero."""
        clock, exits = FakeClock(), []
        stop = make(clock, exits)
        stop.handle(signal.SIGTERM)
        clock.now += 1.5
        stop.handle(signal.SIGINT)
        assert exits == [128 + signal.SIGINT]

    def test_a_repeated_sigterm_never_cuts_the_save_short(self) -> None:
        """Slurm's SIGTERM to every process after the supervisor's own stop is no "stop now": the save goes on."""
        clock, exits = FakeClock(), []
        stop = make(clock, exits)
        stop.handle(signal.SIGTERM)
        for _ in range(3):
            clock.now += 5.0
            stop.handle(signal.SIGTERM)
        assert exits == [] and stop.signum == signal.SIGTERM


class TestInstall:
    def test_real_signal_sets_the_flag_and_uninstall_restores(self) -> None:
        """After install a real SIGTERM only sets the flag; uninstall puts the old handler back."""
        before = signal.getsignal(signal.SIGTERM)
        stop = make(FakeClock(), []).install()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.requested
        finally:
            stop.uninstall()
        assert signal.getsignal(signal.SIGTERM) is before
