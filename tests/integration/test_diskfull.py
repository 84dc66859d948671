"""Disk full: a save into a full file system fails, the supervisor classifies it, frees space, and the job resumes.

The checkpoint root lives on a small tmpfs mounted by the test (we run as root in CI; `FSDP_DISKFULL_MODE=inject`
forces the fallback). Mid-run, another writer fills the file system, so the next save dies with ENOSPC (the trainer
holds the save of FAIL_AT until the test has filled it: tests/jobs/hooked_trainer.py's HOLD_SAVE hook). Without
the permission to mount, tests/jobs/enospc_trainer.py injects the same ENOSPC into the trainer's storage writer
instead (then there is no real pressure for retention to relieve, so that part is not checked).
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.checkpoints import GIB, PARTIAL, newest_complete, scan
from tests.chaos import (
    STEPS,
    TIMEOUT,
    TORCHRUN,
    ChaosRun,
    assert_same_weights,
    export_weights,
    job_config,
    reference,
    train_args,
)
from tests.helpers import HOOKED_ENTRY, REPO, wait_for
from tests.jobs.hooked_trainer import HOLD_SAVE_STEP_ENV, HOLD_SAVE_UNTIL_ENV, PACE_SAVES_ENV
from tests.mounts import try_tmpfs, unmount
from tests.supervise import Supervisors, supervisors  # noqa: F401

MIB = 2**20
DISK_MIB = 16  # four 2 MiB checkpoints fit with room to spare; fills at step 20, fails the save of step 25
MIN_FREE_MIB = 5  # > 2 checkpoints: after the failure retention must delete old ones to get back above it
FILL_AT, FAIL_AT = 20, 25
CONFIG = f"""keep_last = 0
min_free_gb = {MIN_FREE_MIB * MIB / GIB!r}
[restart]
backoff_initial_s = 0.2
backoff_max_s = 1
[health]
stop_timeout_s = 10
save_timeout_s = 120
"""


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path | None]:
    """A DISK_MIB tmpfs (unmounted at teardown), or None when this process may not mount one."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.environ.get("FSDP_DISKFULL_MODE") == "inject" or try_tmpfs(mnt, f"{DISK_MIB}m") is not None:
        yield None
        return
    try:
        yield mnt
    finally:
        unmount(mnt)


def _free(mnt: Path) -> int:
    st = os.statvfs(mnt)
    return st.f_bavail * st.f_frsize


def _fill(mnt: Path, leave: int) -> None:
    """Another writer takes all free space but `leave` bytes (a file next to the checkpoint root)."""
    with open(mnt / "filler.bin", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, _free(mnt) - leave)


def _config(tmp_path: Path, disk: Path | None) -> tuple[Path, Path]:
    """(job.toml, checkpoint root): the real trainer on the tmpfs, or the ENOSPC-injecting entry on plain disk.

    On the tmpfs the save of FAIL_AT waits for `tmp_path/filled`: the test fills the disk between two saves
    however fast or slow the job runs."""
    if disk is not None:
        root = disk / "ckpts"
        entry = [*TORCHRUN, str(HOOKED_ENTRY)] + train_args(str(root))[2:]
        # Each save also waits until the supervisor has seen the last commit: the resumed job (50 ms steps here)
        # otherwise saves faster than a pass can prune behind it and runs out of space again (attempt 3).
        env = {HOLD_SAVE_STEP_ENV: str(FAIL_AT), HOLD_SAVE_UNTIL_ENV: str(tmp_path / "filled"), PACE_SAVES_ENV: "1"}
        return job_config(tmp_path, CONFIG, root=root, command=entry, env=env), root
    root = tmp_path / "ckpts"
    entry = [*TORCHRUN, str(REPO / "tests" / "jobs" / "enospc_trainer.py")] + train_args(str(root))[2:]
    env = {"FSDP_TEST_ENOSPC_STEP": str(FAIL_AT), "FSDP_TEST_ENOSPC_MARKER": str(tmp_path / "enospc-once")}
    return job_config(tmp_path, CONFIG, root=root, command=entry, env=env), root


@pytest.mark.timeout(900)  # may pay for the shared reference run too
class TestDiskFull:
    def test_failed_save_is_classified_space_is_freed_and_the_job_resumes(
            self, tmp_path: Path, small_disk: Path | None, supervisors: Supervisors,
            tmp_path_factory: pytest.TempPathFactory) -> None:
        """ENOSPC mid-save: never a complete-looking dir, a classified crash, retention down to the floor, resume."""
        ref = reference(tmp_path_factory.getbasetemp())
        config, root = _config(tmp_path, small_disk)
        c = ChaosRun(tmp_path, supervisors, 0, config, root)
        c.start_supervisor()
        c.wait_running(1)
        if small_disk is not None:
            # The supervisor has seen (and pruned for) the commit of FILL_AT; the save of FAIL_AT waits for us.
            wait_for(lambda: ((c.dirs.state().get("latest_checkpoint") or {}).get("step") or 0) >= FILL_AT,
                     TIMEOUT, f"the commit of step {FILL_AT}", interval=0.005)
            assert not [i for i in scan(root) if i.step == FAIL_AT], "the save of FAIL_AT did not wait"
            _fill(small_disk, leave=3 * MIB // 2)
            (tmp_path / "filled").touch()
        st = c.wait_relaunch(1)
        c.say(f"attempt 1 ended: {st['last_exit']}")
        assert st["last_exit"]["reason"] == "crash" and st["last_exit"]["code"] not in (0, None), st
        # The job's own error may hide ENOSPC (torch's zip writer says "unexpected pos"); the supervisor's note does not.
        expected = "checkpoint disk full" if small_disk is not None else "No space left on device"
        assert expected in (st["last_exit"]["detail"] or ""), st["last_exit"]
        failed = [i for i in scan(root) if i.step == FAIL_AT]
        assert failed and all(i.state == PARTIAL and i.name.startswith(".tmp-") for i in failed), failed
        assert st["resumed_from"] == str(root / f"step_{FILL_AT:08d}")
        if small_disk is not None:
            freed = [e for e in c.dirs.events("retention_deleted") if e["reason"].startswith("disk:")]
            assert [Path(e["path"]).name for e in freed][:3] == [f"step_{s:08d}" for s in (5, 10, 15)], freed
            wait_for(lambda: _free(small_disk) >= MIN_FREE_MIB * MIB, 60, "free space back above min_free_gb")
        rc, out = c.finish()
        assert rc == 0, out
        st = c.dirs.state()
        assert st["state"] == "completed" and st["attempt"] == 2, st
        final = newest_complete(root)
        assert final is not None and final.step == STEPS
        assert_same_weights(export_weights(final.path, tmp_path / "out.pt"), ref.weights)
