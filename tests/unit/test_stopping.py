"""policy/stopping.py: what each signal does in each state (a graceful stop is never escalated by accident)."""
from __future__ import annotations

import signal

import pytest

from supervisor.host.signals import FORCE_STOP_SIGNAL
from supervisor.policy.state import State
from supervisor.policy.stopping import StopAction, on_stop_signal

T, I, H, U = signal.SIGTERM, signal.SIGINT, signal.SIGHUP, FORCE_STOP_SIGNAL  # noqa: E741 - one letter each keeps the table readable


def decide(signum: int, state: State, *, job: bool = True, pending: bool = False, tty: bool = False) -> StopAction:
    asked: list[bool] = []

    def on_terminal() -> bool:
        asked.append(True)
        return tty

    action = on_stop_signal(signum, state=state, job_running=job, exit_pending=pending, on_terminal=on_terminal).action
    if asked:
        assert signum == I and state is State.STOPPING, "the terminal is asked only for a SIGINT during a stop"
    return action


class TestOnStopSignal:
    @pytest.mark.parametrize(("signum", "state", "job", "pending", "tty", "action"), [
        (T, State.RUNNING, True, False, False, StopAction.TERMINATE),
        (I, State.RUNNING, True, False, True, StopAction.TERMINATE),  # a first Ctrl+C is graceful
        (H, State.STARTING, True, False, False, StopAction.TERMINATE),  # a closed terminal too
        (T, State.BACKOFF, False, False, False, StopAction.FINISH),  # nothing runs: stopped at once
        (T, State.RUNNING, False, True, False, StopAction.JUDGE),  # just exited: the judgement stops
        (T, State.STOPPING, True, False, True, StopAction.WAIT),  # a retried stop never escalates
        (I, State.STOPPING, True, False, False, StopAction.WAIT),  # a SIGINT not from our terminal
        (I, State.STOPPING, True, False, True, StopAction.FORCE),  # a second Ctrl+C typed at us
        (U, State.RUNNING, True, False, False, StopAction.FORCE),  # stop --force
        (U, State.STOPPING, True, False, False, StopAction.FORCE),
        (signal.SIGUSR1, State.RUNNING, True, False, False, StopAction.IGNORE),
        (T, State.COMPLETED, False, False, False, StopAction.IGNORE),
        (U, State.STOPPED, False, False, False, StopAction.IGNORE),
    ])
    def test_table(self, signum: int, state: State, job: bool, pending: bool, tty: bool, action: StopAction) -> None:
        """Each row: the signal, the state, whether a job runs or an exit awaits judgement, the terminal; the action."""
        assert decide(signum, state, job=job, pending=pending, tty=tty) is action

    def test_force_names_its_cause(self) -> None:
        """The log and status.reason say what forced the stop."""
        def cause(signum: int, state: State) -> str | None:
            return on_stop_signal(signum, state=state, job_running=True, exit_pending=False,
                                  on_terminal=lambda: True).cause
        assert cause(U, State.RUNNING) == "stop --force"
        assert cause(I, State.STOPPING) == "second Ctrl+C"
