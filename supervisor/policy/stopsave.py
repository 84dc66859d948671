"""Did a graceful stop's emergency checkpoint land? (pure)

The rule and why `run` still exits 0: docs/operations.md, 'Exit codes'. The heartbeat decides, not the exit:
torchrun ends a stop it relayed with exit 1 and `SignalException` whether or not its workers' save worked.
"""
from __future__ import annotations

import signal

from supervisor.contract import Phase
from supervisor.policy.attempt import RunningAttempt

__all__ = ["emergency_save_failure"]


def emergency_save_failure(job: RunningAttempt, *, latest_step: int | None, disk_note: str | None,
                           grace_s: float) -> str | None:
    """Why the stopped `job`'s emergency checkpoint was not written, or None (written, or nothing to judge)."""
    beat = job.beat
    if job.hang or beat is None or beat.phase != Phase.SAVE or (latest_step is not None and latest_step >= beat.step):
        return None
    if job.returncode == -signal.SIGKILL:
        why = f"the job was killed while saving: stop_timeout_s = {grace_s:g} s ran out, or the stop was forced"
    elif disk_note:
        why = disk_note
    elif job.info is not None and job.info.detail:
        why = job.info.detail
    else:
        why = f"the job exited with {job.returncode} while saving"
    newest = "none" if latest_step is None else f"step {latest_step}"
    return f"the emergency checkpoint of step {beat.step} was not written ({why}); the newest checkpoint is {newest}"
