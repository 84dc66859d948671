"""Unit tests of trainer.commit: manifest contents and the atomic rename, checked by the supervisor's verify."""
from __future__ import annotations

import json

import pytest

from supervisor.checkpoints import verify
from supervisor.checkpoints.markers import is_quarantined, quarantine
from supervisor.layout import MANIFEST_FORMAT, MANIFEST_NAME, METADATA_NAME, tmp_dir_name
from tests.jobs.dcp_files import write_checkpoint
from trainer.commit import build_manifest, commit


def written_tmp(root, step: int):
    """A DCP dir as the writer leaves it: shards and `.metadata` under a temporary name, no manifest."""
    return write_checkpoint(root, step, name=tmp_dir_name(step, "abcd"), manifest=False)


class TestBuildManifest:
    def test_fields_and_file_sizes(self, tmp_path) -> None:
        """The manifest carries the documented fields and the size of every file except itself."""
        tmp = written_tmp(tmp_path, 12)
        (tmp / MANIFEST_NAME).write_text("stale")
        m = build_manifest(tmp, step=12, world_size=2, torch_version="2.13.0", metrics={"loss": 1.5}, now=7.0)
        on_disk = {p.name: p.stat().st_size for p in tmp.iterdir() if p.name != MANIFEST_NAME}
        assert m == {"format": MANIFEST_FORMAT, "step": 12, "world_size": 2, "time": 7.0, "loss": 1.5,
                     "torch_version": "2.13.0", "metrics": {"loss": 1.5}, "files": on_disk}
        assert METADATA_NAME in m["files"]

    def test_sha256_is_optional(self, tmp_path) -> None:
        """Checksums are added only on request, one per listed file."""
        tmp = written_tmp(tmp_path, 1)
        plain = build_manifest(tmp, step=1, world_size=1, torch_version="x", metrics={"loss": None})
        summed = build_manifest(tmp, step=1, world_size=1, torch_version="x", metrics={"loss": None}, sha256=True)
        assert "sha256" not in plain and set(summed["sha256"]) == set(summed["files"])


class TestCommit:
    def manifest(self, tmp, step: int, **kw) -> dict:
        return build_manifest(tmp, step=step, world_size=2, torch_version="t", metrics={"loss": 2.0}, **kw)

    def test_rename_makes_a_complete_checkpoint(self, tmp_path) -> None:
        """After commit the final dir exists, the temp name is gone and the supervisor calls it complete."""
        tmp = written_tmp(tmp_path, 8)
        final, created = commit(tmp, tmp_path / "step_00000008", self.manifest(tmp, 8, sha256=True))
        assert created and final.is_dir() and not tmp.exists()
        assert json.loads((final / MANIFEST_NAME).read_text())["step"] == 8
        assert verify(final).complete and verify(final, deep=True).complete

    def test_temporary_dir_is_never_complete(self, tmp_path) -> None:
        """Before the rename the supervisor refuses the dir, whatever it holds."""
        tmp = written_tmp(tmp_path, 8)
        assert not verify(tmp).complete

    def test_refuses_a_dir_without_metadata(self, tmp_path) -> None:
        """No `.metadata` means DCP did not finish: nothing is renamed."""
        tmp = written_tmp(tmp_path, 3)
        (tmp / METADATA_NAME).unlink()
        with pytest.raises(FileNotFoundError):
            commit(tmp, tmp_path / "step_00000003", {"step": 3})
        assert tmp.exists() and not (tmp_path / "step_00000003").exists()

    def test_existing_final_wins(self, tmp_path) -> None:
        """Re-saving a step that is already complete keeps the old one and removes the temp dir."""
        old = write_checkpoint(tmp_path, 4)
        before = (old / MANIFEST_NAME).read_bytes()
        tmp = written_tmp(tmp_path, 4)
        final, created = commit(tmp, old, self.manifest(tmp, 4))
        assert final == old and not created and not tmp.exists()
        assert (old / MANIFEST_NAME).read_bytes() == before

    def test_incomplete_final_is_set_aside_and_replaced(self, tmp_path) -> None:
        """A final dir that lost a shard is renamed to a temporary name and the new save takes its place."""
        old = write_checkpoint(tmp_path, 4)
        next(old.glob("*.distcp")).unlink()
        tmp = written_tmp(tmp_path, 4)
        final, created = commit(tmp, old, self.manifest(tmp, 4))
        assert created and verify(final).complete and not tmp.exists()
        aside = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-step_00000004-incomplete-")]
        assert len(aside) == 1 and not verify(aside[0]).complete

    def test_a_diverged_final_is_set_aside_and_replaced(self, tmp_path) -> None:
        """A rolled-back run saves a step its diverged predecessor saved too: the diverged save makes way."""
        old = write_checkpoint(tmp_path, 4)
        quarantine(old, "diverged: saved after the last normal loss before the onset at step 3 (nan)")
        tmp = written_tmp(tmp_path, 4)
        final, created = commit(tmp, old, self.manifest(tmp, 4))
        assert created and verify(final).complete and not is_quarantined(final) and not tmp.exists()

    def test_a_final_quarantined_for_crashes_stays(self, tmp_path) -> None:
        """A save quarantined because attempts died loading it is evidence: it wins like any complete one."""
        old = write_checkpoint(tmp_path, 4)
        quarantine(old, "2 consecutive attempts died while loading it")
        tmp = written_tmp(tmp_path, 4)
        final, created = commit(tmp, old, self.manifest(tmp, 4))
        assert not created and is_quarantined(final) and not tmp.exists()
