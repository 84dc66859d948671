"""policy/stopsave.py: a graceful stop's emergency checkpoint judged from the last beat and the root (issue 35 item 9)."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest

from supervisor.contract import Beat, Phase
from supervisor.policy.attempt import RunningAttempt
from supervisor.policy.state import ExitInfo, ExitReason
from supervisor.policy.stopsave import emergency_save_failure

FULL = "checkpoint disk full: 10 bytes free, a checkpoint takes 2000"


def job(phase: Phase | None, step: int = 8, *, code: int = 1, detail: str | None = None,
        hang: bool = False) -> RunningAttempt:
    j = RunningAttempt(number=1, pid=1, started_mono=0, resumed_from=None, resumed_step=None, error_file=Path("e"),
            log_path=Path("l"), oom_before=None, stopping=True, hang=hang)
    j.beat = None if phase is None else Beat(step=step, phase=phase)
    j.end(code, ExitInfo(code=None, signal=None, reason=ExitReason.STOPPED, at=0, detail=detail), 1.0)
    return j


@pytest.mark.parametrize(("j", "latest", "note", "expected"), [
    (job(Phase.SAVE), 5, FULL, f"the emergency checkpoint of step 8 was not written ({FULL}); the newest checkpoint is"),
    (job(Phase.SAVE), None, None, "step 8 was not written (the job exited with 1 while saving); the newest checkpoint"),
    (job(Phase.SAVE, detail="OSError: [Errno 28] No space left"), 5, None, "(OSError: [Errno 28] No space left)"),
    (job(Phase.SAVE, code=-signal.SIGKILL), 5, FULL, "killed while saving: stop_timeout_s = 120 s ran out"),
    (job(Phase.SAVE), 8, FULL, None),  # it landed (the disk is full after it)
    (job(Phase.SAVE), 10, None, None),  # a later one (the local tier's, or an async save that caught up)
    (job(Phase.TRAIN), 5, FULL, None),  # it did not save on the stop: nothing to judge
    (job(None), None, FULL, None),  # no heartbeat: not known, not claimed
    (job(Phase.SAVE, hang=True), 5, FULL, None),  # a hang's kill is no graceful stop
])
def test_judged(j: RunningAttempt, latest: int | None, note: str | None, expected: str | None) -> None:
    got = emergency_save_failure(j, latest_step=latest, disk_note=note, grace_s=120)
    assert (got is None) if expected is None else (got is not None and expected in got), got
