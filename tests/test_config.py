"""job.toml loading: defaults, path resolution, and one-line errors that name the key."""
from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.config import load_config
from supervisor.errors import ConfigError

MINIMAL = """
[job]
command = ["torchrun", "-m", "trainer"]
[checkpoints]
dir = "ckpts"
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "job.toml"
    p.write_text(text)
    return p


class TestLoad:
    def test_defaults_and_relative_paths(self, tmp_path: Path) -> None:
        """Relative dirs resolve against the config's directory; documented defaults apply."""
        cfg = load_config(write(tmp_path, MINIMAL))
        assert cfg.checkpoints.dir == tmp_path / "ckpts"
        assert cfg.run_dir == tmp_path / ".fsdp-supervisor"
        assert cfg.job_cwd == tmp_path
        assert cfg.job.resume_args == ["--resume", "{checkpoint}"]
        assert (cfg.restart.policy, cfg.restart.max_restarts, cfg.restart.max_no_progress_restarts) == ("on-failure", 100, 3)
        assert (cfg.checkpoints.keep_last, cfg.checkpoints.partial_max_age_s) == (3, 3600)
        assert (cfg.health.hang_timeout_s, cfg.health.stop_timeout_s) == (0, 120)

    def test_full_example_from_the_issue(self, tmp_path: Path) -> None:
        """Every key the issue documents is accepted."""
        text = """
[job]
command = ["torchrun", "--nproc-per-node=2", "--max-restarts=0", "-m", "trainer", "--checkpoint-dir", "ckpts"]
resume_args = ["--resume", "{checkpoint}"]
cwd = "."
env = { OMP_NUM_THREADS = "1" }
[checkpoints]
dir = "ckpts"
keep_last = 3
keep_every = 0
min_free_gb = 0
partial_max_age_s = 3600
[restart]
policy = "on-failure"
max_restarts = 100
backoff_initial_s = 1
backoff_max_s = 300
backoff_multiplier = 2
reset_after_s = 600
max_no_progress_restarts = 3
quarantine_after = 2
[health]
hang_timeout_s = 0
save_timeout_s = 1800
stop_timeout_s = 120
[supervisor]
run_dir = "/abs/run"
"""
        cfg = load_config(write(tmp_path, text))
        assert cfg.job.env == {"OMP_NUM_THREADS": "1"}
        assert cfg.run_dir == Path("/abs/run")
        assert cfg.job_cwd == tmp_path


class TestErrors:
    @pytest.mark.parametrize(
        ("text", "needle"),
        [
            (MINIMAL + "[restart]\npolicy = 'sometimes'\n", "[restart.policy]"),
            (MINIMAL + "[restart]\nmax_restartz = 3\n", "[restart.max_restartz] unknown key"),
            ("bogus = 1\n" + MINIMAL, "[bogus] unknown key"),
            (MINIMAL + "bogus = 1\n", "[checkpoints.bogus] unknown key"),
            (MINIMAL.replace('dir = "ckpts"', ""), "[checkpoints.dir] required key is missing"),
            ("[checkpoints]\ndir='x'\n", "[job] section is missing"),
            (MINIMAL + "[health]\nstop_timeout_s = -1\n", "[health.stop_timeout_s]"),
            (MINIMAL + "[health]\nstop_timeout_s = inf\n", "[health.stop_timeout_s] Input should be a finite number"),
            (MINIMAL + "[restart]\nbackoff_max_s = nan\n", "[restart.backoff_max_s]"),
            (MINIMAL + "min_free_gb = inf\n", "[checkpoints.min_free_gb] Input should be a finite number"),
            (MINIMAL.replace('["torchrun", "-m", "trainer"]', "[]"), "[job.command]"),
            (MINIMAL.replace('["torchrun", "-m", "trainer"]', '"torchrun -m trainer"'), "[job.command]"),
            (MINIMAL + "[checkpoints.extra]\n", "[checkpoints.extra] unknown key"),
            ("[job\n", "invalid TOML"),
        ],
    )
    def test_one_line_naming_the_key(self, tmp_path: Path, text: str, needle: str) -> None:
        """Each bad config raises ConfigError whose single line names the culprit."""
        with pytest.raises(ConfigError) as ei:
            load_config(write(tmp_path, text))
        msg = str(ei.value)
        assert needle in msg and "\n" not in msg and str(tmp_path) in msg

    def test_missing_file(self, tmp_path: Path) -> None:
        """A missing config file is a ConfigError naming the path."""
        with pytest.raises(ConfigError, match="not found"):
            load_config(tmp_path / "nope.toml")
