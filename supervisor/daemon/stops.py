"""The stop controller: a requested stop (Ctrl+C, `stop`, systemd, Slurm) carried out on the running attempt.

`policy/stopping.py` decides; this part carries it out and owns what a stop remembers (`reason`, `orphans`, the
workers an agent left saving). Why callbacks into `Core`, and why a hang's kill is not a stop: docs/design.md,
'Notes for maintainers'.
"""
from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

from supervisor.config import Config
from supervisor.daemon.system import System
from supervisor.daemon.timers import Timer
from supervisor.host.log import Log
from supervisor.policy.attempt import RunningAttempt
from supervisor.policy.exits import signal_name
from supervisor.policy.state import State, Status
from supervisor.policy.stopping import STOPPED_BY_SIGNAL, StopAction, on_stop_signal

__all__ = ["Stops"]


class Stops:
    def __init__(self, cfg: Config, system: System, log: Log, status: Status, *, cancel_hang: Callable[[], None],
                 publish: Callable[[], None], finish: Callable[[], None],
                 end_attempt: Callable[[RunningAttempt, int], None]) -> None:
        self.cfg, self.sys, self.log, self.status = cfg, system, log, status
        self.cancel_hang = cancel_hang  # a hang's own timers: a forced stop supersedes them
        # Core's: the status changed; the run is over (stopped, with `reason`); the attempt whose agent exited is over
        self.publish, self.finish, self.end_attempt = publish, finish, end_attempt
        self.reason = STOPPED_BY_SIGNAL  # status.reason once the run has stopped
        self.orphans: str | None = None  # its run token, while a killed predecessor's job is being stopped

    # ---- a killed predecessor's job ------------------------------------------------------------------------
    def stop_orphans(self, run_dir: Path, token: str) -> Callable[[], list[int]]:
        """The off-loop work that stops a killed supervisor's job (it gets stop_timeout_s for its emergency save)."""
        self.orphans = token
        return lambda: self.sys.stop_orphans(token, run_dir, self.cfg.health.stop_timeout_s)

    def orphans_stopped(self, outcome: list[int] | BaseException) -> None:
        """Say what the orphan stop found; launching follows whatever happened (it beats never starting)."""
        self.orphans = None
        if isinstance(outcome, BaseException):  # e.g. /proc unreadable
            self.log.error("orphan_stop_failed", error=f"{type(outcome).__name__}: {outcome}")
        elif outcome:  # oldest first: the job's agent
            self.log.warning("orphan_job_stopped", job_pid=outcome[0], pids=outcome)

    # ---- a stop signal (SIGHUP too: policy/stopping.py decides) --------------------------------------------------------
    def on_signal(self, signum: int, job: RunningAttempt | None, *, exit_pending: bool) -> None:
        """Carry out what policy/stopping.py decides for this signal."""
        decision = on_stop_signal(signum, state=self.status.state, job_running=job is not None,
                                  exit_pending=exit_pending, on_terminal=self.sys.on_terminal)
        action, job_pid = decision.action, job.pid if job else None
        if signum == signal.SIGHUP:  # the terminal closed, an ssh session dropped: never escalates a stop under way
            busy = action in (StopAction.IGNORE, StopAction.WAIT)
            self.log.warning("hangup", signal="SIGHUP", action="none, already stopping" if busy else "graceful stop")
        if action is StopAction.FORCE:
            self._force(signum, decision.cause or "stop --force", job, exit_pending=exit_pending)
        elif action is StopAction.WAIT:
            self.log.info("stop_in_progress", signal=signal_name(signum), job_pid=job_pid,
                          force="fsdp-supervisor stop --force")
        elif action is not StopAction.IGNORE:
            self.status.transition(State.STOPPING)
            self.log.info("stopping", signal=signal_name(signum), job_pid=job_pid, grace_s=self.cfg.health.stop_timeout_s)
            if action is StopAction.TERMINATE:
                assert job is not None
                self._terminate(job)
            (self.finish if action is StopAction.FINISH else self.publish)()

    def _force(self, signum: int, cause: str, job: RunningAttempt | None, *, exit_pending: bool) -> None:
        """Kill the job now (an emergency save in progress is lost), then exit 0 without a restart."""
        if self.status.state is not State.STOPPING:
            self.status.transition(State.STOPPING)
        self.reason = f"force-stopped ({cause})"
        self.log.warning("stop_forced", signal=signal_name(signum), cause=cause, job_pid=job.pid if job else None)
        if job is not None:
            job.stopping = True
            self.cancel_hang()
            self.sys.timers.cancel(Timer.STOP_KILL)
            if job.agent_exit is not None:  # only the workers it left are still saving: no agent exit to wait for
                self.end_attempt(job, job.agent_exit)  # which kills them
            else:
                self.sys.kill_job_tree(job.pid)
                self.publish()
        elif exit_pending:  # the exit being judged sees STOPPING
            self.publish()
        else:
            if self.orphans is not None:  # a killed predecessor's job still saving: no grace left for it either
                killed = self.sys.stop_orphans(self.orphans, self.cfg.run_dir, 0)
                self.log.warning("orphan_job_killed", pids=killed)
            self.finish()

    def terminate(self, job: RunningAttempt) -> None:
        """Stop the job gracefully without stopping the run (a divergence's rollback): as on a stop signal."""
        self.log.info("job_stopping", attempt=job.number, grace_s=self.cfg.health.stop_timeout_s)
        self._terminate(job)

    def _terminate(self, job: RunningAttempt) -> None:
        """SIGTERM the torchrun agent only (it forwards to workers once); SIGKILL after stop_timeout_s."""
        job.stopping = True
        self.sys.timers.cancel(Timer.HANG)
        self.sys.send_signal(job.pid, signal.SIGTERM)
        self.sys.timers.set(Timer.STOP_KILL, self.sys.monotonic() + self.cfg.health.stop_timeout_s)

    # ---- the stop's end ----------------------------------------------------------------------------------------
    def agent_exited(self, job: RunningAttempt, returncode: int) -> bool:
        """The agent exited: during a graceful stop, whether to wait for the workers it left still saving.

        Slurm signals every process of a step, and torchrun, signalled two or three times, stops waiting for its
        workers and exits: what it left keeps the rest of stop_timeout_s (the STOP_KILL timer still runs).
        """
        waiting = job.stopping and not job.hang and self.sys.timers.pending(Timer.STOP_KILL)
        left = self.sys.survivors() if waiting else []
        if left:
            job.agent_exit = returncode
            self.log.warning("waiting_for_workers", attempt=job.number, code=returncode,
                             processes=[f"{p}:{n}" for p, n in left])
        return bool(left)

    def on_kill_timer(self, job: RunningAttempt | None) -> None:
        """stop_timeout_s is over: kill what is left of the job."""
        if job is None:
            return
        if job.agent_exit is not None:  # the agent is gone (its pid may be reused): ending the attempt kills what it left
            self.log.warning("job_killed", attempt=job.number, after_s=self.cfg.health.stop_timeout_s)
            self.end_attempt(job, job.agent_exit)
            return
        killed = self.sys.kill_job_tree(job.pid)
        self.log.warning("job_killed", attempt=job.number, after_s=self.cfg.health.stop_timeout_s, processes=len(killed))
