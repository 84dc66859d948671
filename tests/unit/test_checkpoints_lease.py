"""Tests for supervisor.checkpoints.lease: the one lease of claims and in-use markers (a table, then files)."""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from supervisor.checkpoints import in_use
from supervisor.checkpoints.lease import Here, Lease, lease_state
from supervisor.host.boot import boot_id, pid_namespace, start_ticks
from tests.jobs.dcp_files import write_checkpoint

NOW = 1_700_000_000.0
HERE = Here("node-a", pidns=111, boot="b1")


def started(pid: int) -> int | None:
    return {42: 5, 43: 99}.get(pid)  # 42 runs (since tick 5), 43 is another process now, the rest are gone


def lease(*, host: str = "node-a", pid: int = 42, start: int | None = 5, pidns: int | None = 111,
          boot: str | None = "b1", written: float | None = NOW) -> Lease:
    return Lease(path=Path("x.json"), host=host, pid=pid, start=start, pidns=pidns, boot=boot, written=written)


@pytest.mark.parametrize(("ls", "stale"), [
    (lease(), None),  # this host, its process runs with its start ticks
    (lease(pid=43), "pid 43 is another process now"),
    (lease(pid=44), "its process (pid 44) is gone"),
    (lease(start=None), None),  # no start recorded: the pid alone
    (lease(boot="b0"), "rebooted"),  # the same pid and ticks after a reboot are another process
    (lease(pidns=None, boot=None), None),  # fields unknown: judged on this host
    # A container sharing our host name (another pid namespace): its pid means nothing here, whether some process
    # of ours has that number (44: none) or not; it lives by its refreshes, like a lease from another host.
    (lease(pid=44, pidns=222), None),
    (lease(pid=43, pidns=222, written=NOW - 3599), None),
    (lease(pid=44, pidns=222, written=NOW - 3601), "last refreshed"),
    (lease(host="node-b", pid=44), None),
    (lease(host="node-b", written=NOW - 3601), "last refreshed"),
    (lease(host="node-b", written=None), "no usable time"),  # dated in the future: never live forever
])
def test_lease_state(ls: Lease, stale: str | None) -> None:
    why = lease_state(ls, here=HERE, now=NOW, started=started, max_age=3600)
    assert why is None if stale is None else stale in (why or "")


def test_a_marker_from_a_container_with_our_host_name_protects_and_stays(tmp_path: Path) -> None:
    """The in-use marker of a job in a container that shares our host name (another pid namespace, a pid that is
    no process here): its checkpoint is protected and the marker is left in place, never judged stale by pid."""
    root = tmp_path / "ckpts"
    for step in (10, 20):
        write_checkpoint(root, step)
    folder = root.parent / ".ckpts.fsdp-inuse"
    folder.mkdir(mode=0o700)
    other_ns = (pid_namespace() or 0) + 1
    gone = next(p for p in range(4_000_000, 4_100_000) if start_ticks(p) is None)
    marker = folder / f"{socket.gethostname()}-{gone}-{other_ns}.json"
    doc = {"host": socket.gethostname(), "pidns": other_ns, "boot": boot_id(), "pid": gone, "start": 7,
           "time": time.time(), "path": str(root / "step_00000010")}
    marker.write_text(json.dumps(doc))
    assert in_use(root) == {root / "step_00000010"} and marker.exists()
    marker.write_text(json.dumps({**doc, "time": 0}))  # not refreshed for 7 hours: its writer is gone
    os.utime(marker, (time.time() - 7 * 3600,) * 2)
    assert in_use(root) == set() and not marker.exists()
