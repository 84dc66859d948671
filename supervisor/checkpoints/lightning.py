"""What PyTorch Lightning's sharded checkpoints need beyond DCP: `meta.pt`, `last*.ckpt`, ModelCheckpoint's top-k.

Lightning 2.6 (`FSDPStrategy(state_dict_type="sharded")`, `FSDPStrategy.save_checkpoint`) saves
`<dirpath>/epoch=E-step=S.ckpt/` as a DCP dir (model and optimizers) and then, on rank 0, `meta.pt`:
everything else (`global_step`, `epoch`, loops, callbacks' state) by `torch.save`. Its loader refuses a dir
without `meta.pt` ("does not point to a valid checkpoint"), so:

- **complete** means the DCP files are complete *and* `meta.pt` is a regular, whole torch.save zip
  (`meta_problem`; torchzip.py checks the structure without unpickling). A `.ckpt` dir without it is a save
  cut short; any other DCP dir (a Fabric save, a user's name) is checked only when it has one.
- **`last*.ckpt`** is `ModelCheckpoint(save_last=...)`'s resume pointer: `trainer.fit(ckpt_path="last")` loads
  the most recently modified `last*.ckpt` (`ModelCheckpoint._find_last_checkpoints`), and starts from
  scratch, with a warning only, when there is none. With `save_last=True` it is a full copy of the newest
  save, rewritten in place at every save; with `save_last="link"` a symlink to it (`os.path.relpath`, so a
  plain name). Its step is `global_step` in its `meta.pt` (`meta_step`), or its link target's name.
- **top-k**: `ModelCheckpoint(save_top_k=k, monitor=...)` deletes what falls out of its top k itself, and
  keeps the rest. `held_by_lightning` reads which names it keeps (`best_k_models`, `best_model_path`,
  `last_model_path`) from the newest `meta.pt`, through the same code-free pickle walk.
"""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

from supervisor.checkpoints import torchzip

__all__ = ["META_NAME", "is_lightning_name", "is_last_name", "meta_problem", "meta_step", "link_target",
           "held_by_lightning", "POINTER_HOLD"]

META_NAME = "meta.pt"  # lightning.fabric.strategies.fsdp._METADATA_FILENAME
_LAST = re.compile(r"last.*\.ckpt", re.DOTALL)  # ModelCheckpoint._find_last_checkpoints: ^last(-\d+)? ... .ckpt
_STATE_KEYS = ("best_k_models", "best_model_path", "last_model_path")
POINTER_HOLD = ('Lightning\'s resume pointer: trainer.fit(ckpt_path="last") loads the newest last*.ckpt '
                "(ModelCheckpoint rewrites it at every save)")


def is_lightning_name(name: str) -> bool:
    """A name ModelCheckpoint gives (`epoch=0-step=10.ckpt`, `last.ckpt`): its checkpoints end in `.ckpt`."""
    return name.endswith(".ckpt")


def is_last_name(name: str) -> bool:
    """`last.ckpt`, `last-v1.ckpt`: what `ckpt_path="last"` looks for."""
    return _LAST.fullmatch(name) is not None


def meta_problem(directory: Path) -> tuple[bool, str] | None:
    """For a complete DCP dir: (invalid?, why) when Lightning's `meta.pt` is wanting, else None.

    A `.ckpt` dir without `meta.pt` was cut between its DCP files and `meta.pt` (partial); a `meta.pt` that is
    not a whole zip was cut while being written (partial); a symlink or a special file is invalid.
    """
    path = directory / META_NAME
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not is_lightning_name(directory.name):
            return None
        return False, (f"no {META_NAME}: Lightning writes it last (rank 0, after the DCP files), so the save did "
                       "not finish")
    except OSError as exc:
        return True, f"{META_NAME} cannot be read: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return True, f"{META_NAME} is a symlink"
    if not stat.S_ISREG(st.st_mode):
        return True, f"{META_NAME} is not a regular file"
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


def link_target(link: Path) -> str | None:
    """The sibling a `last*.ckpt` symlink names (Lightning writes a relative plain name), or None when it points
    anywhere else: outside the root, through other folders, or at itself."""
    try:
        target = os.readlink(link)
    except OSError:
        return None
    name = os.path.basename(target)
    if target not in (name, str(link.parent / name)) or name in ("", ".", "..", link.name):
        return None
    return name


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
