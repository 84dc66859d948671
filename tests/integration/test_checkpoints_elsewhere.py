"""Issue 35 item 1: a job that saves outside `[checkpoints] dir` is never relaunched from scratch in silence."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_supervisor_torchrun import FAST, TORCHRUN, state
from tests.supervise import REPO, Supervisors, supervisors, write_config  # noqa: F401

SCRIPT = REPO / "tests" / "jobs" / "user_dcp_script.py"


@pytest.mark.timeout(600)
def test_a_job_saving_elsewhere_is_not_relaunched_fresh(tmp_path: Path, supervisors: Supervisors) -> None:
    """The tutorial script saves `ckpts/epoch_N` while the config says `checkpoints`; it dies after saving epoch 2:
    exit 3 naming `ckpts` and the key to change, no second attempt, nothing of `ckpts` touched."""
    cmd = [*TORCHRUN, str(SCRIPT), "--ckpt-dir", "ckpts", "--epochs", "6", "--save-every", "2", "--crash-at-epoch", "3"]
    cfg = write_config(tmp_path, cmd, FAST)
    cfg.write_text(cfg.read_text().replace('"--resume"', '"--resume-from"').replace('dir = "ckpts"', 'dir = "checkpoints"'))
    p = supervisors.start(cfg)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 3, out[-3000:]
    st = state(tmp_path)
    assert st["state"] == "failed" and st["attempt"] == 1, st
    assert st["reason"].startswith("checkpoints_elsewhere: ") and str(tmp_path / "ckpts") in st["reason"], st["reason"]
    assert f'set [checkpoints] dir = "{tmp_path / "ckpts"}"' in st["reason"], st["reason"]
    events = [json.loads(line) for line in (tmp_path / ".fsdp-supervisor" / "supervisor.log").read_text().splitlines()]
    found = [e for e in events if e["event"] == "checkpoints_elsewhere"]
    assert len(found) == 1 and found[0]["dir"] == str(tmp_path / "ckpts") and found[0]["newest"].endswith("epoch_2")
    assert sorted(x.name for x in (tmp_path / "ckpts").iterdir()) == ["epoch_0", "epoch_2"]
    shown = subprocess.run([sys.executable, "-m", "supervisor", "status", "-c", str(cfg)], capture_output=True,
                           text=True, timeout=60, cwd=REPO).stdout
    assert "checkpoints_elsewhere" in shown, shown
