"""The fast reproductions of torchtitan and Accelerate (tests/jobs/*_like.py) behave as the real programs do.

Part of `make test` (no torchtitan or Accelerate needed; torch-free, well under a second per run). The
layouts they must write are tests/clients/layouts.py, which the real-client tier checks against the real
programs; the resume rules and the kill-mid-save leftovers follow the source cited in each script.
TestUnderTheSupervisor then runs them under the real `fsdp-supervisor run` (a few seconds per test): the
resume point each one gets (`{step}`, `{checkpoint}`) or picks itself (`resume_args = []`) after a kill
mid-run or mid-save and over a torn newest, and that nothing of the supervisor's appears in their folders.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.checkpoints import scan, verify
from tests.clients.harness import SupervisedClient
from tests.clients.layouts import ACCELERATE_ENTRY, ACCELERATE_FILES, TITAN_ENTRY, TITAN_FILES, layout_problems, tree
from tests.supervise import REPO, Supervisors, launches, supervisors  # noqa: F401

TITAN = REPO / "tests" / "jobs" / "titan_like.py"
ACCELERATE = REPO / "tests" / "jobs" / "accelerate_like.py"


def run(script: Path, *args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                          timeout=60, cwd=REPO)


def complete(path: Path) -> bool:
    """The store's verdict (in-process: the store is torch-free)."""
    return verify(path).complete


class TestTitanLike:
    def titan(self, tmp_path: Path, *args: object) -> subprocess.CompletedProcess[str]:
        return run(TITAN, "--dump_folder", tmp_path / "dump", "--marker", tmp_path / "marks", *args)

    def test_writes_torchtitans_layout(self, tmp_path: Path) -> None:
        """step-5 ... step-20 (the last step always saves), each one flat DCP dir of the real file names."""
        assert self.titan(tmp_path, "--training.steps", 20).returncode == 0
        root = tmp_path / "dump" / "checkpoint"
        assert sorted(p.name for p in root.iterdir()) == ["step-10", "step-15", "step-20", "step-5"]
        assert layout_problems(root, TITAN_ENTRY, TITAN_FILES) == []
        assert complete(root / "step-20")

    def test_keep_latest_k_purges_by_name_only(self, tmp_path: Path) -> None:
        """_purge_stale_checkpoints keeps the k highest `step-N` names, whatever they hold."""
        (tmp_path / "dump" / "checkpoint" / "step-99").mkdir(parents=True)  # a partial dir counts as one
        assert self.titan(tmp_path, "--training.steps", 20, "--checkpoint.keep_latest_k", 2).returncode == 0
        assert sorted(p.name for p in (tmp_path / "dump" / "checkpoint").iterdir()) == ["step-20", "step-99"]

    def test_resumes_from_its_newest_step_with_metadata(self, tmp_path: Path) -> None:
        """Its own pick: the highest step-N holding `.metadata`; a dir without it is passed over."""
        self.titan(tmp_path, "--training.steps", 10)
        (tmp_path / "dump" / "checkpoint" / "step-10" / ".metadata").unlink()
        assert self.titan(tmp_path, "--training.steps", 12).returncode == 0
        assert [(m["loaded"], m["start"]) for m in launches(tmp_path / "marks")] == [(None, 1), ("step-5", 6)]

    def test_load_step_overrides_its_pick(self, tmp_path: Path) -> None:
        self.titan(tmp_path, "--training.steps", 10)
        assert self.titan(tmp_path, "--training.steps", 10, "--checkpoint.load_step", 5).returncode == 0
        assert launches(tmp_path / "marks")[-1]["loaded"] == "step-5"

    def test_torn_newest_is_loaded_and_crashes(self, tmp_path: Path) -> None:
        """A cut shard under a present `.metadata`: torchtitan picks it anyway and the load fails."""
        self.titan(tmp_path, "--training.steps", 10)
        shard = tmp_path / "dump" / "checkpoint" / "step-10" / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        done = self.titan(tmp_path, "--training.steps", 20)
        assert done.returncode == 1 and "Loading the checkpoint from" in done.stdout and "CheckpointException" in done.stderr

    def test_unreplaced_placeholder_is_a_usage_error(self, tmp_path: Path) -> None:
        """`--checkpoint.load_step {step}` passed literally: exit 2 before anything loads (tyro does the same)."""
        assert self.titan(tmp_path, "--checkpoint.load_step", "{step}").returncode == 2

    def test_kill_mid_save_leaves_shards_without_metadata(self, tmp_path: Path) -> None:
        """Killed after the shards, before `.metadata`: not complete for the store, passed over on resume."""
        done = self.titan(tmp_path, "--training.steps", 20, "--die-at-save", 10, "--die-after", "__1_0.distcp")
        assert done.returncode == -9
        step10 = tmp_path / "dump" / "checkpoint" / "step-10"
        assert tree(step10) == {"__0_0.distcp", "__1_0.distcp"}
        assert not complete(step10)
        self.titan(tmp_path, "--training.steps", 12)
        assert launches(tmp_path / "marks")[-1]["loaded"] == "step-5"


class TestAccelerateLike:
    def accelerate(self, tmp_path: Path, *args: object) -> subprocess.CompletedProcess[str]:
        return run(ACCELERATE, "--project-dir", tmp_path / "project", "--marker", tmp_path / "marks", *args)

    def root(self, tmp_path: Path) -> Path:
        return tmp_path / "project" / "checkpoints"

    def test_writes_accelerates_layout_and_keeps_total_limit(self, tmp_path: Path) -> None:
        """checkpoint_<save ordinal>, nested DCP dirs plus Accelerate's files; total_limit = 3 keeps 3."""
        assert self.accelerate(tmp_path, "--steps", 30, "--total-limit", 3).returncode == 0
        root = self.root(tmp_path)
        assert sorted(p.name for p in root.iterdir()) == ["checkpoint_3", "checkpoint_4", "checkpoint_5"]
        assert layout_problems(root, ACCELERATE_ENTRY, ACCELERATE_FILES) == []
        assert json.loads((root / "checkpoint_5" / "trainer_state.json").read_text()) == {"global_step": 30}
        for sub in ("pytorch_model_fsdp_0", "optimizer_0"):
            assert complete(root / "checkpoint_5" / sub)

    def test_resumes_from_the_highest_number(self, tmp_path: Path) -> None:
        self.accelerate(tmp_path, "--steps", 10)
        assert self.accelerate(tmp_path, "--steps", 15).returncode == 0
        assert [(m["loaded"], m["start"]) for m in launches(tmp_path / "marks")] == [(None, 1), ("checkpoint_1", 11)]
        assert (self.root(tmp_path) / "checkpoint_2").is_dir()  # iteration continues after the newest

    def test_a_foreign_entry_breaks_load_state(self, tmp_path: Path) -> None:
        """load_state sorts every entry by its trailing number: `.trash` has none -> IndexError."""
        self.accelerate(tmp_path, "--steps", 10)
        (self.root(tmp_path) / ".trash").mkdir()
        done = self.accelerate(tmp_path, "--steps", 15)
        assert done.returncode == 1 and "IndexError" in done.stderr

    def test_a_foreign_entry_breaks_total_limit_cleanup(self, tmp_path: Path) -> None:
        """save_state's cleanup sorts the same way: with total_limit set, the next save dies too."""
        self.accelerate(tmp_path, "--steps", 10, "--total-limit", 3)
        (self.root(tmp_path) / ".trash").mkdir()
        done = self.accelerate(tmp_path, "--steps", 15, "--total-limit", 3, "--resume-from",
                               self.root(tmp_path) / "checkpoint_1")
        assert done.returncode == 1 and "IndexError" in done.stderr and "save_state" in done.stderr

    def test_kill_mid_save_leaves_complete_nested_dirs_and_crashes_the_next_start(self, tmp_path: Path) -> None:
        """Killed after optimizer_0/.metadata: both nested DCP dirs complete, Accelerate's files missing;
        total_limit already removed the oldest before the save; load_state picks the partial one and fails."""
        done = self.accelerate(tmp_path, "--steps", 20, "--total-limit", 2, "--die-at-save", 15,
                               "--die-after", "optimizer_0/.metadata")
        assert done.returncode == -9
        root = self.root(tmp_path)
        assert sorted(p.name for p in root.iterdir()) == ["checkpoint_1", "checkpoint_2"]
        partial = root / "checkpoint_2"
        assert ACCELERATE_FILES - tree(partial) == {"scheduler.bin", "random_states_0.pkl", "random_states_1.pkl",
                                                    "custom_checkpoint_0.pkl", "trainer_state.json"}
        assert all(complete(partial / sub) for sub in ("pytorch_model_fsdp_0", "optimizer_0"))
        crashed = self.accelerate(tmp_path, "--steps", 20, "--total-limit", 2)
        assert crashed.returncode == 1 and "scheduler.bin" in crashed.stderr
        resumed = self.accelerate(tmp_path, "--steps", 20, "--total-limit", 2, "--resume-from", root / "checkpoint_1")
        assert resumed.returncode == 0
        assert [(m["loaded"], m["start"]) for m in launches(tmp_path / "marks")][-1] == ("checkpoint_1", 11)


class TestExampleConfigs:
    def test_torchtitan_example_passes_the_step_and_watches_the_checkpoint_folder(self) -> None:
        """deploy/examples/torchtitan.toml loads; the root is <dump_folder>/checkpoint, not the dump folder."""
        from supervisor.config import load_config

        cfg = load_config(REPO / "deploy" / "examples" / "torchtitan.toml")
        dump = cfg.job.command[cfg.job.command.index("--dump_folder") + 1]
        assert cfg.job.resume_args == ["--checkpoint.load_step", "{step}"]
        assert cfg.checkpoints.dir == Path(dump) / "checkpoint"

    def test_accelerate_example_passes_the_supervisors_pick_and_watches_the_checkpoints_folder(self) -> None:
        from supervisor.config import load_config

        cfg = load_config(REPO / "deploy" / "examples" / "accelerate.toml")
        project = cfg.job.command[cfg.job.command.index("--project-dir") + 1]
        assert cfg.job.resume_args == ["--resume-from", "{checkpoint}"]  # what the real tier runs
        assert cfg.checkpoints.dir == Path(project) / "checkpoints"

    def test_lightning_example_resumes_by_itself_in_its_dirpath(self) -> None:
        """deploy/examples/lightning.toml loads; Lightning's own ckpt_path="last", the root is ModelCheckpoint's dirpath."""
        from supervisor.config import load_config

        cfg = load_config(REPO / "deploy" / "examples" / "lightning.toml")
        assert cfg.job.resume_args == [] and cfg.checkpoints.keep_last == 2  # what the real tier runs
        assert str(cfg.checkpoints.dir) == cfg.job.command[cfg.job.command.index("--ckpt-dir") + 1]

    def test_hf_trainer_example_passes_the_supervisors_pick_and_watches_output_dir(self) -> None:
        from supervisor.config import load_config

        cfg = load_config(REPO / "deploy" / "examples" / "hf_trainer.toml")
        assert cfg.job.resume_args == ["--resume_from_checkpoint", "{checkpoint}"]
        assert str(cfg.checkpoints.dir) == cfg.job.command[cfg.job.command.index("--output_dir") + 1]


# ---- the reproductions under the real `fsdp-supervisor run` ---------------------------------------------------------
FAST = "\n[restart]\nbackoff_initial_s = 0.05\nbackoff_max_s = 0.2\n"
GIVE_UP = FAST + "max_no_progress_restarts = 1\n"


def supervised(sups: Supervisors, tmp_path: Path, command: list[object], resume_args: list[str], root: Path,
               toml: str) -> SupervisedClient:
    """`fsdp-supervisor run` of a reproduction (the harness of the real-client tier, without torchrun)."""
    return SupervisedClient(sups, tmp_path, command=[sys.executable, *map(str, command)], resume_args=resume_args,
                            checkpoint_dir=root, extra_toml=toml).start()


def claims(job: SupervisedClient) -> list[tuple[str | None, int | None]]:
    """(resumed_from's name, resumed_step) of every launch, as the supervisor logged it."""
    return [(e["resumed_from"] and Path(e["resumed_from"]).name, e["resumed_step"]) for e in job.events("job_started")]


def listing(root: Path) -> list[tuple[str, str, int | None]]:
    """(name, state, step) of every entry of the root, oldest first, as `checkpoints list` shows them."""
    return [(c.name, c.state, c.step) for c in reversed(scan(root))]


@pytest.mark.integration
class TestUnderTheSupervisor:
    """torchtitan's and Accelerate's resume rules against the real supervisor, in seconds."""

    def titan_root(self, tmp_path: Path, *, torn: int) -> Path:
        """step-5 ... step-`torn` written by the reproduction, the newest with its rank-1 shard cut in half."""
        run(TITAN, "--dump_folder", tmp_path / "dump", "--training.steps", torn)
        root = tmp_path / "dump" / "checkpoint"
        shard = root / f"step-{torn}" / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        return root

    def test_titan_loads_the_supervisors_pick_by_step(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """Torn newest step-10: `--checkpoint.load_step 5`; killed mid-save of step-15 (shards, no .metadata):
        `--checkpoint.load_step 10` (the step-10 the job re-saved in place); nothing of ours in the folder."""
        root, marks = self.titan_root(tmp_path, torn=10), tmp_path / "marks"
        job = supervised(supervisors, tmp_path, [TITAN, "--dump_folder", tmp_path / "dump", "--training.steps", 20,
                                                  "--marker", marks, "--die-at-save", 15, "--die-after",
                                                  "__1_0.distcp", "--die-attempt", 1],
                         ["--checkpoint.load_step", "{step}"], root, "keep_last = 0\n" + FAST)
        assert job.wait_exit(60) == 0, job.tails()
        assert claims(job) == [("step-5", 5), ("step-10", 10)]
        assert [(m["loaded"], m["start"], m["argv"][-2:]) for m in launches(marks)] == [
            ("step-5", 6, ["--checkpoint.load_step", "5"]), ("step-10", 11, ["--checkpoint.load_step", "10"])]
        assert listing(root) == [(f"step-{s}", "complete", s) for s in (5, 10, 15, 20)]
        assert layout_problems(root, TITAN_ENTRY, TITAN_FILES) == []

    def test_titan_picking_its_own_newest_gets_the_torn_one_cleared_first(
            self, tmp_path: Path, supervisors: Supervisors) -> None:
        """resume_args = []: torchtitan would load its torn step-10 on every launch. The job is down and picks its
        own checkpoint, so the supervisor deletes step-10 before the launch; torchtitan loads step-5 by itself
        and finishes. No resume point is claimed, nothing is quarantined."""
        root = self.titan_root(tmp_path, torn=10)
        job = supervised(supervisors, tmp_path, [TITAN, "--dump_folder", tmp_path / "dump", "--training.steps", 20],
                         [], root, "keep_last = 0\n" + GIVE_UP)
        assert job.wait_exit(60) == 0, job.tails()
        assert f"Loading the checkpoint from {root / 'step-5'}." in job.attempt_logs()[0]
        gone = job.events("retention_deleted")
        assert [Path(e["path"]).name for e in gone] == ["step-10"] and "would load" in gone[0]["reason"]
        assert claims(job) == [(None, None)] and job.state().get("quarantined") in (None, [])
        assert listing(root) == [(f"step-{s}", "complete", s) for s in (5, 10, 15, 20)]

    def test_titan_picking_its_torn_newest_itself_is_not_blamed_on_good_checkpoints(
            self, tmp_path: Path, supervisors: Supervisors) -> None:
        """resume_args = [] on a node that does not prune (prune = false): nothing is cleared, torchtitan loads its
        torn step-10 on every launch; the supervisor gives up (3) claiming no resume point, quarantining nothing,
        with the job's CheckpointException as the detail."""
        root = self.titan_root(tmp_path, torn=10)
        job = supervised(supervisors, tmp_path, [TITAN, "--dump_folder", tmp_path / "dump", "--training.steps", 20],
                         [], root, "prune = false\n" + GIVE_UP)
        assert job.wait_exit(60) == 3, job.tails()
        logs = job.attempt_logs()
        assert len(logs) == 2 and all(f"Loading the checkpoint from {root / 'step-10'}." in log for log in logs)
        assert claims(job) == [(None, None), (None, None)]
        assert job.state().get("quarantined") in (None, []) and listing(root)[0] == ("step-5", "complete", 5)
        assert "CheckpointException" in (job.state()["last_exit"]["detail"] or "")

    def accelerate(self, tmp_path: Path, *args: object) -> list[object]:
        return [ACCELERATE, "--project-dir", tmp_path / "project", "--marker", tmp_path / "marks", *args]

    def test_accelerate_loads_the_supervisors_pick_past_a_save_cut_short(
            self, tmp_path: Path, supervisors: Supervisors) -> None:
        """Killed mid-save of checkpoint_2 (optimizer_0 without .metadata): `--resume-from .../checkpoint_1`,
        step 10 from its trainer_state.json; the job numbers on after the partial one; keep_last = 3."""
        root = tmp_path / "project" / "checkpoints"
        job = supervised(supervisors, tmp_path, self.accelerate(tmp_path, "--steps", 20, "--die-at-save", 15,
                                                                 "--die-after", "optimizer_0/__1_0.distcp",
                                                                 "--die-attempt", 1),
                         ["--resume-from", "{checkpoint}"], root, "keep_last = 3\n" + FAST)
        assert job.wait_exit(60) == 0, job.tails()
        assert claims(job) == [(None, None), ("checkpoint_1", 10)]
        assert [(m["loaded"], m["start"]) for m in launches(tmp_path / "marks")] == [(None, 1), ("checkpoint_1", 11)]
        # keep_last = 3 deleted checkpoint_0 (into a trash next to the root); the partial one is left for
        # partial_max_age_s; nothing else is in the folder
        assert listing(root) == [("checkpoint_1", "complete", 10), ("checkpoint_2", "partial", None),
                                 ("checkpoint_3", "complete", 15), ("checkpoint_4", "complete", 20)]
        assert sorted(os.listdir(root)) == ["checkpoint_1", "checkpoint_2", "checkpoint_3", "checkpoint_4"]

    def test_accelerate_load_state_sorts_a_root_the_supervisor_pruned(
            self, tmp_path: Path, supervisors: Supervisors) -> None:
        """resume_args = [] and keep_last = 1: the supervisor deletes checkpoint_0 (its trash is next to the
        root), so Accelerate's own load_state(), which sorts every entry by its number, resumes after a crash."""
        root = tmp_path / "project" / "checkpoints"
        job = supervised(supervisors, tmp_path, self.accelerate(tmp_path, "--steps", 20, "--die-at-step", 12,
                                                                 "--die-attempt", 1),
                         [], root, "keep_last = 1\n" + FAST)
        assert job.wait_exit(60) == 0, job.tails()
        assert [(m["loaded"], m["start"]) for m in launches(tmp_path / "marks")] == [(None, 1), ("checkpoint_1", 11)]
        assert claims(job) == [(None, None), (None, None)]
        assert os.listdir(root) == ["checkpoint_3"] and listing(root) == [("checkpoint_3", "complete", 20)]

    def test_accelerate_load_state_is_not_relaunched_onto_a_save_cut_short(
            self, tmp_path: Path, supervisors: Supervisors) -> None:
        """resume_args = []: load_state() takes the highest number, which after a kill mid-save is the partial
        checkpoint_2. The supervisor deletes it before the relaunch (the job is down: nothing in flight), so
        load_state() picks checkpoint_1 and the job numbers on; no resume point is claimed."""
        root = tmp_path / "project" / "checkpoints"
        job = supervised(supervisors, tmp_path, self.accelerate(tmp_path, "--steps", 20, "--die-at-save", 15,
                                                                 "--die-after", "optimizer_0/__1_0.distcp",
                                                                 "--die-attempt", 1),
                         [], root, GIVE_UP)
        assert job.wait_exit(60) == 0, job.tails()
        assert [(m["loaded"], m["start"]) for m in launches(tmp_path / "marks")] == [(None, 1), ("checkpoint_1", 11)]
        assert claims(job) == [(None, None)] * 2 and job.state().get("quarantined") in (None, [])
        cleared = [Path(e["path"]).name for e in job.events("retention_deleted") if "would load" in e["reason"]]
        assert cleared == ["checkpoint_2"]
        assert listing(root)[-2:] == [("checkpoint_2", "complete", 15), ("checkpoint_3", "complete", 20)]
