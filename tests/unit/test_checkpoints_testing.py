"""Tests for tests.jobs.dcp_files: torch-free checkpoints that real torch also accepts."""
from __future__ import annotations

from supervisor.checkpoints import verify
from tests.jobs.dcp_files import write_checkpoint


class TestWriteCheckpoint:
    def test_written_checkpoint_is_complete_with_manifest(self, tmp_path):
        """write_checkpoint() produces a dir the store calls complete, with the manifest's metrics."""
        d = write_checkpoint(tmp_path, 12, shards=4, metrics={"loss": 3.0})
        v = verify(d)
        assert v.complete and v.manifest.step == 12 and v.manifest.world_size == 4
        assert sorted(p.name for p in d.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
