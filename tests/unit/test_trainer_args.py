"""Bad input to `python -m trainer`: one line naming the culprit, exit 2, nothing created or overwritten."""
from __future__ import annotations

import pytest

from supervisor.checkpoints.testing import write_checkpoint
from supervisor.errors import UsageError
from trainer.args import build_parser, validate


class TestBadInput:
    @pytest.mark.parametrize("flag", ["--pg-timeout-s", "--lr"])
    def test_infinite_floats_are_refused(self, flag, capsys) -> None:
        """`inf` is no timeout or learning rate (it overflowed the process group's timedelta): exit 2 naming the flag."""
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(["--checkpoint-dir", "c", flag, "inf"])
        assert exc.value.code == 2 and flag in capsys.readouterr().err


class TestValidate:
    def parse(self, tmp_path, *extra: str):
        return build_parser().parse_args(["--checkpoint-dir", str(tmp_path / "c"), *extra])

    def test_defaults_are_valid_and_create_the_dir(self, tmp_path) -> None:
        """The defaults pass validation, which creates the checkpoint dir."""
        validate(self.parse(tmp_path))
        assert (tmp_path / "c").is_dir()

    def test_heads_must_divide_width(self, tmp_path) -> None:
        """A model width not divisible by the head count is a usage error naming both flags."""
        with pytest.raises(UsageError, match="--d-model 60.*--n-heads 8"):
            validate(self.parse(tmp_path, "--d-model", "60", "--n-heads", "8"))

    def test_data_file_must_exist(self, tmp_path) -> None:
        """`--data` must name an existing file."""
        with pytest.raises(UsageError, match="--data"):
            validate(self.parse(tmp_path, "--data", str(tmp_path / "missing.txt")))

    def test_complete_resume_path_is_accepted(self, tmp_path) -> None:
        """A complete checkpoint passes as `--resume PATH`."""
        ckpt = write_checkpoint(tmp_path / "c", 4)
        validate(self.parse(tmp_path, "--resume", str(ckpt)))
