"""Bad input to `python -m trainer`: one line naming the culprit, exit 2, nothing created or overwritten."""
from __future__ import annotations

import pytest

from supervisor.errors import UsageError
from tests.jobs.dcp_files import write_checkpoint
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

    @pytest.mark.parametrize("flag,env,skip", [(None, None, 0), (None, "7", 7), ("3", "7", 3), (None, "", 0)])
    def test_skip_steps_from_the_flag_else_the_supervisor(self, tmp_path, monkeypatch, flag, env, skip) -> None:
        """--skip-steps wins; else $FSDP_SUPERVISOR_SKIP_STEPS (a rollback's); else 0."""
        if env is not None:
            monkeypatch.setenv("FSDP_SUPERVISOR_SKIP_STEPS", env)
        args = self.parse(tmp_path, *(["--skip-steps", flag] if flag else []))
        validate(args)
        assert args.skip_steps == skip

    @pytest.mark.parametrize("env", ["-1", "x", "1e3", "9" * 40])
    def test_a_bad_skip_from_the_environment_is_a_usage_error(self, tmp_path, monkeypatch, env) -> None:
        monkeypatch.setenv("FSDP_SUPERVISOR_SKIP_STEPS", env)
        with pytest.raises(UsageError, match="FSDP_SUPERVISOR_SKIP_STEPS"):
            validate(self.parse(tmp_path))

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


class TestLocalTier:
    def parse(self, tmp_path, *extra: str):
        return build_parser().parse_args(["--checkpoint-dir", str(tmp_path / "c"), *extra])

    def test_the_local_dir_comes_from_the_supervisor(self, tmp_path, monkeypatch) -> None:
        """Without --local-checkpoint-dir, FSDP_SUPERVISOR_LOCAL_DIR ([checkpoints] local_dir) names the tier."""
        monkeypatch.setenv("FSDP_SUPERVISOR_LOCAL_DIR", str(tmp_path / "shm"))
        args = self.parse(tmp_path, "--local-save-every", "5")
        validate(args)
        assert args.local_checkpoint_dir == tmp_path / "shm" and (tmp_path / "shm").is_dir()

    @pytest.mark.parametrize(("extra", "env", "needle"), [
        (["--local-save-every", "5"], {}, "needs --local-checkpoint-dir"),
        (["--local-save-every", "5", "--local-checkpoint-dir", "{tmp}/c/local"], {}, "overlaps --checkpoint-dir"),
        (["--local-save-every", "5", "--local-checkpoint-dir", "{tmp}/l"], {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"},
         "single-node"),
    ])
    def test_bad_local_tiers_are_usage_errors(self, tmp_path, monkeypatch, extra, env, needle) -> None:
        """No dir, an overlapping dir, or a job over several nodes: exit 2 naming the flag, nothing created."""
        monkeypatch.delenv("FSDP_SUPERVISOR_LOCAL_DIR", raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        args = self.parse(tmp_path, *(e.replace("{tmp}", str(tmp_path)) for e in extra))
        with pytest.raises(UsageError) as exc:
            validate(args)
        assert needle in str(exc.value) and exc.value.exit_code == 2 and not (tmp_path / "c").exists()
