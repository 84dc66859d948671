"""Unit tests of trainer.heartbeat: atomic JSON, phase changes at once, training beats throttled."""
from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import time

import pytest

from supervisor.contract import ENV_HEARTBEAT_DIR, parse_heartbeat
from trainer.heartbeat import BAD_HOLD_S, HEARTBEAT_ENV, STEP_INTERVAL_S, Heartbeat, RankBeat


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(autouse=True)
def no_checked_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever an earlier test loaded in this process, these start as a job that has not said its loads check."""
    monkeypatch.setattr(Heartbeat, "checks_loads", False)


class TestHeartbeat:
    def test_writes_the_documented_fields(self, tmp_path, clock) -> None:
        """The file holds exactly step, time, phase and loss."""
        path = tmp_path / "hb.json"
        Heartbeat(path, clock=clock).beat(3, "train", 2.5)
        assert json.loads(path.read_text()) == {"step": 3, "time": 1000.0, "phase": "train", "loss": 2.5}

    def test_a_job_whose_loads_check_says_so_in_every_beat(self, tmp_path, clock) -> None:
        """Once `checks_loads` is set (the reference trainer at start, every `load_checkpoint`), every beat says it."""
        path = tmp_path / "hb.json"
        Heartbeat.checks_loads = True
        Heartbeat(path, clock=clock).beat(3, "load")
        beat, _ = parse_heartbeat(path.read_bytes())
        assert beat is not None and beat.checks_loads

    def test_training_beats_are_throttled_to_the_interval(self, tmp_path, clock) -> None:
        """Within one interval a second train beat is skipped; after it, it is written."""
        hb = Heartbeat(tmp_path / "hb.json", clock=clock)
        assert hb.beat(1, "train", 1.0)
        clock.now += 0.5
        assert not hb.beat(2, "train", 1.0)
        clock.now += 0.5
        assert hb.beat(3, "train", 1.0)
        assert json.loads((tmp_path / "hb.json").read_text())["step"] == 3

    def test_phase_change_is_written_at_once(self, tmp_path, clock) -> None:
        """A new phase is recorded even inside the throttle interval."""
        hb = Heartbeat(tmp_path / "hb.json", clock=clock)
        hb.beat(4, "train", 1.0)
        assert hb.beat(4, "save", 1.0)
        assert json.loads((tmp_path / "hb.json").read_text())["phase"] == "save"

    def test_non_finite_loss_is_a_word_written_at_once(self, tmp_path, clock) -> None:
        """NaN is not JSON: a diverged loss is written as "nan", at once (not a second later), and in the rank's file."""
        hb = Heartbeat(tmp_path / "hb.json", clock=clock, rank_path=tmp_path / "rank-0.json")
        hb.beat(1, "train", 2.0)
        hb.beat(2, "train", float("nan"))
        assert json.loads((tmp_path / "hb.json").read_text())["loss"] == "nan"
        assert json.loads((tmp_path / "rank-0.json").read_text()) == {"step": 2, "time": 1000.0, "phase": "train",
                                                                       "loss": "nan"}
        hb.beat(3, "train", 2.5)  # the rank's file keeps saying it for BAD_HOLD_S (looked at once a second)
        assert json.loads((tmp_path / "rank-0.json").read_text())["loss"] == "nan"
        clock.now += BAD_HOLD_S
        hb.beat(4, "train", 2.5)
        assert json.loads((tmp_path / "rank-0.json").read_text())["loss"] == 2.5

    def test_no_temporary_file_is_left(self, tmp_path, clock) -> None:
        """The rewrite goes through a temp file that is renamed over the target."""
        Heartbeat(tmp_path / "hb.json", clock=clock).beat(1, "load")
        assert [p.name for p in tmp_path.iterdir()] == ["hb.json"]

    def test_unknown_phase_is_refused(self, tmp_path, clock) -> None:
        """Only the contract's phases (load, train, eval, save) are written."""
        with pytest.raises(ValueError):
            Heartbeat(tmp_path / "hb.json", clock=clock).beat(1, "warmup")

    def test_val_loss_is_written_at_once_and_repeated(self, tmp_path, clock) -> None:
        """A new evaluation result is written inside the throttle interval and carried by later beats."""
        hb = Heartbeat(tmp_path / "hb.json", clock=clock)
        hb.beat(10, "train", 1.0)
        assert hb.beat(10, "train", 1.0, val_loss=0.75)
        clock.now += 1.0
        hb.beat(11, "train", 0.9)
        assert json.loads((tmp_path / "hb.json").read_text())["val_loss"] == 0.75

    def test_a_failing_local_tier_is_written_at_once_repeated_and_cleared(self, tmp_path, clock) -> None:
        """Why the local tier fails is said inside the throttle interval, carried by later beats, gone once it works."""
        hb = Heartbeat(tmp_path / "hb.json", clock=clock)
        hb.beat(10, "train", 1.0)
        hb.local_tier = "local save of step 10 failed (ENOSPC)"
        assert hb.beat(10, "train", 1.0)
        clock.now += 1.0
        hb.beat(11, "train", 0.9)
        beat, _ = parse_heartbeat((tmp_path / "hb.json").read_bytes())
        assert beat is not None and beat.local_tier == "local save of step 10 failed (ENOSPC)"
        hb.local_tier = None
        assert hb.beat(11, "train", 0.9)
        assert "local_tier" not in json.loads((tmp_path / "hb.json").read_text())

    def test_unwritable_path_does_not_raise(self, tmp_path, clock) -> None:
        """A heartbeat that cannot be written is reported, not fatal to training."""
        hb = Heartbeat(tmp_path / "missing-dir" / "hb.json", clock=clock)
        assert not hb.beat(1, "train")
        assert isinstance(hb.last_error, OSError)


class TestFromEnv:
    def test_rank_zero_uses_the_env_path(self, tmp_path, monkeypatch) -> None:
        """Rank 0 writes to FSDP_SUPERVISOR_HEARTBEAT."""
        monkeypatch.setenv(HEARTBEAT_ENV, str(tmp_path / "hb.json"))
        assert Heartbeat.from_env(rank=0).path == tmp_path / "hb.json"

    def test_other_ranks_and_no_env_are_disabled(self, tmp_path, monkeypatch) -> None:
        """Only rank 0 writes, and nothing is written without the variable."""
        monkeypatch.setenv(HEARTBEAT_ENV, str(tmp_path / "hb.json"))
        assert not Heartbeat.from_env(rank=1).enabled
        monkeypatch.delenv(HEARTBEAT_ENV)
        hb = Heartbeat.from_env(rank=0)
        assert not hb.enabled and not hb.beat(1, "train")


class TestRankBeat:
    def test_every_step_in_place_with_a_fixed_size(self, tmp_path, clock) -> None:
        """Each new step is one in-place rewrite of the same file (same inode, same size): a parseable beat."""
        path = tmp_path / "rank-3.json"
        rb = RankBeat(path)
        assert rb.beat(1, "train", clock.now, step_s=0.25)
        inode = os.stat(path).st_ino
        for step in range(2, 50):
            assert rb.beat(step, "train", clock.now + step * STEP_INTERVAL_S)
        assert os.stat(path).st_ino == inode and os.stat(path).st_size == RankBeat.SIZE
        beat, problems = parse_heartbeat(path.read_bytes())
        assert beat is not None and beat.step == 49 and beat.phase == "train" and problems == []

    def test_the_same_step_again_only_as_a_keepalive(self, tmp_path, clock) -> None:
        """A long evaluation beats the same step: rewritten at most every min_interval_s, so it stays alive."""
        rb = RankBeat(tmp_path / "rank-0.json")
        assert rb.beat(5, "eval", clock.now)
        assert not rb.beat(5, "eval", clock.now + 0.5)
        assert rb.beat(5, "eval", clock.now + 1.0)
        assert rb.beat(5, "save", clock.now + 1.1)

    NAN, T = float("nan"), STEP_INTERVAL_S
    # (seconds since the first beat, step, phase, loss, step_s) -> (written, the file's step, loss, step_s)
    THROTTLE = [
        ([(0, 1, "train", 2.0, 0.1)], (True, 1, 2.0, 0.1)),
        ([(0, 1, "train", 2.0, 0.1), (0.1, 2, "train", 2.1, 0.1)], (False, 1, 2.0, 0.1)),  # a step: rate-limited
        ([(0, 1, "train", 2.0, 0.1), (T, 2, "train", 2.1, 0.1)], (True, 2, 2.1, 0.1)),  # ... until its interval
        ([(0, 1, "train", 2.0, 0.1), (0.1, 1, "save", 2.0, None)], (True, 1, 2.0, None)),  # a phase change: at once
        ([(0, 1, "train", 2.0, 0.1), (0.1, 2, "train", NAN, 0.1)], (True, 2, "nan", 0.1)),  # a NaN: at once
        ([(0, 1, "train", 2.0, None), (0.1, 2, "train", float("inf"), None)], (True, 2, "inf", None)),
        # stats carried: the mean step time since the last write, and a NaN among the steps held back
        ([(0, 1, "train", 2.0, 0.1), (0.1, 2, "train", 2.0, 0.1), (0.2, 3, "train", 2.0, 0.3),
          (T, 4, "train", 2.0, 0.2)], (True, 4, 2.0, 0.2)),
        # a loss held back is not dropped by a later beat without one (HF: on_log's loss, then on_step_end's beat)
        ([(0, 1, "train", 2.0, None), (0.1, 2, "train", 3.0, None), (T, 3, "train", None, None)], (True, 3, 3.0, None)),
        ([(0, 1, "train", 2.0, None), (T, 2, "train", None, None)], (True, 2, None, None)),
        # a NaN held back is never hidden: the next write says it, though its own step's loss is finite
        ([(0, 1, "train", NAN, 0.1), (T, 2, "train", NAN, 0.1), (T + 0.1, 3, "train", NAN, 0.1),
          (2 * T, 4, "train", 2.0, 0.1)], (True, 4, "nan", 0.1)),
        ([(0, 1, "train", NAN, None), (0.1, 2, "train", 2.0, None), (0.2, 3, "train", NAN, None),
          (T, 4, "train", 2.0, None)], (True, 4, "nan", None)),
        # a NaN written stays BAD_HOLD_S before a finite loss replaces it
        ([(0, 1, "train", NAN, None), (BAD_HOLD_S - 0.1, 2, "train", 2.0, None)], (False, 1, "nan", None)),
        ([(0, 1, "train", NAN, None), (BAD_HOLD_S, 2, "train", 2.0, None)], (True, 2, 2.0, None)),
        # a step's NaN after that step's own beat (a loop that beats, then logs the loss): at once all the same
        ([(0, 1, "train", 2.0, None), (0.01, 1, "train", NAN, None)], (True, 1, "nan", None)),
        # a phase change within the hold (Lightning's validation right after the NaN batch) carries the NaN ...
        ([(0, 1, "train", NAN, None), (0.01, 1, "eval", None, None)], (True, 1, "nan", None)),
        ([(0, 1, "train", NAN, None), (0.01, 1, "eval", 2.0, None)], (True, 1, "nan", None)),
        # ... and the hold still counts from the NaN's own write
        ([(0, 1, "train", NAN, None), (1.0, 1, "eval", None, None), (BAD_HOLD_S, 2, "eval", 2.0, None)],
         (True, 2, 2.0, None)),
    ]

    @pytest.mark.parametrize(("beats", "expected"), THROTTLE)
    def test_throttle(self, tmp_path, clock, beats, expected) -> None:
        """Phase changes and a first NaN at once, new steps at most every STEP_INTERVAL_S, the held-back steps'
        mean step time and any NaN carried by the next write."""
        path = tmp_path / "rank-0.json"
        rb = RankBeat(path, flush=False)
        for at, step, phase, loss, step_s in beats:
            written = rb.beat(step, phase, clock.now + at, step_s=step_s, loss=loss)
        beat, problems = parse_heartbeat(path.read_bytes())
        assert problems == [] and beat is not None
        loss = beat.loss_bad or beat.loss
        assert (written, beat.step, loss, beat.step_s) == expected

    def test_a_flushed_step_counts_its_interval_from_its_due_time(self, tmp_path, clock) -> None:
        """The flusher writes a held-back step at its due time; the next step waits a whole interval from then, not
        from the held step's own time (else 5 writes could land in a second)."""
        path = tmp_path / "rank-0.json"
        rb = RankBeat(path)
        assert rb.beat(1, "train", clock.now)
        assert not rb.beat(2, "train", clock.now + 0.1)
        deadline = time.monotonic() + 30
        while parse_heartbeat(path.read_bytes())[0].step != 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert parse_heartbeat(path.read_bytes())[0].time == pytest.approx(clock.now + 0.1)  # the step's own time
        assert not rb.beat(3, "train", clock.now + STEP_INTERVAL_S + 0.1)
        rb.close()

    def test_close_writes_the_step_held_back(self, tmp_path, clock) -> None:
        """A clean exit leaves the last step in the file (the flusher covers a rank that stops beating)."""
        rb = RankBeat(tmp_path / "rank-0.json", flush=False)
        rb.beat(1, "train", clock.now)
        assert not rb.beat(2, "train", clock.now + 0.1)
        rb.close()
        assert parse_heartbeat((tmp_path / "rank-0.json").read_bytes())[0].step == 2

    def test_close_within_a_nan_s_hold_keeps_the_nan(self, tmp_path, clock) -> None:
        """The loop stops right after a NaN (a step held back with a finite loss): the last record still says NaN."""
        rb = RankBeat(tmp_path / "rank-0.json", flush=False)
        rb.beat(1, "train", clock.now, loss=float("nan"))
        assert not rb.beat(2, "train", clock.now + 0.3, loss=2.0)
        rb.close()
        beat = parse_heartbeat((tmp_path / "rank-0.json").read_bytes())[0]
        assert (beat.step, beat.loss_bad) == (2, "nan")

    def test_the_step_held_back_lands_when_the_process_ends_without_close(self, tmp_path) -> None:
        """A user's loop that raises (or just returns) right after a throttled step: the file still says the last
        step (the flusher is a daemon thread, stopped at exit before its due time)."""
        script = ("import sys, time\nfrom trainer.heartbeat import RankBeat\n"
                  f"rb = RankBeat({str(tmp_path / 'rank-0.json')!r})\n"
                  "for step in range(1, 8):\n    rb.beat(step, 'train', time.time(), loss=1.0)\n"
                  "raise RuntimeError('the loop failed')\n")
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
        assert b"the loop failed" in done.stderr
        assert parse_heartbeat((tmp_path / "rank-0.json").read_bytes())[0].step == 7

    def test_a_forked_child_never_writes_its_parent_s_file(self, tmp_path, clock) -> None:
        """A DataLoader-style fork: the child's exit does not write the parent's held-back step (nor any)."""
        path = tmp_path / "rank-0.json"
        rb = RankBeat(path, flush=False)
        rb.beat(1, "train", clock.now)
        assert not rb.beat(2, "train", clock.now + 0.1)
        child = os.fork()
        if child == 0:  # the atexit hooks run as at any interpreter's exit (sys.exit would go on inside pytest)
            try:
                atexit._run_exitfuncs()
            finally:
                os._exit(0)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0 and parse_heartbeat(path.read_bytes())[0].step == 1
        rb.close()
        assert parse_heartbeat(path.read_bytes())[0].step == 2

    def test_heartbeats_dropped_without_close_leak_no_thread_or_descriptor(self, tmp_path, monkeypatch) -> None:
        """A loop that makes a new heartbeat each epoch and never closes it: each one's flusher ends once idle, and
        the file is released when the heartbeat is collected (20 epochs left 20 threads and 20 descriptors)."""
        import gc
        import threading

        import trainer.heartbeat as hb

        monkeypatch.setattr(hb, "FLUSHER_IDLE_S", 0.05)
        def flushers() -> set[threading.Thread]:
            return {t for t in threading.enumerate() if t.name == "heartbeat-flush"}

        before, fds = flushers(), len(os.listdir("/proc/self/fd"))
        for _ in range(20):
            rb = RankBeat(tmp_path / "rank-0.json")
            rb.beat(1, "train", time.time())
            rb.beat(2, "train", time.time())
        del rb
        deadline = time.monotonic() + 30
        while flushers() - before and time.monotonic() < deadline:
            time.sleep(0.01)
        gc.collect()
        assert not flushers() - before and len(os.listdir("/proc/self/fd")) <= fds
        assert parse_heartbeat((tmp_path / "rank-0.json").read_bytes())[0].step == 2  # the held steps still landed

    def test_a_failed_write_turns_it_off(self, tmp_path, clock) -> None:
        rb = RankBeat(tmp_path / "missing" / "rank-0.json")
        assert not rb.beat(1, "train", clock.now) and isinstance(rb.last_error, OSError)
        assert not rb.beat(2, "train", clock.now)


class TestEveryRank:
    def test_every_rank_writes_its_own_file_named_by_its_global_rank(self, tmp_path, monkeypatch, clock) -> None:
        """With the folder set, local rank 1 (global rank 9) keeps rank-9.json; only local rank 0 the node's file."""
        monkeypatch.setenv(HEARTBEAT_ENV, str(tmp_path / "hb.json"))
        monkeypatch.setenv(ENV_HEARTBEAT_DIR, str(tmp_path))
        monkeypatch.setenv("RANK", "9")
        hb = Heartbeat.from_env(rank=1, clock=clock)
        assert hb.enabled and hb.path is None
        hb.beat(4, "train", 1.0, step_s=0.5)
        beat, _ = parse_heartbeat((tmp_path / "rank-9.json").read_bytes())
        assert beat is not None and beat.step == 4 and beat.step_s == 0.5
        assert not (tmp_path / "hb.json").exists()

    def test_rank_beats_are_throttled_and_the_last_step_lands(self, tmp_path, monkeypatch, clock) -> None:
        """The node's file is written once a second, the rank's 4 times a second; the last step held back is written
        by the flusher when no later beat comes (a rank blocked in a collective): the step reached stays exact."""
        monkeypatch.setenv(HEARTBEAT_ENV, str(tmp_path / "hb.json"))
        monkeypatch.setenv(ENV_HEARTBEAT_DIR, str(tmp_path))
        monkeypatch.setenv("RANK", "0")
        hb = Heartbeat.from_env(rank=0, clock=clock)
        for step in range(1, 11):
            hb.beat(step, "train", 1.0)
            clock.now += 0.05
        assert json.loads((tmp_path / "hb.json").read_text())["step"] == 1
        assert parse_heartbeat((tmp_path / "rank-0.json").read_bytes())[0].step < 10
        deadline = time.monotonic() + 30
        while parse_heartbeat((tmp_path / "rank-0.json").read_bytes())[0].step != 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        beat = parse_heartbeat((tmp_path / "rank-0.json").read_bytes())[0]
        assert beat.step == 10 and beat.time == pytest.approx(1000.45)  # its own step's time, not the flush's
        hb.close()
