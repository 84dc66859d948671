"""What the next attempt is told to load, and whether it may start from scratch (pure: no I/O).

The placeholders, the choice and the refusal of a silent fresh start: docs/operations.md, 'What happens when
things go wrong'; why, and a job that picks its own checkpoint: docs/design.md, 'Notes for maintainers'.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from supervisor.checkpoints import COMPLETE, CORRUPT, FOREIGN, INVALID, TORN, CheckpointInfo
from supervisor.checkpoints.naming import is_temporary
from supervisor.config import CHECKPOINT_PLACEHOLDER, STEP_PLACEHOLDER

__all__ = ["Launch", "Refuse", "plan_resume", "chooses_itself", "passed_over"]

_SHOWN = 3  # dirs named in a refusal; the rest are counted


@dataclass(frozen=True)
class Launch:
    """Launch with `args` appended; `checkpoint` is what the job is told to load (None: fresh, or its own pick)."""

    checkpoint: CheckpointInfo | None
    args: list[str]


@dataclass(frozen=True)
class Refuse:
    """Do not launch: `reason` is one line naming the dirs and what to do."""

    reason: str


def chooses_itself(resume_args: Sequence[str]) -> bool:
    """True when `resume_args` names no checkpoint: the job decides what to load."""
    return not any(CHECKPOINT_PLACEHOLDER in a or STEP_PLACEHOLDER in a for a in resume_args)


def _fill(resume_args: Sequence[str], c: CheckpointInfo) -> list[str]:
    return [a.replace(CHECKPOINT_PLACEHOLDER, str(c.path)).replace(STEP_PLACEHOLDER, str(c.step)) for a in resume_args]


def _blocking(c: CheckpointInfo, skip: Collection[str]) -> str | None:
    """Why `c` forbids a fresh start, or None when it is no checkpoint worth keeping (a partial save)."""
    if is_temporary(c.name):
        return None
    if c.state == COMPLETE:
        return "quarantined" if c.quarantined or str(c.path) in skip else None
    if c.state in (TORN, INVALID, CORRUPT):
        return f"{c.state}: {c.reason}" if c.reason else c.state
    return None


def plan_resume(checkpoints: Sequence[CheckpointInfo], *, resume_args: Sequence[str], allow_fresh_start: bool,
                skip: Collection[str] = (), checks_loads: bool = False) -> Launch | Refuse:
    """Launch (with what appended) or refuse, from a scan of the root (newest first). A job that picks its own
    checkpoint (the newest, markers unread) is refused when that is a corrupt one, unless it said `checks_loads`
    (the trainer library's `--resume auto` skips it, its load checks)."""
    usable = [c for c in checkpoints if c.complete and not c.quarantined and str(c.path) not in skip]
    rotten = next((c for c in checkpoints if c.state == CORRUPT), None)
    if rotten and chooses_itself(resume_args) and not checks_loads and (
            not usable or checkpoints.index(rotten) < checkpoints.index(usable[0])):
        return Refuse(f"the job picks its own checkpoint and would load {rotten.path}, corrupt: {rotten.reason}; "
                      f"move it aside (it was not deleted), or pass {CHECKPOINT_PLACEHOLDER} in resume_args")
    if usable and resume_args:
        c = usable[0]
        if chooses_itself(resume_args):
            return Launch(None, list(resume_args))
        if c.step is None and any(STEP_PLACEHOLDER in a for a in resume_args):
            return Refuse(f"{c.path} has no step (none in its name or manifest), but resume_args pass {STEP_PLACEHOLDER}: "
                          f"rename it to end in its step, or use {CHECKPOINT_PLACEHOLDER}")
        return Launch(c, _fill(resume_args, c))
    if usable or not resume_args or allow_fresh_start:
        return Launch(None, [])
    blocking = [(c, why) for c in checkpoints if (why := _blocking(c, skip)) is not None]
    if not blocking:
        return Launch(None, [])
    shown = "; ".join(f"{c.path} is {why}" for c, why in blocking[:_SHOWN])
    if len(blocking) > _SHOWN:
        shown += f" (+{len(blocking) - _SHOWN} more)"
    every = "every complete checkpoint is quarantined: " if all(why == "quarantined" for _, why in blocking) else ""
    return Refuse(f"not starting from scratch: no usable checkpoint to resume from, and {every}{shown}; fix, "
                  "unquarantine or move them away, or set [checkpoints] allow_fresh_start = true")


def passed_over(checkpoints: Sequence[CheckpointInfo], chosen: CheckpointInfo) -> list[str]:
    """The dirs newer than `chosen` that a resume skips (torn, partial, corrupt, quarantined), each with why."""
    newer = checkpoints[:checkpoints.index(chosen)] if chosen in checkpoints else []
    newer = [c for c in newer if not is_temporary(c.name) and c.state != FOREIGN]  # not a save, or one in flight
    return [f"{c.path}: {'quarantined' if c.complete else c.state}{f' ({c.reason})' if c.reason else ''}" for c in newer]
