"""Tests for supervisor.checkpoints.verify: completeness classes and their human reasons."""
from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
from checkpoints_dcp_writer import run_writer

from supervisor.checkpoints import verify
from supervisor.layout import METADATA_NAME, tmp_dir_name

SHARD = "__0_0.distcp"  # the one storage file of a single-process dcp.save


@pytest.fixture(scope="module")
def torch_ckpt(tmp_path_factory) -> Path:
    """A checkpoint written by the installed torch's single-process dcp.save (read-only template)."""
    out = tmp_path_factory.mktemp("torch-ckpt")
    run_writer("single", out)
    return out / "step_00000010"


@pytest.fixture
def real(torch_ckpt, tmp_path) -> Path:
    """A private copy of the torch-written checkpoint that a test may damage."""
    root = tmp_path / "root"
    root.mkdir()
    return Path(shutil.copytree(torch_ckpt, root / torch_ckpt.name))


class _Evil:
    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


class TestTorchWrittenTraps:
    def test_intact_checkpoint_is_complete(self, real):
        """An untouched torch-written checkpoint is complete with no reason."""
        v = verify(real)
        assert (v.state, v.reason, v.complete) == ("complete", None, True)

    def test_truncated_shard_is_torn_and_named(self, real):
        """A shard cut short is torn, and the reason names the shard and both sizes."""
        size = (real / SHARD).stat().st_size
        os.truncate(real / SHARD, size - 1)
        v = verify(real)
        assert v.state == "torn"
        assert SHARD in v.reason and str(size - 1) in v.reason and str(size) in v.reason

    def test_missing_shard_is_torn(self, real):
        """A deleted shard is torn with a reason saying it is missing."""
        (real / SHARD).unlink()
        v = verify(real)
        assert (v.state, v.reason) == ("torn", f"shard {SHARD} is missing")

    def test_missing_metadata_is_partial(self, real):
        """Shards without .metadata are a save that did not finish: partial."""
        (real / METADATA_NAME).unlink()
        v = verify(real)
        assert v.state == "partial" and METADATA_NAME in v.reason

    def test_garbage_metadata_is_invalid(self, real):
        """Overwriting .metadata with garbage makes the dir invalid, not torn or complete."""
        (real / METADATA_NAME).write_bytes(b"\x80\x04garbage")
        v = verify(real)
        assert v.state == "invalid" and "bad .metadata" in v.reason

    def test_file_creating_metadata_is_invalid_and_inert(self, real, tmp_path):
        """A .metadata that would create a file when unpickled is invalid and the file never appears."""
        target = tmp_path / "pwned"
        (real / METADATA_NAME).write_bytes(pickle.dumps(_Evil(target)))
        v = verify(real)
        assert v.state == "invalid" and "unsafe" in v.reason
        assert not target.exists()

    @pytest.mark.parametrize("replacement,why", [(b"../_0.distcp", "escapes"), (b"/tmp/outside", "absolute")])
    def test_storage_path_leaving_the_dir_is_invalid(self, real, replacement, why):
        """Rewriting the shard path in torch's own metadata to `..` or an absolute path is invalid."""
        data = (real / METADATA_NAME).read_bytes()
        assert data.count(SHARD.encode()) == 1 and len(replacement) == len(SHARD)
        (real / METADATA_NAME).write_bytes(data.replace(SHARD.encode(), replacement))
        v = verify(real)
        assert v.state == "invalid" and why in v.reason

    def test_symlinked_shard_is_invalid(self, real, tmp_path):
        """A shard replaced by a symlink to an identical file outside the dir is invalid."""
        outside = tmp_path / "outside.distcp"
        shutil.copy(real / SHARD, outside)
        (real / SHARD).unlink()
        (real / SHARD).symlink_to(outside)
        v = verify(real)
        assert v.state == "invalid" and "symlink" in v.reason

    def test_symlinked_checkpoint_dir_is_invalid(self, real, tmp_path):
        """A checkpoint dir that is a symlink to a complete checkpoint elsewhere is invalid."""
        link = real.parent / "step_00000099"
        link.symlink_to(real)
        v = verify(link)
        assert v.state == "invalid" and "symlink" in v.reason

    def test_temporary_name_is_partial_even_when_whole(self, real):
        """A complete checkpoint still under its temporary name is partial."""
        tmp = real.parent / tmp_dir_name(10, "abc")
        real.rename(tmp)
        assert verify(tmp).state == "partial"
