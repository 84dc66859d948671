"""Tests for supervisor.checkpoints.sidecars: the folders next to the root are ours (owner-only) or refused;
times from other hosts are trusted only up to a small skew (issue 21: items 5 and 8)."""
from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from supervisor.checkpoints import IN_USE_MAX_AGE_S, in_use, mark_in_use
from supervisor.checkpoints.pruning import clear_trash, execute_retention, parking_problem
from supervisor.checkpoints.retention import Deletion, RetentionPlan
from supervisor.checkpoints.sidecars import CLOCK_SKEW_S, sidecar_problem, written_at
from supervisor.cli import app as top_cli
from supervisor.errors import SidecarError
from tests.unit.test_checkpoints_inuse import root  # noqa: F401  (fixture: complete steps 10, 20 and 30)

NOW = 1_700_000_000.0
ME = os.geteuid()
needs_root = pytest.mark.skipif(ME != 0, reason="needs root to give a folder to another user (chown)")


@pytest.mark.parametrize(("stamps", "expected"), [
    ((NOW - 10, NOW - 20), NOW - 10),  # the later of the two
    ((NOW - 10, None), NOW - 10),
    ((NOW + 60, NOW - 10), NOW),  # a little ahead (clock skew): counts, clamped to now
    ((NOW + CLOCK_SKEW_S + 1, NOW - 10), NOW - 10),  # far ahead: ignored, the other stamp decides
    ((NOW + 365 * 86400, NOW + 365 * 86400), None),  # dated next year: no usable time at all
    ((float("nan"), True), None),  # garbage
])
def test_written_at(stamps: tuple, expected: float | None) -> None:
    assert written_at(stamps, NOW) == expected


def _st(mode: int, uid: int) -> os.stat_result:
    return os.stat_result((mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))


@pytest.mark.parametrize(("mode", "uid", "problem"), [
    (stat.S_IFDIR | 0o700, ME, None),
    (stat.S_IFDIR | 0o755, ME, None),  # an earlier version's in-use folder: readable, but only we write it
    (stat.S_IFDIR | 0o700, 12345, "belongs to uid 12345"),
    (stat.S_IFDIR | 0o770, ME, "writable by its group or by others (mode 0770)"),
    (stat.S_IFDIR | 0o1777, ME, "writable by its group or by others"),
    (stat.S_IFLNK | 0o777, ME, "is a symlink"),
    (stat.S_IFREG | 0o600, ME, "not a plain directory"),
])
def test_sidecar_problem(mode: int, uid: int, problem: str | None) -> None:
    found = sidecar_problem(Path("/p/.ckpts.fsdp-trash"), _st(mode, uid), {ME})
    assert found is None if problem is None else problem in (found or "")


def _plan(*paths: Path) -> RetentionPlan:
    return RetentionPlan(deletions=[Deletion(p, p.name, "test", 0) for p in paths])


@needs_root
class TestSidecarsOfAnotherUser:
    def test_their_trash_is_never_used_nor_emptied(self, root: Path) -> None:
        """Another user pre-created `.ckpts.fsdp-trash` (a shared /tmp): nothing is parked in it or removed from it."""
        trash = root.parent / ".ckpts.fsdp-trash"
        trash.mkdir()
        (trash / "their-file").write_text("theirs")
        os.chown(trash, 65534, 65534)
        with pytest.raises(SidecarError, match="belongs to uid 65534"):
            execute_retention(root, _plan(root / "step_00000010"))
        with pytest.raises(SidecarError):
            clear_trash(root)
        assert (root / "step_00000010").is_dir() and os.listdir(trash) == ["their-file"]
        assert "belongs to uid 65534" in (parking_problem(root) or "")

    def test_prune_exits_2_naming_it(self, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """`checkpoints prune` used to print 'deleted' lines, fail every rename and exit 0."""
        trash = root.parent / ".ckpts.fsdp-trash"
        trash.mkdir()
        os.chown(trash, 65534, 65534)
        assert top_cli.main(["checkpoints", "prune", "--dir", str(root), "--keep-last", "1"]) == 2
        err = capsys.readouterr().err
        assert str(trash) in err and "belongs to uid 65534" in err and err.count("\n") == 1
        assert sorted(os.listdir(root)) == ["step_00000010", "step_00000020", "step_00000030"]

    def test_their_in_use_folder_is_refused(self, root: Path) -> None:
        """Markers planted in another user's folder are not believed, and ours are not written there."""
        folder = root.parent / ".ckpts.fsdp-inuse"
        folder.mkdir()
        os.chown(folder, 65534, 65534)
        with pytest.raises(SidecarError, match="belongs to uid 65534"):
            in_use(root)
        with pytest.raises(SidecarError, match="belongs to uid 65534"):
            mark_in_use(root, root / "step_00000010")
        assert top_cli.main(["checkpoints", "prune", "--dir", str(root), "--keep-last", "1"]) == 2


class TestOurSidecarsAreOwnerOnly:
    def test_a_group_writable_trash_is_refused(self, root: Path) -> None:
        trash = root.parent / ".ckpts.fsdp-trash"
        trash.mkdir()
        os.chmod(trash, 0o777)
        with pytest.raises(SidecarError, match="writable by its group or by others"):
            execute_retention(root, _plan(root / "step_00000010"))
        assert (root / "step_00000010").is_dir()

    def test_in_use_folder_and_markers_are_owner_only(self, root: Path) -> None:
        """Created 0700, markers 0600."""
        marker = mark_in_use(root, root / "step_00000010")
        assert stat.S_IMODE(os.stat(marker.parent).st_mode) == 0o700 and stat.S_IMODE(os.stat(marker).st_mode) == 0o600


class TestInUseTimes:
    @pytest.mark.parametrize(("ahead", "live"), [
        (0.0, True),
        (CLOCK_SKEW_S / 2, True),  # another host's clock a little fast
        (3600.0, True),  # an hour fast (or our clock an hour slow): was judged stale and removed while live
        (365 * 86400.0, False),  # dated next year: was live forever
    ])
    def test_a_marker_from_the_future_is_not_live_forever(self, root: Path, ahead: float, live: bool) -> None:
        """Another host's marker whose `time` and mtime are ahead of ours: judged by the 6 h rule relative to now."""
        folder = root.parent / ".ckpts.fsdp-inuse"
        folder.mkdir(mode=0o700)
        marker = folder / "node-b-42.json"
        when = time.time() + ahead
        marker.write_text(json.dumps({"path": str(root / "step_00000010"), "pid": 42, "host": "node-b",
                                      "start": 1, "time": when}))
        os.utime(marker, (when, when))
        assert (in_use(root) == {root / "step_00000010"}) is live
        assert marker.exists() is live  # a stale marker is removed by its reader

    def test_the_6h_rule_still_holds(self, root: Path) -> None:
        folder = root.parent / ".ckpts.fsdp-inuse"
        folder.mkdir(mode=0o700)
        marker = folder / "node-b-42.json"
        when = time.time() - IN_USE_MAX_AGE_S - 1
        marker.write_text(json.dumps({"path": str(root / "step_00000010"), "host": "node-b", "time": when}))
        os.utime(marker, (when, when))
        assert in_use(root) == set()
