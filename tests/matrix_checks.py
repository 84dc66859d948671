"""The invariants every matrix cell (and chaos run) is checked against after it ended, as code.

- Never a silent fresh start: each attempt's `resumed_from` (history.jsonl) is the newest complete checkpoint
  the root held when it was launched (the monitor's timeline), whenever the root held one; its argv
  (`job_started` in supervisor.log) passed it, and the trainer's own log says it loaded that step.
- Only ours: whatever retention deleted was a checkpoint directly under the resolved root (never a copy, a
  foreign entry or anything outside), and every file recorded as not the run's is still there, unchanged.
"""
from __future__ import annotations

import bisect
import json
import re
from pathlib import Path
from typing import Any

from supervisor.checkpoints import newest_complete
from supervisor.checkpoints.naming import name_step
from tests.chaos import STEPS, ChaosRun, Reference, assert_same_weights, export_weights
from tests.chaos_faults import PLANTED, assert_no_incomplete_final_dirs
from tests.helpers import assert_no_orphans

__all__ = ["OURS", "history", "resume_violations", "deletion_violations", "assert_promises_kept"]

OURS = re.compile(rf"step_\d{{8}}|{PLANTED}")  # the trainer's names, and the old checkpoint a fault plants
_RESUMING = re.compile(r"event=resuming rank=0 path=(\S+) step=(\d+)")


def history(run_dir: Path) -> list[dict[str, Any]]:
    """history.jsonl's records (a last line cut by a SIGKILLed supervisor is skipped, as readers do)."""
    records = []
    for line in (run_dir / "history.jsonl").read_text(errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def _root_at(timeline: list[tuple[float, int | None]], t: float) -> tuple[bool, int | None]:
    """(seen, newest complete step) at the monitor's first look that began at or after `t`."""
    i = bisect.bisect_left(timeline, t, key=lambda sample: sample[0])
    return (True, timeline[i][1]) if i < len(timeline) else (False, None)


def _attempt_log(run_dir: Path, attempt: int) -> str:
    logs = sorted((run_dir / "logs").glob(f"attempt-{attempt:04d}.log*"), reverse=True)  # `.log.1` first: older
    return "".join(p.read_text(errors="replace") for p in logs)


def resume_violations(c: ChaosRun) -> list[str]:
    """Attempts launched without the checkpoint the root held, or not handed it (argv), or not loading it."""
    found = []
    started = {e["attempt"]: e for e in c.dirs.events("job_started")}
    for rec in (r for r in history(c.dirs.run_dir) if r.get("kind") == "attempt_start"):
        n, got, got_step = rec["attempt"], rec["resumed_from"], rec["resumed_step"]
        seen, newest = _root_at(c.monitor.timeline, rec["t"])
        if not seen:
            found.append(f"attempt {n}: the monitor never looked at the root after its launch")
        elif newest is not None and got is None:
            found.append(f"attempt {n}: a fresh start while the root held step {newest} (silent fresh start)")
        elif got_step != newest:
            found.append(f"attempt {n}: resumed from {got} while the newest complete checkpoint was step {newest}")
        if got is not None and Path(got).parent != c.dirs.root:
            found.append(f"attempt {n}: resumed from {got}, not under the resolved root {c.dirs.root}")
        argv = (started.get(n) or {}).get("argv") or []
        if (argv[-2:] == ["--resume", got]) != (got is not None) or (got is None and "--resume" in argv):
            found.append(f"attempt {n}: argv {argv[-3:]} does not pass resumed_from {got}")
        loaded = _RESUMING.findall(_attempt_log(c.dirs.run_dir, n))
        if loaded != ([(got, str(got_step))] if got is not None else []):
            found.append(f"attempt {n}: the trainer said it resumed from {loaded}, the supervisor passed {got}")
    return found


def deletion_violations(c: ChaosRun, ours: re.Pattern[str] = OURS) -> list[str]:
    """Deletions of anything but a checkpoint of the run directly under the resolved root (names like `ours`)."""
    found = []
    for e in c.dirs.events("retention_deleted"):
        path = Path(e["path"])
        if path.parent != c.dirs.root or not ours.fullmatch(path.name) or name_step(path.name) is None:
            found.append(f"retention deleted {path} ({e.get('reason')}): not a checkpoint of the run")
    return found


def assert_promises_kept(c: ChaosRun, rc: int, out: str, *, attempts: int, ref: Reference, context: str) -> None:
    """The end of a chaos run or matrix cell: completed in exactly `attempts` attempts, no monitor violation,
    every launch resumed right, only the run's checkpoints deleted, no process left, bit-identical weights."""
    assert rc == 0, out
    st = c.dirs.state()
    assert st["state"] == "completed" and st["attempt"] == attempts, (st, c.notes)
    assert c.monitor.violations == [] and c.monitor.max_jobs == 1, c.monitor.violations
    assert resume_violations(c) == []
    assert deletion_violations(c) == []
    assert_no_orphans(c.supervisors.tag)
    c.torn.clear()
    assert_no_incomplete_final_dirs(c)
    final = newest_complete(c.dirs.root)
    assert final is not None and final.step == STEPS
    assert_same_weights(export_weights(final.path, c.dirs.base / "out.pt"), ref.weights, context)
