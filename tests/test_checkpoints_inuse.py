"""Tests for supervisor.checkpoints.inuse: in-use markers next to the root, honoured by every prune."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.checkpoints import IN_USE_MAX_AGE_S, clear_in_use, in_use, mark_in_use
from supervisor.checkpoints.testing import write_checkpoint
from supervisor.errors import CheckpointError
from tests.test_checkpoints_cli import fsup


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Complete steps 10, 20 and 30."""
    r = tmp_path / "ckpts"
    for step in (10, 20, 30):
        write_checkpoint(r, step)
    return r


@pytest.fixture
def job() -> Iterator[subprocess.Popen[bytes]]:
    """A live process standing in for a job that resumed from a checkpoint; killed at the end."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _markers(root: Path) -> list[str]:
    folder = root.parent / f".{root.name}.fsdp-inuse"
    return sorted(os.listdir(folder)) if folder.is_dir() else []


class TestMarkers:
    def test_written_next_to_the_root_with_its_fields(self, root, job):
        """`<parent>/.<root>.fsdp-inuse/<host>-<pid>.json` holds path, pid, host, start_time and time."""
        marker = mark_in_use(root, root / "step_00000010", pid=job.pid)
        host = socket.gethostname()
        assert marker == root.parent / ".ckpts.fsdp-inuse" / f"{host}-{job.pid}.json"
        doc = json.loads(marker.read_text())
        assert doc["path"] == str(root / "step_00000010") and (doc["pid"], doc["host"]) == (job.pid, host)
        assert isinstance(doc["start_time"], float) and abs(doc["time"] - time.time()) < 60
        assert sorted(os.listdir(root)) == ["step_00000010", "step_00000020", "step_00000030"]

    def test_live_while_its_process_runs_then_stale_and_removed(self, root, job):
        """A marker counts while its process lives; once it is gone the reader ignores and removes it."""
        mark_in_use(root, root / "step_00000010", pid=job.pid)
        assert in_use(root) == {root / "step_00000010"}
        job.kill()
        job.wait()
        assert in_use(root) == set() and _markers(root) == []

    def test_a_reused_pid_is_not_the_same_process(self, root, job):
        """Same pid, another start time: stale."""
        mark_in_use(root, root / "step_00000010", pid=job.pid, start_time=1.0)
        assert in_use(root) == set()

    def test_another_hosts_marker_lives_until_its_age_limit(self, root):
        """No pid check across hosts: a marker from elsewhere counts until IN_USE_MAX_AGE_S after its last write."""
        folder = root.parent / ".ckpts.fsdp-inuse"
        folder.mkdir()
        now = time.time()
        for host, age in (("node-a", 60.0), ("node-b", IN_USE_MAX_AGE_S + 60)):
            marker = folder / f"{host}-42.json"
            marker.write_text(json.dumps({"path": str(root / f"step_000000{10 if host == 'node-a' else 20}"),
                                          "pid": 42, "host": host, "start_time": 1.0, "time": now - age}))
            os.utime(marker, (now - age, now - age))
        assert in_use(root, now=now) == {root / "step_00000010"}
        assert _markers(root) == ["node-a-42.json"]

    def test_clear_removes_only_that_pid(self, root, job):
        """clear_in_use drops the marker of one process and says whether there was one."""
        mark_in_use(root, root / "step_00000010", pid=job.pid)
        mark_in_use(root, root / "step_00000020")  # this test process
        assert clear_in_use(root, pid=job.pid) and not clear_in_use(root, pid=job.pid)
        assert in_use(root) == {root / "step_00000020"}
        assert clear_in_use(root)

    def test_a_symlinked_marker_folder_is_not_followed(self, root, tmp_path):
        """Markers are never read, nor stale ones removed, through a symlink planted as the marker folder."""
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (elsewhere / "x-1.json").write_text(json.dumps({"path": str(root / "step_00000010"), "host": "h", "time": 0}))
        (root.parent / ".ckpts.fsdp-inuse").symlink_to(elsewhere)
        assert in_use(root) == set() and os.listdir(elsewhere) == ["x-1.json"]
        with pytest.raises(CheckpointError, match="not a plain directory"):
            mark_in_use(root, root / "step_00000010")

    def test_garbage_is_ignored(self, root):
        """An unreadable or malformed marker protects nothing and raises nothing."""
        folder = root.parent / ".ckpts.fsdp-inuse"
        folder.mkdir()
        (folder / "x-1.json").write_text("{not json")
        (folder / "x-2.json").write_text("[1, 2]")
        (folder / "x-3.json").symlink_to(root / "step_00000010")
        assert in_use(root) == set()


class TestPrune:
    def test_prune_dir_keeps_a_live_jobs_resume_point(self, root, job):
        """`prune --dir --keep-last 1` leaves the checkpoint a running job resumed from, until the job is gone."""
        mark_in_use(root, root / "step_00000010", pid=job.pid)
        r = fsup("checkpoints", "prune", "--dir", root, "--keep-last", "1")
        assert r.returncode == 0, r.stderr
        assert "deleted step_00000020" in r.stdout and "step_00000010" not in r.stdout
        assert (root / "step_00000010").is_dir()
        job.kill()
        job.wait()
        r = fsup("checkpoints", "prune", "--dir", root, "--keep-last", "1")
        assert r.returncode == 0 and "deleted step_00000010" in r.stdout
        assert sorted(os.listdir(root)) == ["step_00000030"] and _markers(root) == []
