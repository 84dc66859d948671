"""The checkpoint root in users' setups (issue 21), with real mounts, symlinks and supervisors (a torch-free job).

A symlinked root on another file system (a tmpfs the test mounts), a root that is itself a mount point, two configs
on one root, a run dir removed or re-pointed under a running supervisor, a root re-created mid-run, a backup copy
made inside the root. Each test takes a few seconds; the mounts need root and are skipped (saying why) without it.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import psutil

from tests.jobs.dcp_files import write_checkpoint
from tests.mounts import bind_mount, mount_tmpfs, mounts  # noqa: F401
from tests.supervise import FAKEJOB, REPO, Supervisors, cli, launches, stop, supervisors, wait_for, write_config  # noqa: F401

ATTEMPT_JOB = REPO / "tests" / "jobs" / "attempt_job.py"
FAST = "\n[restart]\nbackoff_initial_s = 0.05\nbackoff_max_s = 0.2\n"


def state(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def commit(root: Path, step: int) -> Path:
    """A checkpoint committed as the reference trainer does: written under a temporary name, renamed into place."""
    tmp = write_checkpoint(root, step, name=f".tmp-step_{step:08d}-x")
    return Path(shutil.move(tmp, root / f"step_{step:08d}"))


def latest_step(run_dir: Path) -> int | None:
    return (state(run_dir).get("latest_checkpoint") or {}).get("step")


def sleeper(tmp_path: Path, marker: Path) -> list[str]:
    return [sys.executable, str(FAKEJOB), "--sleep", "60", "--marker", str(marker)]


class TestRootOnAnotherFileSystem:
    def test_symlinked_root_commits_are_seen_pruned_and_resumed(self, tmp_path: Path, supervisors: Supervisors,
                                                                 mounts: list[Path]) -> None:
        """`ckpts -> <tmpfs>/ckpts`: the first launch resumes (retention could park its deletion next to the target),
        a commit is seen while the job runs (the watch is on the target), and the relaunch resumes from it."""
        mount_tmpfs(tmp_path / "scratch")
        mounts.append(tmp_path / "scratch")
        target = tmp_path / "scratch" / "ckpts"
        for step in (10, 20):
            write_checkpoint(target, step)
        (tmp_path / "ckpts").symlink_to(target)
        marker = tmp_path / "launches"
        p = supervisors.start(write_config(tmp_path, sleeper(tmp_path, marker), "keep_last = 1\n" + FAST))
        first = wait_for(lambda: launches(marker)[:1], 20, "the first launch")[0]  # type: ignore[index]
        assert first["argv"][-2:] == ["--resume", str(target / "step_00000020")]
        commit(target, 30)
        run_dir = tmp_path / ".fsdp-supervisor"
        wait_for(lambda: latest_step(run_dir) == 30, 20, "the commit seen through the watch on the target")
        wait_for(lambda: not (target / "step_00000010").exists(), 20, "retention on the target")
        os.kill(first["pid"], signal.SIGKILL)
        second = wait_for(lambda: launches(marker)[1:2], 20, "the relaunch")[0]  # type: ignore[index]
        assert second["argv"][-2:] == ["--resume", str(target / "step_00000030")]
        rc, out = stop(p)
        assert rc == 0, out

    def test_mount_point_root_resumes_and_retention_stops_loudly(self, tmp_path: Path, supervisors: Supervisors,
                                                                  mounts: list[Path]) -> None:
        """The root is a mount point (its parent and the run dir are another file system): nowhere to park a
        deletion. `run` warns at start-up, retention stops (said once, and in status), and a crash's relaunch
        resumes from the newest checkpoint - it used to give up with exit 3."""
        root = tmp_path / "ckpts"
        mount_tmpfs(root)
        mounts.append(root)
        for step in (10, 20, 30):
            write_checkpoint(root, step)
        marker, trap = tmp_path / "launches", tmp_path / "trap"
        job = [sys.executable, str(ATTEMPT_JOB), "--marker", str(marker), "--trap", str(trap), "--fail-attempts", "1",
               "--sleep", "60"]
        p = supervisors.start(write_config(tmp_path, job, "keep_last = 1\n" + FAST))
        got = wait_for(lambda: launches(marker)[1:2], 30, "the relaunch after the crash")
        assert launches(marker)[0]["resume"] == got[0]["resume"] == str(root / "step_00000030")  # type: ignore[index]
        run_dir = tmp_path / ".fsdp-supervisor"
        assert "nowhere to park deletions" in (state(run_dir).get("retention_stopped") or "")
        status = cli("status", "-c", str(tmp_path / "job.toml"))
        assert status.returncode == 0 and "retention" in status.stdout and "STOPPED" in status.stdout
        rc, out = stop(p)
        assert rc == 0, out
        assert out.count("retention_stopped") == 1  # once, at start-up: not at every pass
        assert sorted(os.listdir(root)) == ["step_00000010", "step_00000020", "step_00000030"]


    def test_a_bind_mounted_root_on_the_same_file_system_stops_retention_once(
            self, tmp_path: Path, supervisors: Supervisors, mounts: list[Path]) -> None:
        """`ckpts` is a bind mount of another folder of the same file system: same device as its parent, yet every
        rename out of it fails (EXDEV). Retention stops, said once at start-up (not a failed rename per doomed
        checkpoint at every pass), and the job still resumes; `prune` exits 2 having deleted nothing."""
        source, root = tmp_path / "data", tmp_path / "ckpts"
        for step in (10, 20, 30):
            write_checkpoint(source, step)
        root.mkdir()
        bind_mount(source, root)
        mounts.append(root)
        marker = tmp_path / "launches"
        p = supervisors.start(write_config(tmp_path, sleeper(tmp_path, marker), "keep_last = 1\n" + FAST))
        first = wait_for(lambda: launches(marker)[:1], 20, "the first launch")[0]  # type: ignore[index]
        assert first["argv"][-2:] == ["--resume", str(root / "step_00000030")]
        commit(root, 40)
        wait_for(lambda: latest_step(tmp_path / ".fsdp-supervisor") == 40, 20, "the commit")
        assert "nowhere to park deletions" in (state(tmp_path / ".fsdp-supervisor").get("retention_stopped") or "")
        prune = cli("checkpoints", "prune", "--dir", str(root), "--keep-last", "1")
        assert prune.returncode == 2 and "nowhere to park deletions" in prune.stderr, prune.stdout + prune.stderr
        rc, out = stop(p)
        assert rc == 0, out
        assert out.count("retention_stopped") == 1 and "retention_rename_failed" not in out, out
        assert sorted(os.listdir(source)) == [f"step_{s:08d}" for s in (10, 20, 30, 40)]


def two_configs(tmp_path: Path, marker: Path) -> tuple[Path, Path]:
    """a.toml and b.toml: the same [checkpoints] dir, each its own run dir."""
    a = write_config(tmp_path, sleeper(tmp_path, marker), FAST + '\n[supervisor]\nrun_dir = "run-a"\n', name="a.toml")
    b = write_config(tmp_path, sleeper(tmp_path, marker), FAST + '\n[supervisor]\nrun_dir = "run-b"\n', name="b.toml")
    return a, b


class TestOneJobPerRoot:
    def test_a_second_config_on_the_same_root_is_refused_naming_the_holder(self, tmp_path: Path,
                                                                           supervisors: Supervisors) -> None:
        marker = tmp_path / "launches"
        a, b = two_configs(tmp_path, marker)
        first = supervisors.start(a)
        wait_for(lambda: launches(marker), 20, "job A")
        second = supervisors.start(b)
        out, _ = second.communicate(timeout=60)
        assert second.returncode == 2, out
        assert f"supervisor pid {first.pid}" in out and f"config {a}" in out and "held by another job" in out
        assert len(out.strip().splitlines()) == 1 and len(launches(marker)) == 1
        rc, out = stop(first)
        assert rc == 0, out

    def test_a_run_dir_edited_or_removed_under_a_running_supervisor(self, tmp_path: Path,
                                                                    supervisors: Supervisors) -> None:
        """`run_dir` edited in the running job's config, then the old run dir removed: `status` still sees the
        supervisor, a second `run` is refused (exit 2 naming it), and `stop` stops it."""
        marker = tmp_path / "launches"
        a, _ = two_configs(tmp_path, marker)
        first = supervisors.start(a)
        wait_for(lambda: launches(marker), 20, "job A")
        a.write_text(a.read_text().replace('run_dir = "run-a"', 'run_dir = "run-edited"'))
        status = cli("status", "-c", str(a))
        assert status.returncode == 0 and f"pid {first.pid}" in status.stdout, status.stdout + status.stderr
        again = cli("run", "-c", str(a))
        assert again.returncode == 2 and f"supervisor pid {first.pid}" in again.stderr, again.stderr
        a.write_text(a.read_text().replace('run_dir = "run-edited"', 'run_dir = "run-a"'))
        shutil.rmtree(tmp_path / "run-a")
        status = cli("status", "-c", str(a))
        assert status.returncode == 0, status.stdout + status.stderr
        again = cli("run", "-c", str(a))  # refused by the run dir's lock, made again, or else by the root's claim
        assert again.returncode == 2 and f"pid {first.pid}" in again.stderr, again.stderr
        wait_for(lambda: state(tmp_path / "run-a").get("pid") == first.pid, 20, "the run dir made again")
        assert "run_dir_restored" in (tmp_path / "run-a" / "supervisor.log").read_text()
        assert cli("stop", "-c", str(a)).returncode == 0
        first.communicate(timeout=60)
        assert first.returncode == 0 and len(launches(marker)) == 1


    def test_one_root_bind_mounted_at_two_paths_is_one_claim(self, tmp_path: Path, supervisors: Supervisors,
                                                             mounts: list[Path]) -> None:
        """`mount --bind data/ckpts view`, config A on one path, B on the other: one directory, so B is refused
        (exit 2 naming A). Each path has its own folder next to it; they meet in the claim's identity home."""
        (tmp_path / "data" / "ckpts").mkdir(parents=True)
        (tmp_path / "view").mkdir()
        bind_mount(tmp_path / "data" / "ckpts", tmp_path / "view")
        mounts.append(tmp_path / "view")
        marker = tmp_path / "launches"
        a = write_config(tmp_path, sleeper(tmp_path, marker), FAST + '\n[supervisor]\nrun_dir = "run-a"\n', name="a.toml")
        b = write_config(tmp_path, sleeper(tmp_path, marker), FAST + '\n[supervisor]\nrun_dir = "run-b"\n', name="b.toml")
        a.write_text(a.read_text().replace('dir = "ckpts"', 'dir = "data/ckpts"'))
        b.write_text(b.read_text().replace('dir = "ckpts"', 'dir = "view"'))
        first = supervisors.start(a)
        wait_for(lambda: launches(marker), 20, "job A")
        second = supervisors.start(b)
        out, _ = second.communicate(timeout=60)
        assert second.returncode == 2 and f"supervisor pid {first.pid}" in out and f"config {a}" in out, out
        assert len(launches(marker)) == 1
        rc, out = stop(first)
        assert rc == 0, out

    def test_the_job_of_a_killed_supervisor_still_holds_the_root(self, tmp_path: Path,
                                                                   supervisors: Supervisors) -> None:
        """Supervisor A is SIGKILLed; its job runs on (its own session) and keeps training on the root. A second
        config on the root is refused (exit 2) naming that job, not let in to run a second job beside it; `run -c
        A` again takes over as before (stops the orphan, then launches)."""
        marker = tmp_path / "launches"
        a, b = two_configs(tmp_path, marker)
        first = supervisors.start(a)
        job = wait_for(lambda: launches(marker)[:1], 20, "job A")[0]  # type: ignore[index]
        supervisors.track(job["pid"])
        first.kill()
        first.communicate(timeout=30)
        second = supervisors.start(b)
        out, _ = second.communicate(timeout=60)
        assert second.returncode == 2, out
        assert f"its job still runs: pid {job['pid']}" in out and f"config {a}" in out, out
        assert len(launches(marker)) == 1
        again = supervisors.start(a)
        wait_for(lambda: launches(marker)[1:2], 60, "A again: the orphan stopped, then a launch")
        assert not psutil.pid_exists(job["pid"]) or psutil.Process(job["pid"]).status() == psutil.STATUS_ZOMBIE
        rc, out = stop(again)
        assert rc == 0 and "orphan_job_stopped" in out, out


class TestRootChangesMidRun:
    def test_a_root_deleted_and_re_created_is_watched_again(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """The watch died with the old root; commits into the new one are seen without waiting for the periodic pass."""
        marker = tmp_path / "launches"
        p = supervisors.start(write_config(tmp_path, sleeper(tmp_path, marker), FAST))
        wait_for(lambda: launches(marker), 20, "the job")
        root = tmp_path / "ckpts"
        shutil.rmtree(root)
        root.mkdir()
        commit(root, 10)
        wait_for(lambda: latest_step(tmp_path / ".fsdp-supervisor") == 10, 20, "the commit in the re-created root")
        rc, out = stop(p)
        assert rc == 0 and "watch_restored" in out, out

    def test_a_root_moved_aside_and_restored_is_watched_again(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """`mv ckpts ckpts.old && cp -a ckpts.old ckpts` (a restore): the watch followed the old directory to its
        new name, and commits into the restored root went unseen until the next periodic pass (found by the setup
        matrix: 20 s of commits missed, up to `retention_interval_s`)."""
        root = tmp_path / "ckpts"
        write_checkpoint(root, 10)
        marker = tmp_path / "launches"
        p = supervisors.start(write_config(tmp_path, sleeper(tmp_path, marker), FAST))
        wait_for(lambda: launches(marker), 20, "the job")
        wait_for(lambda: latest_step(tmp_path / ".fsdp-supervisor") == 10, 20, "the first pass")
        os.rename(root, tmp_path / "ckpts.old")
        shutil.copytree(tmp_path / "ckpts.old", root)
        commit(root, 20)
        wait_for(lambda: latest_step(tmp_path / ".fsdp-supervisor") == 20, 20, "the commit in the restored root")
        rc, out = stop(p)
        assert rc == 0 and "watch_restored" in out, out
        assert sorted(os.listdir(tmp_path / "ckpts.old")) == ["step_00000010"]

    def test_a_bind_mount_over_the_root_is_no_fresh_start(self, tmp_path: Path, supervisors: Supervisors,
                                                          mounts: list[Path]) -> None:
        """An empty folder of the same file system is bind-mounted over the running root (same device, the
        checkpoints hidden, not gone): the relaunch after a crash must not start from scratch there. Passes fail
        naming the mount, and the run gives up (exit 3) - as for a share that came unmounted."""
        root = tmp_path / "ckpts"
        write_checkpoint(root, 10)
        (tmp_path / "empty").mkdir()
        marker = tmp_path / "launches"
        p = supervisors.start(write_config(tmp_path, sleeper(tmp_path, marker), FAST))
        first = wait_for(lambda: launches(marker)[:1], 20, "the first launch")[0]  # type: ignore[index]
        assert first["argv"][-2:] == ["--resume", str(root / "step_00000010")]
        bind_mount(tmp_path / "empty", root)
        mounts.append(root)
        os.kill(first["pid"], signal.SIGKILL)
        out, _ = p.communicate(timeout=90)
        assert p.returncode == 3 and "gave_up" in out, out
        assert "is on another mount than when the supervisor started" in (
            tmp_path / ".fsdp-supervisor" / "supervisor.log").read_text()
        assert len(launches(marker)) == 1


    def test_a_backup_copy_inside_the_root_changes_nothing(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """A user copies checkpoints into `ckpts/backup/` mid-run: ignored for ranking, never deleted, passes go on
        (a commit after it is seen) and the relaunch resumes from the run's own newest checkpoint."""
        root = tmp_path / "ckpts"
        for step in (10, 20):
            write_checkpoint(root, step)
        marker = tmp_path / "launches"
        p = supervisors.start(write_config(tmp_path, sleeper(tmp_path, marker), "keep_last = 1\n" + FAST))
        first = wait_for(lambda: launches(marker)[:1], 20, "the first launch")[0]  # type: ignore[index]
        shutil.copytree(root / "step_00000020", root / "backup" / "step_00000010")
        shutil.copytree(root / "step_00000020", root / "backup" / "step_00000020")
        commit(root, 30)
        wait_for(lambda: latest_step(tmp_path / ".fsdp-supervisor") == 30, 20, "the commit after the copy")
        os.kill(first["pid"], signal.SIGKILL)
        second = wait_for(lambda: launches(marker)[1:2], 20, "the relaunch")[0]  # type: ignore[index]
        assert second["argv"][-2:] == ["--resume", str(root / "step_00000030")]
        rc, out = stop(p)
        assert rc == 0, out
        assert sorted(os.listdir(root / "backup")) == ["step_00000010", "step_00000020"]
        assert "checkpoint_scan_failed" not in (tmp_path / ".fsdp-supervisor" / "supervisor.log").read_text()
