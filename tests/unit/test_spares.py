"""The prewarmed launcher: which commands it takes over, and that a prewarmed attempt behaves like a cold one."""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from supervisor.host.spares import SPARE_SCRIPT, Plan, handed_ranks, is_spare_cmdline, plan


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


class TestPlan:
    def test_module_form(self, tmp_path: Path) -> None:
        """`python -m torch.distributed.run ARGS` is prewarmed with the same python and the same ARGS."""
        got = plan([sys.executable, "-m", "torch.distributed.run", "--standalone", "train.py", "--lr", "1"],
                   cwd=tmp_path, env=dict(os.environ))
        assert got == Plan(sys.executable, None, ("--standalone", "train.py", "--lr", "1"))

    def test_console_script_found_on_the_jobs_path(self, tmp_path: Path) -> None:
        """`torchrun` resolves through the job's PATH; its shebang names the interpreter to prewarm."""
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        script = _script(bin_dir / "torchrun", f"#!{sys.executable}\nimport sys\nfrom torch.distributed.run import main\n")
        got = plan(["torchrun", "--nnodes=1", "x.py"], cwd=tmp_path, env={"PATH": str(bin_dir)})
        assert got == Plan(sys.executable, str(script), ("--nnodes=1", "x.py"))

    @pytest.mark.parametrize(
        "argv",
        [
            [sys.executable, "train.py"],
            [sys.executable, "-u", "-m", "torch.distributed.run", "x.py"],  # interpreter flags: not reproduced
            ["torchrun", "x.py"],  # the wrapper below is no pip console script
            ["no-such-torchrun-here", "x.py"],
            [],
        ],
    )
    def test_anything_else_goes_cold(self, tmp_path: Path, argv: list[str]) -> None:
        """Commands that are not exactly a torchrun start get no plan (the cold path runs them)."""
        _script(tmp_path / "torchrun", "#!/bin/sh\nexec python3 -m torch.distributed.run \"$@\"\n")
        assert plan(argv, cwd=tmp_path, env={"PATH": str(tmp_path)}) is None

    def test_spare_cmdline_is_recognised(self) -> None:
        """A spare's argv (kept after it became a job) is recognised; a job's own argv is not."""
        assert is_spare_cmdline([sys.executable, str(SPARE_SCRIPT), "123"])
        assert not is_spare_cmdline([sys.executable, "-m", "torch.distributed.run", "x.py"])


class TestHandedRanks:
    def test_the_spares_handoff_lines_name_warm_ranks(self, tmp_path: Path) -> None:
        """A warm rank's /proc environment has no RANK: the spare's log names it; the latest line for a pid wins."""
        (tmp_path / "attempt-0002.log").write_bytes(
            b"event=prewarm_ready pid=10 import_s=1.2\n"
            b"event=warm_handoff pid=11 local_rank=0 rank=0\n"
            b"event=warm_handoff pid=12 local_rank=1 rank=1\n"
            b"garbage event=warm_handoff pid=13 local_rank=1 rank=9\n"
            b"event=warm_handoff pid=11 local_rank=1 rank=3\n")
        assert handed_ranks(tmp_path / "attempt-0002.log") == {11: 3, 12: 1}

    def test_no_log_no_ranks(self, tmp_path: Path) -> None:
        assert handed_ranks(tmp_path / "attempt-0001.log") == {}
