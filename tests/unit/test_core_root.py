"""The checkpoint root's identity through Core (issue 21): a failed pass is never a result, a root that cannot be
pruned still resumes, a re-created root is noticed, the root claim is checked before every launch."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from supervisor.daemon.housekeeping import PassResult
from supervisor.daemon.timers import Timer
from supervisor.policy.state import State
from tests.fakes import FakeSystem, RecordingLog
from tests.jobs.dcp_files import write_checkpoint
from tests.unit.test_core import beat, exit_job, make_core


def fields(log: RecordingLog, name: str) -> list[dict]:
    return [f for e, f in log.events if e == name]


def fail_passes(core, times: int, error: str = "checkpoint root X cannot be read: Input/output error") -> None:  # type: ignore[no-untyped-def]
    """The next `times` passes fail as a blip on shared storage would; the ones after look at the real root."""
    real, left = core.house.run_pass, [times]

    def run_pass(**kw):  # type: ignore[no-untyped-def]
        if left[0] > 0:
            left[0] -= 1
            return PassResult(kw["generation"], error=error)
        return real(**kw)

    core.house.run_pass = run_pass


class TestAFailedPassIsNeverAResult:
    def test_relaunch_after_a_failed_pass_waits_for_a_successful_one(self, tmp_path: Path) -> None:
        """The pass after a crash fails; the relaunch (no backoff) must not reuse the successful pass from before
        the commit (an empty root): it waits for a pass that succeeds, and resumes from what that one finds."""
        core, fake, log = make_core(tmp_path, restart="healthy_restart_delay_s = 0")
        core.begin(None)
        assert fake.spawned[0].argv == ["torchrun", "-m", "trainer"]  # an empty root: fresh
        write_checkpoint(core.cfg.checkpoints.dir, 10)  # the job commits; the watcher's event has not come yet
        beat(core, 10)
        fail_passes(core, 1)
        exit_job(core, fake, 1)
        fake.advance(1.5, core)  # within FRESH_PASS_S of the failed pass, and of the successful one before it
        assert len(fake.spawned) == 2
        step10 = str(core.house.root / "step_00000010")
        assert fake.spawned[1].argv == ["torchrun", "-m", "trainer", "--resume", step10]
        assert "checkpoint_scan_failed" in log.names()

    def test_allow_fresh_start_does_not_launch_on_an_unseen_root(self, tmp_path: Path) -> None:
        """allow_fresh_start is consent about unusable checkpoints, not about a root nobody could look at: the
        launch waits, then gives up (exit 3) naming the reason."""
        core, fake, log = make_core(tmp_path, checkpoints="keep_last = 0\nallow_fresh_start = true")
        write_checkpoint(core.cfg.checkpoints.dir, 10)
        fail_passes(core, 99)
        core.begin(None)
        fake.advance(60, core)
        assert fake.spawned == [] and core.status.state is State.FAILED and core.exit_code == 3
        assert "cannot tell whether" in (core.status.reason or "") and "Input/output error" in core.status.reason

    def test_a_missing_root_is_a_failed_pass_not_an_empty_one(self, tmp_path: Path) -> None:
        """A root gone at launch time (deleted, an unmounted share) is never read as 'nothing to resume'."""
        core, fake, _ = make_core(tmp_path)
        shutil.rmtree(core.cfg.checkpoints.dir)
        core.begin(None)
        fake.advance(60, core)
        assert fake.spawned == [] and core.exit_code == 3 and "does not exist" in (core.status.reason or "")


class TestTheRootIsItsResolvedPath:
    def test_a_symlinked_root_resumes_by_its_resolved_path(self, tmp_path: Path) -> None:
        """`dir` is a symlink: the resume path, the watched root and the sidecars all use the target."""
        target = tmp_path / "scratch" / "ckpts"
        write_checkpoint(target, 10)
        core, fake, _ = make_core(tmp_path / "cfg", checkpoints='keep_last = 0')
        os.rmdir(core.cfg.checkpoints.dir)
        core.cfg.checkpoints.dir.symlink_to(target)
        core, fake, _ = make_core(tmp_path / "cfg", checkpoints='keep_last = 0')
        core.begin(None)
        assert core.house.root == target
        assert fake.spawned[0].argv[-1] == str(target / "step_00000010")

    def test_a_replaced_root_is_noticed(self, tmp_path: Path) -> None:
        """A pass that finds another dir in the root's place (moved aside, a new one made: no event reaches the old
        watch) says so and asks the loop to watch the new one. (A deleted root is the loop's: its watch reports it.)"""
        core, fake, log = make_core(tmp_path)
        core.begin(None)
        root = core.house.root
        root.rename(tmp_path / "old-ckpts")
        root.mkdir()
        assert not core.watch_stale
        core.on_timer(Timer.RETENTION)
        assert "checkpoint_root_replaced" in log.names() and core.watch_stale

    def test_a_re_pointed_symlink_fails_the_pass(self, tmp_path: Path) -> None:
        """`dir` now points elsewhere: the supervisor keeps to the root it resolved and says what changed."""
        a, b = tmp_path / "a", tmp_path / "b"
        a.mkdir()
        b.mkdir()
        core, fake, log = make_core(tmp_path / "cfg")
        os.rmdir(core.cfg.checkpoints.dir)
        core.cfg.checkpoints.dir.symlink_to(a)
        core, fake, log = make_core(tmp_path / "cfg")
        core.begin(None)
        core.cfg.checkpoints.dir.unlink()
        core.cfg.checkpoints.dir.symlink_to(b)
        result = core.house.run_pass(generation=0, protect=[])
        assert result.error is not None and f"now resolves to {b}" in result.error


class TestRetentionThatCannotParkIsNoFailure:
    def test_no_trash_possible_stops_retention_and_resume_goes_on(self, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
        """No place for the trash (a mount-point root: its parent is another file system): retention says so once
        (log and status), deletes nothing, and every relaunch resumes from the newest checkpoint."""
        from supervisor.checkpoints import pruning

        core, fake, log = make_core(tmp_path, checkpoints="keep_last = 1")
        root = core.house.root
        for step in (10, 20, 30):
            write_checkpoint(root, step)
        real = pruning._device
        monkeypatch.setattr(pruning, "_device", lambda p: -7 if Path(p) != root else real(p))
        core.house.check_retention()
        core.begin(None)
        for _ in range(3):
            exit_job(core, fake, 1)
            fake.advance(5, core)
        assert [s.argv[-1] for s in fake.spawned] == [str(root / "step_00000030")] * 4
        assert sorted(os.listdir(root)) == ["step_00000010", "step_00000020", "step_00000030"]
        assert len(fields(log, "retention_stopped")) == 1 and "checkpoint_scan_failed" not in log.names()
        assert "nowhere to park deletions" in (core.status.retention_stopped or "")


class TestTheClaimIsCheckedBeforeEveryLaunch:
    def test_a_claim_lost_to_another_job_stops_the_relaunch(self, tmp_path: Path) -> None:
        """Another job holds the root at relaunch time: give up naming it, never launch a second job."""
        class Claim:
            held = "checkpoint root R is held by another job: supervisor pid 7 on h, config other.toml (run dir x)"
            answers: list[str | None] = [None, held]

            def check(self) -> str | None:
                return self.answers.pop(0)

            def refresh(self) -> None:
                pass

        core, fake, log = make_core(tmp_path)
        core.claim = core.house.claim = Claim()  # type: ignore[assignment]
        core.begin(None)
        exit_job(core, fake, 1)
        fake.advance(5, core)
        assert len(fake.spawned) == 1 and core.exit_code == 3 and "config other.toml" in (core.status.reason or "")


_ = FakeSystem  # the fake the helpers build
