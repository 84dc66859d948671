"""PyTorch Lightning's sharded checkpoints beyond DCP (clients.LIGHTNING): `meta.pt`, `last*.ckpt`, its top-k.

`epoch=E-step=S.ckpt/` is a DCP dir, then `meta.pt` (`torch.save` on rank 0: `global_step`, callbacks' state), read
through torchzip.py's code-free pickle walk; `last*.ckpt` is a copy of or a link to the newest save (docs/clients.md).
"""
from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from supervisor.checkpoints import torchzip

if TYPE_CHECKING:
    from supervisor.checkpoints.ranking import CheckpointInfo

__all__ = ["META_NAME", "NAMES", "STEP", "LAST", "POINTER_HOLD", "KEEPS_ADVICE", "UNFINISHED_ALIAS", "meta_whole",
           "meta_step", "held_by_lightning", "keeps"]

META_NAME = "meta.pt"  # lightning.fabric.strategies.fsdp._METADATA_FILENAME
NAMES = re.compile(r".*\.ckpt", re.DOTALL)  # ModelCheckpoint.FILE_EXTENSION: `epoch=0-step=10.ckpt`, `last.ckpt`
STEP = re.compile(r"(?:^|[-_.])step=(\d+)")  # the `{step}` of its default `{epoch}-{step}` name (not the epoch)
LAST = re.compile(r"last.*\.ckpt", re.DOTALL)  # ModelCheckpoint._find_last_checkpoints: ^last(-\d+)? ... .ckpt
_STATE_KEYS = ("best_k_models", "best_model_path", "last_model_path")
# What retention says when its keep rules delete a save whose top-k state could not be read, and before a launch
# whose job loads the newest last*.ckpt itself when that one is not complete (clients.LIGHTNING).
KEEPS_ADVICE = ("which Lightning's ModelCheckpoint may still count in its top-k: its state could not be read ({why}). "
                "Set keep_last = 0 to leave the rotation to save_top_k, or keep_last above save_top_k")
UNFINISHED_ALIAS = ("lightning_last_unfinished",
                    ('{name} is {state} ({reason}): Lightning\'s ckpt_path="last" loads it and will fail at every start '
                     "(with save_last=True it is rewritten in place after each save; a kill then tears it); {fallback}; "
                     'save_last="link" leaves no such window'),
                    ("the newest complete save is {newest}: replace {name} by a copy of it (cp -r), or resume with "
                     'resume_args = ["--ckpt-path", "{{checkpoint}}"]'))
POINTER_HOLD = ('Lightning\'s resume pointer: trainer.fit(ckpt_path="last") loads the newest last*.ckpt '
                "(ModelCheckpoint rewrites it at every save)")


def meta_whole(path: Path, size: int) -> tuple[bool, str] | None:
    """torch.save writes the zip's directory last: a `meta.pt` without one was cut while being written."""
    why = torchzip.zip_problem(path)
    return None if why is None else (False, f"{META_NAME} is not whole ({why}): the save did not finish")


def _meta(directory: Path) -> tuple[dict[str, Any] | None, str | None]:
    root, why = torchzip.read_pickle(directory / META_NAME)
    if why is not None:
        return None, f"{directory.name}/{META_NAME}: {why}"
    if type(root) is not dict:
        return None, f"{directory.name}/{META_NAME} does not hold a dict"
    return root, None


def meta_step(directory: Path) -> int | None:
    """`global_step` in the dir's `meta.pt` (a copied `last.ckpt` has no step in its name), or None."""
    meta, _ = _meta(directory)
    step = meta.get("global_step") if meta else None
    return step if type(step) is int and step >= 0 else None


def _names_in(state: dict[str, Any], root: Path) -> set[str]:
    """The checkpoint names one ModelCheckpoint's state keeps, those that live in `root`."""
    paths: list[Any] = []
    for key in _STATE_KEYS:
        value = state.get(key)
        paths += list(value) if type(value) is dict else [value]
    roots = {os.path.abspath(root), os.path.realpath(root)}
    return {os.path.basename(p) for p in paths if type(p) is str and p and os.path.dirname(p) in roots}


def held_by_lightning(root: Path, newest_meta: Path) -> tuple[set[str], str | None]:
    """(names in `root` that Lightning's ModelCheckpoint callbacks keep, None), read from the newest save's
    `meta.pt` (`newest_meta`, a checkpoint dir); or (empty, why) when that state cannot be read safely."""
    meta, why = _meta(newest_meta)
    if meta is None:
        return set(), why
    callbacks = meta.get("callbacks")
    if type(callbacks) is not dict:
        return set(), f"{newest_meta.name}/{META_NAME} has no callbacks state"
    held: set[str] = set()
    for state in callbacks.values():  # keyed by the callback's class name and settings: subclasses too
        if type(state) is dict and "best_k_models" in state:
            held |= _names_in(state, root)
    return held, None


def _mtime(path: Path) -> float:
    try:
        return os.lstat(path).st_mtime
    except OSError:
        return 0.0


def keeps(root: Path, infos: Sequence[CheckpointInfo]) -> tuple[dict[str, str], dict[str, str]]:
    """(what its ModelCheckpoint keeps in its top-k, read from the newest `meta.pt`; why that could not be read, for
    each complete save of Lightning's that the keep rules may then delete)."""
    saves = [c for c in infos if c.complete and NAMES.fullmatch(c.name) and not c.path.is_symlink()]
    if not saves:
        return {}, {}
    newest = max(saves, key=lambda c: _mtime(c.path / META_NAME))
    held, unknown = held_by_lightning(root, newest.path)
    why = f"kept by Lightning's ModelCheckpoint (its top-k, as {newest.name}/meta.pt says)"
    return dict.fromkeys(held, why), ({c.name: unknown for c in saves} if unknown else {})
