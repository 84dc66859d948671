"""Exit classification: codes, signals, OOM, hang/stop, and torchrun's root cause."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from supervisor.exits import RootCause, classify_exit, read_oom_kills, root_cause

TORCHRUN_TAIL = """
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_12:05:48
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : {code} (pid: 3723)
  error_file: /tmp/x/error.json
  traceback : Traceback (most recent call last):
  ValueError: boom on rank 1
============================================================
"""


class TestClassify:
    @pytest.mark.parametrize(
        ("rc", "kw", "reason", "sig"),
        [
            (0, {}, "completed", None),
            (1, {}, "crash", None),
            (-9, {}, "signal", "SIGKILL"),
            (-15, {"we_stopped": True}, "stopped", "SIGTERM"),
            (1, {"hang": True, "we_stopped": True}, "hang", None),
            (-9, {"oom_before": 2, "oom_after": 3}, "oom", "SIGKILL"),
            (-9, {"oom_before": 2, "oom_after": 2}, "signal", "SIGKILL"),
            (1, {"cause": RootCause(0, -9, None), "oom_before": 0, "oom_after": 1}, "oom", None),
            (1, {"cause": RootCause(0, -11, None)}, "signal", None),
        ],
    )
    def test_table(self, rc: int, kw: dict, reason: str, sig: str | None) -> None:
        """Each combination maps to one documented reason."""
        info = classify_exit(rc, at=1.0, **kw)
        assert (info.reason, info.signal) == (reason, sig)
        assert info.code == (rc if rc >= 0 else None)


class TestRootCause:
    def test_rank_and_message(self, tmp_path: Path) -> None:
        """Rank and worker exit code come from torchrun's output, the message from the error file."""
        log = tmp_path / "a.log"
        log.write_text("noise\n" * 100 + TORCHRUN_TAIL.format(code=1))
        err = tmp_path / "e.json"
        err.write_text(json.dumps({"message": {"message": "ValueError: boom on rank 1", "extraInfo": {}}}))
        rc = root_cause(err, log)
        assert (rc.rank, rc.exitcode) == (1, 1)
        assert rc.describe() == "rank 1: exitcode 1: ValueError: boom on rank 1"

    def test_signal_and_garbage_tolerated(self, tmp_path: Path) -> None:
        """A killed worker is named with its signal; a garbage or missing error file is ignored."""
        log = tmp_path / "a.log"
        log.write_text(TORCHRUN_TAIL.format(code=-9))
        err = tmp_path / "e.json"
        err.write_text("{not json")
        rc = root_cause(err, log)
        assert rc.describe() == "rank 1: exitcode -9 (SIGKILL)"
        assert root_cause(tmp_path / "missing", tmp_path / "missing").describe() is None


class TestOom:
    def test_reads_cgroup_v2_counter(self, tmp_path: Path) -> None:
        """oom_kill is read from our cgroup's memory.events; unreadable gives None."""
        (tmp_path / "cg" / "job").mkdir(parents=True)
        (tmp_path / "cg" / "job" / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\n")
        proc = tmp_path / "cgroup"
        proc.write_text("0::/job\n")
        assert read_oom_kills(tmp_path / "cg", proc) == 2
        assert read_oom_kills(tmp_path / "none", proc) is None
