"""Tests for supervisor.checkpoints.inuse: in-use markers next to the root, honoured by every prune."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from supervisor.checkpoints import IN_USE_MAX_AGE_S, in_use, mark_in_use
from supervisor.errors import CheckpointError
from tests.jobs.dcp_files import write_checkpoint


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Complete steps 10, 20 and 30."""
    r = tmp_path / "ckpts"
    for step in (10, 20, 30):
        write_checkpoint(r, step)
    return r


def _markers(root: Path) -> list[str]:
    folder = root.parent / f".{root.name}.fsdp-inuse"
    return sorted(os.listdir(folder)) if folder.is_dir() else []


class TestMarkers:
    def test_another_hosts_marker_lives_until_its_age_limit(self, root):
        """No pid check across hosts: a marker from elsewhere counts until IN_USE_MAX_AGE_S after its last write."""
        folder = root.parent / ".ckpts.fsdp-inuse"
        folder.mkdir()
        now = time.time()
        for host, age in (("node-a", 60.0), ("node-b", IN_USE_MAX_AGE_S + 60)):
            marker = folder / f"{host}-42.json"
            marker.write_text(json.dumps({"path": str(root / f"step_000000{10 if host == 'node-a' else 20}"),
                                          "pid": 42, "host": host, "start": 1, "time": now - age}))
            os.utime(marker, (now - age, now - age))
        assert in_use(root, now=now) == {root / "step_00000010"}
        assert _markers(root) == ["node-a-42.json"]

    def test_a_symlinked_marker_folder_is_not_followed(self, root, tmp_path):
        """Markers are never read, nor stale ones removed, through a symlink planted as the marker folder."""
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (elsewhere / "x-1.json").write_text(json.dumps({"path": str(root / "step_00000010"), "host": "h", "time": 0}))
        (root.parent / ".ckpts.fsdp-inuse").symlink_to(elsewhere)
        with pytest.raises(CheckpointError, match="is a symlink, not a folder of ours"):
            in_use(root)
        assert os.listdir(elsewhere) == ["x-1.json"]
        with pytest.raises(CheckpointError, match="is a symlink, not a folder of ours"):
            mark_in_use(root, root / "step_00000010")

    def test_garbage_is_ignored(self, root):
        """An unreadable or malformed marker protects nothing and raises nothing."""
        folder = root.parent / ".ckpts.fsdp-inuse"
        folder.mkdir()
        (folder / "x-1.json").write_text("{not json")
        (folder / "x-2.json").write_text("[1, 2]")
        (folder / "x-3.json").symlink_to(root / "step_00000010")
        assert in_use(root) == set()
