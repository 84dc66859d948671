"""The clients' checkpoint layouts as data: one `Layout` record per training program, in `LAYOUTS`.

The store iterates the table instead of naming a client (the rules: docs/clients.md, docs/checkpoints.md); what a
client's files mean is in its own module (lightning.py, hftrainer.py).
"""
from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from supervisor.checkpoints import hftrainer, lightning
from supervisor.checkpoints._files import read_small_json

if TYPE_CHECKING:
    from supervisor.checkpoints.ranking import CheckpointInfo

__all__ = ["Layout", "LAYOUTS", "COMMIT_FILES", "WATCHED", "layout_of", "name_ordinal", "is_alias", "link_target",
           "commit_problem", "owns_files", "files_problem", "inner_step", "json_step", "with_holds"]

Problem = tuple[bool, str] | None  # (invalid?, why) when a save is wanting, else None
Keeps = Callable[[Path, "Sequence[CheckpointInfo]"], tuple[dict[str, str], dict[str, str]]]


@dataclass(frozen=True)
class Layout:
    """How one client names, commits, steps and keeps its checkpoints."""

    client: str
    names: re.Pattern[str]  # the names it gives one checkpoint (whole name)
    shapes: frozenset[str]  # the shapes its saves take (shapes.py: dcp, nested, files)
    step: re.Pattern[str] | None = None  # group 1: the step in its names (searched); else the trailing number
    ordinal: bool = False  # the name's number counts saves, not steps (Accelerate's `checkpoint_<N>`)
    commit: str | None = None  # the file it writes last, after the DCP dirs: a save without it is partial
    commit_anywhere: bool = False  # a dir of another name that has its commit file is judged by it too
    order: str = ""  # what it writes before the commit file (said when the commit file is missing)
    whole: Callable[[Path, int], Problem] | None = None  # (its commit file, size): why it is not whole
    sentinel: str | None = None  # present while a save is in flight: the save is partial
    step_inside: Callable[[Path], int | None] | None = None  # the step its files record (a name without one)
    marks: tuple[str, ...] = ()  # entries only it writes: a dir of its name is its save only with one of them
    torn: Callable[[Path], str | None] | None = None  # why such a save's files are not whole
    alias: re.Pattern[str] | None = None  # names of a copy of, or a link to, another save (its resume pointer)
    alias_hold: str = ""  # why retention keeps an alias
    keeps: Keeps | None = None  # (names it keeps itself with why; why that could not be read, per save)
    keeps_advice: str = ""  # retention's warning when its rules delete a save of one whose state was unknown ({why})
    alias_unfinished: tuple[str, str, str] = ("", "", "")  # (finding, message, fallback) for an unfinished alias


_MAX_BYTES = 64 * 1024  # a JSON sidecar is a few hundred bytes; a larger JSON file is not one
_MAX_FILES = 8  # JSON files opened per folder, at most
_MAX_ENTRIES = 256  # entries of a folder looked at, at most
_STEP_KEYS = ("global_step", "step")


def _names(directory: Path) -> list[str]:
    try:
        with os.scandir(directory) as it:
            return [e.name for _, e in zip(range(_MAX_ENTRIES), it)]
    except OSError:
        return []


def json_step(directory: Path) -> int | None:
    """The step a JSON sidecar directly inside `directory` records (its own copies are pickles, never read): the
    first `*.json` file in name order holding an integer `global_step` (preferred) or `step`, or None."""
    for name in sorted(n for n in _names(directory) if n.endswith(".json"))[:_MAX_FILES]:
        doc = read_small_json(directory / name, _MAX_BYTES)
        for key in _STEP_KEYS if isinstance(doc, dict) else ():
            value = doc.get(key)
            if type(value) is int and value >= 0:
                return value
    return None


REFERENCE = Layout("the reference trainer", re.compile(r"step_\d+"), frozenset({"dcp"}))
TORCHTITAN = Layout("torchtitan", re.compile(r"step-\d+"), frozenset({"dcp"}))
ACCELERATE = Layout("Accelerate", re.compile(r"checkpoint_(\d+)"), frozenset({"nested"}), ordinal=True,
                    step_inside=json_step)
LIGHTNING = Layout(
    "Lightning", lightning.NAMES, frozenset({"dcp"}), step=lightning.STEP, commit=lightning.META_NAME,
    commit_anywhere=True, order="rank 0, after the DCP files", whole=lightning.meta_whole,
    step_inside=lightning.meta_step, alias=lightning.LAST, alias_hold=lightning.POINTER_HOLD, keeps=lightning.keeps,
    keeps_advice=lightning.KEEPS_ADVICE, alias_unfinished=lightning.UNFINISHED_ALIAS)
TRANSFORMERS = Layout(
    "transformers' Trainer", hftrainer.NAMES, frozenset({"nested", "files"}), commit=hftrainer.TRAINER_STATE,
    order="after the model, the optimizer, scheduler.pt and rng_state_*.pth", whole=hftrainer.state_whole,
    sentinel=hftrainer.JIT_SENTINEL, marks=hftrainer.MARKS, torn=hftrainer.files_problem,
    keeps=hftrainer.keeps)
LAYOUTS = (REFERENCE, TORCHTITAN, ACCELERATE, LIGHTNING, TRANSFORMERS)
COMMIT_FILES = tuple(layout.commit for layout in LAYOUTS if layout.commit)
WATCHED = (*COMMIT_FILES, *(layout.sentinel for layout in LAYOUTS if layout.sentinel))  # a file event may commit


def layout_of(name: str) -> Layout | None:
    """The client whose checkpoint names `name` has, or None (a user's own name)."""
    return next((layout for layout in LAYOUTS if layout.names.fullmatch(name)), None)


def name_ordinal(name: str) -> int | None:
    """The save ordinal a name carries (Accelerate's `checkpoint_<N>`), or None for every other name."""
    layout = layout_of(name)
    match = layout.names.fullmatch(name) if layout is not None and layout.ordinal else None
    return int(match.group(1)) if match else None


def is_alias(name: str) -> bool:
    """Is this a client's name for a second place of a save (Lightning's `last.ckpt`, `last-v1.ckpt`)?"""
    return any(layout.alias is not None and layout.alias.fullmatch(name) for layout in LAYOUTS)


def link_target(link: Path) -> str | None:
    """The sibling an alias symlink names (a relative plain name), or None when it points anywhere else: outside the
    root, through other folders, or at itself."""
    try:
        target = os.readlink(link)
    except OSError:
        return None
    name = os.path.basename(target)
    if target not in (name, str(link.parent / name)) or name in ("", ".", "..", link.name):
        return None
    return name


def _claims(layout: Layout, directory: Path) -> bool:
    """Its name (and one of its marks, if it has any), or (for a client whose commit file marks its saves under any
    name) its commit file."""
    if layout.names.fullmatch(directory.name):
        return not layout.marks or any(os.path.lexists(directory / mark) for mark in layout.marks)
    return layout.commit_anywhere and layout.commit is not None and os.path.lexists(directory / layout.commit)


def commit_problem(directory: Path, kind: str) -> Problem:
    """For a save of shape `kind` whose DCP dirs (if any) are complete: (invalid?, why) when the file its client
    writes last is missing, not a regular file or not whole, or its sentinel is still there; else None."""
    layout = next((lo for lo in LAYOUTS if kind in lo.shapes and lo.commit and _claims(lo, directory)), None)
    if layout is None or layout.commit is None:
        return None
    if layout.sentinel and os.path.lexists(directory / layout.sentinel):
        return False, f"{layout.sentinel} is still there: {layout.client}'s save on SIGTERM did not finish"
    path = directory / layout.commit
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False, f"no {layout.commit}: {layout.client} writes it last ({layout.order}), so the save did not finish"
    except OSError as exc:
        return True, f"{layout.commit} cannot be read: {exc.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return True, f"{layout.commit} is a symlink or not a regular file"
    return layout.whole(path, st.st_size) if layout.whole else None


def owns_files(directory: Path) -> bool:
    """Is this a save of plain files (no DCP dir) of a client that has such a layout: its name, and a mark of its?"""
    layout = layout_of(directory.name)
    return layout is not None and "files" in layout.shapes and _claims(layout, directory)


def files_problem(directory: Path) -> str | None:
    """Why a save of plain files whose commit file is whole is torn (a weight file cut short), or None."""
    layout = layout_of(directory.name)
    return layout.torn(directory) if layout is not None and layout.torn is not None else None


def inner_step(directory: Path) -> int | None:
    """The step recorded inside a dir whose name has none: its client's record of it (Lightning's `meta.pt`: a
    copied `last.ckpt`, `ckpt-30.ckpt`), else a JSON sidecar's."""
    for layout in LAYOUTS:
        if layout.step_inside is not None and _claims(layout, directory):
            step = layout.step_inside(directory)
            if step is not None or layout.names.fullmatch(directory.name):
                return step
    return json_step(directory)


def with_holds(root: Path, infos: list[CheckpointInfo]) -> list[CheckpointInfo]:
    """Mark what the clients themselves still need (retention never deletes it): every alias (what Lightning's
    `ckpt_path="last"` loads) and the save an alias link names, and what each client keeps by its own rotation; and
    where that could not be read, why, on the saves the keep rules may delete (`keeps_unknown`: retention warns)."""
    holds: dict[str, str] = {}
    unknown: dict[str, str] = {}
    for c in infos:
        if is_alias(c.name) and c.state != "foreign":
            holds[c.name] = next(layout.alias_hold for layout in LAYOUTS if layout.alias and layout.alias.fullmatch(c.name))
            if c.alias_of is not None and c.path.is_symlink():
                holds.setdefault(c.alias_of, f"{c.name} links to it (its client's resume pointer)")
    for layout in LAYOUTS:
        if layout.keeps is not None:
            held, unsure = layout.keeps(root, infos)
            unknown |= unsure
            for name, why in held.items():
                holds.setdefault(name, why)
    return [replace(c, hold=holds.get(c.name), keeps_unknown=unknown.get(c.name))
            if c.name in holds or c.name in unknown else c for c in infos]
