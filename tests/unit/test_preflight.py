"""Tests for supervisor.daemon.preflight: `run` refuses unusable paths and programs before it creates or launches
anything."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import supervisor.checkpoints
from supervisor.config import Config, load_config
from supervisor.daemon import preflight
from supervisor.errors import CheckpointError, ConfigError
from tests.jobs.dcp_files import write_checkpoint


def config(tmp_path: Path, *, command: list[str] | None = None, dir: str = "ckpts", run_dir: str | None = None,
           cwd: str | None = None) -> Config:
    """A job.toml in tmp_path/conf whose job, if ever launched, leaves tmp_path/launched behind."""
    base = tmp_path / "conf"
    base.mkdir(exist_ok=True)
    command = command or [sys.executable, "-c", f"open({str(tmp_path / 'launched')!r}, 'w').close()"]
    text = f"[job]\ncommand = {json.dumps(command)}\n" + (f"cwd = {json.dumps(cwd)}\n" if cwd else "")
    text += f"[checkpoints]\ndir = {json.dumps(dir)}\n"
    text += f"[supervisor]\nrun_dir = {json.dumps(run_dir)}\n" if run_dir else ""
    (base / "job.toml").write_text(text)
    return load_config(base / "job.toml")


def refused(cfg: Config, *needles: str) -> str:
    """check_setup raises one ConfigError line naming the config and each needle."""
    with pytest.raises(ConfigError) as ei:
        preflight.check_setup(cfg)
    msg = str(ei.value)
    assert "\n" not in msg and str(cfg.path) in msg and all(n in msg for n in needles), msg
    return msg


class TestPaths:
    def test_run_dir_is_a_file(self, tmp_path: Path) -> None:
        """run_dir naming an existing file."""
        (tmp_path / "afile").touch()
        refused(config(tmp_path, run_dir=str(tmp_path / "afile")), "[supervisor.run_dir]", "afile is a file")

    def test_checkpoint_dir_is_a_file(self, tmp_path: Path) -> None:
        """[checkpoints] dir naming an existing file."""
        (tmp_path / "afile").touch()
        refused(config(tmp_path, dir=str(tmp_path / "afile")), "[checkpoints.dir]", "is a file")

    def test_a_file_on_the_way(self, tmp_path: Path) -> None:
        """A parent of the checkpoint dir is a file: nothing can be created under it."""
        (tmp_path / "afile").touch()
        refused(config(tmp_path, dir=str(tmp_path / "afile" / "ckpts")), "[checkpoints.dir]", "afile is a file")

    @pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only directory")
    def test_read_only_parent(self, tmp_path: Path) -> None:
        """A parent without write permission."""
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        refused(config(tmp_path, run_dir=str(ro / "run")), "[supervisor.run_dir]", "not writable")

    def test_job_cwd_missing(self, tmp_path: Path) -> None:
        """A job directory that does not exist."""
        refused(config(tmp_path, cwd=str(tmp_path / "nope")), "[job.cwd]", "is not a directory")

    def test_nothing_left_when_creation_fails(self, tmp_path: Path) -> None:
        """The run dir created before the checkpoint root failed is removed again (/proc refuses new dirs)."""
        cfg = config(tmp_path, dir="/proc/fsdp-supervisor-test/ckpts")
        with pytest.raises(ConfigError, match=r"\[checkpoints.dir\] cannot create /proc/fsdp-supervisor-test"):
            preflight.check_setup(cfg)
            preflight.make_dirs(cfg)
        assert sorted(os.listdir(tmp_path / "conf")) == ["job.toml"]

    def test_the_local_tier_is_refused_to_a_job_our_environment_puts_on_several_nodes(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """PET_NNODES in the supervisor's environment is torchrun's --nnodes for a job that passes none: no local tier."""
        (tmp_path / "job.toml").write_text(
            f"[job]\ncommand = {json.dumps([sys.executable, '-m', 'torch.distributed.run', '-m', 'trainer'])}\n"
            '[checkpoints]\ndir = "ckpts"\nlocal_dir = "local"\n')
        cfg = load_config(tmp_path / "job.toml")
        monkeypatch.setenv("PET_NNODES", "1:2")
        refused(cfg, "[checkpoints.local_dir]", "single-node", "--nnodes 1:2")
        monkeypatch.setenv("PET_NNODES", "1")
        preflight.check_setup(cfg)

    def test_usable_paths_are_created(self, tmp_path: Path) -> None:
        """The good case: check passes and make_dirs creates run dir, logs/ and the root."""
        cfg = config(tmp_path, dir=str(tmp_path / "deep" / "er" / "ckpts"))
        preflight.check_setup(cfg)
        preflight.make_dirs(cfg)
        assert (cfg.run_dir / "logs").is_dir() and cfg.checkpoints.dir.is_dir()


class TestProgram:
    def test_directory(self, tmp_path: Path) -> None:
        """A command naming a directory (exec would fail with EACCES on every attempt)."""
        refused(config(tmp_path, command=[str(tmp_path)]), "[job.command]", repr(str(tmp_path)))

    def test_not_executable(self, tmp_path: Path) -> None:
        """A command naming a file without the execute bit."""
        (tmp_path / "conf").mkdir()
        (tmp_path / "conf" / "train.sh").write_text("#!/bin/sh\n")
        refused(config(tmp_path, command=["./train.sh"]), "[job.command]", "'./train.sh'")

    @pytest.mark.parametrize("kind", ["missing", "not-executable", "directory"])
    def test_script_whose_interpreter_cannot_run(self, tmp_path: Path, kind: str) -> None:
        """An executable script whose `#!` names a missing or non-executable interpreter: exec fails with ENOENT or
        EACCES naming the script, which read as "no such file" for a file that exists, and the run exited 3."""
        (tmp_path / "conf").mkdir()
        interpreter = str(tmp_path / "interp")
        if kind == "not-executable":
            (tmp_path / "interp").write_text("")
        elif kind == "directory":
            (tmp_path / "interp").mkdir()
        script = tmp_path / "conf" / "train.sh"
        script.write_text(f"#! {interpreter} -u\nprint('hi')\n")
        script.chmod(0o755)
        refused(config(tmp_path, command=["./train.sh"]), "[job.command]", "'./train.sh'", f"#! interpreter {interpreter}")

    def test_script_with_a_working_interpreter_passes(self, tmp_path: Path) -> None:
        """`#!/usr/bin/env python3` and `#!/bin/sh` scripts are fine."""
        (tmp_path / "conf").mkdir()
        for name, line in (("a.sh", "#!/bin/sh"), ("b.py", "#!/usr/bin/env python3")):
            (tmp_path / "conf" / name).write_text(line + "\n")
            (tmp_path / "conf" / name).chmod(0o755)
            preflight.check_setup(config(tmp_path, command=[f"./{name}"]))

    def test_not_on_path(self, tmp_path: Path) -> None:
        """A bare name that PATH does not hold."""
        refused(config(tmp_path, command=["no-such-program-xyz"]), "[job.command]", "not found")


class TestRootTooHigh:
    """The store's `check_root` judges the root itself; `run` turns its error into exit 2."""

    def test_store_refusal_is_a_config_error(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """Whatever CheckpointError check_root raises becomes one ConfigError line naming [checkpoints.dir]."""

        class RootTooHigh(CheckpointError):
            pass

        def check_root(root: Path) -> None:
            raise RootTooHigh(f"checkpoint root {root} holds a checkpoint directory")

        monkeypatch.setattr(supervisor.checkpoints, "check_root", check_root, raising=False)
        cfg = config(tmp_path, dir=str(tmp_path / "outputs"))
        (tmp_path / "outputs").mkdir()
        refused(cfg, "[checkpoints.dir] checkpoint root", "holds a checkpoint directory")

    def test_torchtitan_root_one_level_too_high(self, tmp_path: Path) -> None:
        """torchtitan's `outputs/` given instead of `outputs/checkpoint/` (holding step-10, step-20): exit 2."""
        outputs = tmp_path / "outputs"
        for step in (10, 20):
            write_checkpoint(outputs / "checkpoint", step, name=f"step-{step}")
        refused(config(tmp_path, dir=str(outputs)), "[checkpoints.dir]", "checkpoint")


@pytest.mark.parametrize(("command", "key"), [
    (["torchrun", "--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=node-a:29500", "--rdzv-id=run-7", "-m",
      "trainer"], "rdzv node-a:29500 run-7"),
    (["/venv/bin/torchrun", "--nnodes", "2", "--rdzv_endpoint", "node-a:29500", "--rdzv_id", "run-7", "train.py"],
     "rdzv node-a:29500 run-7"),  # underscores, separate values
    (["python", "-m", "torch.distributed.run", "--nnodes=4", "--node-rank=1", "--master-addr=10.0.0.1",
      "--master-port=1234", "train.py"], "master 10.0.0.1:1234"),  # static rendezvous
    (["torchrun", "--nnodes=1", "--rdzv-id=x", "-m", "trainer"], None),  # one node: a job of its own
    (["torchrun", "--nproc-per-node=8", "-m", "trainer"], None),
    (["torchrun", "--nnode", "2", "--rdzv-id=x", "-m", "trainer"], "rdzv  x"),  # abbreviated, as argparse allows
    (["torchrun", "--nnodes=2", "--nnodes=1", "--rdzv-id=x", "-m", "trainer"], None),  # the last one wins
    (["torchrun", "--standalone", "-m", "trainer", "--nnodes=2", "--rdzv-id=x"], None),  # the trainer's own flags
    (["python", "train.py", "--nnodes=2", "--rdzv-id=x"], None),  # not torchrun
])
def test_rendezvous_key(command: list[str], key: str | None) -> None:
    """Which supervisors are nodes of one job and may share the checkpoint root's claim."""
    from supervisor.daemon.preflight import rendezvous_key

    assert rendezvous_key(command) == key
