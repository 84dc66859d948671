"""Tests for supervisor.host.mounts: the mount a path is on, from /proc/self/mountinfo's text."""
from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.host.mounts import mount_id, same_mount

MOUNTINFO = b"""\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 0:25 / /tmp rw,nosuid shared:5 - tmpfs tmpfs rw
41 30 8:1 /data/ckpts /tmp/u/view rw,relatime shared:1 - ext4 /dev/sda1 rw
42 30 0:40 / /tmp/u/job\\040dir/ck\\012pts rw - tmpfs tmpfs rw
43 41 0:41 / /tmp/u/view rw - tmpfs tmpfs rw
"""


@pytest.mark.parametrize(("path", "mount"), [
    ("/etc/passwd", 22),
    ("/tmp/u", 30),
    ("/tmp/u/viewer", 30),  # a sibling whose name starts like a mount point is not under it
    ("/tmp/u/view/step_10", 43),  # a point mounted twice: the mount on top
    ("/tmp/u/job dir/ck\npts/step_1", 42),  # mountinfo's \\ooo escapes
])
def test_mount_id_is_the_longest_mount_point_above_the_path(path: str, mount: int, monkeypatch: pytest.MonkeyPatch,
                                                            ) -> None:
    monkeypatch.setattr("os.path.realpath", lambda p: str(p))
    assert mount_id(path, MOUNTINFO) == mount


def test_unknown_mounts_are_not_a_difference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where mountinfo cannot be read (no /proc), callers go by st_dev alone: same_mount says yes."""
    assert mount_id(tmp_path, b"garbage\n") is None
    monkeypatch.setattr("supervisor.host.mounts._MOUNTINFO", str(tmp_path / "absent"))
    assert mount_id("/") is None and same_mount("/", tmp_path)
