"""The hang path and every rank watched (supervisor/daemon/hangs.py), replayed through Core with a fake clock."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from supervisor.contract import MAX_RANK_FILES, RANK_HEARTBEAT_DIR
from supervisor.daemon.core import Core
from supervisor.daemon.recorder import HistoryRecorder
from supervisor.history.records import HISTORY_FILE, read_history
from supervisor.policy.state import State
from tests.fakes import FakeSystem, RecordingLog
from tests.unit.test_core import beat, exit_job, make_core

HANG = "hang_timeout_s = 10"


def rank_beat(core: Core, rank: int, step: int, phase: str = "train", step_s: float | None = None,
              time: float = 0.0) -> None:
    """Rank `rank` rewrites its own heartbeat (read at the next look: no file event for these)."""
    folder = core.run_dir / RANK_HEARTBEAT_DIR
    folder.mkdir(exist_ok=True)
    record = {"step": step, "time": time, "phase": phase, **({"step_s": step_s} if step_s is not None else {})}
    (folder / f"rank-{rank}.json").write_text(json.dumps(record))


def started(tmp_path: Path, health: str = HANG) -> tuple[Core, FakeSystem, RecordingLog, int]:
    core, fake, log = make_core(tmp_path, health=health)
    core.begin(None)
    return core, fake, log, fake.spawned[-1].pid


def hang_events(log: RecordingLog) -> dict:
    return next(fields for name, fields in log.events if name == "hang_detected")


class TestFastKill:
    def test_the_hang_kill_does_not_wait_for_stop_timeout(self, tmp_path: Path) -> None:
        """Stack dumps, SIGTERM, then SIGKILL of the tree hang_kill_grace_s later: not stop_timeout_s (30 s here)."""
        core, fake, log, pid = started(tmp_path, HANG + "\nhang_kill_grace_s = 3")
        beat(core, 5)
        fake.advance(1, core)  # the beat's held-back state.json write
        assert fake.advance(9, core) == ["hang"] and fake.worker_signals == [(pid, signal.SIGUSR1)]
        assert fake.advance(2, core) == ["hang_term"] and fake.signals == [(pid, signal.SIGTERM)]
        assert fake.advance(2.9, core) == [] and fake.killed_trees == []
        assert fake.advance(0.1, core) == ["hang_kill"] and fake.killed_trees == [pid]
        assert dict(log.events)["job_killed"]["reason"] == "hang"

    def test_a_requested_stop_still_waits_stop_timeout(self, tmp_path: Path) -> None:
        """SIGTERM to the supervisor: the job gets the whole stop_timeout_s for its emergency save."""
        core, fake, _, pid = started(tmp_path, HANG + "\nhang_kill_grace_s = 3")
        beat(core, 5)
        core.on_signal(signal.SIGTERM)
        assert fake.advance(29.9, core) == [] and fake.killed_trees == []
        assert fake.advance(0.1, core) == ["stop_kill"] and fake.killed_trees == [pid]

    def test_the_wait_for_dumps_ends_once_every_worker_dumped(self, tmp_path: Path) -> None:
        """Both workers' faulthandler output in the log: SIGTERM at the next check, and the dumps are kept."""
        core, fake, _, pid = started(tmp_path, HANG)
        fake.workers = {0: (pid + 1, "sleeping"), 1: (pid + 2, "sleeping")}
        fake.signal_workers = lambda p, s: [p + 1, p + 2]  # type: ignore[method-assign]
        beat(core, 5)
        fake.advance(10, core)
        log_path = core.job.log_path
        with open(log_path, "a") as f:
            f.write("Current thread 0x0001 (most recent call first):\n  File \"x.py\", line 1 in f\n"
                    "Current thread 0x0002 (most recent call first):\n  File \"y.py\", line 2 in g\n")
        fake.advance(0.1, core)
        assert fake.signals == [(pid, signal.SIGTERM)]
        stacks = Path(core.status.last_hang["stacks"])
        assert stacks.name == "attempt-0001.stacks.txt" and b"y.py" in stacks.read_bytes()

    def test_the_kill_does_not_wait_the_grace_once_every_runnable_worker_dumped(self, tmp_path: Path) -> None:
        """Rank 0 dumped, rank 1 is stopped (it never will): SIGKILL right after SIGTERM, not hang_kill_grace_s
        later; a worker that dumped nothing keeps the whole grace (the test above)."""
        core, fake, log, pid = started(tmp_path, HANG + "\nhang_kill_grace_s = 30")
        fake.workers = {0: (pid + 1, "sleeping"), 1: (pid + 2, "stopped")}
        fake.signal_workers = lambda p, s: [p + 1, p + 2]  # type: ignore[method-assign]
        beat(core, 5)
        fake.advance(10, core)
        with open(core.job.log_path, "a") as f:
            f.write("Thread 0x0003 (most recent call first):\nCurrent thread 0x0001 (most recent call first):\n")
        assert fake.advance(0.1, core)[-1:] == ["hang_kill"]  # the dumps checked, the kill at the next turn
        assert fake.signals == [(pid, signal.SIGTERM)] and fake.killed_trees == [pid]
        assert dict(log.events)["job_killed"]["after_s"] == 0 and dict(log.events)["hang_stopping"]["kill_after_s"] == 0

    def test_a_job_that_handles_no_sigusr1_keeps_the_whole_grace(self, tmp_path: Path) -> None:
        """No worker asked for a dump (none handles SIGUSR1): nothing says the job cannot take its SIGTERM, so the
        kill waits hang_kill_grace_s (a handler that exits 0 gets its chance); only stopped workers kill at once."""
        core, fake, log, pid = started(tmp_path, HANG + "\nhang_kill_grace_s = 30")
        fake.signal_workers = lambda p, s: []  # type: ignore[method-assign]
        beat(core, 5)
        fake.advance(10, core)
        assert fake.signals == [(pid, signal.SIGTERM)] and fake.killed_trees == []
        fake.advance(29.9, core)
        assert fake.killed_trees == []
        assert "hang_kill" in fake.advance(0.2, core) and fake.killed_trees == [pid]
        assert dict(log.events)["hang_stopping"]["kill_after_s"] == 30

    def test_exit_0_after_the_hang_kill_is_not_completion(self, tmp_path: Path) -> None:
        """A SIGTERM handler that exits 0 after our hang kill: the run goes on (relaunch), it is not `completed`."""
        core, fake, _, _ = started(tmp_path)
        beat(core, 5)
        fake.advance(12, core)
        exit_job(core, fake, 0)
        assert core.status.state is State.BACKOFF and core.status.last_exit.reason == "hang" and not core.done
        fake.advance(1, core)
        assert len(fake.spawned) == 2

    def test_exit_0_after_a_requested_stop_is_a_stop(self, tmp_path: Path) -> None:
        """Ctrl+C, the job saves and exits 0: the run ends as the stop that was asked for."""
        core, fake, _, _ = started(tmp_path)
        core.on_signal(signal.SIGTERM)
        exit_job(core, fake, 0)
        assert core.status.state is State.STOPPED and core.exit_code == 0 and len(fake.spawned) == 1


class TestCulprits:
    def test_a_stopped_rank_is_named_and_not_waited_for(self, tmp_path: Path) -> None:
        """Rank 1's process is SIGSTOPped: it is named, and only rank 0's dump is waited for."""
        core, fake, log, pid = started(tmp_path, HANG)
        fake.workers = {0: (pid + 1000, "sleeping"), 1: (pid + 1001, "stopped")}
        fake.signal_workers = lambda p, s: [p + 1000, p + 1001]  # type: ignore[method-assign]
        rank_beat(core, 0, 5)
        rank_beat(core, 1, 5)
        fake.advance(1, core)
        fake.advance(10, core)
        assert hang_events(log)["ranks"] == ["rank 1: stopped (SIGSTOP or SIGTSTP)"]
        assert core.status.last_hang["ranks"] == [{"rank": 1, "why": "stopped (SIGSTOP or SIGTSTP)"}]
        with open(core.job.log_path, "a") as f:
            f.write("Current thread 0x0001 (most recent call first):\n")
        fake.advance(0.1, core)
        assert fake.signals == [(pid, signal.SIGTERM)]  # one dump was all there could be
        exit_job(core, fake, -9)
        assert core.status.last_exit.reason == "hang" and core.attempts[-1].reason == "hang"

    def test_the_rank_behind_is_named_by_its_beats(self, tmp_path: Path) -> None:
        """No process state to go by: the rank whose step is behind the others' is the culprit."""
        core, fake, log, _ = started(tmp_path)
        rank_beat(core, 0, 8)
        rank_beat(core, 1, 7)
        rank_beat(core, 2, 8)
        fake.advance(12, core)
        assert hang_events(log)["ranks"] == ["rank 1: behind: step 7, others up to 8"]

    def test_the_slowest_rank_decides(self, tmp_path: Path) -> None:
        """The node's file keeps moving, rank 1's does not: hung after hang_timeout_s of rank 1's silence."""
        core, fake, _, _ = started(tmp_path)
        rank_beat(core, 1, 3)
        fake.advance(1, core)
        for step in range(4, 14):
            beat(core, step)
            rank_beat(core, 0, step)
            fake.advance(1, core)
        assert core.job is not None and core.job.hang


    def test_a_rank_waiting_for_rank_0_s_own_save_is_not_hung(self, tmp_path: Path) -> None:
        """A user's loop saves a full state dict on rank 0 alone (phase save) while rank 1 waits in a barrier:
        no hang before save_timeout_s, as with the node's file alone; a save that overstays it is one."""
        core, fake, log, _ = started(tmp_path, HANG + "\nsave_timeout_s = 60")
        rank_beat(core, 0, 30)
        rank_beat(core, 1, 30)
        fake.advance(1, core)
        rank_beat(core, 0, 30, "save")
        beat(core, 30, "save")
        fake.advance(30, core)
        assert "hang_detected" not in log.names()
        fake.advance(31, core)
        assert "hang_detected" in log.names()


class TestJudgedAfterReading:
    def test_a_beat_not_yet_delivered_is_read_before_judging(self, tmp_path: Path) -> None:
        """The file moved but its event is still queued when the timer fires: progress, not a hang."""
        core, fake, log, _ = started(tmp_path)
        beat(core, 5)
        fake.advance(9, core)
        core.heartbeat_path.write_text(json.dumps({"step": 6, "time": 1, "phase": "train"}))  # no on_file_event
        assert fake.advance(1, core) == ["hang"]  # it fired, and found progress
        assert "hang_detected" not in log.names() and core.status.step == 6
        assert fake.advance(9.9, core) == [] and fake.advance(0.1, core) == ["hang"]
        assert "hang_detected" in log.names()

    def test_a_suspended_supervisor_catches_up_before_judging(self, tmp_path: Path) -> None:
        """SIGSTOP of the supervisor for 15 s while the job trained: the beats are read, the job lives on."""
        core, fake, log, _ = started(tmp_path)
        beat(core, 5)
        rank_beat(core, 0, 5)
        fake.advance(2, core)
        fake.clock += 15  # suspended: nothing ran, the job went on
        core.heartbeat_path.write_text(json.dumps({"step": 300, "time": 1, "phase": "train"}))
        rank_beat(core, 0, 300)
        fake.advance(0, core)
        assert "hang_detected" not in log.names() and core.status.step == 300 and not core.job.hang

    def test_a_freeze_without_news_keeps_the_rest_of_the_allowance(self, tmp_path: Path) -> None:
        """Frozen 15 s (the loop postpones the timers and the allowances) 2 s into a 10 s allowance, then one rank
        of two steps: no verdict on the silent one for what nobody watched; the 8 s left later, yes."""
        core, fake, log, _ = started(tmp_path)
        rank_beat(core, 0, 5)
        rank_beat(core, 1, 5)
        fake.advance(2, core)
        fake.clock += 15
        fake.timers.postpone(15)
        core.hangs.postpone(15)
        rank_beat(core, 0, 6)  # rank 0 steps (read a second later): the hang timer is set again, for rank 1
        fake.advance(0, core)
        assert "hang_detected" not in log.names()
        assert fake.advance(8.9, core) == [] and fake.advance(0.1, core) == ["hang"]
        assert "hang_detected" in log.names()
        assert hang_events(log)["idle_s"] == 25.0 == core.status.last_hang["idle_s"]  # silent since the beat


class TestHonestTimes:
    def test_a_hang_that_began_while_the_supervisor_was_suspended_is_timed_from_the_job_s_last_step(
            self, tmp_path: Path) -> None:
        """The job stepped to 40 two seconds into a 60 s suspension of the supervisor, then hung: its step last
        advanced then (its own clock), not when the supervisor woke and read it; detection is timed from there."""
        core, fake, _, _ = started(tmp_path, "hang_timeout_s = 5")
        rank_beat(core, 0, 10, time=fake.now())
        fake.advance(1, core)
        stepped = fake.now() + 2
        rank_beat(core, 0, 40, time=stepped)
        fake.clock += 60  # the supervisor was stopped; the job stepped once more and hung
        fake.advance(7, core)
        assert core.job.hang and core.job.progress_at == stepped
        assert core.job.detected_at - core.job.progress_at > 60

    def test_a_beat_s_time_in_the_future_or_the_past_is_not_believed(self, tmp_path: Path) -> None:
        """The job's clock is believed only between the last progress seen and now: else the step counts as made
        when the supervisor read it."""
        core, fake, _, _ = started(tmp_path, "")
        rank_beat(core, 0, 10, time=fake.now() + 3600)
        fake.advance(1, core)
        assert core.job.progress_at == fake.now()
        rank_beat(core, 0, 11, time=1.0)
        fake.advance(1, core)
        assert core.job.progress_at == fake.now()


class TestRanks:
    def test_a_slow_rank_is_flagged_then_cleared(self, tmp_path: Path) -> None:
        """Rank 1's own step time stays above 1.5x the others': flagged after 3 looks; cleared when it recovers."""
        core, fake, log, _ = started(tmp_path, "")
        for look in range(4):
            for rank in range(3):
                rank_beat(core, rank, 10 + look, step_s=0.4 if rank == 1 else 0.1)
            fake.advance(1, core)
        assert core.status.stragglers == [1] and "straggler_detected" in log.names()
        assert [r["straggler"] for r in core.status.ranks] == [False, True, False]
        for look in range(8):
            for rank in range(3):
                rank_beat(core, rank, 20 + look, step_s=0.1)
            fake.advance(1, core)
        assert core.status.stragglers == [] and "straggler_cleared" in log.names()

    def test_the_step_reached_comes_from_every_rank(self, tmp_path: Path) -> None:
        """The node's beat lags (throttled); the ranks' own files say how far the attempt got."""
        core, fake, _, _ = started(tmp_path, "")
        beat(core, 50)
        rank_beat(core, 0, 57)
        rank_beat(core, 1, 57)
        exit_job(core, fake, 1)
        assert core.attempts[-1].max_step == 57

    def test_the_step_reached_ignores_load_beats(self, tmp_path: Path) -> None:
        """A rank's load beat names the checkpoint's step, not one this attempt trained."""
        core, fake, _, _ = started(tmp_path, "")
        rank_beat(core, 0, 70, "load")
        fake.advance(1, core)
        assert core.job.max_step is None
        rank_beat(core, 1, 52)
        fake.advance(1, core)
        assert core.job.max_step == 52

    def test_the_history_says_whether_the_step_reached_is_the_ranks_or_a_throttled_beat(self, tmp_path: Path) -> None:
        """Per-rank files (every step): the step reached is exact. The node's file alone (the old contract, often
        once a second): the job may have gone further, and the exit record says which it was."""
        core, fake, log = make_core(tmp_path)
        core = Core(core.cfg, fake, log, history=HistoryRecorder(core.run_dir / HISTORY_FILE, now=fake.now, log=log))
        core.begin(None)
        beat(core, 50)
        exit_job(core, fake, 1)
        fake.advance(5, core)
        beat(core, 40)
        rank_beat(core, 0, 57)
        exit_job(core, fake, 1)
        exits = [r for r in read_history(core.run_dir / HISTORY_FILE)[0] if r["kind"] == "attempt_exit"]
        assert [(r["max_step"], r["reached_by"]) for r in exits] == [(50, "heartbeat"), (57, "ranks")]

    def test_a_flood_of_rank_files_is_bounded_and_said_once(self, tmp_path: Path) -> None:
        """Thousands of files in the folder: at most MAX_RANK_FILES beats are read, one warning per attempt."""
        core, fake, log, _ = started(tmp_path, "")
        folder = core.run_dir / RANK_HEARTBEAT_DIR
        for i in range(MAX_RANK_FILES + 50):
            (folder / f"rank-{i}.json").write_text('{"step": 1}')
        for i in range(600):
            (folder / f"junk-{i}").write_text("x")
        fake.advance(3, core)
        assert len(core.hangs.watch.ranks()) <= MAX_RANK_FILES
        assert log.names().count("heartbeat_invalid") == 1

    def test_a_rank_file_that_is_not_a_plain_file_is_said_not_ignored(self, tmp_path: Path) -> None:
        """A symlink (to /dev/zero) or a FIFO planted as a rank's file is not read, and the warning names it."""
        core, fake, log, _ = started(tmp_path, "")
        folder = core.run_dir / RANK_HEARTBEAT_DIR
        (folder / "rank-1.json").symlink_to("/dev/zero")
        os.mkfifo(folder / "rank-2.json")
        fake.advance(1, core)
        problems = dict(log.events)["heartbeat_invalid"]["problems"]
        assert sorted(problems) == ["rank 1: not a regular file", "rank 2: not a regular file"]
        assert core.hangs.watch.ranks() == []

    def test_stale_rank_files_are_removed_before_a_launch(self, tmp_path: Path) -> None:
        """A rank file of the last attempt is no progress of this one; other files in the folder are not ours."""
        core, fake, _, _ = started(tmp_path, "")
        rank_beat(core, 0, 9)
        (core.run_dir / RANK_HEARTBEAT_DIR / "notes.txt").write_text("keep")
        exit_job(core, fake, 1)
        fake.advance(5, core)
        assert len(fake.spawned) == 2
        assert sorted(p.name for p in (core.run_dir / RANK_HEARTBEAT_DIR).iterdir()) == ["notes.txt"]
