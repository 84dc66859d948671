"""The attempt's pure decisions: its environment, how a beat moves status, the hang allowance, the named load."""
from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.checkpoints import CheckpointInfo
from supervisor.config import Config, HealthSection, load_config
from supervisor.contract import ENV_ATTEMPT, ENV_HEARTBEAT, ENV_RUN_TOKEN, Beat
from supervisor.daemon.evidence import read_beat
from supervisor.policy.attempt import RunningAttempt, StepRate, apply_beat, hang_timeout, job_env, named_by_beat
from supervisor.policy.state import Status
from tests.helpers import returns_despite_fifo


def config(tmp_path: Path, extra: str = "") -> Config:
    path = tmp_path / "job.toml"
    path.write_text(f'[job]\ncommand = ["torchrun", "-m", "trainer"]\n{extra}\n[checkpoints]\ndir = "c"\n')
    return load_config(path)


class TestJobEnv:
    @pytest.mark.parametrize(("stop_timeout_s", "grace"),
                             [("90.5", "86491"), ("1e6", "1086400"), ("1.25", "86402"), ("30", "86430")])
    def test_torchrun_grace_is_whole_seconds(self, tmp_path: Path, stop_timeout_s: str, grace: str) -> None:
        """torchrun int()s TORCH_ELASTIC_SHUTDOWN_TIMEOUT at start: a fractional or huge stop_timeout_s is rounded up.
        It is stop_timeout_s and a day: the supervisor ends the stop, not counting time frozen (Slurm's suspend),
        which torchrun's own clock would count, SIGKILLing a suspended save on waking."""
        cfg = config(tmp_path, f"[health]\nstop_timeout_s = {stop_timeout_s}")
        env = job_env(cfg, {}, number=1, heartbeat=tmp_path / "hb", error_file=tmp_path / "e", token="t")
        assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == grace

    def test_contract_wins_over_config_and_user_grace_wins_over_ours(self, tmp_path: Path) -> None:
        """A stale contract variable in our own environment is replaced; [job] env is applied; a user's grace stays."""
        cfg = config(tmp_path, 'env = { FOO = "bar" }')
        env = job_env(cfg, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7", ENV_ATTEMPT: "99"}, number=3, heartbeat=tmp_path / "hb",
                      error_file=tmp_path / "e", token="tok")
        assert (env[ENV_ATTEMPT], env["FOO"], env[ENV_RUN_TOKEN]) == ("3", "bar", "tok")
        assert env[ENV_HEARTBEAT] == str(tmp_path / "hb") and env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "7"


class TestBeats:
    def test_rate_is_steps_over_time_and_step_time_moves_only_with_the_step(self) -> None:
        """Two beats 10 s apart, 10 steps: 1 step/s; a save beat keeps it; the next steps count from the first."""
        st, rate = Status(), StepRate()
        apply_beat(st, Beat(step=0, phase="train", loss=2.0), now=100.0, rate=rate)
        assert st.rate_steps_per_s is None  # one step seen: no rate yet
        apply_beat(st, Beat(step=10, phase="train", loss=1.5), now=110.0, rate=rate)
        assert (st.step, st.step_at, st.rate_steps_per_s, st.loss) == (10, 110.0, 1.0, 1.5)
        apply_beat(st, Beat(step=10, phase="save"), now=115.0, rate=rate)
        assert (st.step_at, st.phase, st.rate_steps_per_s) == (110.0, "save", 1.0)
        apply_beat(st, Beat(step=40, phase="train", val_loss=0.5), now=120.0, rate=rate)
        assert st.rate_steps_per_s == 2.0 and st.val_loss == 0.5  # 40 steps in 20 s

    def test_a_local_tier_the_job_says_fails_is_degraded_until_it_works_again(self) -> None:
        """The job's `local_tier` shows as degraded (status text and --json: status.local_tier) while its beats say
        it; a tier found unusable by `run` at start is not cleared by beats that say nothing of it."""
        st, rate = Status(local_tier="degraded: not writable"), StepRate()
        apply_beat(st, Beat(step=1, phase="train"), now=1.0, rate=rate)
        assert st.local_tier == "degraded: not writable"
        apply_beat(st, Beat(step=2, phase="train", local_tier="local save of step 2 failed (ENOSPC)"), now=2.0, rate=rate)
        assert st.local_tier == "degraded: the job says: local save of step 2 failed (ENOSPC)"
        apply_beat(st, Beat(step=3, phase="train", local_tier="local save of step 2 failed (ENOSPC)"), now=3.0, rate=rate)
        assert st.local_tier == "degraded: the job says: local save of step 2 failed (ENOSPC)"
        apply_beat(st, Beat(step=4, phase="train"), now=4.0, rate=rate)
        assert st.local_tier is None

    def test_beats_read_in_a_burst_are_no_burst_of_rate(self) -> None:
        """A 10 step/s job whose beats we read late, two within a millisecond: still 10 step/s (issue 22: 488)."""
        st, rate = Status(), StepRate()
        for i in range(1, 40):
            read_at = 1000.0 + (i // 5) * 0.5 + i * 0.0001  # read in bunches of five
            apply_beat(st, Beat(step=i * 10, time=1000.0 + i, phase="train"), now=read_at, rate=rate)
            assert st.rate_steps_per_s is None or st.rate_steps_per_s == pytest.approx(10.0)

    @pytest.mark.parametrize(("beats", "expected"), [
        ([(0, 0), (1, 10)], None),                       # less than 2 s of steps
        ([(0, 0), (3, 30)], 10.0),
        ([(0, 0), (30, 30), (60, 60), (61, 1060), (62, 2060)], 2030 / 32),  # the last 30 s and a bit: from t=30
        ([(0, 0), (30, 30), (40, 130)], 3.25),           # the newest sample at least 30 s old anchors it
        ([(0, 100), (10, 200), (11, 5), (14, 35)], 10.0),  # a step gone backwards starts over
        ([(0, 0), (5, 50), (5, 50), (5, 50)], 10.0),     # the same step again adds nothing
    ])
    def test_window_table(self, beats: list[tuple[float, int]], expected: float | None) -> None:
        rate = StepRate()
        got = [rate.add(t, step) for t, step in beats][-1]
        assert got == (None if expected is None else pytest.approx(expected))

    def test_a_load_beat_is_not_a_step_trained(self) -> None:
        """A resumed attempt's load beat names the checkpoint's step: it starts no rate."""
        st, rate = Status(), StepRate()
        apply_beat(st, Beat(step=500, time=0.0, phase="load"), now=0.0, rate=rate)
        apply_beat(st, Beat(step=501, time=20.0, phase="train"), now=20.0, rate=rate)
        apply_beat(st, Beat(step=531, time=23.0, phase="train"), now=23.0, rate=rate)
        assert st.rate_steps_per_s == 10.0

    def test_read_beat_of_missing_fifo_or_garbage(self, tmp_path: Path) -> None:
        """Missing or a FIFO: no beat, no problem (never blocks); garbage: no beat and a problem to warn about."""
        import os
        hb = tmp_path / "heartbeat.json"
        assert read_beat(hb) == (None, [])
        os.mkfifo(hb)
        assert returns_despite_fifo(hb, lambda: read_beat(hb)) == (None, [])
        hb.unlink()
        hb.write_text("{not json")
        beat, problems = read_beat(hb)
        assert beat is None and problems


class TestHangTimeout:
    @pytest.mark.parametrize(("startup", "phase", "hang", "expected"), [
        (True, None, 60, 600), (False, "train", 60, 60), (False, "save", 60, 900), (False, "load", 60, 900),
        (False, "eval", 60, 60), (False, None, 60, 60), (False, "train", 0, None), (False, "save", 0, None),
        (True, None, 0, 600),
    ])
    def test_table(self, startup: bool, phase: str | None, hang: float, expected: float | None) -> None:
        """Startup, slow phases and the rest get their own allowance; hang_timeout_s = 0 leaves only startup's."""
        health = HealthSection(startup_timeout_s=600, hang_timeout_s=hang, save_timeout_s=900)
        beat = Beat(step=1, phase=phase) if phase else None
        assert hang_timeout(health, beat, startup=startup) == expected


class TestNamedByBeat:
    def test_only_a_load_beat_naming_one_checkpoint(self, tmp_path: Path) -> None:
        """A load beat at step 20 names step_20; not when told what to load, not at step 0, not when ambiguous."""
        def info(name: str, step: int) -> CheckpointInfo:
            return CheckpointInfo(name=name, path=tmp_path / name, step=step, state="complete", reason=None,
                                  size_bytes=0, mtime=0.0)

        def job(beat: Beat | None, resumed: str | None = None) -> RunningAttempt:
            return RunningAttempt(1, 1, 0.0, resumed, None, tmp_path / "e", tmp_path / "l", None, beat=beat)

        cks = [info("step_10", 10), info("step_20", 20)]
        assert named_by_beat(job(Beat(step=20, phase="load")), cks) == str(tmp_path / "step_20")
        assert named_by_beat(job(Beat(step=20, phase="train")), cks) is None
        assert named_by_beat(job(Beat(step=0, phase="load")), cks) is None
        assert named_by_beat(job(Beat(step=20, phase="load"), resumed="x"), cks) is None
        assert named_by_beat(job(Beat(step=20, phase="load")), [*cks, info("step-20", 20)]) is None
