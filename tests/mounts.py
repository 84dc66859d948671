"""Real mounts for tests of users' setups: a small tmpfs, a bind mount, a read-only remount.

Each helper skips the test (saying why) when this process may not mount (not root, no mount(8), a container
without the capability); the `mounts` fixture unmounts, in reverse order, every mount point a test registers.
"""
from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["mount_tmpfs", "bind_mount", "remount_read_only", "mounts"]


def _mount(args: list[str], what: str) -> None:
    if os.geteuid() != 0:
        pytest.skip(f"{what} needs root (these setups are real mounts, not simulated)")
    try:
        r = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)
    except OSError as exc:  # no mount(8) here
        pytest.skip(f"cannot {what} here: {exc}")
    if r.returncode:
        pytest.skip(f"cannot {what} here: {r.stderr.strip()}")


def mount_tmpfs(where: Path, size: str = "64m") -> None:
    where.mkdir(parents=True, exist_ok=True)
    _mount(["-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(where)], "mounting a tmpfs")


def bind_mount(source: Path, where: Path) -> None:
    _mount(["--bind", str(source), str(where)], "a bind mount")


def remount_read_only(where: Path) -> None:
    """Make the file system mounted at `where` read-only: even root cannot create an entry in it."""
    _mount(["-o", "remount,ro", str(where)], "a read-only remount")


@pytest.fixture
def mounts() -> Iterator[list[Path]]:
    """Mount points the test made; each is unmounted afterwards, whatever happened."""
    made: list[Path] = []
    try:
        yield made
    finally:
        for m in reversed(made):
            subprocess.run(["umount", "-l", str(m)], capture_output=True)
