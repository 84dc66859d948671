"""What a checkpoint dir's name says: its step or save ordinal, whether it is a temporary, a checkpoint name.

The names the store knows (docs/checkpoints.md, "Layouts"):
- `step_120`, `step-120`, `epoch_12`, `ckpt_000120`, `global_step120`, `iter_0000120`, `checkpoint-500`
  (also after a prefix: `run1_step_120`), or a bare `1500`: the trailing integer is the step (the reference
  trainer's `step_<N>`, torchtitan's `step-<N>`, most user scripts). A number after any other word
  (`backup-20241203`) is not a step;
- `epoch=1-step=500.ckpt` (Lightning, also with a `-v1` suffix): the step is the number after `step=`,
  not the epoch; only in a name ending in `.ckpt` (Lightning's `FILE_EXTENSION`): `epoch=1-step=500.ckpt.bak`
  is someone's copy, and carries no step (ranking.py then finds it a copy);
- `checkpoint_3` (Accelerate's automatic naming): 3 is a *save ordinal*, not a training step. It ranks
  the folder among its siblings; the step, when known, comes from the folder's contents.
"""
from __future__ import annotations

import re

from supervisor.layout import TMP_PREFIX

__all__ = ["name_step", "name_ordinal", "is_temporary", "is_checkpoint_name", "embedded_steps"]

# The step is a trailing integer that follows a checkpoint word (optionally after a prefix: `run1_step_120`), or
# the whole name (`1500/`). Any other trailing number (`backup-20241203`, `llama2-7b-v2`) is no step: a dated
# copy would otherwise outrank the whole run, be resumed from, and make keep_last delete the real newest.
_TRAILING_STEP = re.compile(
    r"(?:^|.*[-_.])?(?:step|epoch|ckpt|checkpoint|global_step|iter|iteration)[-_]?(\d+)|(\d+)", re.IGNORECASE)
_LIGHTNING_STEP = re.compile(r"(?:^|[-_.])step=(\d+)")
_ORDINAL = re.compile(r"checkpoint_(\d+)")
# Names a training program gives a checkpoint dir; a folder holding dirs named like this is a checkpoint
# *directory*, not one checkpoint (see shapes.py). Deliberately narrow: Accelerate's members
# (`pytorch_model_fsdp_0`, `optimizer_0`) end in digits too and must not match.
_CHECKPOINT_NAME = re.compile(
    r"(?:step|epoch|ckpt|checkpoint|global_step|iter|iteration)[-_]?\d+|.*(?:^|[-_.])step=\d+.*", re.IGNORECASE)
# A checkpoint name inside a longer one (`step_00000030.bak`, `step_30_backup`, `old-step-30`): how users name a copy.
_EMBEDDED_STEP = re.compile(r"(?<![a-z])(?:step|epoch|ckpt|checkpoint|global_step|iter|iteration)[-_=]?(\d+)(?!\d)",
                            re.IGNORECASE)


def is_temporary(name: str) -> bool:
    """True for the trainer's `.tmp-...` save-in-flight names: never complete, whatever they hold."""
    return name.startswith(TMP_PREFIX)


def name_ordinal(name: str) -> int | None:
    """The save ordinal of an Accelerate `checkpoint_<N>` name, or None for every other name."""
    match = _ORDINAL.fullmatch(name)
    return int(match.group(1)) if match else None


def name_step(name: str) -> int | None:
    """The training step a dir name encodes, or None (no number, or an ordinal `checkpoint_<N>`).

    A temporary name's `-<nonce>` suffix is ignored.
    """
    if is_temporary(name):
        name = name[len(TMP_PREFIX):].rpartition("-")[0]
    if name_ordinal(name) is not None:
        return None
    lightning = _LIGHTNING_STEP.search(name) if name.endswith(".ckpt") else None
    if lightning:
        return int(lightning.group(1))
    match = _TRAILING_STEP.fullmatch(name)
    return int(match.group(1) or match.group(2)) if match else None


def embedded_steps(name: str) -> set[int]:
    """The steps of the checkpoint names a name contains, wherever they are in it (`step_00000030.bak`: {30})."""
    return {int(m) for m in _EMBEDDED_STEP.findall(name)}


def is_checkpoint_name(name: str) -> bool:
    """Is this a name training programs give one checkpoint (`step-10`, `checkpoint_3`, `epoch=1-step=9.ckpt`)?"""
    return _CHECKPOINT_NAME.fullmatch(name) is not None
