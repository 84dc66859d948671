"""history.jsonl: what `Core` records through a real recorder (fake time), torn lines, failing disks, thinning."""
from __future__ import annotations

import errno
import json
import threading
from pathlib import Path

import pytest

from supervisor.config import load_config
from supervisor.daemon import events as ev
from supervisor.daemon.core import Core
from supervisor.daemon.recorder import HistoryRecorder
from supervisor.history.fold import summarize
from supervisor.history.records import HISTORY_FILE, MAX_LINE, bucket_width, compact_lines, parse_lines, read_history, thin
from supervisor.policy.state import State
from tests.fakes import FakeSystem, RecordingLog
from tests.history_demo import launch_event, month
from tests.unit.test_core import BASE, exit_job

T0 = 1_700_000_000.0


def make_core(tmp_path: Path, previous_history: bool = False) -> tuple[Core, FakeSystem, RecordingLog, HistoryRecorder]:
    cfg_path = tmp_path / "job.toml"
    cfg_path.write_text(BASE.format(restart="", health="", checkpoints="keep_last = 0", job=""))
    cfg = load_config(cfg_path)
    for d in (cfg.run_dir, cfg.checkpoints.dir):
        d.mkdir(parents=True, exist_ok=True)
    fake, log = FakeSystem(), RecordingLog()
    history = HistoryRecorder.for_run_dir(cfg.run_dir, now=fake.now, log=log)
    return Core(cfg, fake, log, history=history), fake, log, history


def beats(core: Core, fake: FakeSystem, steps: range, phase: str = "train", every: float = 1.0) -> None:
    """One heartbeat per step, `every` seconds of fake time apart (the first one now)."""
    for i, step in enumerate(steps):
        if i:
            fake.advance(every, core)
        core.heartbeat_path.write_text(json.dumps({"step": step, "phase": phase, "loss": 10.0 / (step + 1)}))
        core.on_file_event(core.heartbeat_path)


def records(core: Core) -> list[dict]:
    return read_history(core.run_dir / HISTORY_FILE)[0]


def kinds(recs: list[dict]) -> list[str]:
    return [r["kind"] for r in recs if r["kind"] != "beat"]


def hold_compaction(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Make the recorder's compaction wait on `gate` (set by the test); `started` is set once it runs."""
    import supervisor.daemon.recorder as recorder_mod

    gate, started = threading.Event(), threading.Event()
    real = recorder_mod.compact_lines

    def slow_compact(data: bytes, now: float) -> bytes:
        started.set()
        assert gate.wait(30)
        return real(data, now)

    monkeypatch.setattr(recorder_mod, "compact_lines", slow_compact)
    return gate, started


class TestCoreRecords:
    def test_numbering_continues_across_supervisor_runs(self, tmp_path: Path) -> None:
        """A second run appends (a torn last line is cut first) and its attempts continue the numbering."""
        core, fake, _, history = make_core(tmp_path)
        core.begin(None)
        exit_job(core, fake, 0)
        history.close()
        path = core.run_dir / HISTORY_FILE
        with open(path, "ab") as f:
            f.write(b'{"v":1,"t":5,"kind":"torn')  # a SIGKILL mid-write
        core2, fake2, _, _ = make_core(tmp_path)
        core2.begin(core.status)
        exit_job(core2, fake2, 0)
        data = path.read_bytes()
        assert b'torn' not in data and data.endswith(b"\n")
        recs, skipped = read_history(path)
        assert skipped == 0 and [r["attempt"] for r in recs if r["kind"] == "attempt_start"] == [1, 2]
        assert summarize(recs).sessions == 2

    def test_time_the_supervisor_was_suspended_is_not_training_time(self, tmp_path: Path) -> None:
        """The job stepped 2 s into a 60 s suspension of the supervisor, then hung: the attempt trained 3 s by its
        beats' own clock (what the redo of a failure is priced at), not the 62 s between two reads of the file."""
        core, fake, _, _ = make_core(tmp_path)
        core.begin(None)
        for step, when in ((10, fake.now()), (11, fake.now() + 1)):
            fake.clock = when - 1_700_000_000.0
            core.heartbeat_path.write_text(json.dumps({"step": step, "time": when, "phase": "train"}))
            core.on_file_event(core.heartbeat_path)
        core.heartbeat_path.write_text(json.dumps({"step": 12, "time": fake.now() + 2, "phase": "train"}))
        fake.clock += 60
        core.on_file_event(core.heartbeat_path)
        exit_job(core, fake, 1)
        [ended] = [r for r in records(core) if r["kind"] == "attempt_exit"]
        assert ended["train_s"] == pytest.approx(3.0)

    def test_steps_lost_are_the_ranks_own_step_minus_the_resume_step_in_status_and_report(self, tmp_path: Path) -> None:
        """The node's beat lags a second behind (step 50); every rank's own file says 57: 7 lost, not 2, and the
        same number in status (the daemon's fold) and in the report (the file's)."""
        from supervisor.contract import RANK_HEARTBEAT_DIR
        from tests.jobs.dcp_files import write_checkpoint

        core, fake, _, _ = make_core(tmp_path)
        write_checkpoint(core.cfg.checkpoints.dir, 50)
        core.begin(None)
        beats(core, fake, range(45, 51))
        for rank in (0, 1):
            (core.run_dir / RANK_HEARTBEAT_DIR / f"rank-{rank}.json").write_text('{"step": 57, "phase": "train"}')
        exit_job(core, fake, 1)
        fake.advance(1, core)
        assert fake.spawned[-1].argv[-1].endswith("step_00000050")
        beats(core, fake, [50], phase="load")
        beats(core, fake, range(51, 53))
        assert core.status.steps_lost == [7] == summarize(records(core)).steps_lost
        assert core.status.last_failure is not None and core.status.last_failure["reached"] == 57
        assert "first_beat" in kinds(records(core))

    def test_unwritable_history_warns_once_and_supervision_goes_on(self, tmp_path: Path) -> None:
        """A history that cannot be written (here: a directory in its place) costs one warning, not the run;
        once writable again, records resume after a `history_write_recovered`."""
        core, fake, log, _ = make_core(tmp_path)
        blocker = core.run_dir / HISTORY_FILE
        blocker.mkdir()
        core.begin(None)
        beats(core, fake, range(1, 5))
        exit_job(core, fake, 1)
        assert core.status.state is State.BACKOFF
        assert log.names().count("history_write_failed") == 1
        blocker.rmdir()
        fake.advance(1, core)
        assert "history_write_recovered" in log.names()
        assert kinds(records(core))[0] == "attempt_start"

    def test_disk_full_mid_line(self, tmp_path: Path) -> None:
        """ENOSPC after half a line: one warning; once space is back the next record starts on a fresh line, so
        the torn half costs itself only and readers see every later record."""
        core, fake, log, history = make_core(tmp_path)
        real = history.os_write

        def full(fd: int, data: memoryview) -> int:
            real(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

        core.begin(None)
        history.os_write = full
        beats(core, fake, range(1, 4))
        exit_job(core, fake, 1)
        assert log.names().count("history_write_failed") == 1 and core.status.state is State.BACKOFF
        history.os_write = real
        fake.advance(1, core)
        recs, skipped = read_history(core.run_dir / HISTORY_FILE)
        assert kinds(recs) == ["supervisor_start", "attempt_start", "attempt_start"] and skipped >= 1
        assert [r["attempt"] for r in recs if r["kind"] == "attempt_start"] == [1, 2]
        assert "history_write_recovered" in log.names()

    def test_a_bug_in_the_history_costs_records_not_the_run(self, tmp_path: Path) -> None:
        """A hook that raises is logged once (history_failed); supervision goes on."""
        core, fake, log, history = make_core(tmp_path)

        def broken(_: object) -> None:
            raise KeyError("bug")

        history.fold.add = broken  # type: ignore[method-assign]
        core.begin(None)
        beats(core, fake, range(1, 4))
        exit_job(core, fake, 0)
        assert core.status.state is State.COMPLETED and log.names().count("history_failed") == 1

    def test_a_bug_folding_the_old_history_costs_its_numbers_not_the_start(self, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
        """Start-up folds the earlier runs' records outside any hook: an error there is logged (history_failed),
        and the run starts and records as usual."""
        from supervisor.history.fold import Fold

        core, fake, _, history = make_core(tmp_path)
        core.begin(None)
        exit_job(core, fake, 0)
        history.close()

        def broken(self: Fold, rec: dict) -> None:
            raise ArithmeticError("bug")

        monkeypatch.setattr(Fold, "add", broken)
        core2, fake2, log, _ = make_core(tmp_path)
        monkeypatch.undo()
        core2.begin(core.status)
        exit_job(core2, fake2, 0)
        assert log.names().count("history_failed") == 1 and core2.status.state is State.COMPLETED
        assert [r["attempt"] for r in records(core2) if r["kind"] == "attempt_start"] == [1, 2]


class TestReader:
    def test_torn_and_garbage_lines_are_skipped(self) -> None:
        """Whole valid lines only: a torn tail, non-JSON, non-objects and records without v/t/kind are skipped."""
        good = b'{"v":1,"t":5.0,"kind":"supervisor_start"}\n'
        data = good + b'not json\n[1]\n{"v":1,"kind":"beat"}\n{"v":1,"t":NaN,"kind":"x"}\n\n' + good + b'{"v":1,"t":6'
        recs, skipped = parse_lines(data)
        assert len(recs) == 2 and skipped == 4

    @pytest.mark.parametrize(("tail", "records", "skipped"), [
        (b"", 2, 0),
        (b'{"v":1,"t":6,"kind":"x","p":"' + b"a" * (MAX_LINE - 31) + b'"}\n', 3, 0),  # exactly MAX_LINE: a record
        (b'{"v":1,"t":6,"kind":"x","p":"' + b"a" * (MAX_LINE - 30) + b'"}\n', 2, 1),  # one byte more: skipped
        (b"x" * (5 * MAX_LINE) + b"\n", 2, 1),  # skipped in pieces
        (b"x" * (5 * MAX_LINE), 2, 0),  # torn: not a line yet
    ])
    def test_file_reader_bounds_each_line(self, tmp_path: Path, tail: bytes, records: int, skipped: int) -> None:
        """The file reader sees what `parse_lines` sees, holding at most MAX_LINE bytes of any line."""
        good = b'{"v":1,"t":5.0,"kind":"supervisor_start"}\n'
        data = good + good + tail
        (tmp_path / HISTORY_FILE).write_bytes(data)
        got = read_history(tmp_path / HISTORY_FILE)
        assert (len(got[0]), got[1]) == (records, skipped) and got == parse_lines(data)


class TestThinning:
    def test_rule(self) -> None:
        """Events are all kept; a sample per attempt and age bucket (val_loss samples apart); each attempt's last."""
        now = T0 + 100_000
        recs = [{"v": 1, "t": T0 + i, "kind": "beat", "attempt": 1, "step": i} for i in range(0, 100_000, 1)]
        recs.insert(500, {"v": 1, "t": T0 + 499.5, "kind": "checkpoint_committed", "step": 499})
        recs.insert(700, {"v": 1, "t": T0 + 698.5, "kind": "beat", "attempt": 1, "step": 698, "val_loss": 1.0})
        kept = thin(recs, now)
        assert kept[0]["step"] == 0 and kept[-1] == recs[-1]
        assert any(r["kind"] == "checkpoint_committed" for r in kept) and any("val_loss" in r for r in kept)
        ages = [now - r["t"] for r in kept if r["kind"] == "beat"]
        assert sum(a < 512 for a in ages) >= 500  # young samples at full resolution
        assert len(ages) < 256 * 10  # about 256 per doubling of age
        assert bucket_width(10) == 1 and bucket_width(86400 * 30) == 8192

    def test_compaction_drops_lines_no_reader_would_read(self) -> None:
        """A beat whose time is not a number or is beyond any clock, and an over-long event line: dropped (the
        first two used to raise in the compaction thread, so the file was never compacted again)."""
        good = b'{"v":1,"t":5,"kind":"beat","attempt":1,"step":3}\n'
        bad = [b'{"v":1,"t":1e999,"kind":"beat","attempt":1,"step":3}\n',
               b'{"v":1,"t":1-2,"kind":"beat","attempt":1,"step":3}\n',
               b'{"v":1,"t":5,"kind":"x","p":"' + b"a" * MAX_LINE + b'"}\n']
        for line in bad:
            assert compact_lines(line + good, 100.0) == good

    def test_simulated_month_stays_a_few_mb(self, tmp_path: Path) -> None:
        """30 days with a checkpoint every 10 minutes (the last 5 hours beating every second, where thinning keeps
        more than one sample a minute; before, every minute): the file never passes
        the compaction threshold by more than a line, a compaction brings it under 2 MB (the file's own lines,
        byte for byte, exactly those `thin` keeps), and thinning changed no summary number."""
        sim = month(tmp_path, beat_s=60, dense_s=5 * 3600)
        data = sim.path.read_bytes()
        recs, _ = parse_lines(data)
        assert sim.rec.compactions >= 2 and sim.max_bytes <= 4 * 2**20 + 1024
        now = recs[-1]["t"]
        compacted = compact_lines(data, now)
        assert len(compacted) < 2 * 2**20 and parse_lines(compacted) == (thin(recs, now), 0)
        s = summarize(recs)
        assert s.attempts == 15 and s.failures == 14 and len(s.steps_lost) == 14
        assert s.checkpoints_committed == sum(r["kind"] == "checkpoint_committed" for r in recs) > 4000
        assert 0.95 < s.goodput < 1
        assert summarize(thin(recs, recs[-1]["t"] + 86400)) == s


class TestCompactionOffTheLoop:
    def test_records_written_while_compacting_are_kept_in_order(self, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
        """Compaction runs on its own thread; records written meanwhile go to the old file, then follow the
        rewritten part of it in the new one."""
        gate, started = hold_compaction(monkeypatch)
        clock = [T0]
        rec = HistoryRecorder(tmp_path / HISTORY_FILE, now=lambda: clock[0], log=RecordingLog(), compact_bytes=2048)
        rec.notify(ev.SupervisorStarted())
        n = 0
        while rec._compactor is None:  # write until a compaction starts
            rec.notify(ev.Quarantined(f"/ckpts/step_{n}", "test"))
            n += 1
            clock[0] += 1
            assert n < 1000, "no compaction started"
        assert started.wait(30)
        for i in range(5):  # the loop goes on while the thread is held
            rec.notify(ev.Quarantined(f"/ckpts/during_{i}", "test"))
        assert rec._compactor is not None and rec._compactor.is_alive()
        gate.set()
        rec.close()
        paths = [r["path"] for r in read_history(tmp_path / HISTORY_FILE)[0] if r["kind"] == "quarantined"]
        assert paths == [f"/ckpts/step_{i}" for i in range(n)] + [f"/ckpts/during_{i}" for i in range(5)]
        assert rec.compactions == 1


class TestHostileFiles:
    def test_start_up_with_a_fifo_or_device_in_place_of_the_history(self, tmp_path: Path) -> None:
        """A FIFO (whose open used to block the daemon before its first launch) or /dev/zero (an endless read) as
        history.jsonl: one history_write_failed, and supervision goes on."""
        import os
        import threading

        run_dir = tmp_path / ".fsdp-supervisor"
        run_dir.mkdir()
        os.mkfifo(run_dir / HISTORY_FILE)
        built: list[tuple[Core, FakeSystem, RecordingLog, HistoryRecorder]] = []
        worker = threading.Thread(target=lambda: built.append(make_core(tmp_path)), daemon=True)
        worker.start()
        worker.join(20)
        hung = not built
        if hung:  # release the hung open() so that the thread ends
            os.close(os.open(run_dir / HISTORY_FILE, os.O_WRONLY | os.O_NONBLOCK))
            worker.join(5)
        assert not hung, "start-up hung on a FIFO"
        core, fake, log, _ = built[0]
        core.begin(None)
        exit_job(core, fake, 0)
        assert core.status.state is State.COMPLETED and log.names().count("history_write_failed") == 1
        (run_dir / HISTORY_FILE).unlink()
        (run_dir / HISTORY_FILE).symlink_to("/dev/zero")
        with pytest.raises(OSError, match="not a regular file"):
            read_history(run_dir / HISTORY_FILE)

    @pytest.mark.parametrize("fields", ['"step":%d,"train_s":1.0' % 10**400, '"step":5,"train_s":%d' % 10**400])
    def test_absurd_numbers_in_an_old_run_cost_no_later_record(self, tmp_path: Path, fields: str) -> None:
        """A step beyond any float in an earlier run's history used to make every later attempt_start raise in
        the fold (history_failed), so none was written; such a train_s made the start-up itself raise."""
        run_dir = tmp_path / ".fsdp-supervisor"
        run_dir.mkdir()
        (run_dir / HISTORY_FILE).write_text(
            f'{{"v":1,"t":{T0},"kind":"attempt_start","attempt":1,"resumed_from":null,"resumed_step":null}}\n'
            f'{{"v":1,"t":{T0 + 1},"kind":"beat","attempt":1,{fields}}}\n')
        core, fake, log, _ = make_core(tmp_path)
        core.begin(None)
        exit_job(core, fake, 1)
        fake.advance(10, core)
        assert "history_failed" not in log.names()
        assert [r["attempt"] for r in records(core) if r["kind"] == "attempt_start"] == [1, 2, 3]

    def test_numbering_continues_from_the_history_when_state_json_is_lost(self, tmp_path: Path) -> None:
        """Without a state.json the next attempt follows the history's last one (it used to be 1 again, and the
        report merged the new attempt 1 into the old one)."""
        core, fake, _, history = make_core(tmp_path)
        core.begin(None)
        exit_job(core, fake, 0)
        history.close()
        core2, fake2, _, _ = make_core(tmp_path)
        core2.begin(None)  # state.json unreadable or gone
        exit_job(core2, fake2, 0)
        recs = records(core2)
        assert [r["attempt"] for r in recs if r["kind"] == "attempt_start"] == [1, 2]
        assert summarize(recs).attempts == 2 and (core2.run_dir / "logs" / "attempt-0002.log").exists()

    def test_a_file_larger_than_any_history_is_read_only_in_part(self, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
        """Start-up folds at most MAX_READ_BYTES (a line at a time), never cuts what it did not read, and does not
        compact a file that size (here the limit is 1 KB)."""
        import supervisor.daemon.recorder as recorder_mod
        import supervisor.history.records as history_mod

        monkeypatch.setattr(history_mod, "MAX_READ_BYTES", 1024)
        monkeypatch.setattr(recorder_mod, "MAX_READ_BYTES", 1024, raising=False)
        path = tmp_path / HISTORY_FILE
        lines = [f'{{"v":1,"t":{T0 + i},"kind":"attempt_start","attempt":{i},"resumed_from":null}}\n'
                 for i in range(1, 101)]
        path.write_text("".join(lines) + '{"v":1,"t":5,"kind":"to')  # torn at the end, far beyond the limit
        log = RecordingLog()
        rec = HistoryRecorder(path, now=lambda: T0 + 1000, log=log, compact_bytes=512)
        assert 5 <= len(rec.fold.attempts) < 20 and path.stat().st_size > 5000
        rec.notify(ev.SupervisorStarted())
        rec.close()
        assert "history_compact_failed" in log.names() and path.read_text().startswith("".join(lines))


class TestCompactionCrashSafety:
    def test_a_sigkill_mid_compaction_loses_no_record_and_leaves_no_temp_file(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """Records written while a compaction runs are on disk at once (a durable one used to wait in memory
        until the compaction ended); a supervisor killed before the rename leaves the old file whole and a temp
        file, which the next run removes."""
        gate, started = hold_compaction(monkeypatch)
        path = tmp_path / HISTORY_FILE
        rec = HistoryRecorder(path, now=lambda: T0, log=RecordingLog(), compact_bytes=2048)
        n = 0
        while rec._compactor is None:
            rec.notify(ev.Quarantined(f"/ckpts/step_{n}", "test"))
            n += 1
        assert started.wait(30)
        rec.notify(launch_event(1, None, None))  # durable
        assert [r["kind"] for r in read_history(path)[0]][-1] == "attempt_start"
        gate.set()
        rec._compactor.join(30)  # the temp file is written; the SIGKILL comes before the next record renames it
        temps = list(tmp_path.glob(f".{HISTORY_FILE}.*.tmp"))
        assert len(temps) == 1
        again = HistoryRecorder(path, now=lambda: T0, log=RecordingLog())
        assert not temps[0].exists() and again.last_attempt == 1
        assert [r.get("path") for r in read_history(path)[0]][:n] == [f"/ckpts/step_{i}" for i in range(n)]
