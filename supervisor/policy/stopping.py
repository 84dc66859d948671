"""What a stop signal does, decided from the state alone: a graceful stop is never escalated by accident.

SIGTERM/SIGINT/SIGHUP stop gracefully; a repeat while stopping only waits (a retried `stop`, systemd or
Slurm repeating SIGTERM), except a second Ctrl+C typed in the supervisor's own terminal, which forces, as
does `stop --force` (SIGUSR2). The daemon's core carries the decision out.
"""
from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass

from supervisor.host.signals import FORCE_STOP_SIGNAL, STOP_SIGNALS
from supervisor.policy.state import State
from supervisor.vocabulary import Vocabulary

__all__ = ["StopAction", "StopDecision", "on_stop_signal", "STOPPED_BY_SIGNAL"]

STOPPED_BY_SIGNAL = "stopped by signal"  # status.reason of a graceful stop


class StopAction(Vocabulary):
    IGNORE = "ignore"  # not a stop signal, or the run is over
    FORCE = "force"  # kill the job now (an emergency save in progress is lost), exit 0 without a restart
    WAIT = "wait"  # a stop is already in progress: say so, change nothing
    TERMINATE = "terminate"  # SIGTERM the job, SIGKILL after stop_timeout_s
    FINISH = "finish"  # nothing runs (backoff, waiting to launch): stopped at once
    JUDGE = "judge"  # the job just exited and is being judged: the judgement sees STOPPING and stops


@dataclass(frozen=True)
class StopDecision:
    action: StopAction
    cause: str | None = None  # for FORCE: what forced it, for the log and status.reason


def on_stop_signal(signum: int, *, state: State, job_running: bool, exit_pending: bool,
                   on_terminal: Callable[[], bool]) -> StopDecision:
    """What `signum` does now. `on_terminal` is asked only for a SIGINT during a stop (it opens /dev/tty)."""
    if state.final:
        return StopDecision(StopAction.IGNORE)
    if signum == FORCE_STOP_SIGNAL:
        return StopDecision(StopAction.FORCE, "stop --force")
    if signum not in STOP_SIGNALS:
        return StopDecision(StopAction.IGNORE)
    if state is State.STOPPING:
        if signum == signal.SIGINT and on_terminal():
            return StopDecision(StopAction.FORCE, "second Ctrl+C")
        return StopDecision(StopAction.WAIT)
    if job_running:
        return StopDecision(StopAction.TERMINATE)
    return StopDecision(StopAction.JUDGE if exit_pending else StopAction.FINISH)
