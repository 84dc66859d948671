"""Exit classification: codes, signals, OOM, hang/stop, and the failing worker's rank and exception.

The torchrun samples in tests/data are real output of `torchrun --standalone --nproc-per-node=2
--max-restarts=0 [--tee 3 [--role rank]] tests/data/torchrun_failing_worker.py` (torch 2.13, CPU), where rank 1
raises and rank 0 is torn down; torchrun_two_ranks.log ran torchrun_two_ranks_worker.py (both ranks fail,
rank 0 with a chained exception) with `--monitor-interval 5`; torchrun_stopped.log is torchrun SIGTERMed while both
workers trap SIGTERM and exit 0 (torchrun then exits 1 with its SignalException traceback); torchrun_filtered.log adds
`--local-ranks-filter 0` (torchtitan's launcher), which hides the failing rank's output; python_single.log is
the worker run alone with RANK=1. torchtitan_checkpoint_exception.log is the failing part of an attempt log
of the real torchtitan (CPU shims, `make test-clients`, test_titan_self_resume_is_not_claimed_and_torn_newest_
quarantines_nothing) loading a torn step-10: torch prints each rank's uncaught exception as `[rank0]: ...`, and
dcp's CheckpointException message embeds the ranks' own tracebacks. None of them had an error file (no `@record`).
torchrun_peer_killed.log is the reference trainer under torchrun (2 ranks, gloo) whose rank 1 was SIGKILLed
mid-training: rank 0's all_reduce raised "Connection reset by peer" (paths shortened, training lines left out).
torchrun_peer_reset_first.log is the same kill from the setup matrix (tests/integration/test_matrix.py): there rank 0's
"Connection reset by peer" error file was dated a second before the agent saw rank 1's SIGKILL, so torchrun named
rank 0 its root cause and listed rank 1 under "Failures".
torchrun_no_traceback.log is a prewarmed `torchrun --nproc-per-node=1 x.py` whose x.py does not exist: the worker's
Python prints one line and no traceback (paths shortened).
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.daemon.evidence import read_oom_kills, root_cause
from supervisor.policy.exits import RootCause, classify_exit
from supervisor.policy.state import ExitReason

DATA = Path(__file__).parents[1] / "data"
OOM = "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"

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
            (1, {"cause": RootCause(0, 1, "CheckpointCorruptError: checkpoint corrupt: /r/step_5/__0_0.distcp "
                                          "bytes 0-9 do not match their xxh3_64 checksum recorded at save")},
             "corrupt", None),
            (1, {"cause": RootCause(0, 1, "RuntimeError: CheckpointCorruptError: elsewhere")}, "crash", None),
            (-9, {"cause": RootCause(0, -9, "CheckpointCorruptError: checkpoint corrupt: x")}, "signal", "SIGKILL"),
        ],
    )
    def test_table(self, rc: int, kw: dict, reason: str, sig: str | None) -> None:
        """Each combination maps to one documented reason."""
        info = classify_exit(rc, at=1.0, **kw)
        assert (info.reason, info.signal) == (reason, sig)
        assert info.code == (rc if rc >= 0 else None)


class TestGracefulStop:
    def test_torchruns_signal_exception_after_our_stop_is_a_stop_without_a_failure_code(self) -> None:
        """torchrun exits 1 with SignalException after forwarding our SIGTERM: recorded as `stopped`, no code."""
        cause = root_cause(None, DATA / "torchrun_stopped.log")
        assert cause.message and cause.message.startswith("SignalException")
        info = classify_exit(1, at=1.0, we_stopped=True, cause=cause)
        assert (info.reason, info.code, info.signal, info.detail) == ("stopped", None, None, None)

    @pytest.mark.parametrize("kw", [{"we_stopped": False}, {"we_stopped": True, "hang": True}])
    def test_the_same_exit_not_asked_for_keeps_its_code(self, kw: dict) -> None:
        """Somebody else's SIGTERM to torchrun (or our hang kill) keeps code 1 and the SignalException detail."""
        info = classify_exit(1, at=1.0, cause=root_cause(None, DATA / "torchrun_stopped.log"), **kw)
        assert info.code == 1 and info.reason != "stopped" and "SignalException" in (info.detail or "")

    def test_a_worker_failure_during_the_stop_keeps_its_code(self) -> None:
        """A Root Cause block (a worker failed while stopping) is never folded into a clean stop."""
        info = classify_exit(1, at=1.0, we_stopped=True, cause=RootCause(1, 1, "SignalException: x"))
        assert (info.reason, info.code) == ("stopped", 1)


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


class TestWorkerException:
    """Without torchrun's error file the worker's last exception comes from the attempt log (issue 17.4)."""

    @pytest.mark.parametrize("sample", ["torchrun_plain.log", "torchrun_tee_default.log", "torchrun_tee_role_rank.log"])
    def test_real_torchrun_output(self, sample: str) -> None:
        """Unprefixed, `[default1]:` and `[rank1]:` output: rank 1's exception, not torchrun's ChildFailedError."""
        assert root_cause(None, DATA / sample).describe() == f"rank 1: exitcode 1: {OOM}"

    def test_root_cause_rank_picks_its_exception(self) -> None:
        """Both ranks raised: the rank torchrun names as root cause gives the exception (the last of a chain)."""
        assert root_cause(None, DATA / "torchrun_two_ranks.log").describe() == (
            "rank 0: exitcode 1: RuntimeError: rank 0 fails later")

    def test_torchtitan_checkpoint_exception(self) -> None:
        """torch's `[rank0]: ` prefix; the exception line, not the tracebacks embedded in its message."""
        assert root_cause(None, DATA / "torchtitan_checkpoint_exception.log").describe() == (
            "rank 0: exitcode 1: CheckpointException: CheckpointException ranks:dict_keys([0, 1])")

    def test_stacked_prefixes(self, tmp_path: Path) -> None:
        """torchrun's tee prefix in front of torch's own: the outer one names the source."""
        log = tmp_path / "a.log"
        log.write_text("[default1]:[rank1]: Traceback (most recent call last):\n[default1]:[rank1]:   File \"x\"\n"
                       "[default1]:[rank1]: KeyError: 'w'\n")
        assert root_cause(None, log).describe() == "KeyError: 'w'"

    def test_a_killed_rank_is_the_cause_not_its_peers_reaction(self) -> None:
        """Rank 1 SIGKILLed (the OOM killer, say): its signal is the cause, not rank 0's "Connection reset by peer"."""
        cause = root_cause(None, DATA / "torchrun_peer_killed.log")
        assert cause.describe() == "rank 1: exitcode -9 (SIGKILL)"
        assert any("Connection reset by peer" in line for line in cause.last_output)  # still shown as the last lines

    def test_a_killed_rank_listed_after_its_peers_reaction_is_still_the_cause(self, tmp_path: Path) -> None:
        """torchrun's root cause is the earliest failure by time, and rank 0's error file was dated before the agent
        saw rank 1's SIGKILL: the killed rank is the cause all the same, and rank 0's error file is not its message."""
        err = tmp_path / "e.json"
        err.write_text(json.dumps({"message": {"message": "RuntimeError: Read error: Connection reset by peer",
                                               "extraInfo": {}}}))
        for error_file in (None, err):
            cause = root_cause(error_file, DATA / "torchrun_peer_reset_first.log")
            assert cause.describe() == "rank 1: exitcode -9 (SIGKILL)"
        info = classify_exit(1, at=0.0, cause=cause)
        assert info.reason == ExitReason.SIGNAL

    def test_a_raising_root_cause_is_kept_beside_a_killed_rank(self, tmp_path: Path) -> None:
        """A root cause with an error of its own (not a lost peer) stays the cause, whatever else failed."""
        text = re.sub(r"RuntimeError: .*", "RuntimeError: bad shape", (DATA / "torchrun_peer_reset_first.log").read_text())
        log = tmp_path / "a.log"
        log.write_text(text)
        assert root_cause(None, log).describe() == "rank 0: exitcode 1: RuntimeError: bad shape"

    def test_filtered_output_names_no_agent_exception(self) -> None:
        """The failing rank's lines were filtered out: rank and code only, never torchrun's own traceback."""
        assert root_cause(None, DATA / "torchrun_filtered.log").describe() == "rank 1: exitcode 1"

    def test_plain_python_process(self) -> None:
        """A job that is not torchrun: its last exception, without rank or worker exit code."""
        assert root_cause(None, DATA / "python_single.log").describe() == OOM

    def test_error_file_message_wins(self, tmp_path: Path) -> None:
        """What `@record` wrote beats what is parsed from the output."""
        err = tmp_path / "e.json"
        err.write_text(json.dumps({"message": {"message": "ValueError: recorded", "extraInfo": {}}}))
        assert root_cause(err, DATA / "torchrun_tee_default.log").describe() == "rank 1: exitcode 1: ValueError: recorded"

    def test_first_failing_prefixed_rank_without_root_cause_block(self, tmp_path: Path) -> None:
        """No Root Cause block (output cut short): the rank whose exception came first, and its last one."""
        log = tmp_path / "a.log"
        log.write_text("[default3]:Traceback (most recent call last):\n[default3]:  File \"x\", line 1\n"
                       "[default0]:Traceback (most recent call last):\n"
                       "[default3]:torch.OutOfMemoryError: CUDA out of memory\n"
                       "[default0]:ValueError: later\n")
        assert root_cause(None, log).describe() == "OutOfMemoryError: CUDA out of memory"


class TestUntrustedInput:
    """Job output and the error file are written by the job: bounded reads, no blow-ups, no hangs."""

    @pytest.mark.parametrize("doc", ['{"message": "   "}', '{"message": {"message": "\\n\\n"}}',
                                     "[" * 100_000, '"just a string"', "[1, 2]"])
    def test_odd_error_files_are_ignored(self, tmp_path: Path, doc: str) -> None:
        """A blank message, JSON nested past the parser's stack, or the wrong shape: no detail, no exception."""
        err = tmp_path / "e.json"
        err.write_text(doc)
        assert root_cause(err, None).describe() is None

    def test_oversized_error_file_is_not_read(self, tmp_path: Path) -> None:
        """An error file over the cap is skipped rather than parsed (its size is the job's to choose)."""
        err = tmp_path / "e.json"
        err.write_text(json.dumps({"message": "ValueError: x", "pad": "x" * (2 * 2**20)}))
        assert root_cause(err, None).describe() is None

    def test_fifo_error_file_does_not_block(self, tmp_path: Path) -> None:
        """A FIFO planted as the error file is refused at once instead of blocking the event loop."""
        fifo = tmp_path / "e.json"
        os.mkfifo(fifo)
        got: list[RootCause] = []
        t = threading.Thread(target=lambda: got.append(root_cause(fifo, fifo)), daemon=True)
        t.start()
        t.join(10)
        if t.is_alive():  # free the reader so the thread ends, then fail
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
            t.join(10)
            pytest.fail("root_cause blocked on a FIFO")
        assert got[0].describe() is None

    # The review's case: 16 KiB repeating a Root Cause header and `rank : 0` without an exit code took 5.9 s.
    WORST = {
        "root cause headers without exitcode": "Root Cause (first observed failure):\n rank : 0\n",
        "root cause on one line": "Root Cause (first observed failure): rank : 0 ",
        "traceback headers": "Traceback (most recent call last):\n",
        "prefixed traceback headers": "[rank1]:Traceback (most recent call last):\n[rank1]:  File x\n",
        "many sources": "".join(f"[r{i}]:Traceback (most recent call last):\n[r{i}]:E: x\n" for i in range(50)),
        "one long line": "a",
        "brackets": "[" * 90 + "]:",
        "dotted names": "a." * 40,
    }

    @pytest.mark.parametrize("unit", list(WORST.values()), ids=list(WORST))
    def test_worst_case_tails_are_fast(self, tmp_path: Path, unit: str) -> None:
        """64 KiB of each pathological pattern is parsed well within the budget (it catches super-linear cost)."""
        log = tmp_path / "a.log"
        log.write_text((unit * (65536 // len(unit) + 1))[:65536])
        started = time.process_time()
        root_cause(None, log)
        assert time.process_time() - started < 0.5

    # deadline: wall time on a shared CI core; the super-linear regex this guards against took 4.5 s for 16 KiB.
    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(parts=st.lists(st.sampled_from([
        "Root Cause (first observed failure):", "rank : 0", "  rank      : 1 (local_rank: 1)", "exitcode  : -9",
        "Traceback (most recent call last):", "[rank1]:", "[default0]:", "ValueError: x", "ChildFailedError:",
        "  File \"x\", line 1", "=" * 60, "\n", "\r", " ", ":", "(local_rank:", "\x00", "\u00e9",
    ]) | st.text(max_size=40), min_size=1, max_size=40), repeat=st.integers(1, 4000))
    def test_fuzzed_tails_parse_in_time(self, tmp_path_factory: pytest.TempPathFactory, parts: list[str],
                                        repeat: int) -> None:
        """Up to 64 KiB built from torchrun's own fragments: a RootCause within hypothesis' deadline, never an error."""
        log = tmp_path_factory.getbasetemp() / "fuzz.log"
        unit = "".join(parts)
        log.write_text((unit * min(repeat, 65536 // max(1, len(unit)) + 1))[:65536], encoding="utf-8")
        cause = root_cause(None, log)
        assert cause.describe() is None or "\n" not in cause.describe()


class TestOom:
    def test_reads_cgroup_v2_counter(self, tmp_path: Path) -> None:
        """oom_kill is read from our cgroup's memory.events; unreadable gives None."""
        (tmp_path / "cg" / "job").mkdir(parents=True)
        (tmp_path / "cg" / "job" / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\n")
        proc = tmp_path / "cgroup"
        proc.write_text("0::/job\n")
        assert read_oom_kills(tmp_path / "cg", proc) == 2
        assert read_oom_kills(tmp_path / "none", proc) is None


TORCHRUN_SAMPLES = ["torchrun_plain.log", "torchrun_tee_default.log", "torchrun_tee_role_rank.log",
                    "torchrun_two_ranks.log", "torchrun_no_traceback.log", "torchrun_filtered.log"]


class TestLastOutput:
    """The job's last lines kept with a failure: the cause when it printed no traceback (issue 22, item 4)."""

    def test_an_error_line_without_a_traceback_is_the_cause(self) -> None:
        """`python: can't open file`: torchrun's report names only `exitcode 2`; the worker's own line says why."""
        cause = root_cause(None, DATA / "torchrun_no_traceback.log")
        line = "/venv/bin/python: can't open file '/tmp/job/x.py': [Errno 2] No such file or directory"
        assert cause.describe() == f"rank 0: exitcode 2: {line}"
        assert cause.last_output == [line]

    @pytest.mark.parametrize("sample", TORCHRUN_SAMPLES)
    def test_torchruns_own_lines_and_report_are_left_out(self, sample: str) -> None:
        """No torch log line, no ChildFailedError traceback, no report; the worker's exception ends it if it has one."""
        cause = root_cause(None, DATA / sample)
        joined = "\n".join(cause.last_output)
        assert not any(word in joined for word in ("torch/distributed", "ChildFailedError", "Root Cause", "=====",
                                                   "FAILED", "exitcode  :"))
        if cause.message:
            assert cause.last_output[-1].endswith(cause.message.split(": ", 1)[-1])

    def test_bounded_and_blank_lines_skipped(self, tmp_path: Path) -> None:
        log = tmp_path / "a.log"
        log.write_text("".join(f"line {i}\n\n[default0]:   \n" for i in range(50)) + "x" * 5000 + "\n")
        last = root_cause(None, log).last_output
        assert last == ["line 46", "line 47", "line 48", "line 49", "x" * 240]

    def test_no_error_line_no_message(self, tmp_path: Path) -> None:
        """Output that reads like progress, not like an error (a SIGKILLed worker's), is no cause."""
        log = tmp_path / "a.log"
        log.write_text("step 10 loss 3.2\nstep 11 loss 3.1\n")
        cause = root_cause(None, log)
        assert cause.describe() is None and cause.last_output == ["step 10 loss 3.2", "step 11 loss 3.1"]

    def test_kept_for_failures_only(self) -> None:
        cause = RootCause(0, 2, None, ["oops: error"])
        assert classify_exit(1, at=0.0, cause=cause).last_output == ["oops: error"]
        assert classify_exit(0, at=0.0, cause=cause).last_output is None
        assert classify_exit(-15, at=0.0, we_stopped=True, cause=cause).last_output is None
