"""host/joblog: attempt logs in bounded space (a capped live log, one segment, the last attempts only)."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from supervisor.host import joblog
from tests.unit.test_core import make_core


class TestRules:
    @pytest.mark.parametrize(("size", "cap", "due"), [(0, 100, False), (50, 100, False), (51, 100, True),
                                                      (10**9, 64 << 20, True)])
    def test_needs_rotation(self, size: int, cap: int, due: bool) -> None:
        """A live log is rotated once it passes half the cap (live + segment stay within it)."""
        assert joblog.needs_rotation(size, cap) is due

    @pytest.mark.parametrize(("name", "number"), [("attempt-0007.log", 7), ("attempt-0007.log.1", 7),
                                                  ("attempt-12345.json", 12345), ("attempt-0003.handoff", 3),
                                                  ("attempt-x.log", None),
                                                  ("prewarm.log", None), (".attempt-0001.log.1.tmp", None)])
    def test_attempt_number(self, name: str, number: int | None) -> None:
        """Only our own attempt file names carry a number."""
        assert joblog.attempt_number(name) == number

    def test_stale_keeps_the_newest_and_the_current(self) -> None:
        """Files of attempts older than the `keep` newest go; the current attempt's and foreign names stay."""
        names = ["attempt-0001.log", "attempt-0001.log.1", "attempt-0002.log", "attempt-0003.log",
                 "attempt-0010.log", "prewarm.log", "notes.txt"]
        assert joblog.stale(names, 2, None) == ["attempt-0001.log", "attempt-0001.log.1", "attempt-0002.log"]
        assert joblog.stale(names, 1, 2) == ["attempt-0001.log", "attempt-0001.log.1", "attempt-0003.log"]


class TestRotate:
    def test_tail_kept_and_the_writer_goes_on_at_the_new_end(self, tmp_path: Path) -> None:
        """The last half-cap bytes move to `.1`; the job's O_APPEND descriptor then writes from offset 0."""
        log = tmp_path / "attempt-0001.log"
        fd = joblog.open_log(log)
        try:
            os.write(fd, b"".join(b"line %05d\n" % i for i in range(1000)))  # 11000 bytes
            assert joblog.rotate(log, 4000) is None
            segment = log.with_name(log.name + joblog.SEGMENT_SUFFIX).read_bytes()
            assert segment.endswith(b"line 00999\n") and len(segment) == 2000
            assert log.stat().st_size == 0
            os.write(fd, b"after\n")
            assert log.read_bytes() == b"after\n"
        finally:
            os.close(fd)
        for f in tmp_path.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


class TestCore:
    def test_running_attempts_log_stays_under_the_cap(self, tmp_path: Path) -> None:
        """bound_output rotates the running attempt's log once it passes half of job_log_max_bytes."""
        core, _, _ = make_core(tmp_path, health="[supervisor]\njob_log_max_bytes = 65536")  # the last table
        core.begin(None)
        log = core.job.log_path if core.job else None
        assert log is not None and log.exists()
        with open(log, "ab") as f:
            f.write(b"x" * (1 << 20))
        core.bound_output()
        assert log.stat().st_size == 0
        assert log.with_name(log.name + ".1").stat().st_size == 1 << 15

    def test_old_attempts_logs_are_pruned_at_launch(self, tmp_path: Path) -> None:
        """At each launch only the last job_logs_kept attempts keep their logs and error files."""
        core, _, _ = make_core(tmp_path, health="[supervisor]\njob_logs_kept = 3")
        logs, errors = core.run_dir / "logs", core.run_dir / "errors"
        for d in (logs, errors):
            d.mkdir(exist_ok=True)
        for n in range(1, 6):
            (logs / f"attempt-{n:04d}.log").write_text("old")
            (errors / f"attempt-{n:04d}.json").write_text("{}")
        (logs / "attempt-0001.log.1").write_text("old")
        core.begin(None)
        assert core.job is not None
        kept = {p.name for p in logs.iterdir()}
        assert kept == {"attempt-0004.log", "attempt-0005.log", core.job.log_path.name}
        assert {p.name for p in errors.iterdir()} == {"attempt-0004.json", "attempt-0005.json"}

    def test_a_segment_that_cannot_be_written_is_said_once_and_the_log_still_shrinks(self, tmp_path: Path) -> None:
        """The `.1` segment cannot be written (here: a folder in its place): truncate anyway, warn once per attempt."""
        core, _, log = make_core(tmp_path, health="[supervisor]\njob_log_max_bytes = 65536")
        core.begin(None)
        assert core.job is not None
        live = core.job.log_path
        (live.parent / f".{live.name}.1.tmp").mkdir()  # where the segment is written first
        for _ in range(2):
            with open(live, "ab") as f:
                f.write(b"x" * (1 << 20))
            core.bound_output()
            assert live.stat().st_size == 0
        assert [e for e in log.names() if e == "run_dir_write_failed"] == ["run_dir_write_failed"]
        assert core.job is not None and not core.job.rotating
