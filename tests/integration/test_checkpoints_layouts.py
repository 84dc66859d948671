"""Tests for the layouts the store knows (shapes.py, naming.py, ranking.py): what is a checkpoint, what is not.

Where each on-disk layout comes from is said per test: the real DCP `.metadata` of the session fixture
`dcp_template` (a real `dcp.save`), or tests/jobs/accelerate_like.py, the torch-free reproduction of
Accelerate 1.16.0's `save_state()` that tests/clients checks against the real library's output.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor.checkpoints import (
    CheckpointDirectoryError,
    DiskUsage,
    RetentionRules,
    check_root,
    execute_retention,
    identify,
    judge,
    newest_complete,
    plan_retention,
    scan,
)
from supervisor.checkpoints.naming import name_step
from supervisor.checkpoints.retention import GIB
from supervisor.daemon.housekeeping import Housekeeper
from tests.fakes import RecordingLog
from tests.jobs.dcp_files import write_torch_file
from tests.supervise import REPO

ACCELERATE = REPO / "tests" / "jobs" / "accelerate_like.py"
MakeCheckpoint = Callable[[Path, str], Path]


def accelerate(project: Path, *args: object) -> Path:
    """Run the Accelerate reproduction (2 ranks, a save every 5 steps); returns its `checkpoints/` root."""
    subprocess.run([sys.executable, str(ACCELERATE), "--project-dir", str(project), "--step-s", "0",
                    *map(str, args)], cwd=REPO, capture_output=True, timeout=60)
    return project / "checkpoints"


@pytest.fixture(scope="module")
def accelerate_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One Accelerate run of 15 steps: checkpoint_0..2, each with trainer_state.json {"global_step": 5, 10, 15}."""
    return accelerate(tmp_path_factory.mktemp("accelerate") / "project", "--steps", 15)


@pytest.fixture
def acc_root(accelerate_run: Path, tmp_path: Path) -> Path:
    """A private copy of the Accelerate checkpoints folder."""
    return Path(shutil.copytree(accelerate_run, tmp_path / "project" / "checkpoints"))


def _rows(root: Path) -> list[tuple[str, str, int | None]]:
    return [(c.name, c.state, c.step) for c in scan(root)]


class TestForeign:
    @pytest.fixture
    def mixed_root(self, tmp_path: Path, make_checkpoint: MakeCheckpoint) -> Path:
        """Two real DCP checkpoints next to what people keep in the same folder (TensorBoard, exports)."""
        root = tmp_path / "ckpts"
        make_checkpoint(root, "step_10")
        make_checkpoint(root, "step_20")
        (root / "tensorboard" / "run1").mkdir(parents=True)
        (root / "tensorboard" / "run1" / "events.out.tfevents.1.host").write_bytes(b"x" * 4096)
        (root / "best").mkdir()
        (root / "best" / "model.safetensors").write_bytes(b"\0" * (2 << 20))
        (root / "best" / "best.json").write_text('{"step": 20, "loss": 0.5}')
        (root / "final_model").mkdir()
        (root / "final_model" / "config.json").write_text("{}")
        (root / "final_model" / "model.safetensors").write_bytes(b"\0" * 1024)
        for p in root.rglob("*"):
            os.utime(p, (0, 0))  # ancient: any age limit is long past
        return root

    def test_listed_as_foreign_with_a_reason_and_no_size(self, mixed_root):
        """tensorboard/, best/ (model.safetensors) and final_model/ are foreign: not partial, not sized."""
        foreign = {c.name: c for c in scan(mixed_root) if c.state == "foreign"}
        assert sorted(foreign) == ["best", "final_model", "tensorboard"]
        assert all(c.reason and "not a checkpoint" in c.reason and c.size_bytes == 0 and not c.complete
                   for c in foreign.values())

    def test_never_deleted_by_any_rule(self, mixed_root):
        """keep_last=1, partial_max_age_s=0 and an unmeetable disk floor: only the older checkpoint goes."""
        rules = RetentionRules(keep_last=1, partial_max_age_s=0, min_free_gb=1e9)
        plan = plan_retention(scan(mixed_root), rules=rules, disk=DiskUsage(GIB, 0), now=1e10)
        assert [d.name for d in plan.deletions] == ["step_10"]
        execute_retention(mixed_root, plan)
        assert sorted(os.listdir(mixed_root)) == ["best", "final_model", "step_20", "tensorboard"]
        assert (mixed_root / "best" / "model.safetensors").stat().st_size == 2 << 20

    def test_not_counted_against_max_total_gb(self, mixed_root):
        """A 2 MiB export in the root does not push the checkpoints over a 1 MiB budget."""
        rules = RetentionRules(keep_last=0, max_total_gb=1 / 1024)
        plan = plan_retention(scan(mixed_root), rules=rules, disk=DiskUsage(GIB, GIB), now=1e10)
        assert plan.deletions == [] and plan.findings == []

    def test_daemon_pass_neither_counts_nor_deletes_them(self, mixed_root, tmp_path):
        """The daemon's housekeeping pass over the same root: checkpoint_bytes is the two checkpoints only."""
        house = _housekeeper(tmp_path, mixed_root, "keep_last = 1\npartial_max_age_s = 0\n")
        result = house.run_pass(generation=0, protect=())
        assert result.error is None and [d.name for d in result.deleted] == ["step_10"]
        assert result.checkpoint_bytes == sum(f.stat().st_size for f in (mixed_root / "step_20").iterdir())
        assert {"best", "final_model", "tensorboard"} <= set(os.listdir(mixed_root))

    def test_dcp_dirs_in_a_folder_not_named_like_a_checkpoint_are_foreign(self, tmp_path, make_checkpoint):
        """`exports/llama/` and `exports/bert/` (real DCP dirs copied by hand) are no Accelerate checkpoint: the
        folder is foreign, never deleted by keep_last=1, and never resumed from."""
        root = tmp_path / "ckpts"
        make_checkpoint(root, "step_10")
        make_checkpoint(root, "step_20")
        make_checkpoint(root / "exports", "llama")
        make_checkpoint(root / "exports", "bert")
        infos = {c.name: c for c in scan(root)}
        assert infos["exports"].state == "foreign" and "not named like a checkpoint" in infos["exports"].reason
        plan = plan_retention(scan(root), rules=RetentionRules(keep_last=1), disk=DiskUsage(GIB, GIB), now=1e10)
        assert [d.name for d in plan.deletions] == ["step_10"]


class TestNested:
    """Accelerate's `checkpoint_N/` (tests/jobs/accelerate_like.py: same names, files and write order)."""

    def test_complete_with_the_ordinal_and_the_sidecar_step(self, acc_root):
        """Each checkpoint_N is complete; it ranks by N and shows the step from trainer_state.json."""
        infos = scan(acc_root)
        assert [(c.name, c.state, c.ordinal, c.step) for c in infos] == [
            ("checkpoint_2", "complete", 2, 15), ("checkpoint_1", "complete", 1, 10), ("checkpoint_0", "complete", 0, 5)]
        assert infos[0].size_bytes == sum(f.stat().st_size for f in (acc_root / "checkpoint_2").rglob("*") if f.is_file())
        assert newest_complete(acc_root).name == "checkpoint_2"

    def test_without_a_sidecar_the_step_is_unknown(self, acc_root):
        """No pickle-free step: `step` is None and the ordinal still ranks it."""
        (acc_root / "checkpoint_2" / "trainer_state.json").unlink()
        newest = scan(acc_root)[0]
        assert (newest.name, newest.step, newest.ordinal, newest.state) == ("checkpoint_2", None, 2, "complete")

    def test_ordinal_ranks_past_the_tenth_save(self, acc_root):
        """checkpoint_10 is newer than checkpoint_9 (numbers, not strings)."""
        shutil.copytree(acc_root / "checkpoint_2", acc_root / "checkpoint_10")
        shutil.copytree(acc_root / "checkpoint_2", acc_root / "checkpoint_9")
        assert [c.name for c in scan(acc_root)][:2] == ["checkpoint_10", "checkpoint_9"]

    def test_save_cut_between_members_is_partial(self, tmp_path):
        """Killed after the model's `.metadata`, before the optimizer: partial, naming the missing member."""
        root = accelerate(tmp_path / "project", "--steps", 15, "--die-at-save", 15,
                          "--die-after", "pytorch_model_fsdp_0/.metadata")
        assert sorted(p.name for p in (root / "checkpoint_2").iterdir()) == ["pytorch_model_fsdp_0"]
        cut = scan(root)[0]
        assert (cut.name, cut.state) == ("checkpoint_2", "partial")
        assert "optimizer_0 missing (checkpoint_1 has it)" in cut.reason
        assert newest_complete(root).name == "checkpoint_1"
        assert judge(root / "checkpoint_2").state == "partial"  # `checkpoints verify` says the same

    def test_save_cut_inside_a_member_is_partial(self, tmp_path):
        """Killed after the optimizer's first shard: that member has no `.metadata` yet."""
        root = accelerate(tmp_path / "project", "--steps", 10, "--die-at-save", 10,
                          "--die-after", "optimizer_0/__0_0.distcp")
        cut = scan(root)[0]
        assert (cut.name, cut.state) == ("checkpoint_1", "partial") and cut.reason.startswith("optimizer_0: no .metadata")

    def test_different_member_set_than_the_sibling_is_partial(self, acc_root):
        """A folder whose DCP dirs are not those of its newest complete sibling lacks one of them: partial."""
        (acc_root / "checkpoint_2" / "optimizer_0").rename(acc_root / "checkpoint_2" / "optimizer_1")
        infos = {c.name: c for c in scan(acc_root)}
        assert infos["checkpoint_2"].state == "partial" and "optimizer_0 missing" in infos["checkpoint_2"].reason
        assert infos["checkpoint_1"].state == "complete" and newest_complete(acc_root).name == "checkpoint_1"

    def test_oldest_folder_is_held_against_the_nearest_newer_one(self, acc_root):
        """A cut oldest folder has no older sibling: its reference is the nearest newer one."""
        shutil.rmtree(acc_root / "checkpoint_0" / "optimizer_0")
        assert [c.state for c in scan(acc_root)] == ["complete", "complete", "partial"]

    def test_a_layout_change_confirmed_by_a_newer_save_is_complete(self, acc_root):
        """The optimizer dropped from the script: once two saves agree on the new members, both are complete."""
        for name in ("checkpoint_1", "checkpoint_2"):
            shutil.rmtree(acc_root / name / "optimizer_0")
        assert [c.state for c in scan(acc_root)] == ["complete", "complete", "complete"]
        shutil.rmtree(acc_root / "checkpoint_2")
        assert [c.state for c in scan(acc_root)] == ["partial", "complete"]  # one save alone is a cut

    def test_symlinked_member_is_invalid_not_a_cut_save(self, acc_root):
        """A member that is a symlink to another save's member (deduplicated by hand) loads fine: it was
        'missing' (partial), so the newest save was deleted after partial_max_age_s. Now invalid: kept."""
        (acc_root / "checkpoint_2" / "optimizer_0").rename(acc_root.parent / "optimizer_0")
        (acc_root / "checkpoint_2" / "optimizer_0").symlink_to("../checkpoint_1/optimizer_0")
        for p in acc_root.rglob("*"):
            os.utime(p, (0, 0), follow_symlinks=False)
        newest = scan(acc_root)[0]
        assert (newest.name, newest.state) == ("checkpoint_2", "invalid")
        assert "optimizer_0 is a symlink" in newest.reason
        plan = plan_retention(scan(acc_root), rules=RetentionRules(keep_last=1, partial_max_age_s=0),
                              disk=DiskUsage(total_bytes=10 * GIB, free_bytes=10 * GIB), now=1e9)
        assert "checkpoint_2" not in {Path(d.path).name for d in plan.deletions}

    def test_torn_member_makes_the_folder_torn(self, acc_root):
        """A short shard in one member: the folder is torn and the reason names member and shard."""
        shard = acc_root / "checkpoint_2" / "optimizer_0" / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[:2])
        newest = scan(acc_root)[0]
        assert newest.state == "torn" and newest.reason.startswith("optimizer_0: shard __1_0.distcp is short")

    def test_lone_folder_is_judged_on_its_own(self, tmp_path, make_checkpoint: MakeCheckpoint):
        """One nested DCP dir (real dcp.save) and no sibling: complete."""
        make_checkpoint(tmp_path / "ckpts" / "checkpoint_0", "pytorch_model_fsdp_0")
        (info,) = scan(tmp_path / "ckpts")
        assert (info.state, info.ordinal) == ("complete", 0)

    def test_two_levels_down_counts(self, tmp_path, make_checkpoint: MakeCheckpoint):
        """DCP dirs two levels below the folder are its members too."""
        root = tmp_path / "ckpts"
        make_checkpoint(root / "checkpoint_0" / "model", "fsdp")
        make_checkpoint(root / "checkpoint_0" / "optim", "fsdp")
        (info,) = scan(root)
        assert info.state == "complete" and identify(root / "checkpoint_0").members == {"model/fsdp", "optim/fsdp"}

    def test_a_new_nested_commit_is_progress(self, acc_root, tmp_path):
        """The daemon's pass sees a new checkpoint_N as a commit, even before its step is known."""
        house = _housekeeper(tmp_path, acc_root, "keep_last = 0\n")
        assert house.absorb(house.run_pass(generation=0, protect=())) is None  # the baseline
        shutil.copytree(acc_root / "checkpoint_2", acc_root / "checkpoint_3")
        (acc_root / "checkpoint_3" / "trainer_state.json").unlink()  # the script writes it after save_state()
        new = house.absorb(house.run_pass(generation=1, protect=()))
        assert new is not None and (new.name, new.step, new.ordinal) == ("checkpoint_3", None, 3)
        assert house.concerns(acc_root / "checkpoint_3" / "trainer_state.json")


class TestOtherLayouts:
    def test_torchtitan_step_dirs(self, tmp_path, make_checkpoint: MakeCheckpoint):
        """torchtitan's `step-N` (flat DCP, real dcp.save): complete, step N, newest by N."""
        root = tmp_path / "checkpoint"
        for n in (5, 10, 15):
            make_checkpoint(root, f"step-{n}")
        assert _rows(root) == [("step-15", "complete", 15), ("step-10", "complete", 10), ("step-5", "complete", 5)]

    def test_lightning_sharded_dirs_rank_by_step_not_epoch(self, tmp_path, make_checkpoint: MakeCheckpoint):
        """Lightning's `epoch=E-step=S.ckpt/` (DCP files + meta.pt): step S; epoch 2 of a short epoch is older."""
        root = tmp_path / "lightning"
        for name in ("epoch=0-step=900.ckpt", "epoch=2-step=300.ckpt", "epoch=1-step=600.ckpt"):
            write_torch_file(make_checkpoint(root, name) / "meta.pt", {"global_step": name_step(name)})
        assert _rows(root) == [("epoch=0-step=900.ckpt", "complete", 900), ("epoch=1-step=600.ckpt", "complete", 600),
                               ("epoch=2-step=300.ckpt", "complete", 300)]


class TestRootTooHigh:
    @pytest.fixture
    def outputs(self, tmp_path: Path, make_checkpoint: MakeCheckpoint) -> Path:
        """torchtitan's dump folder set as the root: checkpoint/step-10, step-20 next to its logs."""
        out = tmp_path / "outputs"
        make_checkpoint(out / "checkpoint", "step-10")
        make_checkpoint(out / "checkpoint", "step-20")
        for name in ("structured_logs", "comm_traces", "tb"):
            (out / name).mkdir()
            (out / name / "rank0.log").write_text("x")
        for p in out.rglob("*"):
            os.utime(p, (0, 0))
        return out

    def test_scan_and_check_root_name_the_folder_meant(self, outputs):
        """The error names the checkpoint directory and the dir the user probably meant."""
        expected = (f"checkpoint root {outputs} holds a checkpoint directory ({outputs}/checkpoint with step-10, "
                    f'step-20): did you mean [checkpoints] dir = "{outputs}/checkpoint"?')
        for look in (scan, newest_complete, check_root):
            with pytest.raises(CheckpointDirectoryError) as err:
                look(outputs)
            assert str(err.value) == expected and err.value.exit_code == 2

    def test_two_levels_too_high_names_the_folder_meant(self, outputs):
        """The folder above the dump folder as root: the error names `outputs/checkpoint`, nothing is one checkpoint."""
        with pytest.raises(CheckpointDirectoryError) as err:
            scan(outputs.parent)
        assert f'did you mean [checkpoints] dir = "{outputs}/checkpoint"?' in str(err.value)

    def test_daemon_pass_deletes_nothing(self, outputs, tmp_path):
        """A housekeeping pass over it reports the error and deletes nothing, whatever the rules."""
        before = sorted(str(p) for p in outputs.rglob("*"))
        house = _housekeeper(tmp_path, outputs, "keep_last = 1\npartial_max_age_s = 0\nmin_free_gb = 1e9\n")
        result = house.run_pass(generation=0, protect=())
        assert "did you mean" in result.error and result.deleted == []
        assert sorted(str(p) for p in outputs.rglob("*")) == before

    def test_accelerate_project_dir_as_root(self, acc_root):
        """Accelerate's project dir instead of its checkpoints/ folder: same error."""
        with pytest.raises(CheckpointDirectoryError, match=r"with checkpoint_0, checkpoint_1, checkpoint_2\)"):
            check_root(acc_root.parent)

    def test_the_right_root_is_fine(self, outputs):
        """One level down it is an ordinary root."""
        check_root(outputs / "checkpoint")
        assert [c.name for c in scan(outputs / "checkpoint")] == ["step-20", "step-10"]

    def test_one_checkpoint_inside_another_folder_is_foreign(self, tmp_path, make_checkpoint: MakeCheckpoint):
        """A single checkpoint-named dir inside a folder (a copy in `best/`) is no series: foreign, not an error."""
        root = tmp_path / "ckpts"
        make_checkpoint(root, "step_10")
        make_checkpoint(root / "best", "step_5")
        infos = {c.name: c for c in scan(root)}
        assert infos["best"].state == "foreign" and "step_5" in infos["best"].reason


def _housekeeper(tmp_path: Path, root: Path, rules: str) -> Housekeeper:
    from supervisor.config import load_config

    cfg_path = tmp_path / "job.toml"
    cfg_path.write_text(f'[job]\ncommand = ["true"]\n\n[checkpoints]\ndir = {json.dumps(str(root))}\n{rules}')
    return Housekeeper(load_config(cfg_path), RecordingLog(), now=lambda: 1e10)
