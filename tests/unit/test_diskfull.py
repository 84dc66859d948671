"""Disk full, the pure part: when the supervisor adds "checkpoint disk full" to a failed attempt's reason.

The real ENOSPC mid-save, the classified crash, retention and the resume: tests/integration/test_diskfull.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from supervisor import checkpoints as store
from supervisor.checkpoints import DiskUsage
from supervisor.config import load_config
from supervisor.daemon.housekeeping import Housekeeper
from tests.chaos import (
    job_config,
)
from tests.jobs.dcp_files import write_checkpoint


class TestFullDiskNote:
    @pytest.mark.parametrize(("free", "noted"), [(0, True), (10, True), (10**12, False)])
    def test_note_only_when_another_checkpoint_cannot_fit(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          free: int, noted: bool) -> None:
        """A failed attempt gets "checkpoint disk full" only when free space is below one checkpoint's size."""
        write_checkpoint(tmp_path / "ckpts", 5)
        cfg = job_config(tmp_path, "")
        house = Housekeeper(load_config(cfg), log=None, now=lambda: 0.0)
        house.absorb(house.run_pass(generation=0, protect=()))
        monkeypatch.setattr(store, "disk_usage", lambda root: DiskUsage(total_bytes=10**12, free_bytes=free))
        note = house.full_disk_note()
        assert (note is not None and "checkpoint disk full" in note) == noted, note

    def test_no_note_without_a_checkpoint(self, tmp_path: Path) -> None:
        """With no checkpoint yet there is no size to compare with: no note."""
        house = Housekeeper(load_config(job_config(tmp_path, "")), log=None, now=lambda: 0.0)
        assert house.full_disk_note() is None
