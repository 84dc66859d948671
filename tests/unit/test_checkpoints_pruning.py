"""Tests for supervisor.checkpoints.pruning: executing a retention plan on a real directory."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import supervisor.checkpoints.pruning as pruning
from supervisor.checkpoints import (
    Deletion,
    DiskUsage,
    RetentionPlan,
    RetentionRules,
    clear_trash,
    disk_usage,
    execute_retention,
    newest_complete,
    pin,
    plan_retention,
    scan,
    trash_dir,
)
from supervisor.checkpoints.retention import GIB
from supervisor.errors import CheckpointError
from tests.fakes import RecordingLog
from tests.jobs.dcp_files import write_checkpoint


def _plan(*paths: Path) -> RetentionPlan:
    return RetentionPlan(deletions=[Deletion(p, p.name, "test", 0) for p in paths])


def _tree(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


NS = "1733239812000000000"  # a time_ns, as earlier versions named what they parked in <root>/.trash


def _trash(root: Path) -> Path:
    """Where the trash of `root` lives: next to it, never inside."""
    return root.parent / f".{root.name}.fsdp-trash"


class TestExecuteRetention:
    def test_deletes_targets_and_leaves_the_rest(self, tmp_path):
        """Planned dirs disappear entirely; others remain, and nothing of ours is left in the root."""
        root = tmp_path / "root"
        old, new = write_checkpoint(root, 1), write_checkpoint(root, 2)
        done = execute_retention(root, _plan(old))
        assert [d.name for d in done] == [old.name]
        assert not old.exists() and new.exists()
        assert os.listdir(root) == [new.name] and not os.listdir(_trash(root))

    def test_rename_only_parks_in_trash_until_cleared(self, tmp_path):
        """empty_trash=False only renames: the target vanishes from scans at once, clear_trash removes it."""
        root = tmp_path / "root"
        old, new = write_checkpoint(root, 1), write_checkpoint(root, 2)
        done = execute_retention(root, _plan(old), empty_trash=False)
        assert [d.name for d in done] == [old.name] and not old.exists()
        assert [c.name for c in scan(root)] == [new.name]
        assert len(os.listdir(_trash(root))) == 1
        assert clear_trash(root) == 1 and not os.listdir(_trash(root))

    def test_a_name_near_the_file_system_limit_can_still_go(self, tmp_path):
        """A 245-byte Lightning-style name: its trash name must stay under 255 bytes, or it is never deleted."""
        root = tmp_path / "root"
        old = write_checkpoint(root, 1, name="epoch=0-step=1-" + "é" * 112 + ".ckpt", manifest=False)
        write_checkpoint(root, 2)
        assert [d.name for d in execute_retention(root, _plan(old), empty_trash=False)] == [old.name]
        assert not old.exists() and len(os.listdir(_trash(root))) == 1

    def test_a_dir_renamed_into_a_planned_name_is_not_deleted(self, tmp_path):
        """Planned: an old torn step_100. Before the delete, the trainer's commit sets it aside and renames a
        fresh complete save to step_100 (the newest complete): that one is not the dir judged, so it stays."""
        root = tmp_path / "root"
        write_checkpoint(root, 90)
        torn = write_checkpoint(root, 100)
        (torn / "__1_0.distcp").unlink()
        plan = plan_retention(scan(root), rules=RetentionRules(), disk=DiskUsage(GIB, GIB), now=1e10)
        assert [d.name for d in plan.deletions] == ["step_00000100"]
        fresh = write_checkpoint(root, 100, name=".tmp-step_00000100-abc")
        os.rename(torn, root / ".tmp-step_00000100-incomplete-abc")
        os.rename(fresh, torn)
        assert execute_retention(root, plan) == []
        assert newest_complete(root).name == "step_00000100"

    def test_a_dir_pinned_after_planning_is_not_deleted(self, tmp_path):
        """`checkpoints pin` run while a pass was planning: the pin is honoured at the delete."""
        root = tmp_path / "root"
        old = write_checkpoint(root, 1)
        write_checkpoint(root, 2)
        plan = _plan(old)
        pin(old)
        assert execute_retention(root, plan) == [] and old.is_dir()

    def test_symlink_target_is_skipped_and_its_target_untouched(self, tmp_path):
        """A planned deletion that is a symlink is refused; the linked dir outside keeps every file."""
        outside = write_checkpoint(tmp_path / "outside", 5)
        before = _tree(outside)
        root = tmp_path / "root"
        root.mkdir()
        (root / "step_00000005").symlink_to(outside)
        assert execute_retention(root, _plan(root / "step_00000005")) == []
        assert (root / "step_00000005").is_symlink() and _tree(outside) == before

    @pytest.mark.parametrize("rel", ["../outside/step_00000005", "step_00000001/sub", ".trash", "../.root.fsdp-trash"])
    def test_targets_that_are_not_direct_children_are_skipped(self, tmp_path, rel):
        """Paths outside the root, nested inside a checkpoint, or a trash itself are never deleted."""
        outside = write_checkpoint(tmp_path / "outside", 5)
        root = tmp_path / "root"
        write_checkpoint(root, 1)
        (root / "step_00000001" / "sub").mkdir()
        (root / ".trash").mkdir()
        (root / ".trash" / f"step_00000002.{NS}").mkdir()  # a .trash folder: not a checkpoint, never deleted
        before = _tree(tmp_path)
        assert execute_retention(root, _plan(root / rel)) == []
        assert _tree(tmp_path) - {".root.fsdp-trash"} == before and outside.exists()

    def test_interrupted_delete_never_looks_complete_and_is_cleared_next_time(self, tmp_path, monkeypatch):
        """A crash after the rename leaves the dir only in the trash: invisible to scans, cleared on the next run."""
        root = tmp_path / "root"
        write_checkpoint(root, 1)
        doomed = write_checkpoint(root, 2)

        def crash(path):
            raise OSError(5, "simulated crash")

        monkeypatch.setattr(pruning, "_remove", crash)
        execute_retention(root, _plan(doomed))
        assert len(os.listdir(_trash(root))) == 1
        assert [c.name for c in scan(root)] == ["step_00000001"]
        assert newest_complete(root).name == "step_00000001"
        monkeypatch.undo()
        execute_retention(root, RetentionPlan())
        assert os.listdir(_trash(root)) == []

    def test_symlinked_trash_is_refused(self, tmp_path):
        """If the trash is a symlink, nothing is moved through it."""
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        root = tmp_path / "root"
        d = write_checkpoint(root, 1)
        _trash(root).symlink_to(elsewhere)
        with pytest.raises(CheckpointError, match="is a symlink, not a folder of ours"):
            execute_retention(root, _plan(d))
        assert d.exists() and os.listdir(elsewhere) == []

    def test_vanished_target_is_skipped(self, tmp_path):
        """A target removed by someone else since planning is skipped quietly."""
        root = tmp_path / "root"
        root.mkdir()
        assert execute_retention(root, _plan(root / "step_00000009")) == []


class TestDiskUsage:
    def test_reports_the_filesystem(self, tmp_path):
        """disk_usage() returns positive total and free bytes for an existing root."""
        u = disk_usage(tmp_path)
        assert u.total_bytes > 0 and 0 <= u.free_bytes <= u.total_bytes

    def test_missing_root_raises(self, tmp_path):
        """disk_usage() of a missing root is a CheckpointError naming it."""
        with pytest.raises(CheckpointError, match="missing"):
            disk_usage(tmp_path / "missing")


class TestEndToEnd:
    @settings(max_examples=15, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(steps=st.sets(st.integers(1, 30), min_size=1, max_size=6), torn=st.integers(0, 5),
           pinned=st.integers(0, 5), keep_last=st.integers(0, 3))
    def test_real_root_keeps_its_invariants(self, tmp_path_factory, steps, torn, pinned, keep_last):
        """Scan, plan (with a disk floor nobody can meet) and execute on real dirs: the guarded ones survive."""
        root = tmp_path_factory.mktemp("case") / "root"
        root.mkdir()
        dirs = [write_checkpoint(root, s, shards=1) for s in sorted(steps)]
        (dirs[torn % len(dirs)] / "__0_0.distcp").unlink()
        pin(dirs[pinned % len(dirs)])
        newest = newest_complete(root)
        infos = scan(root)
        plan = plan_retention(infos, rules=RetentionRules(keep_last=keep_last, min_free_gb=10**6),
                              disk=DiskUsage(GIB, 0), now=0.0)
        execute_retention(root, plan)
        survivors = set(os.listdir(root))
        assert dirs[pinned % len(dirs)].name in survivors
        assert newest is None or newest.name in survivors
        assert dirs[torn % len(dirs)].name in survivors  # torn but "young" (now=0): may be in flight
        assert survivors == {c.name for c in infos} - {d.name for d in plan.deletions}


class TestTrash:
    """The trash sits next to the root, never in it: Accelerate sorts every entry of its folder by a number."""

    def test_made_next_to_the_root_private(self, tmp_path):
        """`<parent>/.<root>.fsdp-trash`, mode 0700, and the root holds only checkpoints afterwards."""
        root = tmp_path / "root"
        old = write_checkpoint(root, 1)
        write_checkpoint(root, 2)
        execute_retention(root, _plan(old), empty_trash=False)
        assert trash_dir(root) == _trash(root) and os.stat(_trash(root)).st_mode & 0o777 == 0o700
        assert os.listdir(root) == ["step_00000002"]

    def test_nothing_is_created_without_a_deletion(self, tmp_path):
        """A pass that deletes nothing creates no trash at all (the old code made `.trash` on every pass)."""
        root = tmp_path / "root"
        write_checkpoint(root, 1)
        execute_retention(root, RetentionPlan())
        assert sorted(os.listdir(tmp_path)) == ["root"] and os.listdir(root) == ["step_00000001"]


    def test_what_another_emptier_removes_meanwhile_is_no_failure(self, tmp_path, monkeypatch):
        """Two emptiers of one trash race (a second supervisor's first pass, `checkpoints prune`): each entry or
        file the other removed first was a `trash_clear_failed` warning and the rest of that entry stayed."""
        root = tmp_path / "root"
        write_checkpoint(root, 1)
        trash = trash_dir(root)
        for step in (5, 6):
            write_checkpoint(trash, step, name=f"step_{step}.{NS}")
        real, racing = os.scandir, [True]

        class Listing(list):  # what os.scandir gives, listed before the other emptier takes its part
            def __enter__(self) -> Listing:
                return self

            def __exit__(self, *_: object) -> None:
                pass

        def scandir(path):  # the other emptier removes the first entry of every listing, just after ours
            with real(path) as it:
                entries = Listing(it)
            if racing[0] and entries:
                racing[0] = False  # its own removal is not a race
                first = entries[0]
                if isinstance(path, int):
                    os.unlink(first.name, dir_fd=path) if first.is_file() else None
                else:
                    pruning._remove(Path(first.path))
                racing[0] = True
            return entries

        log = RecordingLog()
        monkeypatch.setattr(pruning, "log", log)
        monkeypatch.setattr(os, "scandir", scandir)
        clear_trash(root)
        monkeypatch.undo()
        assert os.listdir(trash) == [] and log.events == []

    def test_falls_back_to_the_callers_dir_when_the_parent_is_not_writable(self, tmp_path, monkeypatch):
        """Parent read-only: the trash goes into the fallback dir (the daemon's run dir) on the same file system."""
        root, run_dir = tmp_path / "ro" / "root", tmp_path / "run"
        run_dir.mkdir(parents=True)
        old = write_checkpoint(root, 1)
        write_checkpoint(root, 2)
        real = os.access
        monkeypatch.setattr(pruning.os, "access", lambda p, mode: Path(p) != root.parent and real(p, mode))
        assert [d.name for d in execute_retention(root, _plan(old), fallback=run_dir)] == [old.name]
        assert os.listdir(run_dir) == [".root.fsdp-trash"] and not (tmp_path / "ro" / ".root.fsdp-trash").exists()

    def test_no_place_for_the_trash_deletes_nothing(self, tmp_path, monkeypatch):
        """Neither the parent nor a fallback can hold it: one clear line, and every checkpoint is still there."""
        root = tmp_path / "ro" / "root"
        old = write_checkpoint(root, 1)
        real = os.access
        monkeypatch.setattr(pruning.os, "access", lambda p, mode: Path(p) != root.parent and real(p, mode))
        with pytest.raises(CheckpointError, match="nowhere to park deletions .* nothing was deleted") as err:
            execute_retention(root, _plan(old))
        assert "\n" not in str(err.value) and old.is_dir()

    def test_fallback_on_another_file_system_is_refused(self, tmp_path, monkeypatch):
        """A fallback whose st_dev differs from the root's would make the rename a copy: refused."""
        root, run_dir = tmp_path / "ro" / "root", tmp_path / "run"
        run_dir.mkdir()
        old = write_checkpoint(root, 1)
        real_access, real_device = os.access, pruning._device
        monkeypatch.setattr(pruning.os, "access", lambda p, mode: Path(p) != root.parent and real_access(p, mode))
        monkeypatch.setattr(pruning, "_device", lambda p: -1 if p == run_dir else real_device(p))
        with pytest.raises(CheckpointError, match="nothing was deleted"):
            execute_retention(root, _plan(old), fallback=run_dir)
        assert old.is_dir() and os.listdir(run_dir) == []
