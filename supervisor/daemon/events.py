"""The run's events, each said once to both of its sinks: the structured log and `history.jsonl`.

Core calls one method per event; what goes to which sink, and in what order, lives here. (state.json is not an
event sink: it is a snapshot of `Status` that Core publishes after a change, daemon/publisher.py.)
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from supervisor.checkpoints import CheckpointInfo
from supervisor.daemon.housekeeping import PassResult
from supervisor.daemon.recorder import NullHistory
from supervisor.observe.redact import redact_argv, redact_env
from supervisor.policy.attempt import Job
from supervisor.policy.divergence import Diverged
from supervisor.policy.ranks import StragglerChange
from supervisor.policy.restarts import Attempt
from supervisor.policy.state import ExitInfo

__all__ = ["Events"]


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


class Events:
    def __init__(self, log: Any, history: NullHistory) -> None:
        self.log, self.history = log, history

    def attempt_started(self, job: Job, argv: Sequence[str], env: Mapping[str, str]) -> None:
        self.log.info(
            "job_started", attempt=job.number, pid=job.pid, resumed_from=job.resumed_from,
            resumed_step=job.resumed_step, argv=redact_argv(argv), env=redact_env(env), log=str(job.log_path),
        )
        self.history.attempt_start(job.number, job.resumed_from, job.resumed_step)

    def attempt_exited(self, job: Job, attempt: Attempt, info: ExitInfo, *, latest_step: int | None) -> None:
        self.history.attempt_exit(attempt, info, progress_at=job.progress_at, detected_at=job.detected_at,
                                  hung_ranks=job.hung_ranks, reached_by=job.reached_by)
        self.log.info(
            "job_exited", attempt=job.number, code=info.code, signal=info.signal, reason=info.reason,
            detail=info.detail, duration_s=round(attempt.duration, 3), max_step=job.max_step,
            latest_checkpoint_step=latest_step, progressed=attempt.progressed,
            last_output=info.last_output,
            **({"hung_ranks": [r for r, _ in job.hung_ranks]} if job.hung_ranks else {}),
        )

    def hang(self, job: Job, *, idle_s: float | None) -> None:
        """The hung attempt's record: when it was seen, the ranks named, where its stack dumps are."""
        assert job.detected_at is not None
        self.history.hang(job.number, at=job.detected_at, step=job.max_step, idle_s=idle_s, ranks=job.hung_ranks,
                          stacks=job.stacks)

    def straggler(self, job: Job, change: StragglerChange) -> None:
        self.history.straggler(job.number, change)
        fields = {"attempt": job.number, "rank": change.rank, "step_s": _round(change.step_s),
                  "others_s": _round(change.others_s)}
        if change.flagged:
            self.log.warning("straggler_detected", **fields)
        else:
            self.log.info("straggler_cleared", **fields)

    def pass_done(self, result: PassResult, committed: CheckpointInfo | None) -> None:
        self.history.housekeeping(result, committed)
        if committed is not None:
            self.log.info("checkpoint_committed", path=str(committed.path), step=committed.step,
                          size_bytes=committed.size_bytes)

    def quarantined(self, path: str, reason: str) -> None:
        self.history.quarantined(path, reason)
        self.log.error("quarantined", path=path, reason=reason)

    def diverged(self, attempt: int, found: Diverged, action: str) -> None:
        fields = {"attempt": attempt, "onset_step": found.onset_step, "step": found.step, "rank": found.rank,
                  "loss": found.loss, "why": found.why, "level": _round(found.level), "action": action}
        self.history.divergence("diverged", fields)
        self.log.error("diverged", **fields)

    def rolled_back(self, attempt: int, from_step: int, to: CheckpointInfo | None, skip: int) -> None:
        fields = {"attempt": attempt, "from_step": from_step, "to_checkpoint": str(to.path) if to else None,
                  "to_step": to.step if to else None, "skip": skip}
        self.history.divergence("rolled_back", fields)
        self.log.warning("rolled_back", **fields)
