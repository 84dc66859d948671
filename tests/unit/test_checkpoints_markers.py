"""Tests for supervisor.checkpoints.markers: pin and quarantine marker files."""
from __future__ import annotations

import json

import pytest

from supervisor.checkpoints import (
    is_pinned,
    is_quarantined,
    pin,
    quarantine,
    quarantine_reason,
    unpin,
    unquarantine,
)
from supervisor.checkpoints.testing import write_checkpoint
from supervisor.errors import CheckpointError
from supervisor.layout import PIN_MARKER, QUARANTINE_MARKER


class TestPin:
    def test_pin_then_unpin(self, tmp_path):
        """pin() creates the marker, unpin() removes it and reports that there was one."""
        d = write_checkpoint(tmp_path, 1)
        assert not is_pinned(d)
        pin(d)
        assert is_pinned(d) and (d / PIN_MARKER).is_file()
        assert unpin(d) is True
        assert not is_pinned(d) and unpin(d) is False

    def test_pinning_does_not_break_completeness(self, tmp_path):
        """A pinned checkpoint with a manifest still verifies complete (markers are not shards)."""
        from supervisor.checkpoints import verify

        d = write_checkpoint(tmp_path, 1)
        pin(d)
        quarantine(d, "x")
        assert verify(d).complete

    def test_missing_dir_raises(self, tmp_path):
        """Pinning a path that does not exist is a CheckpointError naming it."""
        with pytest.raises(CheckpointError, match="nope"):
            pin(tmp_path / "nope")

    def test_symlinked_dir_is_refused(self, tmp_path):
        """Markers are never written through a symlink."""
        d = write_checkpoint(tmp_path, 1)
        (tmp_path / "link").symlink_to(d)
        with pytest.raises(CheckpointError, match="not a checkpoint directory"):
            pin(tmp_path / "link")
        assert not is_pinned(d)

    @pytest.mark.parametrize("member", ["optimizer_0", "optim/fsdp"])
    def test_member_of_a_nested_checkpoint_is_refused(self, tmp_path, member):
        """Pinning `checkpoint_0/optimizer_0` said "pinned" and retention still deleted checkpoint_0."""
        folder = tmp_path / "checkpoint_0"
        write_checkpoint(folder, 0, name="pytorch_model_fsdp_0", manifest=False)
        write_checkpoint(folder, 0, name=member, manifest=False)
        with pytest.raises(CheckpointError, match="pin .*checkpoint_0 instead"):
            pin(folder / member)
        assert not is_pinned(folder / member)
        pin(folder)
        assert is_pinned(folder)


class TestQuarantine:
    def test_reason_and_time_are_recorded(self, tmp_path):
        """quarantine() writes JSON with the reason and a time; quarantine_reason() reads it back."""
        d = write_checkpoint(tmp_path, 1)
        assert quarantine_reason(d) is None
        quarantine(d, "job crashed 3 times right after loading")
        body = json.loads((d / QUARANTINE_MARKER).read_text())
        assert body["reason"] == "job crashed 3 times right after loading" and body["time"] > 0
        assert quarantine_reason(d) == body["reason"] and is_quarantined(d)

    def test_unreadable_marker_still_quarantines(self, tmp_path):
        """A garbled marker still counts: when in doubt, do not resume from it."""
        d = write_checkpoint(tmp_path, 1)
        (d / QUARANTINE_MARKER).write_text("{garbage")
        assert is_quarantined(d) and quarantine_reason(d)

    def test_unquarantine_removes_the_marker(self, tmp_path):
        """unquarantine() clears the marker and reports whether there was one."""
        d = write_checkpoint(tmp_path, 1)
        quarantine(d, "x")
        assert unquarantine(d) is True and not is_quarantined(d) and unquarantine(d) is False
