"""Lightning's checkpoint names beyond `epoch=E-step=S.ckpt`, and a user's copies of them (torch-free, crafted files).

ModelCheckpoint names a save from its `filename` template plus `.ckpt` (`FILE_EXTENSION`): `{epoch}-{step}`
by default, any text with `auto_insert_metric_name=False` (`ckpt-{step}` gives `ckpt-30.ckpt`). A name that
goes on after `.ckpt` (`epoch=0-step=30.ckpt.bak`) is not Lightning's: it is someone's copy.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from supervisor.checkpoints import DiskUsage, RetentionRules, newest_complete, plan_retention, scan
from supervisor.checkpoints.naming import name_step
from supervisor.checkpoints.retention import GIB
from tests.jobs.dcp_files import lightning_meta, write_lightning_checkpoint

DISK = DiskUsage(total_bytes=1000 * GIB, free_bytes=900 * GIB)


def deleted(root: Path, *, settled: bool = False, **rules: object) -> set[str]:
    plan = plan_retention(scan(root), rules=RetentionRules(**rules), disk=DISK, now=time.time() + 1e6,
                          settled=settled)
    return {d.name for d in plan.deletions}


def saves(root: Path, steps: tuple[int, ...], name: str = "epoch=0-step={}.ckpt") -> Path:
    for s in steps:
        write_lightning_checkpoint(root, s, name=name.format(s), meta=lightning_meta(s, dirpath=root))
    return root


class TestCopiesOfLightningSaves:
    def test_a_name_going_on_after_ckpt_carries_no_step(self):
        """`step=` is Lightning's only inside a Lightning name, which ends in `.ckpt`."""
        assert name_step("epoch=0-step=30.ckpt") == 30 and name_step("epoch=0-step=30-v1.ckpt") == 30
        assert name_step("epoch=0-step=30.ckpt.bak") is None and name_step("epoch=0-step=30.ckpt.old") is None

    def test_a_copy_beside_its_original_is_foreign(self, tmp_path):
        """`cp -r epoch=0-step=30.ckpt epoch=0-step=30.ckpt.bak` was a second step-30 save: newer by mtime, it
        became the newest complete (the resume pick), keep_last counted it, and it was deleted as saves came."""
        root = saves(tmp_path / "ckpts", (10, 20, 30))
        shutil.copytree(root / "epoch=0-step=30.ckpt", root / "epoch=0-step=30.ckpt.bak")
        infos = {c.name: c for c in scan(root)}
        assert infos["epoch=0-step=30.ckpt.bak"].state == "foreign"
        assert newest_complete(root).name == "epoch=0-step=30.ckpt"
        assert deleted(root, keep_last=2) == {"epoch=0-step=10.ckpt"}
        shutil.rmtree(root / "epoch=0-step=30.ckpt")  # Lightning's top-k dropped the original: the copy stays
        assert deleted(root, keep_last=1) == {"epoch=0-step=10.ckpt"}

    def test_a_copy_cut_short_is_not_deleted_before_a_launch(self, tmp_path):
        """A half-made copy ranked above the newest complete save: the pass before a launch of a job that picks
        its own checkpoint deleted it as a torn save."""
        root = saves(tmp_path / "ckpts", (10, 20, 30))
        copy = root / "epoch=0-step=30.ckpt.bak"
        shutil.copytree(root / "epoch=0-step=30.ckpt", copy)
        shard = sorted(copy.glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[:3])
        assert "epoch=0-step=30.ckpt.bak" not in deleted(root, settled=True, keep_last=3)
        assert copy.is_dir()


class TestOtherFilenameTemplates:
    def test_a_step_without_step_equals_is_read_from_meta_pt(self, tmp_path):
        """`ModelCheckpoint(filename="ckpt-{step}", auto_insert_metric_name=False)` names `ckpt-30.ckpt`: every save
        was listed foreign ("a copy of a checkpoint of step 30"), so `{checkpoint}` resumed from nothing."""
        root = saves(tmp_path / "ckpts", (10, 20, 30), name="ckpt-{}.ckpt")
        assert [(c.name, c.state, c.step) for c in scan(root)] == [
            ("ckpt-30.ckpt", "complete", 30), ("ckpt-20.ckpt", "complete", 20), ("ckpt-10.ckpt", "complete", 10)]
        assert newest_complete(root).name == "ckpt-30.ckpt"
        assert deleted(root, keep_last=2) == {"ckpt-10.ckpt"}

    def test_a_link_to_such_a_save_has_its_step(self, tmp_path):
        """save_last="link" to `model-step000030.ckpt`: the link is an alias with the step of what it names."""
        root = saves(tmp_path / "ckpts", (10, 20, 30), name="model-step{:06d}.ckpt")
        os.symlink("model-step000030.ckpt", root / "last.ckpt")
        last = next(c for c in scan(root) if c.name == "last.ckpt")
        assert (last.state, last.step, last.alias_of) == ("complete", 30, "model-step000030.ckpt")
        assert newest_complete(root).name == "model-step000030.ckpt"
