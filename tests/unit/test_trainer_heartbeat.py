"""Unit tests of trainer.heartbeat: atomic JSON, phase changes at once, training beats throttled."""
from __future__ import annotations

import json
import os

import pytest

from supervisor.contract import ENV_HEARTBEAT_DIR, parse_heartbeat
from trainer.heartbeat import HEARTBEAT_ENV, Heartbeat, RankBeat


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
        hb.beat(3, "train", 2.5)
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
            assert rb.beat(step, "train", clock.now)
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

    def test_rank_beats_are_not_throttled(self, tmp_path, monkeypatch, clock) -> None:
        """The node's file is written once a second; the rank's file on every step (the step reached, exactly)."""
        monkeypatch.setenv(HEARTBEAT_ENV, str(tmp_path / "hb.json"))
        monkeypatch.setenv(ENV_HEARTBEAT_DIR, str(tmp_path))
        monkeypatch.setenv("RANK", "0")
        hb = Heartbeat.from_env(rank=0, clock=clock)
        for step in range(1, 11):
            hb.beat(step, "train", 1.0)
            clock.now += 0.05
        assert json.loads((tmp_path / "hb.json").read_text())["step"] == 1
        assert parse_heartbeat((tmp_path / "rank-0.json").read_bytes())[0].step == 10
