"""The shape of each entry of the checkpoint root, told before judging it: a checkpoint of a known layout, or not ours.

Retention may only delete what it can identify as a checkpoint or an unfinished one: the shapes are
docs/checkpoints.md, 'Layouts' and 'A root set one level too high' (CheckpointDirectoryError). A foreign entry is
never counted, deleted, selected or walked; symlinks to directories inside a nested folder are noted, never
followed. Looking is bounded (`.metadata` first, at most MAX_ENTRIES entries per child). Standard library only.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.checkpoints.clients import owns_files
from supervisor.checkpoints.naming import is_checkpoint_name, is_temporary
from supervisor.errors import CheckpointError
from supervisor.layout import METADATA_NAME, TMP_PREFIX

__all__ = ["DCP", "NESTED", "FILES", "TEMPORARY", "UNSTARTED", "FOREIGN", "DIRECTORY", "MAX_ENTRIES", "Shape",
           "CheckpointDirectoryError", "identify", "EXPORT_REASON"]

DCP, NESTED, FILES, TEMPORARY, UNSTARTED = "dcp", "nested", "files", "temporary", "unstarted"
FOREIGN, DIRECTORY = "foreign", "directory"
MAX_ENTRIES = 4096  # directory entries read per child of the root, at most
SHARD_SUFFIX = ".distcp"  # DCP's FileSystemWriter storage files: `__<rank>_<n>.distcp`
_SHOWN = 3  # names quoted in a message
# The reference trainer's `--export-best DIR` (trainer/best.py), often put inside the root as `ckpts/best`:
# listed as what it is, not as an unknown folder, and like every foreign entry never touched.
_EXPORT_FILES = ("best.json", "model.safetensors")
EXPORT_REASON = "the trainer's best-model export (best.json, model.safetensors): not a checkpoint, never touched"
_TRAINER_TEMPORARY = re.compile(re.escape(TMP_PREFIX) + r"step_\d+-.+", re.DOTALL)  # layout.tmp_dir_name


class CheckpointDirectoryError(CheckpointError):
    """The checkpoint root holds a whole directory of checkpoints: it was set one level too high.

    Treating `outputs/checkpoint/` as one checkpoint would let retention delete every checkpoint in it at
    once, so the store refuses the root (exit 2) and names the folder the user probably meant.
    """

    def __init__(self, root: Path, child: Path, series: tuple[str, ...]) -> None:
        shown = _shown(list(series))
        super().__init__(f"checkpoint root {root} holds a checkpoint directory ({child} with {shown}): "
                         f'did you mean [checkpoints] dir = "{child}"?')
        self.root, self.child, self.series = root, child, series


@dataclass(frozen=True)
class Shape:
    """What a child of the root is; `members` for nested, `series` for directory, `reason` for foreign."""

    kind: str
    members: frozenset[str] = field(default_factory=frozenset)
    series: tuple[str, ...] = ()
    within: str = ""  # for directory: the folder below the child that holds the series ("" = the child)
    reason: str | None = None
    links: tuple[str, ...] = ()  # for nested: symlinks to directories where a member could be (never followed)

    @property
    def ours(self) -> bool:
        """A checkpoint or an unfinished one: something retention may judge (and delete)."""
        return self.kind in (DCP, NESTED, FILES, TEMPORARY, UNSTARTED)


class _Budget:
    def __init__(self, entries: int) -> None:
        self.left = entries

    def take(self) -> bool:
        self.left -= 1
        return self.left >= 0


@dataclass(frozen=True)
class _Listing:
    dcp: bool = False
    dirs: tuple[str, ...] = ()
    files: bool = False
    readable: bool = True
    links: tuple[str, ...] = ()  # symlinks that point at a directory


def _look(path: Path, budget: _Budget) -> _Listing:
    """Is `path` a DCP dir; else its subdirectories and whether it holds any file (stops at the budget)."""
    if budget.take() and os.path.lexists(path / METADATA_NAME):
        return _Listing(dcp=True)
    dirs: list[str] = []
    links: list[str] = []
    files = False
    try:
        with os.scandir(path) as it:
            for entry in it:
                if not budget.take():
                    break
                if entry.name.endswith(SHARD_SUFFIX):
                    return _Listing(dcp=True)
                try:
                    is_dir = entry.is_dir(follow_symlinks=False)
                except OSError:
                    continue
                if is_dir:
                    dirs.append(entry.name)
                else:
                    files = True  # a file, a symlink, anything that is not a plain subdirectory
                    if entry.is_symlink() and _points_at_dir(entry):
                        links.append(entry.name)
    except OSError:
        return _Listing(readable=False)
    return _Listing(dirs=tuple(sorted(dirs)), files=files, links=tuple(sorted(links)))


def _points_at_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()  # one stat through the link; the target is never walked
    except OSError:
        return False


def _members(path: Path, top: _Listing, budget: _Budget) -> tuple[list[str], bool, list[str]]:
    """DCP dirs one or two levels below `path` (relative paths), whether any file was seen on the way, and
    the symlinks to directories seen at those levels (relative paths)."""
    members: list[str] = []
    links = list(top.links)
    files = top.files
    for sub in top.dirs:
        below = _look(path / sub, budget)
        if below.dcp:
            members.append(sub)
            continue
        files = files or below.files
        links += [f"{sub}/{link}" for link in below.links]
        for subsub in below.dirs:
            deeper = _look(path / sub / subsub, budget)
            if deeper.dcp:
                members.append(f"{sub}/{subsub}")
            files = files or deeper.files or bool(deeper.dirs)
    return members, files, links


def _shown(names: list[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (", ..." if len(names) > _SHOWN else "")


def _series(members: list[str]) -> tuple[str, tuple[str, ...]] | None:
    """Two or more checkpoint-named folders side by side holding DCP dirs: one level down (`step-10/`,
    `step-20/`) or two (`checkpoint/step-10/`, `checkpoint/step-20/`). Returns (the folder holding them,
    relative to the child, "" for the child itself; their names), else None."""
    heads = {m.split("/")[0] for m in members if is_checkpoint_name(m.split("/")[0])}
    if len(heads) >= 2:
        return "", tuple(sorted(heads))
    by_folder: dict[str, set[str]] = {}
    for m in members:
        folder, _, leaf = m.rpartition("/")
        if folder and is_checkpoint_name(leaf):
            by_folder.setdefault(folder, set()).add(leaf)
    for folder in sorted(by_folder):
        if len(by_folder[folder]) >= 2:
            return folder, tuple(sorted(by_folder[folder]))
    return None


def identify(path: Path) -> Shape:
    """The shape of one child of the checkpoint root (a real directory, not a symlink)."""
    name = path.name
    if is_temporary(name):
        if _TRAINER_TEMPORARY.fullmatch(name):
            return Shape(TEMPORARY)
        # Not the reference trainer's `.tmp-step_<N>-<nonce>` (nor its `-incomplete-<nonce>` set-aside): some
        # other program's (or person's) `.tmp-` folder. Deleting it as an abandoned save would lose their data.
        return Shape(FOREIGN, reason="a .tmp- dir not named by the reference trainer (.tmp-step_<N>-<nonce>): "
                                     "not looked into")
    budget = _Budget(MAX_ENTRIES)
    top = _look(path, budget)
    if top.dcp:
        return Shape(DCP)
    if not top.readable:
        # A checkpoint we may not read is judged (and shown invalid) by verify(); anything else is not ours.
        return Shape(DCP) if is_checkpoint_name(name) else Shape(FOREIGN, reason="cannot be read: not looked into")
    members, files, links = _members(path, top, budget)
    series = _series(members) or _series([d for d in top.dirs if owns_files(path / d)])  # plain-file saves too
    if series is not None:
        return Shape(DIRECTORY, series=series[1], within=series[0])
    if budget.left < 0:  # members seen so far may not be all of them: not a layout we can judge
        return Shape(FOREIGN, reason=f"more than {MAX_ENTRIES} entries: not a checkpoint layout the store knows")
    inner = next((m for m in sorted(members) if any(is_checkpoint_name(part) for part in m.split("/"))), None)
    if inner is not None:
        return Shape(FOREIGN, reason=f"holds the checkpoint {inner} inside it (a copy or a checkpoint "
                                     "directory): not looked into")
    if members and not is_checkpoint_name(name):
        # Nested checkpoints are written into `checkpoint_<N>`, `checkpoint-<N>` (or a name the script picks, like
        # `step_<N>`). A folder called `exports/` or `tmp/` with DCP dirs inside is someone's copy: not ours.
        return Shape(FOREIGN, reason=f"holds DCP dirs ({_shown(sorted(members))}) but is not named like a "
                                     "checkpoint (checkpoint_N, step_N, ...): not looked into")
    if members:
        return Shape(NESTED, members=frozenset(members), links=tuple(links))
    if is_checkpoint_name(name) and not files:
        return Shape(UNSTARTED)
    if owns_files(path):
        return Shape(FILES)
    if all(os.path.isfile(path / f) for f in _EXPORT_FILES):
        return Shape(FOREIGN, reason=EXPORT_REASON)
    return Shape(FOREIGN, reason="not a checkpoint: no DCP dir (.metadata or *.distcp) in it or two levels down")
