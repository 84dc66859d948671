"""The divergence guard: the detector and the rollback arithmetic (pure), then Core rolling back through a fake System."""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.checkpoints.markers import is_quarantined, quarantine, quarantine_reason
from supervisor.cli import app as top_cli
from supervisor.config import DivergenceSection
from supervisor.contract import MAX_STEP, Beat
from supervisor.daemon.core import Core
from supervisor.daemon.divergence import DIVERGENCE_FILE, read_open
from supervisor.observe.statusview import render_status
from supervisor.policy.divergence import Detector, Diverged, Open, same_region, skip_steps
from supervisor.policy.state import State
from tests.fakes import FakeSystem, RecordingLog
from tests.jobs.dcp_files import write_checkpoint
from tests.unit.test_core import exit_job, make_core

DATA = Path(__file__).resolve().parents[1] / "data"
# The reference trainer on 2 CPU ranks, its defaults but --lr: the loss of its first steps (its own log).
LR30 = [5.74998, 121.03773, 1030.2019, 1662.39551, 4221.11621, 2951.33447, 3085.34033, 7825.64307]
LR3000 = [5.74998, 1260500.875, 112746360.0, 14634310656.0, 671528976384.0, math.nan, math.nan]


def reference_curve() -> list[tuple[int, float]]:
    rows = (line.split() for line in (DATA / "reference_loss.txt").read_text().splitlines() if not line.startswith("#"))
    return [(int(s), float(v)) for s, v in rows]


def run(losses: list[tuple[int, float | str]], *, factor: float = 2.0, patience: int = 3,
        rank: int | None = None) -> Diverged | None:
    d = Detector(factor, patience)
    for step, loss in losses:
        bad = loss if isinstance(loss, str) else None
        found = d.feed(rank, Beat(step, loss=None if bad else float(loss), loss_bad=bad))
        if found is not None:
            return found
    return None


class TestDetector:
    @pytest.mark.parametrize("stride", [1, 3, 20, 57])
    def test_the_reference_trainer_s_normal_run_never_trips_it(self, stride: int) -> None:
        """2,000 steps of the reference trainer's loss (its early fall and its noise), read every step or about once
        a second (every 20 steps), by the node's beat and two ranks' beats, trip no default detector."""
        default = DivergenceSection()
        d = Detector(default.spike_factor, default.spike_patience)
        for step, loss in reference_curve()[::stride]:
            for rank in (None, 0, 1):
                assert d.feed(rank, Beat(step, loss=loss)) is None

    @pytest.mark.parametrize("losses,onset,step,why", [
        ([(1, 5.0), (2, 4.0), (3, "nan")], 3, 3, "nan"),
        ([(1, 5.0), (2, "inf")], 2, 2, "inf"),
        ([(1, "nan")], 1, 1, "nan"),
        ([(1, 1.0), (2, 1.0), (3, 9.0), (4, 9.0), (5, 9.0)], 3, 5, "spike"),
        ([(1, 1.0), (2, 1.0), (3, 9.0), (4, 9.0), (5, "nan")], 3, 5, "nan"),  # a NaN after a spike: the spike's onset
        ([(1, 1.0), (2, 9.0), (3, 1.0), (4, 9.0), (5, 9.0), (6, 9.0)], 4, 6, "spike"),  # a normal beat ends a stretch
        ([(s, -5.0) for s in range(1, 20)] + [(20, 6.0), (21, 7.0), (22, 8.0)], 20, 22, "spike"),  # negative, then up
        ([(s, 0.0 if s % 5 < 3 else 0.5) for s in range(1, 40)] + [(s, 3.0) for s in range(40, 43)], 40, 42, "spike"),
        (list(enumerate(LR30, 1)), 2, 4, "spike"),
        (list(enumerate(LR3000, 1)), 2, 4, "spike"),
    ])
    def test_found(self, losses: list[tuple[int, float | str]], onset: int, step: int, why: str) -> None:
        """NaN/inf at once; a spike after `patience` beats in a row; the onset is the stretch's first beat."""
        found = run(losses)
        assert found is not None and (found.onset_step, found.step, found.why) == (onset, step, why)

    @pytest.mark.parametrize("losses", [
        [(1, 1.0), (2, 9.0), (3, 9.0), (4, 1.0), (5, 9.0)],  # never 3 in a row
        [(1, 1.0), (2, 1.9), (3, 1.9), (4, 1.99)],  # below 2x
        [(1, 1.0), (2, 9.0), (2, 9.0), (2, 9.0)],  # the same step thrice (node and ranks): one beat
        [(s, 6.0 - s / 100) for s in range(1, 400)],  # a fall
        [(1, 0.4), (2, 1.3), (3, 1.3), (4, 1.3), (5, 1.2)],  # a low first batch is no level to judge by
        [(s, -5.0 + (0.3 if s % 3 else -0.3)) for s in range(1, 200)],  # a negative objective, noisy
        [(s, -1.0 - s / 10) for s in range(1, 200)],  # a negative one falling
        [(s, 1.0 - s / 50) for s in range(1, 200)],  # one that falls through 0
        [(s, 0.0 if s % 5 < 3 else 0.5) for s in range(1, 400)],  # most batches exactly 0 (a hinge loss)
        [(s, 0.0) for s in range(1, 50)],
    ])
    def test_not_found(self, losses: list[tuple[int, float | str]]) -> None:
        assert run(losses) is None

    @pytest.mark.parametrize("losses,since", [
        ([(10, 1.0), (30, 9.0), (50, 9.0), (70, 9.0)], 11),  # beats a second apart: it may have begun at step 11
        ([(10, 1.0), (30, 1.0), (20, 1.0), (40, "nan")], 31),  # a late, older beat moves nothing back
        ([(10, 1.0), (30, 9.0), (25, 1.0), (50, 9.0), (70, 9.0)], 26),  # older news does not end the stretch
        ([(5, "nan")], 5),
    ])
    def test_saves_after_the_last_normal_beat_are_suspect(self, losses: list[tuple[int, float | str]],
                                                          since: int) -> None:
        found = run(losses)
        assert found is not None and found.since == since and found.since <= found.onset_step

    def test_val_loss_is_not_watched(self) -> None:
        """A val_loss going up, or NaN, is no divergence: only `loss` is watched."""
        d = Detector(2.0, 1)
        for step in range(1, 50):
            assert d.feed(None, Beat(step, loss=1.0, val_loss=float(step))) is None
        assert d.feed(None, Beat(50, loss=1.0, val_loss=None)) is None  # a NaN val_loss is dropped by the contract

    def test_one_beat_that_lies_a_huge_step_does_not_freeze_the_level(self) -> None:
        """A rank writes the largest step the contract takes once: the level still follows the loss's fall after it,
        and a 10x spike over the new level is found."""
        d = Detector(3.0, 3)
        for step in range(1, 60):
            assert d.feed(None, Beat(step, loss=5.0)) is None
        assert d.feed(1, Beat(MAX_STEP, loss=5.0)) is None
        for step in range(60, 200):
            assert d.feed(None, Beat(step, loss=1.0)) is None
        found = [d.feed(None, Beat(step, loss=10.0)) for step in (200, 201, 202)][-1]
        assert found is not None and (found.onset_step, found.why) == (200, "spike")

    def test_one_rank_s_nan_names_it(self) -> None:
        d = Detector(2.0, 3)
        assert d.feed(None, Beat(7, loss=2.0)) is None and d.feed(0, Beat(7, loss=2.0)) is None
        found = d.feed(1, Beat(7, loss_bad="nan"))
        assert found is not None and (found.rank, found.onset_step, found.why) == (1, 7, "nan")

    @given(st.lists(st.floats(1.0, 1.99), min_size=1, max_size=200), st.integers(1, 5))
    def test_noise_below_the_factor_never_fires(self, losses: list[float], patience: int) -> None:
        """Losses that never exceed factor x the smallest of them never make a divergence, whatever their order."""
        assert run(list(enumerate(losses, 1)), patience=patience) is None

    @given(st.lists(st.one_of(st.floats(0.1, 1e6), st.just("nan")), min_size=1, max_size=100))
    def test_the_onset_is_a_step_fed_no_later_than_the_detecting_one(self, losses: list[float | str]) -> None:
        steps = list(enumerate(losses, 1))
        found = run(steps)
        if found is not None:
            assert 1 <= found.onset_step <= found.step and (found.why == "spike") == (found.loss is not None)


class TestArithmetic:
    @pytest.mark.parametrize("onset,resume,after,before,skip", [
        (140, 120, 10, None, 30),
        (140, 140, 0, None, 0),
        (140, 120, 10, Open(140, 141, 0, None, "nan", 1, 1, 120, 30), 60),  # the same checkpoint again: the skips add
        (150, 140, 10, Open(140, 141, 0, None, "nan", 1, 1, 120, 30), 20),  # a newer one already holds the skip
    ])
    def test_skip_steps(self, onset: int, resume: int, after: int, before: Open | None, skip: int) -> None:
        assert skip_steps(onset, resume, after, before) == skip

    def test_same_region(self) -> None:
        before = Open(140, 141, 0, None, "nan", 1)
        assert same_region(before, Diverged(150, 151, 0, None, "nan"), 10)
        assert not same_region(before, Diverged(151, 152, 0, None, "nan"), 10)
        assert not same_region(None, Diverged(150, 151, 0, None, "nan"), 10)

    @pytest.mark.parametrize("raw", [None, [], {"onset_step": 1}, {**Open(1, 2, 0, None, "nan", 1).to_json(), "why": "x"},
                                     {**Open(1, 2, 0, None, "nan", 1).to_json(), "skip": -1}])
    def test_a_record_not_ours_is_refused(self, raw: object) -> None:
        with pytest.raises(ValueError):
            Open.from_json(raw)


# ---- Core, through the fake System -------------------------------------------------------------------------
RESUME = 'resume_args = ["--resume", "{checkpoint}", "--skip-steps", "{skip_steps}"]'


def nan_beat(core: Core, step: int, loss: float | str = "nan") -> None:
    core.heartbeat_path.write_text(json.dumps({"step": step, "time": 0, "phase": "train", "loss": loss}))
    core.on_file_event(core.heartbeat_path)


def diverging(tmp_path: Path, divergence: str = "", keep_last: int = 1, job: str = RESUME
              ) -> tuple[Core, FakeSystem, RecordingLog, Path]:
    core, fake, log = make_core(tmp_path, job=job, checkpoints=f"keep_last = {keep_last}",
                                restart="max_no_progress_restarts = 0", health=f"[divergence]\n{divergence}")
    root = core.cfg.checkpoints.dir
    for step in (100, 120):
        write_checkpoint(root, step)
    return core, fake, log, root


class TestRollback:
    def test_a_nan_rolls_back_to_the_checkpoint_before_it_skipping_the_window(self, tmp_path: Path) -> None:
        """A spike from step 135, a save at 140, NaN at 141: stop, 140 and the emergency save are diverged, relaunch
        from 120 with (135 - 120) + 10 steps skipped, no restart counted; a launch that is no rollback says 0."""
        core, fake, log, root = diverging(tmp_path, keep_last=3)
        core.begin(None)
        assert fake.spawned[0].env["FSDP_SUPERVISOR_SKIP_STEPS"] == "0"
        assert fake.spawned[0].argv[-1] == "0"
        nan_beat(core, 130, 1.0)
        nan_beat(core, 135, 30.0)
        write_checkpoint(root, 140)
        nan_beat(core, 140, 30.0)
        assert not fake.signals
        nan_beat(core, 141)
        assert fake.signals[-1][0] == fake.spawned[0].pid and "diverged" in log.names()
        write_checkpoint(root, 141)  # its emergency save
        exit_job(core, fake, 0)
        fake.advance(0, core)
        assert len(fake.spawned) == 2 and core.status.restarts == 0 and core.status.rollbacks == 1
        relaunch = fake.spawned[1]
        assert relaunch.argv[-4:] == ["--resume", str(root / "step_00000120"), "--skip-steps", "25"]
        assert relaunch.env["FSDP_SUPERVISOR_SKIP_STEPS"] == "25"
        for step in (140, 141):
            path = root / f"step_{step:08d}"
            assert is_quarantined(path) and (quarantine_reason(path) or "").startswith("diverged")
        assert "rolled_back" in log.names() and core.status.divergence is not None
        assert json.loads((core.run_dir / DIVERGENCE_FILE).read_text())["onset_step"] == 135

    def test_a_diverged_emergency_save_is_no_failed_one(self, tmp_path: Path) -> None:
        """The stop's emergency save was written (then marked diverged): no `emergency_save_failed`, although the
        newest usable checkpoint is older than the step of its `save` beat (torchrun exits 1 on a relayed stop)."""
        core, fake, log, root = diverging(tmp_path, keep_last=3)
        core.begin(None)
        nan_beat(core, 130, 1.0)
        nan_beat(core, 131)
        core.heartbeat_path.write_text(json.dumps({"step": 131, "time": 0, "phase": "save"}))
        core.on_file_event(core.heartbeat_path)
        write_checkpoint(root, 131)
        exit_job(core, fake, 1)
        fake.advance(0, core)
        assert is_quarantined(root / "step_00000131") and len(fake.spawned) == 2
        assert "emergency_save_failed" not in log.names()

    def test_a_save_between_the_last_normal_beat_and_the_first_bad_one_is_diverged(self, tmp_path: Path) -> None:
        """Normal at 130, a save at 140, the first bad beat seen at 145: 140 may hold the spike's first steps."""
        core, fake, _, root = diverging(tmp_path, keep_last=3)
        core.begin(None)
        nan_beat(core, 130, 1.0)
        write_checkpoint(root, 140)
        nan_beat(core, 145)
        exit_job(core, fake, 0)
        fake.advance(0, core)
        assert is_quarantined(root / "step_00000140")
        assert fake.spawned[-1].argv[-4:] == ["--resume", str(root / "step_00000120"), "--skip-steps", "35"]

    def test_the_divergence_closes_past_the_onset(self, tmp_path: Path) -> None:
        core, fake, _, root = diverging(tmp_path)
        core.begin(None)
        nan_beat(core, 141)
        exit_job(core, fake, 0)
        fake.advance(0, core)
        nan_beat(core, 150, 1.0)
        assert core.status.divergence is not None
        nan_beat(core, 151, 1.0)
        assert core.status.divergence is None and not (core.run_dir / DIVERGENCE_FILE).exists()

    def test_max_rollbacks_then_exit_3_naming_the_last_good_checkpoint(self, tmp_path: Path) -> None:
        """The same region diverges again and again: after max_rollbacks the run gives up, the skips grow, and the
        last good checkpoint (and keep_last before it) survive retention although newer saves are diverged."""
        core, fake, log, root = diverging(tmp_path, "max_rollbacks = 2", keep_last=2)
        core.begin(None)
        skips = []
        for n in range(3):
            write_checkpoint(root, 141 + n)
            nan_beat(core, 141 + n)
            exit_job(core, fake, 1)
            fake.advance(0, core)
            skips.append(fake.spawned[-1].env["FSDP_SUPERVISOR_SKIP_STEPS"])
        assert core.exit_code == 3 and core.status.state is State.FAILED and len(fake.spawned) == 3
        assert skips == ["31", "63", "63"]  # the second resumes from 120 again: the first skip is added
        reason = core.status.reason or ""
        assert "step 143" in reason and "2 rollback" in reason and "step_00000120" in reason and "nan" in reason
        assert (root / "step_00000120").is_dir() and (root / "step_00000100").is_dir()

    def test_action_stop_gives_up_at_once(self, tmp_path: Path) -> None:
        core, fake, _, _ = diverging(tmp_path, 'action = "stop"')
        core.begin(None)
        nan_beat(core, 141)
        assert fake.signals
        exit_job(core, fake, 0)
        reason = core.status.reason or ""
        assert core.exit_code == 3 and "diverged (nan) at step 141" in reason and "step_00000120 (kept)" in reason

    def test_a_job_that_picks_its_own_checkpoint_is_stopped_not_rolled_back(self, tmp_path: Path) -> None:
        """resume_args = []: the relaunch would load the job's own pick, its newest save (Lightning's last.ckpt, its
        emergency save from after the onset), and skip from step 0 ("to a fresh start"): measured, a Lightning run
        loaded its NaN last.ckpt, skipped to the end and ended `completed`. So: stop and exit 3, saying why."""
        core, fake, _, _ = diverging(tmp_path, job="resume_args = []")
        core.begin(None)
        nan_beat(core, 141)
        assert fake.signals
        exit_job(core, fake, 0)
        reason = core.status.reason or ""
        assert core.exit_code == 3 and len(fake.spawned) == 1 and core.status.rollbacks == 0
        assert "no rollback: resume_args name no {checkpoint}" in reason and "step_00000120 (kept)" in reason

    @pytest.mark.parametrize(("losses", "warned"), [([None], True), ([1.0, None, None, None], False)])
    def test_unguarded_only_when_no_beat_carries_a_loss(self, tmp_path: Path, losses: list[float | None],
                                                        warned: bool) -> None:
        """HF's Trainer beats a loss only on the steps it logs (logging_steps > 1): that job is guarded."""
        core, _, log, _ = diverging(tmp_path)
        core.begin(None)
        for step in range(1, 41):
            nan_beat(core, step, losses[step % len(losses)])  # type: ignore[arg-type]
        assert ("divergence_unguarded" in log.names()) is warned
        shown = "divergence: off: the job's heartbeats carry no loss" in render_status(core.status, running=True, now=0.0)
        assert shown is warned and (core.status.divergence_guard is not None) is warned

    @pytest.mark.parametrize("action", ["warn", "off"])
    def test_warn_and_off_do_not_stop(self, tmp_path: Path, action: str) -> None:
        core, fake, log, _ = diverging(tmp_path, f'action = "{action}"')
        core.begin(None)
        nan_beat(core, 141)
        assert not fake.signals and ("diverged" in log.names()) == (action == "warn")
        exit_job(core, fake, 0)
        assert core.status.state is State.COMPLETED

    def test_a_restarted_supervisor_keeps_the_open_divergence(self, tmp_path: Path) -> None:
        core, fake, log, _ = diverging(tmp_path)
        core.begin(None)
        nan_beat(core, 141)
        again = Core(core.cfg, fake, log)
        assert again.guard.open is not None and again.guard.open.onset_step == 141

    def test_a_supervisor_killed_before_the_rollback_makes_it_at_its_first_launch(self, tmp_path: Path) -> None:
        """Killed between the divergence and the relaunch: the next `run` relaunches from the last good checkpoint
        with the skip, as the killed one would have."""
        core, fake, log, root = diverging(tmp_path)
        core.begin(None)
        nan_beat(core, 141)
        again = Core(core.cfg, fake, log)
        again.begin(core.status)
        assert fake.spawned[-1].argv[-3:] == [str(root / "step_00000120"), "--skip-steps", "31"]
        assert fake.spawned[-1].env["FSDP_SUPERVISOR_SKIP_STEPS"] == "31"

    def test_a_spike_that_outlasts_the_skip_is_found_again_after_the_rollback(self, tmp_path: Path) -> None:
        """Bad data longer than the skip: the rolled-back attempt's first losses are the spike again. Its detector
        starts from the loss the resumed checkpoint recorded (1.0), not from nothing (which would take the spike
        for the level): a second `diverged`, and no save of it is a resume point."""
        core, fake, log, root = diverging(tmp_path, keep_last=3)
        shutil.rmtree(root / "step_00000120")
        write_checkpoint(root, 120, metrics={"loss": 1.0})
        core.begin(None)
        for step in range(121, 131):
            nan_beat(core, step, 1.0)
        for step in range(131, 134):
            nan_beat(core, step, 50.0)
        exit_job(core, fake, 0)
        fake.advance(0, core)
        assert len(fake.spawned) == 2 and log.names().count("diverged") == 1
        for step in range(141, 144):  # resumed at 120, 21 steps skipped: the spike goes on
            nan_beat(core, step, 50.0)
        assert log.names().count("diverged") == 2

    def test_a_supervisor_killed_before_marking_the_emergency_save_keeps_the_last_good_checkpoint(
            self, tmp_path: Path) -> None:
        """Killed after `diverged`, the job's emergency save (step 141) landed unmarked: keep_last = 1 would keep it
        alone, but the next `run`'s first pass keeps 120, marks 141 and rolls back to 120."""
        core, fake, log, root = diverging(tmp_path)
        core.begin(None)
        nan_beat(core, 130, 1.0)
        nan_beat(core, 141)
        write_checkpoint(root, 141)
        again = Core(core.cfg, fake, log)
        again.begin(core.status)
        assert (root / "step_00000120").is_dir() and is_quarantined(root / "step_00000141")
        assert fake.spawned[-1].argv[-3:] == [str(root / "step_00000120"), "--skip-steps", "31"]


def test_a_rollback_s_skip_keeps_the_spare_agent_and_the_warm_workers() -> None:
    """FSDP_SUPERVISOR_SKIP_STEPS is set per launch and read by the job after the hand-off: a spare started before
    the rollback (and its warm workers) still runs it."""
    from supervisor.host.spares import VOLATILE_ENV
    from trainer.warm_pool import stable_env

    env = {"PATH": "/usr/bin", "FSDP_SUPERVISOR_SKIP_STEPS": "0"}
    assert stable_env({**env, "FSDP_SUPERVISOR_SKIP_STEPS": "31"}, VOLATILE_ENV) == stable_env(env, VOLATILE_ENV)


def test_a_prune_by_hand_keeps_what_the_open_divergence_keeps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`checkpoints prune -c` while a divergence is open (onset 25, saves from 22 on diverged): keep_last = 1 would
    keep step 20 only; the last good (20) and the keep_last good one before it (10) stay, as the daemon keeps them."""
    cfg = tmp_path / "job.toml"
    cfg.write_text('[job]\ncommand = ["true"]\n[checkpoints]\ndir = "ckpts"\nkeep_last = 1\n')
    for step in (5, 10, 20, 26):
        write_checkpoint(tmp_path / "ckpts", step)
    quarantine(tmp_path / "ckpts" / "step_00000026", "diverged: after step 25")
    (tmp_path / ".fsdp-supervisor").mkdir()
    (tmp_path / ".fsdp-supervisor" / DIVERGENCE_FILE).write_text(json.dumps(
        Open(25, 25, None, None, "nan", 1, since=22).to_json()))
    assert top_cli.main(["checkpoints", "prune", "-c", str(cfg)]) == 0
    assert "deleted step_00000005" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == ["step_00000010", "step_00000020",
                                                                      "step_00000026"]


def test_the_open_divergence_is_read_like_any_run_dir_file(tmp_path: Path) -> None:
    """None when there is none; a planted FIFO or an oversized file is unreadable at once (OSError, ValueError),
    never a read that blocks the loop or the CLI."""
    assert read_open(tmp_path) is None
    (tmp_path / DIVERGENCE_FILE).write_text(json.dumps(Open(25, 25, None, None, "nan", 1, since=22).to_json()))
    op = read_open(tmp_path)
    assert op is not None and op.onset_step == 25 and op.since == 22
    (tmp_path / DIVERGENCE_FILE).write_text(" " * 5000 + "{}")
    with pytest.raises(ValueError, match="over 4096 bytes"):
        read_open(tmp_path)
    (tmp_path / DIVERGENCE_FILE).unlink()
    os.mkfifo(tmp_path / DIVERGENCE_FILE)
    with pytest.raises(OSError, match="not a regular file"):
        read_open(tmp_path)
