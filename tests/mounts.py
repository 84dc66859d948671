"""Real mounts for tests of users' setups: a small tmpfs, a bind mount, a read-only remount.

Each helper skips the test (saying why) when this process may not mount (not root, no mount(8), a container
without the capability); the `mounts` fixture unmounts, in reverse order, every mount point a test registers.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["mount_tmpfs", "tmpfs", "try_tmpfs", "unmount", "bind_mount", "remount_read_only", "mounts", "loop_ext4",
           "flip_on_device"]


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


def try_tmpfs(where: Path, size: str) -> str | None:
    """Mount a `size` tmpfs at `where` (made if missing): None, or why this process could not (not root, no mount(8))."""
    where.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                           text=True, timeout=30)
    except OSError as exc:
        return str(exc)
    return r.stderr.strip() or f"mount exited {r.returncode}" if r.returncode else None


def unmount(where: Path) -> None:
    """Unmount `where`; still busy (a process of the test lingering): detach it anyway."""
    if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@contextlib.contextmanager
def tmpfs(where: Path, size: str, why: str) -> Iterator[Path]:
    """A `size` tmpfs at `where` for the block, unmounted after; the test is skipped (it needs one: `why`) where this
    process may not mount."""
    error = try_tmpfs(where, size)
    if error is not None:
        pytest.skip(f"cannot mount a tmpfs here ({error}): {why}")
    try:
        yield where
    finally:
        unmount(where)


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


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=60)
    except OSError as exc:  # the tool is not installed here
        return subprocess.CompletedProcess(args, 127, "", str(exc))


@pytest.fixture
def loop_ext4(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """(mount point, its loop device): a 64 MiB ext4 on a loop device; unmounted and detached afterwards."""
    if os.geteuid() != 0:
        pytest.skip("a loop-mounted file system needs root")
    img, where = tmp_path / "fs.img", tmp_path / "fs"
    where.mkdir()
    with open(img, "wb") as f:
        f.truncate(64 << 20)
    if (r := _run(["mkfs.ext4", "-q", "-F", str(img)])).returncode:
        pytest.skip(f"cannot make an ext4 file system here: {r.stderr.strip()}")
    if (r := _run(["losetup", "-f", "--show", str(img)])).returncode:
        pytest.skip(f"no loop device here: {r.stderr.strip()}")
    device = r.stdout.strip()
    try:
        if (r := _run(["mount", "-t", "ext4", device, str(where)])).returncode:
            pytest.skip(f"cannot mount {device} here: {r.stderr.strip()}")
        try:
            yield where, device
        finally:
            _run(["umount", str(where)])
    finally:
        _run(["losetup", "-d", device])


def flip_on_device(device: str, path: Path, offset: int, bit: int = 0x04) -> None:
    """Flip one bit of `path`'s byte at `offset` on the block device below its file system, as media rot does:
    the file's size, mtime and ctime stay as they are. The file's cached pages are dropped after."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())  # its blocks are allocated and on the device
    out = _run(["filefrag", "-v", str(path)]).stdout
    size = re.search(r"blocks? of (\d+) bytes", out)
    assert size, out
    bs = int(size.group(1))
    block = offset // bs
    for m in re.finditer(r"^\s*\d+:\s*(\d+)\.\.\s*(\d+):\s*(\d+)\.\.", out, re.M):
        first, last, physical = map(int, m.groups())
        if first <= block <= last:
            at = (physical + block - first) * bs
            break
    else:
        raise AssertionError(f"no extent of {path} holds block {block}: {out}")
    buf = mmap.mmap(-1, bs)  # page-aligned, as O_DIRECT wants
    fd = os.open(device, os.O_RDWR | os.O_DIRECT)
    try:
        assert os.preadv(fd, [buf], at) == bs
        buf[offset % bs] ^= bit
        assert os.pwritev(fd, [buf], at) == bs
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # the next read comes from the device
