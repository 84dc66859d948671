"""An attempt's files in the run dir: made ready before the launch, its output log bounded while it runs.

Before a launch the attempt's error and hand-off files and the stale heartbeats are cleared (a stale beat is no
progress; a hand-off file planted by an earlier attempt would hide the agent's), old attempts' logs are pruned
and the attempt's log is created; while it runs, the log is bounded off the loop (supervisor/host/joblog.py).
Every write here can fail on a full, read-only or vanishing file system: each failure is logged and survived (the
job matters more).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from supervisor.config import Config
from supervisor.daemon.system import System
from supervisor.host import joblog
from supervisor.host.log import Log
from supervisor.policy.attempt import RunningAttempt

__all__ = ["AttemptFiles", "try_write"]


def try_write(log: Log, what: str, action: Callable[[], object]) -> bool:
    """Run one run-dir file operation; a failure is logged, never raised."""
    try:
        action()
        return True
    except OSError as exc:
        log.warning("run_dir_write_failed", what=what, error=f"{exc.strerror or exc}",
                    path=str(getattr(exc, "filename", None) or ""))
        return False


class AttemptFiles:
    def __init__(self, cfg: Config, system: System, log: Log) -> None:
        self.cfg, self.sys, self.log = cfg, system, log

    def prepare(self, error_file: Path, log_path: Path, heartbeats: list[tuple[str, Callable[[], object]]]) -> Path | None:
        """Clear the error file and the heartbeats (`heartbeats`: what to clear, how), prune old logs, create the
        attempt's log; the log, or None when it cannot be made (the job's output then goes to the supervisor's)."""
        try_write(self.log, "errors dir", lambda: error_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True))
        try_write(self.log, "error file", lambda: error_file.unlink(missing_ok=True))
        try_write(self.log, "hand-off file", lambda: log_path.with_suffix(joblog.HANDOFF_SUFFIX).unlink(missing_ok=True))
        for what, clear in heartbeats:
            try_write(self.log, what, clear)
        kept = self.cfg.supervisor.job_logs_kept - 1  # this attempt's files are about to be the newest
        try_write(self.log, "old attempt logs",
                  lambda: joblog.prune([log_path.parent, error_file.parent], max(kept, 0), None))

        def create_log() -> None:
            log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.close(joblog.open_log(log_path))

        made = try_write(self.log, "attempt log (the job's output goes to the supervisor's)", create_log)
        return log_path if made else None

    def bound(self, job: RunningAttempt | None) -> None:
        """Keep the running attempt's log under `job_log_max_bytes`; called every tick.

        The copy into the `.1` segment runs off the loop (it is up to half the cap of file I/O), one at a time.
        """
        if job is None or job.rotating:
            return
        cap = self.cfg.supervisor.job_log_max_bytes
        try:
            due = joblog.needs_rotation(os.stat(job.log_path).st_size, cap)
        except OSError:  # no log this attempt (the job writes to the supervisor's output), or it vanished
            return
        if due:
            job.rotating = True
            self.sys.run_off_loop(lambda: joblog.rotate(job.log_path, cap), lambda out: self._on_rotated(job, out))

    def _on_rotated(self, job: RunningAttempt, outcome: OSError | BaseException | None) -> None:
        """A rotation finished: a failure to write the segment (a full disk) is said once per attempt."""
        job.rotating = False
        if outcome is not None and not job.log_warned:
            job.log_warned = True
            error = outcome.strerror if isinstance(outcome, OSError) and outcome.strerror else str(outcome)
            self.log.warning("run_dir_write_failed", what="attempt log segment", error=error, path=str(job.log_path))
