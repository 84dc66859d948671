"""The best checkpoint by a manifest metric: status's `best_checkpoint` and retention's `keep_best`, end to end.

Torch-free: checkpoints come from `tests.jobs.dcp_files` and from a plain user script that writes
its own `manifest.json` by hand (no trainer code), run under the real `fsdp-supervisor run`.
"""
from __future__ import annotations

import json
from pathlib import Path

from supervisor.checkpoints import KeepBest, quarantine, scan
from supervisor.daemon.housekeeping import best_checkpoint
from supervisor.daemon.statefile import read_status, write_status
from supervisor.observe.statusview import render_status
from supervisor.policy.state import State, Status
from tests.jobs.dcp_files import write_checkpoint


def root_with(tmp_path: Path, values: dict[int, dict[str, float]]) -> Path:
    root = tmp_path / "ckpts"
    for step, metrics in values.items():
        write_checkpoint(root, step, metrics=metrics)
    return root


class TestBestCheckpoint:
    def test_val_loss_min_without_keep_best(self, tmp_path) -> None:
        """No keep_best: the lowest val_loss; checkpoints without it are not candidates."""
        root = root_with(tmp_path, {1: {"loss": 0.1}, 2: {"val_loss": 2.0}, 3: {"val_loss": 1.5}, 4: {"val_loss": 1.7}})
        assert best_checkpoint(scan(root), None) == {"path": str(root / "step_00000003"), "step": 3,
                                                     "metric": "val_loss", "value": 1.5}

    def test_keep_best_metric_and_mode(self, tmp_path) -> None:
        """keep_best names the metric and the direction."""
        root = root_with(tmp_path, {1: {"acc": 0.5}, 2: {"acc": 0.9}, 3: {"acc": 0.7}})
        assert best_checkpoint(scan(root), KeepBest(metric="acc", mode="max", k=1))["step"] == 2  # type: ignore[index]

    def test_nothing_carries_the_metric(self, tmp_path) -> None:
        """Without the metric anywhere there is no best checkpoint."""
        root = root_with(tmp_path, {1: {"loss": 1.0}})
        assert best_checkpoint(scan(root), None) is None

    def test_quarantined_and_incomplete_are_not_candidates(self, tmp_path) -> None:
        """The best must be usable: a quarantined or torn checkpoint is skipped."""
        root = root_with(tmp_path, {1: {"val_loss": 1.0}, 2: {"val_loss": 0.5}, 3: {"val_loss": 0.7}, 4: {"val_loss": 0.9}})
        quarantine(root / "step_00000002", "crashed after loading")
        next((root / "step_00000003").glob("*.distcp")).unlink()
        assert best_checkpoint(scan(root), None)["step"] == 4  # type: ignore[index]

    def test_ties_go_to_the_first_to_reach_the_value(self, tmp_path) -> None:
        """Equal values (an emergency save repeats the last evaluation): the older checkpoint, the one the
        best-model export names, as keep_best keeps it."""
        root = root_with(tmp_path, {1: {"val_loss": 1.0}, 2: {"val_loss": 1.0}})
        assert best_checkpoint(scan(root), None)["step"] == 1  # type: ignore[index]

    def test_keep_best_k1_keeps_the_exported_one_over_a_later_emergency_save(self, tmp_path) -> None:
        """keep_best k=1 with keep_last=1: the evaluated save (step 20) survives the emergency save (step 23)
        that repeats its value; the newest (23) stays as newest complete."""
        from supervisor.checkpoints import DiskUsage, KeepBest, RetentionRules, plan_retention

        root = root_with(tmp_path, {10: {"val_loss": 2.0}, 20: {"val_loss": 1.0}, 23: {"val_loss": 1.0}})
        rules = RetentionRules(keep_last=1, keep_best=KeepBest(metric="val_loss", mode="min", k=1))
        plan = plan_retention(scan(root), rules=rules, disk=DiskUsage(10**15, 10**15), now=0.0)
        assert sorted(d.name for d in plan.deletions) == ["step_00000010"]


class TestStatus:
    BEST = {"path": "/c/step_00000040", "step": 40, "metric": "val_loss", "value": 1.23456}

    def test_round_trip_and_row(self, tmp_path) -> None:
        """best_checkpoint survives state.json and shows as one row."""
        write_status(tmp_path, Status(state=State.RUNNING, best_checkpoint=self.BEST))
        st = read_status(tmp_path)
        assert st is not None and st.best_checkpoint == self.BEST
        assert "best checkpoint: step 40 val_loss 1.235 /c/step_00000040" in render_status(st, running=True, now=0.0)

    def test_malformed_best_checkpoint_is_rejected(self, tmp_path) -> None:
        """A hand-edited best_checkpoint of the wrong shape makes state.json unreadable, not a crash in status."""
        (tmp_path / "state.json").write_text(json.dumps({"state": "running", "best_checkpoint": {"path": 3}}))
        assert read_status(tmp_path) is None

    def test_no_best_no_row(self) -> None:
        assert "best checkpoint" not in render_status(Status(state=State.RUNNING), running=True, now=0.0)
