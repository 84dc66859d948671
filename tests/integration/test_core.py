"""Core state machine: scripted histories replayed through a fake System (no processes, fake time)."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from supervisor.policy.state import State
from tests.unit.test_core import beat, exit_job, make_core


class TestLaunch:
    def test_resume_args_get_newest_complete(self, tmp_path: Path, make_checkpoint: Callable[[Path, str], Path]) -> None:
        """With checkpoints present, resume_args carry the newest complete one's absolute path."""
        core, fake, _ = make_core(tmp_path)
        ck = core.cfg.checkpoints.dir
        make_checkpoint(ck, "step_00000010")
        make_checkpoint(ck, "step_00000020")
        (ck / ".tmp-step_00000030-x").mkdir()
        core.begin(None)
        assert fake.spawned[0].argv[-2:] == ["--resume", str(ck / "step_00000020")]
        assert core.status.resumed_from == str(ck / "step_00000020")


class TestRestarts:
    def test_quarantine_and_fallback(self, tmp_path: Path, make_checkpoint: Callable[[Path, str], Path]) -> None:
        """Two attempts die while loading step_20 (heartbeat phase load): it is quarantined, step_10 is next."""
        core, fake, log = make_core(tmp_path, restart="max_no_progress_restarts = 10")
        ck = core.cfg.checkpoints.dir
        make_checkpoint(ck, "step_10")
        make_checkpoint(ck, "step_20")
        core.begin(None)
        for _ in range(2):
            assert fake.spawned[-1].argv[-1] == str(ck / "step_20")
            beat(core, 20, "load")
            exit_job(core, fake, 1)
            fake.advance(10, core)
        assert "quarantined" in log.names() and (ck / "step_20" / ".quarantined").exists()
        assert fake.spawned[-1].argv[-1] == str(ck / "step_10")
        assert core.status.quarantined == [str(ck / "step_20")]


class TestRetention:
    def test_commit_prunes_on_the_loop_and_empties_trash_off_it(self, tmp_path: Path,
                                                                 make_checkpoint: Callable[[Path, str], Path]) -> None:
        """A new commit triggers retention; deletions are logged, parked in the trash next to the root, then
        removed by a thread; nothing of ours is left inside the root."""
        core, fake, log = make_core(tmp_path, checkpoints="keep_last = 1")
        ck = core.cfg.checkpoints.dir
        core.begin(None)
        for step in (10, 20, 30):
            make_checkpoint(ck, f"step_{step}")
            core.on_file_event(ck / f"step_{step}")
            fake.advance(1, core)
        core.house.wait_idle(30)
        assert sorted(p.name for p in ck.iterdir()) == ["step_30"]
        assert not list((ck.parent / f".{ck.name}.fsdp-trash").iterdir())
        deleted = [f["path"] for e, f in log.events if e == "retention_deleted"]
        assert deleted == [str(ck / "step_10"), str(ck / "step_20")]
        assert core.status.latest_checkpoint["step"] == 30
        assert core.status.checkpoint_bytes == sum(f.stat().st_size for f in (ck / "step_30").iterdir())

    def test_a_predecessors_trash_is_emptied_by_the_first_pass(self, tmp_path: Path,
                                                              make_checkpoint: Callable[[Path, str], Path]) -> None:
        """A checkpoint a killed supervisor parked in the trash is removed by the next supervisor's first pass,
        even when that pass deletes nothing (it held its disk space until the next deletion)."""
        for prune in ("true", "false"):  # `prune = false`: nothing is deleted, leftovers included
            core, fake, log = make_core(tmp_path / prune, checkpoints=f"keep_last = 2\nprune = {prune}")
            ck = core.cfg.checkpoints.dir
            make_checkpoint(ck, "step_10")
            parked = make_checkpoint(ck.parent / f".{ck.name}.fsdp-trash", "step_5.1733239812000000000")
            core.begin(None)
            core.house.wait_idle(30)
            assert parked.exists() == (prune == "false") and sorted(p.name for p in ck.iterdir()) == ["step_10"]
            assert "retention_deleted" not in log.names()

    def test_the_first_pass_on_a_root_not_there_yet_warns_of_nothing(self, tmp_path: Path,
                                                                      make_checkpoint: Callable[[Path, str], Path]) -> None:
        """No root (removed, or a share not mounted): the pass fails, saying so - never an empty result that would
        start the job from scratch (issue 21) - and the root's unreadable disk usage is no `trash_clear_failed`
        (it was one, at every such start). A predecessor's trash is emptied by the first pass that finds the root."""
        core, fake, log = make_core(tmp_path, checkpoints="keep_last = 2")
        ck = core.cfg.checkpoints.dir
        ck.rmdir()
        parked = make_checkpoint(ck.parent / f".{ck.name}.fsdp-trash", "step_5.1733239812000000000")
        core.begin(None)
        core.house.wait_idle(30)
        assert fake.spawned == [] and "trash_clear_failed" not in log.names()
        assert "does not exist" in next(f["error"] for e, f in log.events if e == "checkpoint_scan_failed")
        ck.mkdir()
        fake.advance(5, core)
        core.house.wait_idle(30)
        assert len(fake.spawned) == 1 and not parked.exists() and "trash_clear_failed" not in log.names()


class TestInUseMarker:
    def test_written_at_launch_and_dropped_on_commit_and_exit(self, tmp_path: Path,
                                                              make_checkpoint: Callable[[Path, str], Path]) -> None:
        """Launching from a checkpoint writes the in-use marker next to the root (for `prune --dir` and other
        nodes); a newer commit by the attempt, or its exit, removes it."""
        core, fake, _ = make_core(tmp_path)
        ck = core.cfg.checkpoints.dir
        make_checkpoint(ck, "step_10")
        folder = ck.parent / f".{ck.name}.fsdp-inuse"
        core.begin(None)
        (marker,) = folder.iterdir()
        doc = json.loads(marker.read_text())
        assert (doc["path"], doc["pid"]) == (str(ck / "step_10"), fake.spawned[-1].pid)
        make_checkpoint(ck, "step_20")
        core.on_file_event(ck / "step_20")
        fake.advance(1, core)
        assert core.in_use is None and list(folder.iterdir()) == []
        exit_job(core, fake, 1)
        fake.advance(10, core)
        (marker,) = folder.iterdir()  # the relaunch resumed from step_20
        assert json.loads(marker.read_text())["path"] == str(ck / "step_20")
        exit_job(core, fake, 0)
        assert list(folder.iterdir()) == []


class TestProgress:
    def test_commit_seen_only_at_exit_counts_as_progress(self, tmp_path: Path,
                                                          make_checkpoint: Callable[[Path, str], Path]) -> None:
        """A checkpoint committed without a file event (e.g. NFS) is found at exit and counts as progress."""
        core, fake, log = make_core(tmp_path, restart="max_no_progress_restarts = 0")
        core.begin(None)
        make_checkpoint(core.cfg.checkpoints.dir, "step_5")  # no on_file_event: the watcher never saw it
        exit_job(core, fake, 1)
        assert core.status.state is State.BACKOFF and "checkpoint_committed" in log.names()
        fake.advance(1, core)
        assert fake.spawned[-1].argv[-1] == str(core.cfg.checkpoints.dir / "step_5")
        exit_job(core, fake, 1)  # no new checkpoint this time: no progress allowed
        assert core.exit_code == 3

    def test_fallback_after_quarantine_is_not_progress(self, tmp_path: Path,
                                                        make_checkpoint: Callable[[Path, str], Path]) -> None:
        """Falling back to an older checkpoint after quarantine is not a new commit."""
        core, fake, log = make_core(tmp_path, restart="max_no_progress_restarts = 2\nquarantine_after = 1")
        ck = core.cfg.checkpoints.dir
        make_checkpoint(ck, "step_10")
        make_checkpoint(ck, "step_20")
        core.begin(None)
        beat(core, 20, "load")
        exit_job(core, fake, 1)
        assert "quarantined" in log.names() and "checkpoint_committed" not in log.names()
        assert core.attempts[-1].progressed is False
