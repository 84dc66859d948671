"""The prewarmed launcher: which commands it takes over, and that a prewarmed attempt behaves like a cold one."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.daemon.attemptfiles import AttemptFiles
from supervisor.host.boot import start_ticks
from supervisor.host.spares import SPARE_SCRIPT, VOLATILE_ENV, Plan, handed_ranks, is_spare_cmdline, plan
from tests.fakes import RecordingLog
from trainer.warm_pool import WarmPool, WorkerPlan


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
    """Which worker runs which rank comes from the agent's side file, with each worker's start time; the job's output
    (the attempt log) is never read for it."""

    def test_the_side_file_names_live_warm_ranks(self, tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
        """A record counts while its pid has the start time written beside it; the first line for a pid wins, and
        for a rank: the agent's, written before the worker runs the job's code, which may append forged lines (its
        sibling's pid as its own rank: once the stopped sibling was reported under the forger's rank)."""
        start = start_ticks(sleeper.pid)
        _side(tmp_path, {"pid": sleeper.pid, "start": start, "rank": 0}, {"pid": sleeper.pid, "start": start, "rank": 3})
        assert handed_ranks(tmp_path / "attempt-0002.log") == {sleeper.pid: 0}
        _side(tmp_path, {"pid": os.getpid(), "start": start_ticks(os.getpid()), "rank": 1},
              {"pid": sleeper.pid, "start": start, "rank": 1})
        assert handed_ranks(tmp_path / "attempt-0002.log") == {os.getpid(): 1}

    @pytest.mark.parametrize("plant", ["fifo", "symlink", "junk"])
    def test_a_side_file_planted_before_the_launch_is_cleared(self, tmp_path: Path, plant: str) -> None:
        """An earlier attempt's job plants the next attempt's side file (a FIFO or a symlink the agent cannot write, or
        64 KiB of junk its lines would come after): the launch clears it, so the agent's lines are the ones read."""
        side = tmp_path / "logs" / "attempt-0002.handoff"
        side.parent.mkdir()
        {"fifo": lambda: os.mkfifo(side), "symlink": lambda: side.symlink_to(tmp_path / "victim"),
         "junk": lambda: side.write_bytes(b"x" * (1 << 17))}[plant]()
        cfg = types.SimpleNamespace(supervisor=types.SimpleNamespace(job_logs_kept=5))
        AttemptFiles(cfg, None, RecordingLog()).prepare(  # type: ignore[arg-type]
            tmp_path / "errors" / "attempt-0002.json", tmp_path / "logs" / "attempt-0002.log", [])
        assert not os.path.lexists(side)

    def test_a_process_started_after_the_launch_is_no_warm_worker(self, tmp_path: Path,
                                                                  sleeper: subprocess.Popen[bytes]) -> None:
        """Warm workers wait for the launch; a rank started at or after it is torchrun's cold one, named by its own
        RANK, whatever a record the job appended to the side file claims."""
        start = start_ticks(sleeper.pid) or 0
        _side(tmp_path, {"pid": sleeper.pid, "start": start, "rank": 0})
        assert handed_ranks(tmp_path / "attempt-0002.log", start + 1) == {sleeper.pid: 0}
        assert handed_ranks(tmp_path / "attempt-0002.log", start) == {}

    def test_a_reused_pid_names_nothing(self, tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
        """Another start time: the pid is another process now (or the record was forged)."""
        _side(tmp_path, {"pid": sleeper.pid, "start": (start_ticks(sleeper.pid) or 0) + 1, "rank": 1})
        assert handed_ranks(tmp_path / "attempt-0002.log") == {}

    def test_the_jobs_output_is_never_read(self, tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
        """The lines that crashed the supervisor (a 5,000-digit pid: ValueError) and renamed a stopped rank (a real
        pid) in the job's output change nothing."""
        (tmp_path / "attempt-0002.log").write_bytes(
            b"event=warm_handoff pid=" + b"9" * 5000 + b" local_rank=0 rank=0\n"
            + f"event=warm_handoff pid={sleeper.pid} local_rank=0 rank=0\n".encode())
        assert handed_ranks(tmp_path / "attempt-0002.log") == {}

    @pytest.mark.parametrize("line", [
        b'{"pid": ' + b"9" * 5000 + b', "start": 1, "rank": 0}',  # past Python's int digit limit
        b"[" * 60_000, b"not json", b"[1, 2, 3]", b'"pid"', b'{"pid": 1}',
        b'{"pid": true, "start": 1, "rank": 0}', b'{"pid": -1, "start": 1, "rank": 0}',
        b'{"pid": 1, "start": 1, "rank": 18446744073709551616}',
    ])
    def test_bad_lines_are_skipped(self, tmp_path: Path, sleeper: subprocess.Popen[bytes], line: bytes) -> None:
        """Anything but three small ints is skipped, never an exception; the good line after it still counts."""
        good = json.dumps({"pid": sleeper.pid, "start": start_ticks(sleeper.pid), "rank": 1}).encode()
        (tmp_path / "attempt-0002.handoff").write_bytes(line + b"\n" + good + b"\n")
        assert handed_ranks(tmp_path / "attempt-0002.log") == {sleeper.pid: 1}

    def test_a_symlink_is_not_followed(self, tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
        """A side file planted as a symlink (to records that would name ranks) is not read."""
        real = tmp_path / "elsewhere"
        real.write_text(json.dumps({"pid": sleeper.pid, "start": start_ticks(sleeper.pid), "rank": 1}) + "\n")
        (tmp_path / "attempt-0002.handoff").symlink_to(real)
        assert handed_ranks(tmp_path / "attempt-0002.log") == {}

    def test_what_the_agent_records_the_supervisor_reads(self, tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
        """trainer/warm_pool.py's record (pid, its start ticks, rank) is what handed_ranks accepts."""
        pool = WarmPool(WorkerPlan(sys.executable, ("-u", "x.py"), str(tmp_path), 1, {}), str(tmp_path), [],
                        VOLATILE_ENV, lambda line: None, handoff=str(tmp_path / "attempt-0002.handoff"))
        pool._record(sleeper.pid, "5")
        assert handed_ranks(tmp_path / "attempt-0002.log") == {sleeper.pid: 5}

    def test_the_agent_never_writes_through_a_symlink(self, tmp_path: Path) -> None:
        """A symlink planted at the side file's name: the agent says so and the target is untouched."""
        victim = tmp_path / "notes.txt"
        victim.write_text("mine\n")
        (tmp_path / "attempt-0002.handoff").symlink_to(victim)
        said: list[str] = []
        pool = WarmPool(WorkerPlan(sys.executable, ("-u", "x.py"), str(tmp_path), 1, {}), str(tmp_path), [],
                        VOLATILE_ENV, said.append, handoff=str(tmp_path / "attempt-0002.handoff"))
        pool._record(os.getpid(), "0")
        assert victim.read_text() == "mine\n" and said[0].startswith("event=warm_handoff_unrecorded")

    def test_no_file_no_ranks(self, tmp_path: Path) -> None:
        assert handed_ranks(tmp_path / "attempt-0001.log") == {}


def _side(tmp_path: Path, *records: dict) -> None:
    (tmp_path / "attempt-0002.handoff").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A live process of ours, to stand for a warm worker."""
    proc = subprocess.Popen(["sleep", "60"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()
