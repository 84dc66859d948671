"""Core lifecycle hardening, replayed through the fake System: stop, orphans, resume consent, failing writes.

Each class guards one defect class of issue 13 (1: a graceful stop escalated by accident, 3: orphan identity,
5: quarantine evidence and fresh-start consent, 6: failing writes, 11: the in-use checkpoint's protection), or
one its second review found (files the job controls, a heartbeat flood, signals nobody handled).
"""
from __future__ import annotations

import errno
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor.checkpoints import markers
from supervisor.daemon.timers import Timer
from supervisor.policy.state import State
from tests.unit.test_core import beat, exit_job, make_core
from tests.unit.test_core_lifecycle import events

MakeCheckpoint = Callable[[Path, str], Path]


class TestQuarantineNeedsEvidenceAndAFreshStartNeedsConsent:
    def test_silent_quick_failures_quarantine_nothing_and_keep_resuming(self, tmp_path: Path,
                                                                       make_checkpoint: MakeCheckpoint) -> None:
        """No heartbeat, failing seconds after launch: nothing quarantined, every launch resumes, then exit 3."""
        core, fake, log = make_core(tmp_path)
        ck = core.cfg.checkpoints.dir
        make_checkpoint(ck, "step_10")
        make_checkpoint(ck, "step_20")
        core.begin(None)
        while not core.done:
            exit_job(core, fake, 1)
            fake.advance(100, core)
        assert [s.argv[-2:] for s in fake.spawned] == [["--resume", str(ck / "step_20")]] * 4
        assert "quarantined" not in log.names() and not (ck / "step_20" / ".quarantined").exists()
        assert core.exit_code == 3 and "crash loop" in (core.status.reason or "")

    def test_silent_job_quarantine_after_another_checkpoint_loaded_and_trained(
            self, tmp_path: Path, make_checkpoint: MakeCheckpoint) -> None:
        """No heartbeat: step_20 (written by this run from step_10) fails twice on load -> quarantined, step_10 next."""
        core, fake, log = make_core(tmp_path)
        ck = core.cfg.checkpoints.dir
        make_checkpoint(ck, "step_10")
        core.begin(None)
        make_checkpoint(ck, "step_20")
        core.on_file_event(ck / "step_20")
        fake.advance(1, core)
        exit_job(core, fake, 1)  # it trained and committed: a healthy failure
        for _ in range(2):
            fake.advance(100, core)
            assert fake.spawned[-1].argv[-1] == str(ck / "step_20")
            exit_job(core, fake, 1)
        fake.advance(100, core)
        assert (ck / "step_20" / ".quarantined").exists() and fake.spawned[-1].argv[-1] == str(ck / "step_10")
        assert "another checkpoint" in events(log, "quarantined")[0]["reason"]

    def test_every_complete_checkpoint_quarantined_gives_up(self, tmp_path: Path, make_checkpoint: MakeCheckpoint) -> None:
        """The only checkpoint quarantined: no launch without resume; exit 3 naming it."""
        core, fake, log = make_core(tmp_path)
        ck = core.cfg.checkpoints.dir
        make_checkpoint(ck, "step_20")
        core.begin(None)
        for _ in range(2):
            beat(core, 20, "load")
            exit_job(core, fake, 1)
            fake.advance(100, core)
        assert len(fake.spawned) == 2 and all(s.argv[-1] == str(ck / "step_20") for s in fake.spawned)
        assert core.exit_code == 3 and core.status.state is State.FAILED
        assert "every complete checkpoint is quarantined" in core.status.reason and str(ck / "step_20") in core.status.reason
        assert events(log, "gave_up")[-1]["reason"] == core.status.reason

    @pytest.mark.parametrize("damage", ["unsafe", "torn"])
    def test_unusable_checkpoint_refuses_a_fresh_start(self, tmp_path: Path, make_checkpoint: MakeCheckpoint,
                                                       damage: str) -> None:
        """A root whose only checkpoint cannot be used: exit 3 naming it, nothing launched; allow_fresh_start opts in."""
        for allow in (False, True):
            base = tmp_path / str(allow)
            core, fake, log = make_core(base, checkpoints="keep_last = 0" + ("\nallow_fresh_start = true" if allow else ""))
            ck = core.cfg.checkpoints.dir
            bad = make_checkpoint(ck, "step_20")
            if damage == "unsafe":
                (bad / ".metadata").write_bytes(b"\x80\x04cos\nsystem\n.")  # a pickle that would import os
            else:
                shard = max((p for p in bad.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
                shard.write_bytes(shard.read_bytes()[:3])
            (ck / ".tmp-step_00000030-x").mkdir()  # a partial save alone would not matter
            core.begin(None)
            if allow:
                assert len(fake.spawned) == 1 and fake.spawned[0].argv == ["torchrun", "-m", "trainer"]
                continue
            assert fake.spawned == [] and core.exit_code == 3 and core.status.state is State.FAILED
            reason = core.status.reason or ""
            assert str(bad) in reason and ("invalid" if damage == "unsafe" else "torn") in reason
            assert "allow_fresh_start" in reason and events(log, "gave_up")[0]["reason"] == reason

    def test_step_placeholder(self, tmp_path: Path, make_checkpoint: MakeCheckpoint) -> None:
        """{step} becomes the chosen checkpoint's step; a checkpoint without a step is an error at launch."""
        job = 'resume_args = ["--checkpoint.load_step", "{step}"]'
        core, fake, _ = make_core(tmp_path / "a", job=job)
        make_checkpoint(core.cfg.checkpoints.dir, "step-10")
        core.begin(None)
        assert fake.spawned[0].argv[-2:] == ["--checkpoint.load_step", "10"] and core.status.resumed_from
        core, fake, _ = make_core(tmp_path / "b", job=job)
        final = make_checkpoint(core.cfg.checkpoints.dir, "final")
        core.begin(None)
        assert fake.spawned == [] and core.exit_code == 3
        assert str(final) in (core.status.reason or "") and "{step}" in (core.status.reason or "")

    def test_empty_resume_args_leave_the_choice_to_the_job(self, tmp_path: Path, make_checkpoint: MakeCheckpoint) -> None:
        """resume_args = []: no resumed_from claimed, said once in the log, no quarantine without a named load."""
        core, fake, log = make_core(tmp_path, job="resume_args = []", restart="max_no_progress_restarts = 10")
        ck = core.cfg.checkpoints.dir
        make_checkpoint(ck, "step_10")
        make_checkpoint(ck, "step_20")
        core.begin(None)
        for _ in range(3):  # silent failures: the supervisor cannot know what the job loaded
            assert fake.spawned[-1].argv == ["torchrun", "-m", "trainer"] and core.status.resumed_from is None
            exit_job(core, fake, 1)
            fake.advance(100, core)
        assert [f["resumed_from"] for f in events(log, "job_started")] == [None] * 4
        assert len(events(log, "resume_choice_left_to_job")) == 1 and "quarantined" not in log.names()
        for _ in range(2):  # its heartbeat says it died loading step 20: that one is named
            beat(core, 20, "load")
            exit_job(core, fake, 1)
            fake.advance(100, core)
        assert core.status.quarantined == [str(ck / "step_20")]


class TestEveryWriteCanFail:
    @pytest.mark.parametrize("how", ["vanished", "read-only"])
    def test_quarantine_marker_that_cannot_be_written(self, tmp_path: Path, make_checkpoint: MakeCheckpoint,
                                                      monkeypatch: pytest.MonkeyPatch, how: str) -> None:
        """The marker write fails: logged, the run goes on from the older checkpoint, never exit 2."""
        core, fake, log = make_core(tmp_path, restart="max_no_progress_restarts = 10")
        ck = core.cfg.checkpoints.dir
        make_checkpoint(ck, "step_10")
        make_checkpoint(ck, "step_20")
        core.begin(None)
        beat(core, 20, "load")
        exit_job(core, fake, 1)
        fake.advance(100, core)
        beat(core, 20, "load")
        if how == "vanished":
            shutil.rmtree(ck / "step_20")
        else:
            def refuse(*_a: object, **_k: object) -> None:
                raise OSError(errno.EROFS, "Read-only file system")
            monkeypatch.setattr(markers, "write_atomic", refuse)
        exit_job(core, fake, 1)
        fake.advance(100, core)
        assert events(log, "quarantine_failed")[0]["path"] == str(ck / "step_20")
        assert core.status.state is State.RUNNING and fake.spawned[-1].argv[-1] == str(ck / "step_10")


class TestInUseProtection:
    def test_completed_run_keeps_exactly_keep_last(self, tmp_path: Path, make_checkpoint: MakeCheckpoint) -> None:
        """keep_last = 2, resumed from step_10, commits seen only at exit: the exit pass leaves exactly two."""
        core, fake, _ = make_core(tmp_path, checkpoints="keep_last = 2")
        ck = core.cfg.checkpoints.dir
        make_checkpoint(ck, "step_10")
        core.begin(None)
        assert fake.spawned[0].argv[-1] == str(ck / "step_10")
        make_checkpoint(ck, "step_20")
        make_checkpoint(ck, "step_30")  # no file events: the watcher missed both (e.g. NFS)
        exit_job(core, fake, 0)
        core.house.wait_idle(30)
        assert core.status.state is State.COMPLETED
        assert sorted(p.name for p in ck.iterdir() if p.name != ".trash") == ["step_20", "step_30"]

    def test_resumed_from_is_protected_until_a_newer_one_commits(self, tmp_path: Path,
                                                                 make_checkpoint: MakeCheckpoint) -> None:
        """keep_last = 1: the pass that finds step_20 keeps the in-use step_10; the next one deletes it."""
        core, fake, log = make_core(tmp_path, checkpoints="keep_last = 1")
        ck = core.cfg.checkpoints.dir
        make_checkpoint(ck, "step_10")
        core.begin(None)
        assert core.in_use == ck / "step_10"
        make_checkpoint(ck, "step_20")
        core.on_file_event(ck / "step_20")
        fake.advance(1, core)
        assert (ck / "step_10").exists() and "retention_deleted" not in log.names()
        assert core.in_use is None and core.job is not None  # released while the attempt still runs
        core.on_timer(Timer.RETENTION)
        assert [Path(f["path"]).name for f in events(log, "retention_deleted")] == ["step_10"]
