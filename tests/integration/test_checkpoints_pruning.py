"""Tests for supervisor.checkpoints.pruning: executing a retention plan on a real directory."""
from __future__ import annotations

import os
import subprocess
import sys

from supervisor.checkpoints import (
    DiskUsage,
    RetentionRules,
    execute_retention,
    plan_retention,
    scan,
)
from supervisor.checkpoints.retention import GIB


class TestTrash:
    """The trash sits next to the root, never in it: Accelerate sorts every entry of its folder by a number."""

    def test_accelerate_still_loads_after_a_prune(self, tmp_path):
        """tests/jobs/accelerate_like.py (Accelerate's load_state(): sorts every entry of checkpoints/ by its
        trailing number) resumes after `prune` deleted one of its checkpoints."""
        from tests.supervise import REPO

        script, project = REPO / "tests" / "jobs" / "accelerate_like.py", tmp_path / "project"

        def run(steps: int) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, str(script), "--project-dir", str(project), "--step-s", "0",
                                   "--steps", str(steps)], cwd=REPO, capture_output=True, text=True, timeout=60)

        assert run(15).returncode == 0
        root = project / "checkpoints"
        plan = plan_retention(scan(root), rules=RetentionRules(keep_last=2), disk=DiskUsage(GIB, GIB), now=0.0)
        assert [d.name for d in execute_retention(root, plan)] == ["checkpoint_0"]
        assert sorted(os.listdir(root)) == ["checkpoint_1", "checkpoint_2"]
        resumed = run(20)
        assert resumed.returncode == 0, resumed.stderr
        assert "Loading states from" in resumed.stdout and "checkpoint_2" in resumed.stdout
