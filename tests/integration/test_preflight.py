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
