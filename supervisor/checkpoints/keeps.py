"""What the training program keeps itself, so that retention keeps it too: Lightning's `last*.ckpt` and its top-k,
transformers' best checkpoint.

ranking.scan() lists a root; `with_holds` then sets `CheckpointInfo.hold` on what the program still needs
(retention.py never deletes it) and `keeps_unknown` where Lightning's own keep list could not be read (retention
warns when its keep rules delete such a checkpoint). The layouts' facts are in lightning.py and hftrainer.py.
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from supervisor.checkpoints import hftrainer, lightning
from supervisor.checkpoints.completeness import FOREIGN

if TYPE_CHECKING:
    from supervisor.checkpoints.ranking import CheckpointInfo

__all__ = ["with_holds"]


def _mtime(path: Path) -> float:
    try:
        return os.lstat(path).st_mtime
    except OSError:
        return 0.0


def with_holds(root: Path, infos: list[CheckpointInfo]) -> list[CheckpointInfo]:
    """Mark what the training program itself still needs (retention.py never deletes it): Lightning's every
    `last*.ckpt` (what `ckpt_path="last"` loads), the checkpoint a `last*.ckpt` link names, and what its
    ModelCheckpoint keeps in its top-k, read from the newest `meta.pt`; transformers' `best_model_checkpoint`.
    When Lightning's state cannot be read, its complete checkpoints say why (`keeps_unknown`): retention then
    warns when its keep rules delete one."""
    holds: dict[str, str] = {}
    for c in infos:
        if lightning.is_last_name(c.name) and c.state != FOREIGN:
            holds[c.name] = lightning.POINTER_HOLD
            if c.alias_of is not None and c.path.is_symlink():
                holds.setdefault(c.alias_of, f"{c.name} links to it (Lightning's resume pointer)")
    trainer = [c for c in infos if c.complete and hftrainer.is_trainer_name(c.name)]
    best = hftrainer.held_by_trainer(root, max(trainer, key=lambda c: c.step or 0).path) if trainer else None
    if best is not None:
        holds[best] = "transformers' best_model_checkpoint (trainer_state.json): its own rotation keeps it too"
    saves = {c.name: c for c in infos if c.complete and lightning.is_lightning_name(c.name) and not c.path.is_symlink()}
    unknown = None
    if saves:
        newest = max(saves.values(), key=lambda c: _mtime(c.path / lightning.META_NAME))
        held, unknown = lightning.held_by_lightning(root, newest.path)
        for name in held:
            holds.setdefault(name, f"kept by Lightning's ModelCheckpoint (its top-k, as {newest.name}/meta.pt says)")
    return [replace(c, hold=holds.get(c.name), keeps_unknown=unknown if c.name in saves else None)
            if c.name in holds or (unknown and c.name in saves) else c for c in infos]
