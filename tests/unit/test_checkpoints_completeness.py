"""Tests for supervisor.checkpoints.verify: completeness classes and their human reasons."""
from __future__ import annotations

import json

import pytest

from supervisor.checkpoints import verify
from supervisor.errors import CheckpointError
from supervisor.layout import MANIFEST_NAME, METADATA_NAME
from tests.jobs.dcp_files import storage_metadata_bytes, write_checkpoint, write_manifest


class TestSyntheticTraps:
    def test_empty_dir_is_partial(self, tmp_path):
        """An empty dir is partial: nothing says a save finished."""
        (tmp_path / "step_1").mkdir()
        assert verify(tmp_path / "step_1").state == "partial"

    def test_shard_that_is_a_directory_is_invalid(self, tmp_path):
        """A storage name that is a directory is invalid."""
        d = write_checkpoint(tmp_path, 1, manifest=False)
        (d / "__1_0.distcp").unlink()
        (d / "__1_0.distcp").mkdir()
        assert verify(d).state == "invalid"

    @pytest.mark.parametrize("name", [METADATA_NAME, MANIFEST_NAME])
    def test_metadata_or_manifest_that_is_a_directory_is_invalid(self, tmp_path, name):
        """A `.metadata` or `manifest.json` that is a folder (Eclipse keeps `.metadata/` in a workspace) is invalid."""
        d = write_checkpoint(tmp_path, 1)
        (d / name).unlink()
        (d / name).mkdir()
        v = verify(d)
        assert v.state == "invalid" and f"{name} is not a regular file" in v.reason

    def test_storage_path_that_names_no_file_is_invalid(self, tmp_path):
        """A storage path holding a lone surrogate (a 200-byte hostile pickle) is invalid, not a crash of the scan."""
        d = tmp_path / "step_1"
        d.mkdir()
        (d / METADATA_NAME).write_bytes(storage_metadata_bytes([("\ud800", 0, 4)]))
        v = verify(d)
        assert v.state == "invalid" and "not a valid file name" in v.reason

    def test_manifest_file_that_names_no_file_is_invalid(self, tmp_path):
        """A manifest listing a name with a lone surrogate (a JSON escape) is invalid, not a crash of the scan."""
        d = write_checkpoint(tmp_path, 1)
        doc = json.loads((d / MANIFEST_NAME).read_text())
        doc["files"]["\ud800"] = 1
        (d / MANIFEST_NAME).write_text(json.dumps(doc))
        v = verify(d)
        assert v.state == "invalid" and "not a valid file name" in v.reason

    def test_rank_local_metadata_is_invalid_not_an_unfinished_save(self, tmp_path):
        """dcp.save(use_collectives=False) ends with `__0.metadata` and no `.metadata` (torch 2.13, checked by hand):
        invalid (never resumed from, never deleted as debris), not partial."""
        d = write_checkpoint(tmp_path, 1, manifest=False)
        (d / METADATA_NAME).rename(d / "__0.metadata")
        v = verify(d)
        assert v.state == "invalid" and "use_collectives=False" in v.reason

    def test_many_problems_are_summarised(self, tmp_path):
        """With more problems than the reason lists, it says how many more."""
        d = tmp_path / "step_1"
        d.mkdir()
        (d / METADATA_NAME).write_bytes(storage_metadata_bytes([(f"s{i}", 0, 1) for i in range(5)]))
        v = verify(d)
        assert v.state == "torn" and "(+2 more)" in v.reason

    def test_invalid_outranks_torn(self, tmp_path):
        """A dir with a missing shard and an escaping path is invalid (the worse state)."""
        d = tmp_path / "step_1"
        d.mkdir()
        (d / METADATA_NAME).write_bytes(storage_metadata_bytes([("gone", 0, 1), ("../x", 0, 1)]))
        assert verify(d).state == "invalid"

    def test_missing_path_raises_naming_it(self, tmp_path):
        """verify() of a path that does not exist raises CheckpointError naming it."""
        with pytest.raises(CheckpointError, match="nope"):
            verify(tmp_path / "nope")

    def test_regular_file_raises(self, tmp_path):
        """verify() of a regular file raises CheckpointError."""
        (tmp_path / "f").write_text("x")
        with pytest.raises(CheckpointError, match="not a directory"):
            verify(tmp_path / "f")


class TestManifestChecks:
    def test_manifest_metrics_and_step_are_returned(self, tmp_path):
        """A complete dir with a manifest returns its step and metrics."""
        d = write_checkpoint(tmp_path, 7, metrics={"loss": 2.5})
        v = verify(d)
        assert v.complete and v.manifest.step == 7 and v.manifest.metrics == {"loss": 2.5}

    def test_size_mismatch_with_manifest_is_torn(self, tmp_path):
        """A shard bigger than DCP needs but different from the manifest's size is torn."""
        d = write_checkpoint(tmp_path, 7)
        with open(d / "__0_0.distcp", "ab") as f:
            f.write(b"x")
        v = verify(d)
        assert v.state == "torn" and "manifest says" in v.reason

    def test_file_listed_in_manifest_but_missing_is_torn(self, tmp_path):
        """A file the manifest lists, though DCP does not reference it, must exist."""
        d = write_checkpoint(tmp_path, 7, manifest=False)
        (d / "extra.bin").write_bytes(b"123")
        write_manifest(d, 7)
        (d / "extra.bin").unlink()
        v = verify(d)
        assert v.state == "torn" and "extra.bin" in v.reason

    def test_unparseable_manifest_is_invalid(self, tmp_path):
        """A manifest that is not JSON makes the dir invalid."""
        d = write_checkpoint(tmp_path, 7)
        (d / MANIFEST_NAME).write_text("{not json")
        assert verify(d).state == "invalid"

    def test_manifest_step_disagreeing_with_name_is_invalid(self, tmp_path):
        """A manifest saying step 8 in step_00000007 is invalid, so ranking by name stays honest."""
        d = write_checkpoint(tmp_path, 7)
        body = json.loads((d / MANIFEST_NAME).read_text())
        body["step"] = 8
        (d / MANIFEST_NAME).write_text(json.dumps(body))
        v = verify(d)
        assert v.state == "invalid" and "step 8" in v.reason

    def test_deep_detects_flipped_byte(self, tmp_path):
        """--deep catches a same-size corruption that only the checksum reveals."""
        d = write_checkpoint(tmp_path, 7, sha256=True)
        with open(d / "__1_0.distcp", "r+b") as f:
            f.write(b"\x01")
        assert verify(d).complete
        v = verify(d, deep=True)
        assert v.state == "torn" and "__1_0.distcp" in v.reason and "sha256" in v.reason

    def test_deep_passes_intact_and_says_it_checked(self, tmp_path):
        """--deep on an intact checkpoint with checksums is complete and marked checksummed."""
        v = verify(write_checkpoint(tmp_path, 7, sha256=True), deep=True)
        assert v.complete and v.checksummed

    def test_deep_without_checksums_is_not_marked_checked(self, tmp_path):
        """--deep without sha256 in the manifest stays complete but not checksummed."""
        v = verify(write_checkpoint(tmp_path, 7), deep=True)
        assert v.complete and not v.checksummed
