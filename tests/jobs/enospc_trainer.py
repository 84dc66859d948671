"""TEST-ONLY torchrun entry: the reference trainer, but one checkpoint write fails with ENOSPC (no disk needed).

Used by tests/integration/test_diskfull.py when the test cannot mount a small tmpfs (not root). Environment:
FSDP_TEST_ENOSPC_STEP=N     the save of step N fails on rank FSDP_TEST_ENOSPC_RANK (default 1) ...
FSDP_TEST_ENOSPC_MARKER=F   ... once: the first failure creates F, later attempts write normally.
The failure is raised where DCP calls the storage writer, so DCP propagates it to every rank like a real one.
"""
from __future__ import annotations

import errno
import os
import runpy
import sys
from pathlib import Path
from typing import Any

import trainer.checkpoint
from supervisor.checkpoints.naming import name_step


class _FullDiskWriter(trainer.checkpoint.FileSystemWriter):  # type: ignore[misc, name-defined]
    def write_data(self, plan: Any, planner: Any) -> Any:
        marker = Path(os.environ["FSDP_TEST_ENOSPC_MARKER"])
        failing = name_step(Path(str(self.path)).name) == int(os.environ["FSDP_TEST_ENOSPC_STEP"])
        if failing and os.environ.get("RANK") == os.environ.get("FSDP_TEST_ENOSPC_RANK", "1") and not marker.exists():
            marker.touch()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        return super().write_data(plan, planner)


if __name__ == "__main__":
    trainer.checkpoint.FileSystemWriter = _FullDiskWriter  # type: ignore[attr-defined, misc]
    sys.argv[0] = "trainer"
    runpy.run_module("trainer", run_name="__main__", alter_sys=True)
