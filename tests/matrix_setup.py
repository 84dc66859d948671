"""A matrix cell's setup: its checkpoint root (plain, symlinked onto a tmpfs, a mount point under a read-only
parent), what it already holds, the files that are not the run's, and a record of those to compare at the end.

Every cell starts from a root holding the uninterrupted reference run's checkpoints up to a seeded step (0: an
empty root), as a re-run after Ctrl+C would: its first launch must resume from the newest of them.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from supervisor.checkpoints.naming import name_step
from tests.mounts import mount_tmpfs, remount_read_only

__all__ = ["Root", "build_root", "prepopulate", "plant_foreign", "Keep"]

ROOT_TMPFS = "128m"  # all of a run's checkpoints (~2 MiB each) even where retention cannot delete


@dataclass(frozen=True)
class Root:
    spelled: Path  # `[checkpoints] dir` and the trainer's --checkpoint-dir
    resolved: Path  # what the supervisor must scan, watch, prune and pass as {checkpoint}
    alias: Path  # another path to the same directory (a second config's spelling)
    stage: Path  # a folder on the root's file system, outside the root (a planted checkpoint is renamed in)
    retention: bool  # whether deletions can be parked next to the root (False: retention stops, said once)


def build_root(kind: str, base: Path, mounts: list[Path]) -> Root:
    """Make the root of `kind` under `base` (mounting what it needs; `mounts` unmounts them)."""
    if kind in ("plain", "recreated"):
        root = base / "ckpts"
        root.mkdir()
        (base / "alias").symlink_to(root)
        return Root(root, root, base / "alias", base / "stage", True)
    if kind == "symlink":  # ckpts -> scratch/ckpts, scratch a tmpfs: the target is on another file system
        mount_tmpfs(base / "scratch", ROOT_TMPFS)
        mounts.append(base / "scratch")
        target = base / "scratch" / "ckpts"
        target.mkdir()
        (base / "ckpts").symlink_to(target)
        return Root(base / "ckpts", target, target, base / "scratch" / "stage", True)
    if kind == "mount_ro":  # ro/ckpts is a mount point; ro/ is read-only, even for root
        mount_tmpfs(base / "ro", "1m")
        mounts.append(base / "ro")
        root = base / "ro" / "ckpts"
        root.mkdir()
        remount_read_only(base / "ro")
        mount_tmpfs(root, ROOT_TMPFS)
        mounts.append(root)
        (base / "alias").symlink_to(root)
        return Root(root, root, base / "alias", base / "stage", False)
    raise ValueError(f"unknown root kind {kind!r}")


def prepopulate(root: Path, reference_ckpts: Path, upto: int) -> None:
    """Copy the reference run's checkpoints of steps <= `upto` into `root` (`cp -a`: times kept)."""
    for ckpt in sorted(reference_ckpts.glob("step_*")):
        step = name_step(ckpt.name)
        if step is not None and step <= upto:
            shutil.copytree(ckpt, root / ckpt.name)


def plant_foreign(root: Path, base: Path) -> list[Path]:
    """What users keep in and beside a checkpoint root that is not the run's: none of it may be touched."""
    made = {
        root / "README.txt": b"notes about this run\n",
        root / "tb" / "events.out.tfevents.1700000000.host": b"\x00tensorboard",
        root / ".tmp-notes" / "keep.txt": b"another program's temporary folder\n",
        root / ".trash" / "notes.txt": b"a user's own .trash\n",
        base / "run-b" / "notes.txt": b"the other config's run dir\n",
    }
    for path, data in made.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    if root.parent != base and os.access(root.parent, os.W_OK) and not _read_only(root.parent):
        (root.parent / "data.bin").write_bytes(os.urandom(4096))  # another user's file beside a symlink's target
        return [*made, root.parent / "data.bin"]
    return list(made)


def _read_only(path: Path) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


class Keep:
    """Files that are not the run's, by content: `add` them when they appear, `changed()` at the end."""

    def __init__(self) -> None:
        self.files: dict[Path, str] = {}

    def add(self, *paths: Path) -> None:
        for path in paths:
            for f in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
                self.files[f] = _digest(f)

    def changed(self) -> list[str]:
        """What was removed or rewritten since it was added (empty: nothing was touched)."""
        found = []
        for f, digest in self.files.items():
            if not f.is_file():
                found.append(f"{f} was deleted")
            elif _digest(f) != digest:
                found.append(f"{f} was rewritten")
        return found


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
