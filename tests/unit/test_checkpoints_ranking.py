"""Tests for supervisor.checkpoints.ranking: listing a root, ranking, and the newest complete checkpoint."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

import supervisor.checkpoints.ranking as scan_module
from supervisor.checkpoints import (
    CheckpointInfo,
    DiskUsage,
    RetentionRules,
    newest_complete,
    plan_retention,
    quarantine,
    scan,
)
from supervisor.checkpoints.retention import GIB
from supervisor.errors import CheckpointError
from supervisor.layout import METADATA_NAME, tmp_dir_name
from tests.jobs.dcp_files import write_checkpoint


def _tear(d: Path) -> Path:
    (d / "__1_0.distcp").unlink()
    return d


def _set_mtime(d: Path, t: float) -> None:
    os.utime(d / METADATA_NAME, (t, t))


class TestScan:
    def test_lists_newest_first_with_states(self, tmp_path):
        """scan() lists every child newest first, with complete, torn and partial states."""
        write_checkpoint(tmp_path, 10)
        _tear(write_checkpoint(tmp_path, 30))
        (tmp_path / "step_00000040").mkdir()
        write_checkpoint(tmp_path, 20)
        infos = scan(tmp_path)
        assert [(i.step, i.state) for i in infos] == [(40, "partial"), (30, "torn"), (20, "complete"), (10, "complete")]
        assert all(i.path == tmp_path / i.name and i.path.is_absolute() for i in infos)
        assert all(i.reason is None for i in infos if i.complete)
        assert all(i.reason for i in infos if not i.complete)

    def test_reports_size_and_metrics(self, tmp_path):
        """Each entry carries the dir's total bytes and the manifest metrics."""
        d = write_checkpoint(tmp_path, 5, metrics={"loss": 1.25, "acc": 0.5})
        (info,) = scan(tmp_path)
        assert info.size_bytes == sum(p.stat().st_size for p in d.iterdir())
        assert info.metrics == {"loss": 1.25, "acc": 0.5}

    @pytest.mark.parametrize("names,order", [
        (["step_120", "step-9", "epoch_12"], ["step_120", "epoch_12", "step-9"]),
        (["ckpt_000120", "global_step121", "ckpt_000119"], ["global_step121", "ckpt_000120", "ckpt_000119"]),
    ])
    def test_step_comes_from_the_trailing_integer(self, tmp_path, names, order):
        """Names without a manifest rank by their trailing integer, in any of the common spellings."""
        for n in names:
            write_checkpoint(tmp_path, 0, name=n, manifest=False)
        assert [i.name for i in scan(tmp_path)] == order

    def test_manifest_step_is_used_when_the_name_has_none(self, tmp_path):
        """A dir named `best` ranks by its manifest step."""
        write_checkpoint(tmp_path, 50, name="best")
        write_checkpoint(tmp_path, 40)
        assert [(i.name, i.step) for i in scan(tmp_path)] == [("best", 50), ("step_00000040", 40)]

    def test_stepless_dirs_come_after_stepped_ones_by_mtime(self, tmp_path):
        """Dirs with no step at all follow the stepped ones, newest .metadata mtime first."""
        for name, t in (("alpha", 3000.0), ("beta", 2000.0)):
            _set_mtime(write_checkpoint(tmp_path, 0, name=name, manifest=False), t)
        _set_mtime(write_checkpoint(tmp_path, 1), 1000.0)
        assert [i.name for i in scan(tmp_path)] == ["step_00000001", "alpha", "beta"]

    def test_equal_steps_tie_break_by_mtime(self, tmp_path):
        """Two dirs with the same step are ordered by .metadata mtime, newest first."""
        _set_mtime(write_checkpoint(tmp_path, 0, name="step_7", manifest=False), 1000.0)
        _set_mtime(write_checkpoint(tmp_path, 0, name="step-7", manifest=False), 2000.0)
        assert [i.name for i in scan(tmp_path)] == ["step-7", "step_7"]

    def test_temporary_dirs_are_listed_as_partial(self, tmp_path):
        """A `.tmp-` dir is listed (retention needs it) as partial."""
        write_checkpoint(tmp_path, 3, name=tmp_dir_name(3, "n0nce"))
        (info,) = scan(tmp_path)
        assert (info.state, info.step) == ("partial", 3)

    def test_other_programs_tmp_dirs_are_foreign(self, tmp_path):
        """`.tmp-notes/` (not `.tmp-step_<N>-<nonce>`) was 'temporary', partial, and deleted once idle; the
        trainer's set-aside `.tmp-step_<N>-incomplete-<nonce>` is still temporary."""
        (tmp_path / ".tmp-notes").mkdir()
        (tmp_path / ".tmp-notes" / "todo.txt").write_text("keep me")
        write_checkpoint(tmp_path, 4, name=".tmp-step_00000004-incomplete-abc")
        states = {i.name: i.state for i in scan(tmp_path)}
        assert states == {".tmp-notes": "foreign", ".tmp-step_00000004-incomplete-abc": "partial"}

    def test_a_trash_folder_is_foreign_and_plain_files_are_skipped(self, tmp_path):
        """A `.trash` folder (ours is next to the root, never in it) and regular files in the root are not checkpoints."""
        write_checkpoint(tmp_path / ".trash", 99)
        (tmp_path / "notes.txt").write_text("hi")
        write_checkpoint(tmp_path, 1)
        assert [(i.name, i.state) for i in scan(tmp_path)] == [("step_00000001", "complete"), (".trash", "foreign")]

    def test_symlinked_dir_is_invalid_and_not_followed(self, tmp_path):
        """A symlink to a complete checkpoint outside the root is listed invalid with no size read through it."""
        outside = write_checkpoint(tmp_path / "elsewhere", 100)
        root = tmp_path / "root"
        root.mkdir()
        write_checkpoint(root, 1)
        (root / "step_00000100").symlink_to(outside)
        infos = scan(root)
        assert [(i.name, i.state, i.size_bytes) for i in infos][0] == ("step_00000100", "invalid", 0)
        assert "symlink" in infos[0].reason

    def test_a_torn_dir_being_rewritten_is_not_idle(self, tmp_path):
        """DCP saving again into an old torn step_100 (overwrite: the old `.metadata` stays while shards are
        rewritten) is torn with a fresh write: its age is that write, not the old commit, so it is not debris."""
        d = write_checkpoint(tmp_path, 100)
        hours_ago = time.time() - 7200
        for f in d.iterdir():
            os.utime(f, (hours_ago, hours_ago))
        (d / "__1_0.distcp").write_bytes(b"\0")  # being rewritten: short, and written just now
        (info,) = scan(tmp_path)
        assert info.state == "torn" and time.time() - info.mtime < 600
        plan = plan_retention([info], rules=RetentionRules(), disk=DiskUsage(GIB, GIB), now=time.time())
        assert plan.deletions == []

    def test_pin_and_quarantine_markers_are_reported(self, tmp_path):
        """Pinned and quarantined flags come from the marker files."""
        d = write_checkpoint(tmp_path, 1)
        quarantine(d, "crashed after load")
        (info,) = scan(tmp_path)
        assert info.quarantined and not info.pinned

    def test_missing_root_raises_naming_it(self, tmp_path):
        """A root that does not exist is a CheckpointError naming the path."""
        with pytest.raises(CheckpointError, match="does not exist") as err:
            scan(tmp_path / "missing")
        assert str(tmp_path / "missing") in str(err.value)

    def test_root_that_is_a_file_raises(self, tmp_path):
        """A root that is a file is a CheckpointError."""
        (tmp_path / "f").write_text("")
        with pytest.raises(CheckpointError, match="not a directory"):
            scan(tmp_path / "f")

    @pytest.mark.skipif(os.geteuid() == 0, reason="root reads unreadable dirs")
    def test_unreadable_root_raises(self, tmp_path):
        """A root without read permission is a CheckpointError."""
        root = tmp_path / "r"
        root.mkdir(mode=0)
        try:
            with pytest.raises(CheckpointError, match="cannot be read"):
                scan(root)
        finally:
            root.chmod(0o755)

    def test_lazy_scan_leaves_older_dirs_unverified(self, tmp_path):
        """verify_all=False verifies down to the newest complete and marks older dirs unverified."""
        write_checkpoint(tmp_path, 1)
        write_checkpoint(tmp_path, 2)
        _tear(write_checkpoint(tmp_path, 3))
        assert [i.state for i in scan(tmp_path, verify_all=False)] == ["torn", "complete", "unverified"]


class TestNewestComplete:
    def test_skips_torn_partial_temporary_and_quarantined(self, tmp_path):
        """The newest complete is below a torn, a partial, a temp and a quarantined newer dir."""
        write_checkpoint(tmp_path, 10)
        write_checkpoint(tmp_path, 20)
        quarantine(write_checkpoint(tmp_path, 30), "crash loop")
        _tear(write_checkpoint(tmp_path, 40))
        (tmp_path / "step_00000050").mkdir()
        write_checkpoint(tmp_path, 60, name=tmp_dir_name(60, "x"))
        best = newest_complete(tmp_path)
        assert best is not None and (best.name, best.step, best.complete) == ("step_00000020", 20, True)

    def test_none_when_nothing_is_complete(self, tmp_path):
        """An empty root, or one with only torn dirs, has no newest complete."""
        assert newest_complete(tmp_path) is None
        _tear(write_checkpoint(tmp_path, 1))
        assert newest_complete(tmp_path) is None

    def test_symlink_to_newer_complete_is_never_selected(self, tmp_path):
        """A symlink pointing at a newer complete checkpoint outside the root is never chosen."""
        outside = write_checkpoint(tmp_path / "elsewhere", 100)
        root = tmp_path / "root"
        write_checkpoint(root, 1)
        (root / "step_00000100").symlink_to(outside)
        assert newest_complete(root).name == "step_00000001"

    def test_stops_verifying_at_the_first_complete(self, tmp_path, monkeypatch):
        """Only dirs down to the newest complete are verified; older ones are never opened."""
        for step in range(1, 8):
            write_checkpoint(tmp_path, step)
        _tear(tmp_path / "step_00000007")
        seen = []
        real = scan_module.verify
        monkeypatch.setattr(scan_module, "verify", lambda p, **kw: seen.append(Path(p).name) or real(p, **kw))
        assert newest_complete(tmp_path).step == 6
        assert seen == ["step_00000007", "step_00000006"]

    def test_dir_vanishing_during_scan_is_skipped(self, tmp_path, monkeypatch):
        """A dir renamed away between listing and verifying (retention, trainer) is skipped, not an error."""
        write_checkpoint(tmp_path, 1)
        write_checkpoint(tmp_path, 2)
        real = scan_module.verify

        def vanish(p, **kw):
            if Path(p).name == "step_00000002":
                shutil.rmtree(p)
            return real(p, **kw)

        monkeypatch.setattr(scan_module, "verify", vanish)
        assert newest_complete(tmp_path).step == 1


def assert_only_the_run_is_resumed_and_pruned(root: Path, infos: dict[str, CheckpointInfo]) -> None:
    """The run's own step_00000030 is the newest; keep_last=1 deletes its step_10 and step_20, no copy."""
    newest = newest_complete(root)
    assert newest is not None and newest.name == "step_00000030"
    plan = plan_retention(list(infos.values()), rules=RetentionRules(keep_last=1, partial_max_age_s=0),
                          disk=DiskUsage(100 * GIB, 90 * GIB), protect=set(), now=time.time() + 1e6)
    assert sorted(d.name for d in plan.deletions) == ["step_00000010", "step_00000020"]


class TestACopiedSeriesInsideTheRoot:
    """A user copies checkpoints into `backup/` inside the root mid-run (issue 21): a copy, not a root set too high."""

    @pytest.fixture
    def root(self, tmp_path: Path) -> Path:
        r = tmp_path / "ckpts"
        for step in (10, 20, 30):
            write_checkpoint(r, step)
        for step in (10, 20):
            shutil.copytree(r / f"step_{step:08d}", r / "backup" / f"step_{step:08d}")
        return r

    def test_ignored_for_ranking_never_deleted_never_an_error(self, root: Path) -> None:
        from supervisor.checkpoints import check_root

        check_root(root)  # no CheckpointDirectoryError: the root has checkpoints of its own
        infos = {c.name: c for c in scan(root)}
        assert infos["backup"].state == "foreign" and "a copy: never touched" in (infos["backup"].reason or "")
        assert_only_the_run_is_resumed_and_pruned(root, infos)

    def test_a_root_holding_only_the_series_is_still_set_too_high(self, root: Path) -> None:
        """Without checkpoints of its own the same folder means the root is one level too high: refused."""
        from supervisor.checkpoints import CheckpointDirectoryError

        for step in (10, 20, 30):
            shutil.rmtree(root / f"step_{step:08d}")
        with pytest.raises(CheckpointDirectoryError, match="did you mean"):
            scan(root)


class TestACopyBesideTheOriginal:
    """`cp -a step_00000030 step_00000030.bak` in the root (issue 21, review): the copy's name carries no step, its
    manifest says 30, the original's name says 30. It tied with the original (same mtime after `cp -a`), outranked
    it, and retention deleted the run's own step_00000030 first and the user's copy later."""

    @pytest.fixture
    def root(self, tmp_path: Path) -> Path:
        r = tmp_path / "ckpts"
        for step in (10, 20, 30):
            write_checkpoint(r, step)
        for source, copy in [(30, "step_00000030.bak"), (30, "step_00000030-old"), (20, "step_20_backup")]:
            shutil.copytree(r / f"step_{source:08d}", r / copy)  # copy2: the mtimes too, as `cp -a` keeps them
        return r

    def test_foreign_never_resumed_from_never_deleted(self, root: Path) -> None:
        infos = {c.name: c for c in scan(root)}
        for copy in ("step_00000030.bak", "step_00000030-old", "step_20_backup"):
            assert infos[copy].state == "foreign" and "a copy of step_000000" in (infos[copy].reason or ""), copy
        assert_only_the_run_is_resumed_and_pruned(root, infos)

    def test_a_name_without_a_step_and_no_twin_is_still_a_checkpoint(self, tmp_path: Path) -> None:
        """The reference trainer's manifest gives the step of a dir named `latest` when no sibling's name has it."""
        write_checkpoint(tmp_path, 10)
        write_checkpoint(tmp_path, 20, name="latest")
        assert [(c.name, c.step, c.state) for c in scan(tmp_path)] == [("latest", 20, "complete"),
                                                                       ("step_00000010", 10, "complete")]

    def test_a_copy_stays_foreign_once_retention_pruned_its_original(self, root: Path) -> None:
        """Found by the setup matrix: `step_00000025.bak` was foreign only while `step_00000025` existed; once
        keep_last pruned the original, the copy ranked as step 25 again and the next pass deleted the user's copy.
        A name that carries the step its manifest says, with something after it, is a copy by its name alone."""
        for step in (20, 30):
            shutil.rmtree(root / f"step_{step:08d}")  # retention pruned the originals as the run went on
        write_checkpoint(root, 40)
        infos = {c.name: c for c in scan(root)}
        for copy in ("step_00000030.bak", "step_00000030-old", "step_20_backup"):
            assert infos[copy].state == "foreign" and "a copy" in (infos[copy].reason or ""), infos[copy]
        plan = plan_retention(list(infos.values()), rules=RetentionRules(keep_last=1, partial_max_age_s=0),
                              disk=DiskUsage(100 * GIB, 90 * GIB), protect=set(), now=time.time() + 1e6)
        assert sorted(d.name for d in plan.deletions) == ["step_00000010"]
