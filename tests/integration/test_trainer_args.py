"""Bad input to `python -m trainer`: one line naming the culprit, exit 2, nothing created or overwritten."""
from __future__ import annotations

import subprocess
import sys

import pytest

from supervisor.errors import UsageError
from tests.jobs.dcp_files import write_checkpoint
from trainer.args import build_parser, validate


def run_trainer(*args: str, cwd) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainer", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def assert_usage_error(proc: subprocess.CompletedProcess[str], culprit: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and culprit in lines[0] and "Traceback" not in proc.stderr, proc.stderr


class TestBadInput:
    def test_save_every_zero(self, tmp_path) -> None:
        """`--save-every 0` is refused before the checkpoint dir is even created."""
        proc = run_trainer("--checkpoint-dir", "ckpts", "--save-every", "0", cwd=tmp_path)
        assert_usage_error(proc, "--save-every")
        assert not (tmp_path / "ckpts").exists()

    def test_resume_path_missing(self, tmp_path) -> None:
        """A `--resume PATH` that does not exist names the path."""
        proc = run_trainer("--checkpoint-dir", "ckpts", "--resume", "nope/step_00000004", cwd=tmp_path)
        assert_usage_error(proc, "nope/step_00000004")
        assert not (tmp_path / "ckpts").exists()

    def test_resume_path_incomplete(self, tmp_path) -> None:
        """A checkpoint whose shards are missing is refused and left untouched."""
        ckpt = write_checkpoint(tmp_path / "ckpts", 4)
        shard = sorted(p for p in ckpt.iterdir() if p.suffix == ".distcp")[0]
        shard.unlink()
        before = sorted(p.name for p in ckpt.iterdir())
        proc = run_trainer("--checkpoint-dir", "ckpts", "--resume", str(ckpt), cwd=tmp_path)
        assert_usage_error(proc, str(ckpt))
        assert "incomplete" in proc.stderr
        assert sorted(p.name for p in ckpt.iterdir()) == before

    def test_checkpoint_dir_is_a_file(self, tmp_path) -> None:
        """A regular file where the checkpoint dir should be is named, and not overwritten."""
        (tmp_path / "ckpts").write_text("keep me")
        proc = run_trainer("--checkpoint-dir", "ckpts", cwd=tmp_path)
        assert_usage_error(proc, "--checkpoint-dir")
        assert (tmp_path / "ckpts").read_text() == "keep me"

    def test_checkpoint_dir_cannot_be_created(self, tmp_path) -> None:
        """A checkpoint dir below a regular file cannot be created: exit 2."""
        (tmp_path / "file").write_text("")
        proc = run_trainer("--checkpoint-dir", "file/ckpts", cwd=tmp_path)
        assert_usage_error(proc, "file/ckpts")

    def test_export_best_needs_evaluation(self, tmp_path) -> None:
        """`--export-best` without `--eval-every` has no val_loss to choose by: exit 2, DIR not created."""
        proc = run_trainer("--checkpoint-dir", "ckpts", "--export-best", "best", cwd=tmp_path)
        assert_usage_error(proc, "--eval-every")
        assert not (tmp_path / "best").exists()

    def test_export_best_is_a_file(self, tmp_path) -> None:
        """A regular file where the best-model dir should be is named and left alone."""
        (tmp_path / "best").write_text("keep me")
        proc = run_trainer("--checkpoint-dir", "ckpts", "--eval-every", "5", "--export-best", "best", cwd=tmp_path)
        assert_usage_error(proc, "--export-best")
        assert (tmp_path / "best").read_text() == "keep me"


class TestValidate:
    def parse(self, tmp_path, *extra: str):
        return build_parser().parse_args(["--checkpoint-dir", str(tmp_path / "c"), *extra])

    def test_data_file_must_hold_a_validation_region(self, tmp_path) -> None:
        """With evaluation on, a file too short to split into training and held-out parts is refused."""
        data = tmp_path / "short.txt"
        data.write_bytes(b"x" * 60)
        validate(self.parse(tmp_path, "--data", str(data), "--seq-len", "32"))  # eval off: long enough
        with pytest.raises(UsageError, match="--data.*--eval-every needs at least 68"):
            validate(self.parse(tmp_path, "--data", str(data), "--seq-len", "32", "--eval-every", "10"))
