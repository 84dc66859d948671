"""Issue 35 item 9: a stop whose emergency checkpoint hit a real ENOSPC is reported as a failed stop.

The checkpoint root is a small tmpfs (we run as root in CI; skipped where this process may not mount one). The job
holds after step 8 (its save of step 5 committed); the test fills the file system, stops the supervisor, lets the
job go: its emergency save of step 8 dies with ENOSPC on every rank.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import HOOKED_ENTRY
from tests.integration.test_supervisor_torchrun import FAST, TIMEOUT, TORCHRUN, TRAIN, state
from tests.jobs.hooked_trainer import HOLD_TRAIN_STEP_ENV, HOLD_TRAIN_UNTIL_ENV
from tests.mounts import tmpfs
from tests.supervise import Supervisors, supervisors, wait_for, write_config  # noqa: F401


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "disk", "16m", "a real ENOSPC needs a small file system") as mnt:
        yield mnt


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("fault", "why"), [("full", "checkpoint disk full"), ("ro", "is on a read-only file system")])
def test_emergency_save_on_a_full_disk_is_a_failed_stop(tmp_path: Path, disk: Path, supervisors: Supervisors,
                                                        fault: str, why: str) -> None:
    """`run` exits 0 (stopped, as asked: docs/operations.md), and status, the history and the log say the stop's
    checkpoint was not written and why: `emergency_save_failed`, the attempt's real exit code, the full disk; or
    the root remounted read-only (the reason said only "the job exited with 1 while saving": the EROFS was in
    the workers' output, torchrun's error file holds its own SignalException)."""
    root, go = disk / "ckpts", tmp_path / "go"
    args = [a if a != "ckpts" else str(root) for a in TRAIN[2:]]
    cfg = write_config(tmp_path, [*TORCHRUN, str(HOOKED_ENTRY), *args], FAST)
    cfg.write_text(cfg.read_text().replace('dir = "ckpts"', f"dir = {json.dumps(str(root))}").replace(
        'env = { OMP_NUM_THREADS = "1" }',
        f'env = {{ OMP_NUM_THREADS = "1", {HOLD_TRAIN_STEP_ENV} = "8", {HOLD_TRAIN_UNTIL_ENV} = {json.dumps(str(go))} }}'))
    p = supervisors.start(cfg)
    wait_for(lambda: ((state(tmp_path).get("latest_checkpoint") or {}).get("step") or 0) >= 5, TIMEOUT, "step 5 saved")
    if fault == "ro":
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True, timeout=30)
    else:
        st = os.statvfs(disk)
        with open(disk / "filler.bin", "wb") as f:  # another writer takes the rest of the disk
            os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize - 4096)
    p.send_signal(signal.SIGINT)
    log_path = tmp_path / ".fsdp-supervisor" / "supervisor.log"
    wait_for(lambda: '"stopping"' in log_path.read_text(), 60, "the stop")
    go.with_name("go.8").touch()
    out, _ = p.communicate(timeout=180)
    assert p.returncode == 0, out[-3000:]
    st = state(tmp_path)
    assert st["state"] == "stopped" and re.search(r"emergency checkpoint of step \d+ was not written", st["reason"]), st
    assert why in st["reason"] and st["last_exit"]["code"] not in (None, 0), st
    events = [json.loads(line) for line in log_path.read_text().splitlines()]
    failed = [e for e in events if e["event"] == "emergency_save_failed"]
    assert len(failed) == 1 and failed[0]["code"] not in (None, 0) and why in failed[0]["reason"], events[-5:]
    history = [json.loads(line) for line in (tmp_path / ".fsdp-supervisor" / "history.jsonl").read_text().splitlines()]
    exits = [r for r in history if r.get("kind") == "attempt_exit"]
    assert exits and exits[-1]["code"] not in (None, 0) and "not written" in exits[-1]["detail"], history[-4:]
    shown = subprocess.run([*TORCHRUN[:1], "-m", "supervisor", "status", "-c", str(cfg)], capture_output=True,
                           text=True, timeout=60).stdout
    assert "was not written" in shown, shown
