"""What a checkpoint dir's name says: its step, and whether it is an in-flight temporary."""
from __future__ import annotations

import re

from supervisor.layout import TMP_PREFIX

__all__ = ["name_step", "is_temporary"]

# step_120, step-120, epoch_12, ckpt_000120, global_step120: the trailing integer is the step.
_TRAILING_INT = re.compile(r"(\d+)$")


def is_temporary(name: str) -> bool:
    """True for the trainer's `.tmp-...` save-in-flight names: never complete, whatever they hold."""
    return name.startswith(TMP_PREFIX)


def name_step(name: str) -> int | None:
    """The step encoded in a dir name, or None; a temporary name's `-<nonce>` suffix is ignored."""
    if is_temporary(name):
        name = name[len(TMP_PREFIX):].rpartition("-")[0]
    match = _TRAILING_INT.search(name)
    return int(match.group(1)) if match else None
