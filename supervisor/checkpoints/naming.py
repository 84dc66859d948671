"""What a checkpoint dir's name says: its step or save ordinal, whether it is a temporary, a checkpoint name.

The naming rules (which trailing numbers are steps, a client's own names): docs/checkpoints.md, 'Layouts'; a
client's record (clients.py) overrides the generic rule.
"""
from __future__ import annotations

import re

from supervisor.checkpoints.clients import layout_of, name_ordinal
from supervisor.layout import TMP_PREFIX

__all__ = ["name_step", "name_ordinal", "is_temporary", "is_checkpoint_name", "embedded_steps"]

# The step is a trailing integer that follows a checkpoint word (optionally after a prefix: `run1_step_120`), or
# the whole name (`1500/`). Any other trailing number (`backup-20241203`, `llama2-7b-v2`) is no step: a dated
# copy would otherwise outrank the whole run, be resumed from, and make keep_last delete the real newest.
_WORD = r"(?:step|epoch|ckpt|checkpoint|global_step|iter|iteration)"  # what names a checkpoint
_TRAILING_STEP = re.compile(rf"(?:^|.*[-_.])?{_WORD}[-_]?(\d+)|(\d+)", re.IGNORECASE)
# Names a training program gives a checkpoint dir; a folder holding dirs named like this is a checkpoint
# *directory*, not one checkpoint (see shapes.py). Deliberately narrow: Accelerate's members
# (`pytorch_model_fsdp_0`, `optimizer_0`) end in digits too and must not match.
_CHECKPOINT_NAME = re.compile(rf"{_WORD}[-_]?\d+|.*(?:^|[-_.])step=\d+.*", re.IGNORECASE)
# A checkpoint name inside a longer one (`step_00000030.bak`, `step_30_backup`, `old-step-30`): how users name a copy.
_EMBEDDED_STEP = re.compile(rf"(?<![a-z]){_WORD}[-_=]?(\d+)(?!\d)", re.IGNORECASE)


def is_temporary(name: str) -> bool:
    """True for the trainer's `.tmp-...` save-in-flight names: never complete, whatever they hold."""
    return name.startswith(TMP_PREFIX)


def name_step(name: str) -> int | None:
    """The training step a dir name encodes, or None (no number, or an ordinal `checkpoint_<N>`).

    A temporary name's `-<nonce>` suffix is ignored.
    """
    if is_temporary(name):
        name = name[len(TMP_PREFIX):].rpartition("-")[0]
    layout = layout_of(name)
    if layout is not None and layout.ordinal:
        return None
    client = layout.step.search(name) if layout is not None and layout.step is not None else None
    if client:
        return int(client.group(1))
    match = _TRAILING_STEP.fullmatch(name)
    return int(match.group(1) or match.group(2)) if match else None


def embedded_steps(name: str) -> set[int]:
    """The steps of the checkpoint names a name contains, wherever they are in it (`step_00000030.bak`: {30})."""
    return {int(m) for m in _EMBEDDED_STEP.findall(name)}


def is_checkpoint_name(name: str) -> bool:
    """Is this a name training programs give one checkpoint (`step-10`, `checkpoint_3`, `epoch=1-step=9.ckpt`)?"""
    return _CHECKPOINT_NAME.fullmatch(name) is not None
