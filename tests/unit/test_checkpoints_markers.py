"""Tests for supervisor.checkpoints.markers: pin and quarantine marker files."""
from __future__ import annotations

import json

import pytest

from supervisor.checkpoints import (
    checkpoint_in_root,
    is_pinned,
    is_quarantined,
    pin,
    quarantine,
    quarantine_reason,
    unpin,
    unquarantine,
)
from supervisor.errors import CheckpointError
from supervisor.layout import PIN_MARKER, QUARANTINE_MARKER
from tests.jobs.dcp_files import write_checkpoint


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


class TestOnlyOurMarkers:
    """Markers are written and removed only when ours: an entry under a marker name we did not write is kept."""

    @pytest.mark.parametrize(("name", "undo"), [(PIN_MARKER, unpin), (QUARANTINE_MARKER, unquarantine)])
    @pytest.mark.parametrize("theirs", [b"mine", b"{}", b'{"time": 1, "owner": "me"}', b'{"by": "me", "time": 1}'])
    def test_a_marker_we_did_not_write_is_never_removed(self, tmp_path, name, undo, theirs):
        """A user's own `.pinned` (any content but ours) is refused by unpin, naming it, and stays."""
        d = write_checkpoint(tmp_path, 1)
        (d / name).write_bytes(theirs)
        with pytest.raises(CheckpointError, match=f"{name}: not a marker fsdp-supervisor wrote"):
            undo(d)
        assert (d / name).read_bytes() == theirs

    def test_a_symlink_or_folder_under_the_marker_name_is_kept(self, tmp_path):
        """Neither a symlink (never followed) nor a folder is ours."""
        d = write_checkpoint(tmp_path, 1)
        (tmp_path / "target").write_text("x")
        (d / PIN_MARKER).symlink_to(tmp_path / "target")
        (d / QUARANTINE_MARKER).mkdir()
        with pytest.raises(CheckpointError, match="symlink"):
            unpin(d)
        with pytest.raises(CheckpointError, match="not a regular file"):
            unquarantine(d)
        assert (d / PIN_MARKER).is_symlink() and (d / QUARANTINE_MARKER).is_dir()

    def test_ours_are_removed_and_one_without_by_is_not_ours(self, tmp_path):
        """What we write (`by`) is ours; a marker without `by` is someone else's (no release ever wrote one)."""
        d = write_checkpoint(tmp_path, 1)
        pin(d)
        assert json.loads((d / PIN_MARKER).read_text())["by"] == "fsdp-supervisor" and unpin(d)
        (d / PIN_MARKER).write_text('{"time": 1700000000.5}')
        with pytest.raises(CheckpointError, match="not the JSON object"):
            unpin(d)
        assert is_pinned(d)

    def test_pin_keeps_a_marker_it_did_not_write(self, tmp_path):
        """An entry already named `.pinned` pins the dir (any entry counts): pin leaves it as it is."""
        d = write_checkpoint(tmp_path, 1)
        (d / PIN_MARKER).write_bytes(b"mine")
        pin(d)
        assert (d / PIN_MARKER).read_bytes() == b"mine" and is_pinned(d)


class TestCheckpointInRoot:
    """What pin, unpin and unquarantine may act on: a checkpoint directly under the configured root."""

    def test_a_checkpoint_of_the_root_is_accepted_also_through_a_symlinked_root(self, tmp_path):
        """Compared resolved: the root named through a symlink, the checkpoint through its real path, or both."""
        real = tmp_path / "scratch" / "ckpts"
        d = write_checkpoint(real, 10)
        (tmp_path / "ckpts").symlink_to(real)
        assert checkpoint_in_root(d, tmp_path / "ckpts") == d
        assert checkpoint_in_root(tmp_path / "ckpts" / d.name, real) == tmp_path / "ckpts" / d.name

    @pytest.mark.parametrize(("make", "why"), [
        (lambda root: root.parent / "etc", "not in the checkpoint root"),  # `pin /etc`
        (lambda root: root, "not in the checkpoint root"),
        (lambda root: root / "notes", "not a checkpoint"),
        (lambda root: root / ".tmp-step_00000050-abc", "a save in flight"),
        (lambda root: root / "step_00000010" / "sub", "not in the checkpoint root"),
    ])
    def test_anything_else_is_refused(self, tmp_path, make, why):
        """A folder outside the root, the root itself, a plain folder in it, a save in flight, a folder inside a
        checkpoint: CheckpointError naming why."""
        root = tmp_path / "ckpts"
        write_checkpoint(root, 10)
        write_checkpoint(root, 50, name=".tmp-step_00000050-abc")
        path = make(root)
        path.mkdir(exist_ok=True)
        (path / "file.txt").write_text("x")
        with pytest.raises(CheckpointError, match=why):
            checkpoint_in_root(path, root)

    def test_a_member_names_its_checkpoint(self, tmp_path):
        """`checkpoint_0/optimizer_0` is refused and names the folder to act on."""
        root = tmp_path / "ckpts"
        for member in ("pytorch_model_fsdp_0", "optimizer_0"):
            write_checkpoint(root / "checkpoint_0", 0, name=member, manifest=False)
        with pytest.raises(CheckpointError, match="name .*checkpoint_0 instead"):
            checkpoint_in_root(root / "checkpoint_0" / "optimizer_0", root)
        assert checkpoint_in_root(root / "checkpoint_0", root) == root / "checkpoint_0"
