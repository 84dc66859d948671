"""The run's events: typed records, each published once on a `Bus`; the sinks are its subscribers.

`Core` and its parts publish what happened and never call a sink; the subscribers: docs/design.md, 'From a job's
exit to its relaunch'. A subscriber must not raise: each one's own failures are said and survived inside it.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from supervisor.contract import Beat
from supervisor.host.log import Log
from supervisor.observe.redact import redact_argv, redact_env
from supervisor.policy.state import ExitInfo, State, Status

if TYPE_CHECKING:
    from supervisor.checkpoints import CheckpointInfo
    from supervisor.daemon.housekeeping import PassResult
    from supervisor.policy.attempt import RunningAttempt
    from supervisor.policy.ranks import StragglerChange
    from supervisor.policy.restarts import Attempt

__all__ = ["Bus", "Event", "SupervisorStarted", "AttemptStarted", "BeatRead", "AttemptExited", "HangRecorded",
           "StragglerChanged", "PassAbsorbed", "Quarantined", "Finished", "StatusChanged", "Alarm", "AlertSent", "to_log"]


class SupervisorStarted(NamedTuple):  # a `run` began (the run dir locked, before any orphan is stopped)
    pass


class AttemptStarted(NamedTuple):
    job: RunningAttempt
    argv: Sequence[str]
    env: Mapping[str, str]
    skipped: Sequence[str] = ()  # newer dirs the resume passed over, and why


class BeatRead(NamedTuple):  # a new heartbeat of the running attempt (the node's file)
    number: int
    beat: Beat


class AttemptExited(NamedTuple):  # an attempt's exit judged (a pass looked at what it committed)
    job: RunningAttempt
    attempt: Attempt
    info: ExitInfo
    latest_step: int | None


class HangRecorded(NamedTuple):  # a hung attempt is being stopped: job.hung_ranks named, job.stacks kept
    job: RunningAttempt
    idle_s: float | None


class StragglerChanged(NamedTuple):
    job: RunningAttempt
    change: StragglerChange


class PassAbsorbed(NamedTuple):
    result: PassResult
    committed: CheckpointInfo | None  # a new commit since the last pass


class Quarantined(NamedTuple):
    path: str
    reason: str


class Finished(NamedTuple):  # the run ended: completed, stopped or failed (gave up)
    state: State
    reason: str
    attempt: int
    save_failed: bool = False  # stopped, but the stopped attempt did not end cleanly: its emergency save failed


class StatusChanged(NamedTuple):  # write state.json (beat: a heartbeat's change, which may be held back a moment)
    status: Status
    beat: bool = False


class Alarm(NamedTuple):  # for a person while the run goes on: `crash_loop` (Core), the divergence guard's words
    kind: str
    reason: str
    fields: Mapping[str, Any] | None = None


class AlertSent(NamedTuple):  # an alert's delivery ended (daemon/alerts.py): {channel: error or None}
    kind: str
    outcome: Mapping[str, str | None]
    warn: bool = False  # a channel failed that worked before (or was not tried): said once until it works again


Event = (SupervisorStarted | AttemptStarted | BeatRead | AttemptExited | HangRecorded | StragglerChanged | PassAbsorbed
         | Quarantined | Finished | StatusChanged | Alarm | AlertSent)
Subscriber = Callable[[Event], None]


class Bus(list[Subscriber]):
    """The subscribers, in the order they subscribed (`append`); `publish` gives each event to every one."""

    def publish(self, event: Event) -> None:
        for subscriber in self:
            subscriber(event)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def to_log(log: Log) -> Subscriber:
    """The structured log's lines for the events it says (heartbeats and status writes it does not)."""

    def say(ev: Event) -> None:
        if isinstance(ev, AttemptStarted):
            job = ev.job
            log.info("job_started", attempt=job.number, pid=job.pid, resumed_from=job.resumed_from,
                     resumed_step=job.resumed_step, argv=redact_argv(ev.argv), env=redact_env(ev.env),
                     log=str(job.log_path), **({"skipped": list(ev.skipped)} if ev.skipped else {}))
        elif isinstance(ev, AttemptExited):
            job, info = ev.job, ev.info
            log.info("job_exited", attempt=job.number, code=info.code, signal=info.signal, reason=info.reason,
                     detail=info.detail, duration_s=round(ev.attempt.duration, 3), max_step=job.max_step,
                     latest_checkpoint_step=ev.latest_step, progressed=ev.attempt.progressed,
                     last_output=info.last_output,
                     **({"hung_ranks": [r for r, _ in job.hung_ranks]} if job.hung_ranks else {}))
        elif isinstance(ev, StragglerChanged):
            c = ev.change
            (log.warning if c.flagged else log.info)("straggler_detected" if c.flagged else "straggler_cleared",
                                                     attempt=ev.job.number, rank=c.rank, step_s=_round(c.step_s),
                                                     others_s=_round(c.others_s))
        elif isinstance(ev, PassAbsorbed) and ev.committed is not None:
            log.info("checkpoint_committed", path=str(ev.committed.path), step=ev.committed.step,
                     size_bytes=ev.committed.size_bytes)
        elif isinstance(ev, Quarantined):
            log.error("quarantined", path=ev.path, reason=ev.reason)
        elif isinstance(ev, Finished):  # the run's attempts, earlier sessions' too
            if ev.state is State.FAILED:
                log.error("gave_up", reason=ev.reason, attempts=ev.attempt)
            elif ev.state is State.COMPLETED:
                log.info("completed", attempts=ev.attempt)
            else:
                log.info("stopped", attempt=ev.attempt, reason=ev.reason, emergency_save_failed=ev.save_failed)
        elif isinstance(ev, Alarm):  # crash_loop; the divergence guard's diverged (an error) and rolled_back
            (log.error if ev.kind == "diverged" else log.warning)(ev.kind, reason=ev.reason, **(ev.fields or {}))
        elif isinstance(ev, AlertSent) and ev.warn:
            log.warning("alert_failed", alert=ev.kind, errors={k: v for k, v in ev.outcome.items() if v},
                        effect="the run goes on; every alert's outcome is in history.jsonl")

    return say
