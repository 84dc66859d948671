"""Issue 35 item 4: the node-local tier is an optimisation, never a reason to stop (a real tmpfs, full or read-only).

Skipped where this process may not mount a tmpfs (we run as root in CI).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.checkpoints import scan
from tests.mounts import tmpfs
from tests.supervise import REPO, cli

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0"]


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "shm", "4m", "the tier's failures need a real file system") as mnt:
        (mnt / "ckpts").mkdir()
        yield mnt


def _run(tmp_path: Path, local: str = "shm/ckpts") -> tuple[subprocess.CompletedProcess[str], str, str]:
    """`run` of the reference trainer, saving to the local tier every 2 steps, durable every 6: (result, log, job's)."""
    cmd = [*TORCHRUN, "-m", "trainer", "--checkpoint-dir", str(tmp_path / "ckpts"), "--steps", "12", "--save-every", "6",
           "--local-save-every", "2", "--seed", "7", "--log-every", "1"]
    cfg = tmp_path / "job.toml"
    cfg.write_text(f"[job]\ncommand = {json.dumps(cmd)}\ncwd = {json.dumps(str(REPO))}\n"
                   'env = { OMP_NUM_THREADS = "1" }\n\n[checkpoints]\ndir = "ckpts"\n'
                   f"local_dir = {json.dumps(local)}\nkeep_last = 10\n"
                   "[restart]\nmax_no_progress_restarts = 1\n[health]\nstop_timeout_s = 20\n")
    r = cli("run", "-c", str(cfg), timeout=400)
    run_dir = tmp_path / ".fsdp-supervisor"
    job = "".join(p.read_text() for p in sorted((run_dir / "logs").glob("attempt-*.log")))
    return r, (run_dir / "supervisor.log").read_text(), job


@pytest.mark.timeout(600)
def test_a_full_tier_costs_its_saves_not_the_run(tmp_path: Path, shm: Path) -> None:
    """Every local save dies with ENOSPC: `local_save_failed errno=ENOSPC`, training goes on with its durable saves
    in one attempt, and the full tier holds no leftovers (it held five `.tmp-step_*` dirs and the run gave up);
    `status` (text and --json) shows the tier degraded, from the job's heartbeat."""
    st = os.statvfs(shm)
    with open(shm / "filler.bin", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize)
    r, log, job = _run(tmp_path)
    assert r.returncode == 0, r.stderr[-3000:] + job[-3000:]
    assert "event=local_save_failed" in job and "errno=ENOSPC" in job, job[-3000:]
    assert job.count("event=started ") == 1 and '"completed"' in log
    assert [c.step for c in scan(tmp_path / "ckpts") if c.complete] == [12, 6] or \
        sorted(c.step for c in scan(tmp_path / "ckpts") if c.complete) == [6, 12]
    assert sorted(os.listdir(shm / "ckpts")) == [], os.listdir(shm / "ckpts")
    state = json.loads(cli("status", "-c", str(tmp_path / "job.toml"), "--json").stdout)
    assert state["local_tier"].startswith("degraded: the job says: local save of step ") and \
        state["local_tier"].endswith("failed (ENOSPC)"), state
    assert "local tier" in (text := cli("status", "-c", str(tmp_path / "job.toml")).stdout) and "ENOSPC" in text, text


@pytest.mark.timeout(600)
def test_a_read_only_tier_is_a_warning_not_an_exit_2(tmp_path: Path, shm: Path) -> None:
    """`mount -o remount,ro`: `run` and the trainer both warn and train with durable saves only."""
    subprocess.run(["mount", "-o", "remount,ro", str(shm)], check=True, capture_output=True, timeout=30)
    r, log, job = _run(tmp_path)
    assert r.returncode == 0, r.stderr[-3000:] + job[-3000:]
    assert "event=local_tier_unusable" in job and "local_tier_unusable" in log, (job[-2000:], log[-2000:])
    state = json.loads((tmp_path / ".fsdp-supervisor" / "state.json").read_text())
    assert state["local_tier"].startswith("degraded: ") and "not writable" in state["local_tier"], state
    assert sorted(c.step for c in scan(tmp_path / "ckpts") if c.complete) == [6, 12]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("local", ["tierfile", "shm/new/ckpts"])
def test_a_tier_that_is_a_file_or_cannot_be_created_is_a_warning(tmp_path: Path, shm: Path, local: str) -> None:
    """A file where the tier should be, or a tier dir that a read-only tmpfs cannot make: `run` made them exit 2
    (make_dirs), although a read-only tier that exists was only a warning."""
    (tmp_path / "tierfile").write_text("not a dir")
    subprocess.run(["mount", "-o", "remount,ro", str(shm)], check=True, capture_output=True, timeout=30)
    r, log, job = _run(tmp_path, local)
    assert r.returncode == 0, r.stderr[-3000:] + job[-3000:]
    state = json.loads((tmp_path / ".fsdp-supervisor" / "state.json").read_text())
    assert state["local_tier"].startswith("degraded: ") and "local_tier_unusable" in log, state
    assert sorted(c.step for c in scan(tmp_path / "ckpts") if c.complete) == [6, 12]
