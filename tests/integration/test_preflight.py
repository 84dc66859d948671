"""Tests for supervisor.daemon.preflight: `run` refuses unusable paths and programs before it creates or launches
anything."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.supervise import cli


class TestThroughTheCli:
    # One per layer (the rest are covered in-process): preflight's paths, its program check, load_config's overlap.
    @pytest.mark.parametrize("case", ["dir_file", "command_dir", "dot_dir"])
    def test_exit_2_one_line_nothing_created_nothing_launched(self, tmp_path: Path, case: str) -> None:
        """`run` on each bad setup: exit 2, one stderr line naming the key, no run dir, no launch."""
        (tmp_path / "afile").touch()
        launch = f"open({str(tmp_path / 'launched')!r}, 'w').close()"
        job, ckpts = f"command = {json.dumps([sys.executable, '-c', launch])}\n", 'dir = "ckpts"\n'
        key = {"dir_file": "[checkpoints.dir]", "command_dir": "[job.command]", "dot_dir": "[checkpoints.dir]"}[case]
        if case == "dir_file":
            ckpts = f"dir = {json.dumps(str(tmp_path / 'afile'))}\n"
        elif case == "command_dir":
            job = f"command = {json.dumps([str(tmp_path)])}\n"
        else:
            ckpts = 'dir = "."\n'
        conf = tmp_path / "conf"
        conf.mkdir()
        (conf / "job.toml").write_text(f"[job]\n{job}[checkpoints]\n{ckpts}")
        out = cli("run", "-c", str(conf / "job.toml"))
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and key in lines[0], out.stderr
        assert sorted(os.listdir(conf)) == ["job.toml"] and not (tmp_path / "launched").exists()


class TestTrainerClash:
    """A `-m trainer` job whose Python imports another distribution's `trainer` (Coqui's) is refused before launch."""

    @staticmethod
    def coqui(root: Path) -> Path:
        (root / "trainer").mkdir(parents=True)
        (root / "trainer" / "__init__.py").write_text("from trainer.trainer import Trainer  # Coqui's\n")
        info = root / "trainer-0.0.36.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: trainer\nVersion: 0.0.36\n")
        (info / "top_level.txt").write_text("trainer\n")
        return root

    @staticmethod
    def write(tmp_path: Path, command: list[str], pythonpath: str) -> Path:
        conf = tmp_path / "conf"
        conf.mkdir(exist_ok=True)
        (conf / "job.toml").write_text(f"[job]\ncommand = {json.dumps(command)}\n"
                                       f"env = {{ PYTHONPATH = {json.dumps(pythonpath)} }}\n"
                                       '[checkpoints]\ndir = "ckpts"\n')
        return conf / "job.toml"

    @pytest.mark.parametrize("launcher", ["python", "torchrun"])
    def test_coqui_trainer_first_exit_2_naming_it(self, tmp_path: Path, launcher: str) -> None:
        """python -m trainer and torchrun -m trainer (its `#!` Python): exit 2, one line naming the distribution."""
        from tests.helpers import TORCHRUN

        prefix = [sys.executable] if launcher == "python" else [str(TORCHRUN), "--standalone", "--nproc-per-node=1"]
        config = self.write(tmp_path, [*prefix, "-m", "trainer", "--steps", "2"], str(self.coqui(tmp_path / "site")))
        out = cli("run", "-c", str(config))
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, out.stderr
        assert "[job.command]" in lines[0] and "distribution trainer" in lines[0] and "venv without it" in lines[0]
        assert sorted(os.listdir(config.parent)) == ["job.toml"]

    @pytest.mark.parametrize("launcher", ["python", "torchrun"])
    def test_our_trainer_passes(self, tmp_path: Path, launcher: str) -> None:
        """Control: the same commands with this checkout's trainer first pass the check (in-process, no launch)."""
        from supervisor.config import load_config
        from supervisor.daemon.preflight import check_setup
        from tests.helpers import REPO, TORCHRUN

        prefix = [sys.executable] if launcher == "python" else [str(TORCHRUN), "--standalone", "--nproc-per-node=1"]
        check_setup(load_config(self.write(tmp_path, [*prefix, "-m", "trainer", "--steps", "2"], str(REPO))))
