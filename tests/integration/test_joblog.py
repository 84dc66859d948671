"""A job that floods its output: the attempt log stays under its cap, and a small run-dir disk never fills.

The run dir lives on a small tmpfs the test mounts (skipped unless root). Observed before the cap: one attempt
wrote 3.9 GB in 8 s, the run dir's disk filled, the job's heartbeat (in the run dir) could no longer be
written, and the healthy job was killed as hung. Here the job writes several times the disk's size while it
beats; it must complete in one attempt with no hang, and the logs must stay within the cap (plus what one
tick lets the job write past it).
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mounts import tmpfs
from tests.supervise import Supervisors, supervisors, write_config  # noqa: F401

MIB = 2**20
DISK_MIB = 48
CAP_MIB = 4
# 400 steps of 256 KiB: 100 MiB of output, twice the disk. Each step rewrites the heartbeat (tmp + rename, as
# the trainer does) and a write that fails (ENOSPC) is skipped, as a job ignoring a full stdout would.
FLOOD = """
import json, os, sys, time
hb = os.environ["FSDP_SUPERVISOR_HEARTBEAT"]
chunk = (b"x" * 1023 + b"\\n") * 256
for step in range(1, 401):
    try:
        os.write(1, chunk)
    except OSError:
        pass
    try:
        with open(hb + ".tmp", "w") as f:
            f.write(json.dumps({"step": step, "time": time.time(), "phase": "train", "loss": 1.0}))
        os.replace(hb + ".tmp", hb)
    except OSError:
        pass
    time.sleep(0.02)
"""


@pytest.fixture
def run_disk(tmp_path: Path) -> Iterator[Path]:
    """A DISK_MIB tmpfs for the run dir, unmounted at teardown."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs for the run dir needs root")
    with tmpfs(tmp_path / "disk", f"{DISK_MIB}m", "the run dir's disk") as mnt:
        yield mnt


class TestFloodedOutput:
    def test_a_flooding_job_completes_and_its_log_stays_capped(self, tmp_path: Path, run_disk: Path,
                                                               supervisors: Supervisors) -> None:
        """100 MiB of output on a 48 MiB run-dir disk: one attempt, completed, no hang; logs within the cap."""
        run_dir = run_disk / "run"
        extra = (f"\n[health]\nhang_timeout_s = 2\n[supervisor]\nrun_dir = {json.dumps(str(run_dir))}\n"
                 f"job_log_max_bytes = {CAP_MIB * MIB}\n")
        p = supervisors.start(write_config(tmp_path, [sys.executable, "-c", FLOOD], extra))
        out, _ = p.communicate(timeout=120)
        events = [json.loads(line) for line in (run_dir / "supervisor.log").read_text().splitlines()]
        names = [e["event"] for e in events]
        assert p.returncode == 0 and "hang_detected" not in names, (out, names)
        assert names.count("job_started") == 1 and "completed" in names, names
        logs = run_dir / "logs"
        sizes = {f.name: f.stat().st_size for f in logs.iterdir()}
        assert set(sizes) <= {"attempt-0001.log", "attempt-0001.log.1"}, sizes
        assert sizes.get("attempt-0001.log.1") == CAP_MIB * MIB // 2  # the tail before the last rotation
        assert sum(sizes.values()) < DISK_MIB * MIB // 2, sizes
