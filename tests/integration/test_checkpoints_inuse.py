"""Tests for supervisor.checkpoints.inuse: in-use markers next to the root, honoured by every prune."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from supervisor.checkpoints import clear_in_use, in_use, mark_in_use
from supervisor.checkpoints.claim import RootClaim
from supervisor.errors import ClaimedError
from supervisor.host.boot import boot_id, pid_namespace, start_ticks
from tests.integration.test_checkpoints_cli import fsup
from tests.unit.test_checkpoints_inuse import (
    _markers,
    root,  # noqa: F401  (a fixture, taken as an argument)
)


@pytest.fixture
def job() -> Iterator[subprocess.Popen[bytes]]:
    """A live process standing in for a job that resumed from a checkpoint; killed at the end."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


class TestMarkers:
    def test_written_next_to_the_root_with_its_fields(self, root, job):
        """`<parent>/.<root>.fsdp-inuse/<host>-<pid>-<pidns>.json`: a lease (host, pidns, boot, pid, start ticks,
        time) holding the path."""
        marker = mark_in_use(root, root / "step_00000010", pid=job.pid)
        host = socket.gethostname()
        assert marker == root.parent / ".ckpts.fsdp-inuse" / f"{host}-{job.pid}-{pid_namespace()}.json"
        doc = json.loads(marker.read_text())
        assert doc["path"] == str(root / "step_00000010") and (doc["pid"], doc["host"]) == (job.pid, host)
        assert doc["start"] == start_ticks(job.pid) and doc["boot"] == boot_id() and abs(doc["time"] - time.time()) < 60
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
        mark_in_use(root, root / "step_00000010", pid=job.pid, start=1)
        assert in_use(root) == set()

    def test_clear_removes_only_that_pid(self, root, job):
        """clear_in_use drops the marker of one process and says whether there was one."""
        mark_in_use(root, root / "step_00000010", pid=job.pid)
        mark_in_use(root, root / "step_00000020")  # this test process
        assert clear_in_use(root, pid=job.pid) and not clear_in_use(root, pid=job.pid)
        assert in_use(root) == {root / "step_00000020"}
        assert clear_in_use(root)

    def test_seen_whichever_way_the_root_is_spelled(self, root, job, tmp_path):
        """A marker written through a symlinked root (the daemon's config) protects the checkpoint from a
        prune that names the real root, and the other way round; so does one written through a symlinked parent."""
        link = tmp_path / "data" / "ckpts"
        link.parent.mkdir()
        link.symlink_to(root)
        alias = tmp_path / "alias"
        alias.symlink_to(tmp_path)
        mark_in_use(link, link / "step_00000010", pid=job.pid)
        mark_in_use(alias / "ckpts", alias / "ckpts" / "step_00000020")  # this test process
        assert in_use(root) == {root / "step_00000010", root / "step_00000020"}
        assert in_use(link) == {link / "step_00000010", link / "step_00000020"}
        assert clear_in_use(root)
        mark_in_use(root, root / "step_00000030", pid=job.pid)
        assert in_use(link) == {link / "step_00000030"}


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


@pytest.fixture
def container(root):
    """A starter: runs `code` (root as sys.argv[1]; it prints one line when ready, then sleeps) in a new pid namespace, a
    container sharing our host name; returns its first line."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(code: str) -> str:
        try:
            proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code, str(root)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as exc:
            pytest.skip(f"no unshare: {exc}")
        procs.append(proc)
        line = proc.stdout.readline().decode().strip() if proc.stdout else ""
        if not line:
            pytest.skip(f"cannot make a pid namespace here: {proc.stderr.read().decode() if proc.stderr else ''}")
        return line

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_marker_written_in_another_pid_namespace_is_honoured_not_deleted(root, container):
    """A real container sharing our host name (`unshare --pid`): its job's marker names a pid of its own namespace
    (1 or so, some other process here, or none); the checkpoint stays protected and the marker stays."""
    marker = container("import sys, time; from supervisor.checkpoints import mark_in_use; "
                       "print(mark_in_use(sys.argv[1], sys.argv[1] + '/step_00000010'), flush=True); time.sleep(60)")
    assert in_use(root) == {root / "step_00000010"} and os.path.exists(marker)
    r = fsup("checkpoints", "prune", "--dir", root, "--keep-last", "1")
    assert r.returncode == 0 and (root / "step_00000010").is_dir() and os.path.exists(marker)


def test_a_claim_taken_in_another_pid_namespace_refuses_and_stays(root, container):
    """The same for the root claim: a supervisor in the container holds the root, ours is refused naming it, and
    its claim file is not taken over as "its supervisor is gone"."""
    path = container("import sys, time; from supervisor.checkpoints.claim import RootClaim; c = RootClaim(sys.argv[1], "
                     "job=None, config='/c/job.toml', run_dir='/c/run', refresh_s=300); c.acquire(); "
                     "print(c.path, flush=True); time.sleep(60)")
    with pytest.raises(ClaimedError, match="config /c/job.toml"):
        RootClaim(root, job=None, config="/me/job.toml", run_dir="/me/run", refresh_s=300).acquire()
    assert os.path.exists(path)
