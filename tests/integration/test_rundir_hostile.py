"""A run dir is ours or refused (issue 35 item 3), with the real CLI: another user's run dir, and symlinks planted
under the names of the daemon's files, are refused with exit 2 and one line; the file a symlink names is intact."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

from supervisor.config import load_config
from supervisor.daemon.preflight import check_setup
from supervisor.errors import ConfigError
from tests.supervise import FAKEJOB, cli, launches, write_config

NOBODY = 65534


def _config(tmp_path: Path) -> tuple[Path, Path, Path]:
    marker = tmp_path / "launches"
    cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--sleep", "60", "--marker", str(marker)],
                       '[supervisor]\nrun_dir = "run"\n')
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    return cfg, run_dir, marker


@pytest.mark.parametrize("name", ["supervisor.lock", "supervisor.log", "history.jsonl", "state.json"])
def test_a_planted_symlink_is_refused_and_its_target_untouched(tmp_path: Path, name: str) -> None:
    cfg, run_dir, marker = _config(tmp_path)
    victim = tmp_path / "victim-notes.txt"
    victim.write_text("precious\n")
    (run_dir / name).symlink_to(victim)
    r = cli("run", "-c", str(cfg))
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{run_dir / name} is a symlink" in lines[0] and "Remove it" in lines[0], r.stderr
    assert victim.read_text() == "precious\n" and launches(marker) == []


def test_a_shared_sticky_folder_as_run_dir_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    """`run_dir = "/tmp"` (here a folder like it: sticky, world-writable, holding others' files): exit 2 saying to
    set run_dir to a folder of its own; it was accepted and narrowed to 0700, locking every other user out of it."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    (shared / "someone-elses.txt").write_text("theirs\n")
    cfg = write_config(tmp_path, ["/bin/true"], f'[supervisor]\nrun_dir = "{shared}"\n')
    r = cli("run", "-c", str(cfg))
    assert r.returncode == 2 and "(mode 1777)" in r.stderr and "run_dir to a folder of its own" in r.stderr, r.stderr
    assert os.stat(shared).st_mode & 0o7777 == 0o1777 and os.listdir(shared) == ["someone-elses.txt"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the run dir to another user")
@pytest.mark.parametrize("which", ["run", "run/logs", "run/heartbeats"])
def test_another_users_run_dir_is_refused(tmp_path: Path, which: str) -> None:
    cfg, run_dir, marker = _config(tmp_path)
    target = tmp_path / which
    target.mkdir(exist_ok=True)
    os.chown(target, NOBODY, NOBODY)
    r = cli("run", "-c", str(cfg))
    assert r.returncode == 2 and f"{target} belongs to uid {NOBODY}" in r.stderr, r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and launches(marker) == []
    assert sorted(os.listdir(run_dir)) == (["logs"] if which == "run/logs" else ["heartbeats"] if which != "run" else [])



@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to check as another user")
@pytest.mark.parametrize("mode", [0o777, 0o755])
def test_a_run_dir_planted_for_another_user_is_refused_by_that_users_check(mode: int) -> None:
    """`run`'s checks made by another user (nobody, in a forked process: the interpreter here may not be theirs
    to execute) whose run dir, in a shared sticky folder, someone else (here root) made first and left writable for
    them, or made with `sudo mkdir` (0755; was "not writable", which invites a chmod): refused naming its owner."""
    with tempfile.TemporaryDirectory() as shared:
        base = Path(shared)
        os.chmod(base, 0o1777)
        cfg = write_config(base, ["/bin/sleep", "60"], '[supervisor]\nrun_dir = "run"\n')  # theirs to run
        os.chmod(cfg, 0o644)
        (base / "run").mkdir()
        os.chmod(base / "run", mode)
        config = load_config(cfg)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                check_setup(config)
                os.write(write, b"accepted")
            except ConfigError as exc:
                os.write(write, str(exc).encode()[:4000])
            finally:
                os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        with os.fdopen(read, "rb") as f:
            said = f.read().decode()
        assert f"[supervisor.run_dir] {base / 'run'} belongs to uid 0, not to you (uid {NOBODY})" in said, said
        assert os.listdir(base / "run") == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to look as another user")
@pytest.mark.parametrize("command", ["stop", "status"])
def test_another_users_live_run_is_not_called_not_running(command: str) -> None:
    """`stop`/`status` by a user who may not read the run dir of a live supervisor (root's, here held by this
    process): exit 2 saying permission denied, never "no supervisor is running" with exit 0 (nothing stopped)."""
    import ctypes  # noqa: F401 - imported here, as root: nobody may not read this interpreter's library
    import importlib
    import pkgutil

    import supervisor
    from supervisor.cli.app import main
    from supervisor.host.runlock import RunLock

    for module in pkgutil.walk_packages(supervisor.__path__, "supervisor."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)

    with tempfile.TemporaryDirectory() as shared:
        os.chmod(shared, 0o755)
        cfg = write_config(Path(shared), ["/bin/sleep", "60"], '[supervisor]\nrun_dir = "run"\n')
        os.chmod(cfg, 0o644)
        (Path(shared) / "run").mkdir(mode=0o700)
        lock = RunLock(Path(shared) / "run")
        lock.acquire()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            rc = 1
            try:
                sys.stdout = sys.stderr = os.fdopen(write, "w")  # what main says
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                rc = main([command, "-c", str(cfg)])
            except BaseException as exc:  # noqa: BLE001 - said, for the assertion below
                print(repr(exc))
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc)
        os.close(write)
        _, code = os.waitpid(pid, 0)
        with os.fdopen(read, "rb") as f:
            said = f.read().decode()
        lock.release()
        assert os.waitstatus_to_exitcode(code) == 2 and "permission denied" in said, said


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant as another user")
def test_a_run_dir_planted_after_the_check_is_refused_when_made() -> None:
    """The run dir is missing at the check and planted by another user (in a shared sticky folder) before `run`
    makes it: make_dirs refuses it (it used the other user's folder, where that user could plant links)."""
    from supervisor.daemon.preflight import make_dirs

    with tempfile.TemporaryDirectory() as shared:
        os.chmod(shared, 0o1777)
        cfg = write_config(Path(shared), ["/bin/true"], '[supervisor]\nrun_dir = "run"\n')
        config = load_config(cfg)
        check_setup(config)  # nothing there yet
        (Path(shared) / "run").mkdir()
        os.chown(Path(shared) / "run", NOBODY, NOBODY)  # the other user won the race
        with pytest.raises(ConfigError, match=f"belongs to uid {NOBODY}"):
            make_dirs(config)
        assert os.listdir(Path(shared) / "run") == []


@pytest.mark.parametrize("key", ["dir", "local_dir"])
def test_a_checkpoint_root_under_a_folder_anyone_may_write_is_refused(tmp_path: Path, key: str) -> None:
    """A checkpoint root (or the local tier: a `chmod 777 /mnt/nvme`) under a folder anyone may write without the
    sticky bit: anyone could rename it away and put their folder there, whose checkpoint the job then resumes from
    (torch.load: their code, run as the job). `run` exits 2 naming the folder and the fix."""
    shared = tmp_path / "scratch"
    shared.mkdir()
    os.chmod(shared, 0o777)
    ckpts = f'dir = "{shared / "ckpts"}"\n' if key == "dir" else f'dir = "ckpts"\nlocal_dir = "{shared / "local"}"\n'
    cfg = write_config(tmp_path, ["/bin/true"], '[supervisor]\nrun_dir = "run"\n').read_text()
    (tmp_path / "job.toml").write_text(cfg.replace('dir = "ckpts"\n', ckpts))
    r = cli("run", "-c", str(tmp_path / "job.toml"))
    assert r.returncode == 2 and f"[checkpoints.{key}] {shared}, above " in r.stderr and "chmod +t" in r.stderr, r.stderr
    assert os.listdir(shared) == []
