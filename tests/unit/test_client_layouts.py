"""The clients' layouts as data (supervisor/checkpoints/clients.py), and transformers' Trainer judged by what it
writes last: the first sharded save cut before trainer_state.json, and the default full-state-dict layout.

What the Trainer writes and in which order: docs/clients.md; the real Trainer: tests/clients/test_clients_hf.py.
"""
from __future__ import annotations

import json
import shutil
import tracemalloc
import zipfile

import pytest

from supervisor.checkpoints import RetentionRules, newest_complete, plan_retention, scan, verify
from supervisor.checkpoints.clients import LAYOUTS, WATCHED, layout_of, name_ordinal
from supervisor.checkpoints.markers import checkpoint_in_root
from supervisor.checkpoints.naming import name_step
from supervisor.checkpoints.shapes import FILES, CheckpointDirectoryError, identify
from tests.jobs.dcp_files import (
    FULL_TRAINER_ORDER,
    safetensors_bytes,
    write_checkpoint,
    write_full_trainer_checkpoint,
    write_torch_file,
    write_trainer_checkpoint,
)
from tests.unit.test_checkpoints_clients import DISK, housekeeper, rows


class TestTable:
    @pytest.mark.parametrize("name,client", [
        ("step_00000010", "the reference trainer"), ("step-10", "torchtitan"), ("checkpoint_3", "Accelerate"),
        ("epoch=0-step=10.ckpt", "Lightning"), ("last.ckpt", "Lightning"), ("checkpoint-10", "transformers' Trainer"),
        ("epoch_5", None), ("step_30.bak", None), ("checkpoint-10.old", None),
    ])
    def test_each_name_has_at_most_one_client(self, name, client):
        """The first record whose names match is the name's client; a user's own name has none."""
        assert sum(bool(lo.names.fullmatch(name)) for lo in LAYOUTS) == (client is not None)
        assert getattr(layout_of(name), "client", None) == client

    @pytest.mark.parametrize("name,step,ordinal", [
        ("checkpoint_3", None, 3), ("checkpoint-3", 3, None), ("epoch=2-step=30.ckpt", 30, None), ("last.ckpt", None, None),
    ])
    def test_a_records_step_and_ordinal_rules_decide_the_name(self, name, step, ordinal):
        """Accelerate's number counts saves; Lightning's step is the number after step=, not the epoch."""
        assert (name_step(name), name_ordinal(name)) == (step, ordinal)

    def test_every_commit_file_and_sentinel_is_a_file_event_that_counts(self, tmp_path):
        """A commit file written inside a checkpoint dir (never a top-level event) must start a pass."""
        root = tmp_path / "ckpts"
        root.mkdir()
        house = housekeeper(tmp_path, root)
        assert {"meta.pt", "trainer_state.json", "checkpoint-is-incomplete.txt"} <= set(WATCHED)
        assert all(house.concerns(root / "checkpoint-10" / name) for name in WATCHED)


class TestShardedFirstSave:
    """FSDP SHARDED_STATE_DICT: pytorch_model_fsdp_0/, optimizer_0/, scheduler.pt, rng_state_*.pth, trainer_state.json.
    Seen with transformers 5.25: the first save was committed at pytorch_model_fsdp_0/.metadata, while optimizer_0/
    was still being written; a kill then crash-looped on FileNotFoundError: trainer_state.json."""

    @pytest.mark.parametrize("upto,state", [
        ("pytorch_model_fsdp_0", "partial"), ("optimizer_0", "partial"), ("scheduler.pt", "partial"),
        ("rng_state", "partial"), ("trainer_state.json", "complete"),
    ])
    def test_the_first_save_is_complete_only_with_trainer_state(self, tmp_path, upto, state):
        """No sibling to compare with: the commit file alone decides, at every point of the Trainer's order."""
        root = tmp_path / "out"
        write_trainer_checkpoint(root, 10, upto=upto)
        assert rows(root) == [("checkpoint-10", state, 10)]
        assert (newest_complete(root) is not None) == (state == "complete")

    def test_the_optimizer_dir_created_but_empty(self, tmp_path):
        """The model's DCP dir is whole and optimizer_0/ exists with nothing in it yet: partial, and why."""
        root = tmp_path / "out"
        (write_trainer_checkpoint(root, 10, upto="pytorch_model_fsdp_0") / "optimizer_0").mkdir()
        [info] = scan(root)
        assert (info.state, info.reason.split(":")[0]) == ("partial", "no trainer_state.json")

    def test_a_save_cut_after_the_model_goes_before_a_launch_whose_job_picks_its_own(self, tmp_path):
        """resume_args = [] (resume_from_checkpoint=True would load it and fail): settled retention clears it."""
        root = tmp_path / "out"
        write_trainer_checkpoint(root, 5)
        write_trainer_checkpoint(root, 10, upto="pytorch_model_fsdp_0")
        plan = plan_retention(scan(root), rules=RetentionRules(), disk=DISK, now=0, settled=True)
        assert [d.name for d in plan.deletions] == ["checkpoint-10"]


class TestFullStateDict:
    """The Trainer's default: model.safetensors (or pytorch_model.bin), optimizer.pt, scheduler.pt, rng_state_*.pth,
    then trainer_state.json. Listed foreign before: a kill at step 27 relaunched from step 1 and overwrote the run."""

    @pytest.mark.parametrize("upto", FULL_TRAINER_ORDER)
    def test_cut_at_each_point_of_the_order(self, tmp_path, upto):
        """Partial until trainer_state.json is there, complete once it is; never foreign."""
        root = tmp_path / "out"
        write_full_trainer_checkpoint(root, 10, upto=upto)
        assert identify(root / "checkpoint-10").kind == FILES
        assert rows(root) == [("checkpoint-10", "complete" if upto == "trainer_state.json" else "partial", 10)]

    @pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin", "model.safetensors.index.json"])
    def test_a_kill_at_step_27_resumes_from_checkpoint_20(self, tmp_path, weights):
        """checkpoint-10 and -20 whole, -25 cut before trainer_state.json: the newest complete is checkpoint-20."""
        root = tmp_path / "out"
        for step in (10, 20):
            write_full_trainer_checkpoint(root, step, weights=weights)
        write_full_trainer_checkpoint(root, 25, upto="rng_state", weights=weights)
        assert rows(root) == [("checkpoint-25", "partial", 25), ("checkpoint-20", "complete", 20),
                              ("checkpoint-10", "complete", 10)]
        assert newest_complete(root).name == "checkpoint-20"

    @pytest.mark.parametrize("cut,state,said", [
        ("model.safetensors", "torn", "model.safetensors is short"),
        ("optimizer.pt", "torn", "optimizer.pt is not whole"),
        ("rng_state_1.pth", "torn", "rng_state_1.pth is not whole"),
        ("trainer_state.json", "partial", "trainer_state.json is cut short"),
    ])
    def test_a_file_cut_short_is_not_complete(self, tmp_path, cut, state, said):
        """Whole means the safetensors header's sizes, the torch.save zip's directory, a trainer_state.json that parses."""
        path = write_full_trainer_checkpoint(tmp_path / "out", 10) / cut
        path.write_bytes(path.read_bytes()[:-9])
        verdict = verify(path.parent)
        assert verdict.state == state and said in verdict.reason

    def test_a_shard_the_index_names_is_missing(self, tmp_path):
        """model.safetensors.index.json lists the shards: one that is gone tears the save."""
        directory = write_full_trainer_checkpoint(tmp_path / "out", 10, weights="model.safetensors.index.json")
        (directory / "model-00002-of-00002.safetensors").unlink()
        verdict = verify(directory)
        assert verdict.state == "torn" and "model-00002-of-00002.safetensors is missing" in verdict.reason

    @pytest.mark.parametrize("header", [b"\xff" * 8, (16).to_bytes(8, "little") + b"[1, 2, 3]" + b" " * 7,
                                        (32).to_bytes(8, "little") + b'{"w": {"data_offsets": [0, 99]}}',
                                        (200_000).to_bytes(8, "little") + b"[" * 200_000])
    def test_a_bad_safetensors_header_is_a_reason_not_a_crash(self, tmp_path, header):
        """A header length past the file, a header that is not an object, tensors past the file's end: torn, with one
        line."""
        directory = write_full_trainer_checkpoint(tmp_path / "out", 10)
        (directory / "model.safetensors").write_bytes(header)
        assert verify(directory).state == "torn"

    def test_a_step_that_disagrees_with_the_name_is_invalid(self, tmp_path):
        """checkpoint-N is named after global_step, as in the sharded layout."""
        directory = write_full_trainer_checkpoint(tmp_path / "out", 10)
        (directory / "trainer_state.json").write_text(json.dumps({"global_step": 30}))
        assert verify(directory).state == "invalid"

    def test_jit_sentinel_makes_it_partial(self, tmp_path):
        """enable_jit_checkpoint: the sentinel stays until the SIGTERM save is done."""
        directory = write_full_trainer_checkpoint(tmp_path / "out", 10)
        (directory / "checkpoint-is-incomplete.txt").write_text("")
        assert verify(directory).state == "partial"

    def test_retention_counts_them_as_checkpoints(self, tmp_path):
        """keep_last = 2 over three whole saves deletes the oldest; an old cut save goes as debris."""
        root = tmp_path / "out"
        for step in (10, 20, 30):
            write_full_trainer_checkpoint(root, step)
        write_full_trainer_checkpoint(root, 5, upto="optimizer.pt")
        plan = plan_retention(scan(root), rules=RetentionRules(keep_last=2), disk=DISK, now=1e10)
        assert sorted(d.name for d in plan.deletions) == ["checkpoint-10", "checkpoint-5"]

    @pytest.mark.parametrize("files", [{"notes.txt": "x"}, {"events.out.tfevents": "x"}])
    def test_a_checkpoint_named_folder_without_the_trainers_files_stays_foreign(self, tmp_path, files):
        """Only the Trainer's own files make a checkpoint-N of plain files its save: anything else is never touched."""
        directory = tmp_path / "out" / "checkpoint-10"
        directory.mkdir(parents=True)
        for name, text in files.items():
            (directory / name).write_text(text)
        assert rows(tmp_path / "out") == [("checkpoint-10", "foreign", None)]

    def test_another_name_with_the_same_files_stays_foreign(self, tmp_path):
        """The layout is the Trainer's only under its name: `export/` holding model.safetensors is someone's copy."""
        directory = write_full_trainer_checkpoint(tmp_path / "out", 10)
        shutil.move(directory, tmp_path / "out" / "export")
        assert rows(tmp_path / "out") == [("export", "foreign", None)]

    def test_a_root_one_level_too_high_is_refused(self, tmp_path):
        """The run dir instead of output_dir: its checkpoint-N saves are a series, as DCP ones are (exit 2, naming it)."""
        for step in (10, 20):
            write_full_trainer_checkpoint(tmp_path / "run" / "out", step)
        with pytest.raises(CheckpointDirectoryError, match="out"):
            scan(tmp_path / "run")

    def test_it_can_be_pinned(self, tmp_path):
        """pin, unpin and unquarantine act on this layout's saves as on any checkpoint of the root."""
        root = tmp_path / "out"
        directory = write_full_trainer_checkpoint(root, 10)
        assert checkpoint_in_root(directory, root) == directory

    def test_a_safetensors_file_is_whole_by_its_header(self, tmp_path):
        """The size the header's largest data_offsets end gives, plus the header: a longer file is whole too."""
        directory = write_full_trainer_checkpoint(tmp_path / "out", 10)
        data = safetensors_bytes({"w": 3})
        (directory / "model.safetensors").write_bytes(data + b"\0")
        assert verify(directory).complete
        (directory / "model.safetensors").write_bytes(data[:-1])
        assert verify(directory).state == "torn"


    def test_a_huge_safetensors_header_is_searched_not_built(self, tmp_path):
        """A 20 MB header of 400,000 tensors (safetensors allows 100 MB): the largest data_offsets end decides. Parsed
        as JSON it took the daemon ~12x the header's size in memory (53 MB: 635 MB, 15 s on a loaded 2-core machine)."""
        directory = write_full_trainer_checkpoint(tmp_path / "out", 10)
        tensors = ",".join(f'"t{i}": {{"dtype": "F32", "shape": [1], "data_offsets": [{4 * i}, {4 * i + 4}]}}'
                           for i in range(400_000))
        header = ("{" + tensors + "}").encode()
        data = len(header).to_bytes(8, "little") + header + bytes(1_600_000)
        (directory / "model.safetensors").write_bytes(data)
        tracemalloc.start()
        try:
            assert verify(directory).complete
            assert tracemalloc.get_traced_memory()[1] < 4 * len(header)
        finally:
            tracemalloc.stop()
        (directory / "model.safetensors").write_bytes(data[:-1])
        assert "short" in verify(directory).reason

    def test_a_torch_save_file_past_a_gib_is_whole(self, tmp_path):
        """Adam's optimizer.pt is 8 bytes a parameter: past 1 GiB for a 134M-parameter model. Its zip directory
        decides, not its size (a cap meant for Lightning's meta.pt listed every such save torn)."""
        directory = write_full_trainer_checkpoint(tmp_path / "out", 10)
        optimizer = directory / "optimizer.pt"
        with zipfile.ZipFile(optimizer) as z:
            members = [(i.filename, z.read(i)) for i in z.infolist()]
        with optimizer.open("wb") as f:
            f.truncate((1 << 30) + 4096)  # sparse: the tensors' bytes, as far as the directory is concerned
        with zipfile.ZipFile(optimizer, "a") as z:
            for name, data in members:
                z.writestr(name, data)
        assert verify(directory).complete

    @pytest.mark.parametrize("header", [b"", (0).to_bytes(8, "little"), (1 << 40).to_bytes(8, "little")])
    def test_a_safetensors_file_without_a_whole_header_is_torn(self, tmp_path, header):
        """No header length, a zero one (a file of zeros) or one past the file's end: never whole."""
        directory = write_full_trainer_checkpoint(tmp_path / "out", 10)
        (directory / "model.safetensors").write_bytes(header + bytes(64))
        assert verify(directory).state == "torn"

    @pytest.mark.parametrize("shard", ["a\0b.safetensors", "..", "", "../model.safetensors"])
    def test_an_index_naming_no_shard_of_this_folder_is_no_crash(self, tmp_path, shard):
        """A weight_map value that is no file name of this folder is not looked up (a NUL byte used to raise)."""
        directory = write_full_trainer_checkpoint(tmp_path / "out", 10, weights="model.safetensors.index.json")
        (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
        assert verify(directory).complete


class TestAScriptsOwnCheckpointN:
    """`checkpoint-N` is also a name scripts give their own saves: only one holding a file or dir that the Trainer
    alone writes (pytorch_model_fsdp_<k>/, training_args.bin, trainer_state.json) is judged as the Trainer's."""

    def test_its_nested_dcp_saves_need_no_trainer_state(self, tmp_path):
        """As before the Trainer's layout was judged: complete with their DCP dirs, and the newest is the pick."""
        root = tmp_path / "out"
        for step in (10, 20):
            for part in ("model", "optim"):
                write_checkpoint(root / f"checkpoint-{step}", step, name=part, manifest=False)
        assert rows(root) == [("checkpoint-20", "complete", 20), ("checkpoint-10", "complete", 10)]
        assert newest_complete(root).name == "checkpoint-20"

    def test_its_plain_file_saves_are_never_deleted(self, tmp_path):
        """model.safetensors + optimizer.pt of its own: foreign, never partial debris that retention deletes."""
        root = tmp_path / "out"
        for step in (10, 20):
            (root / f"checkpoint-{step}").mkdir(parents=True)
            (root / f"checkpoint-{step}" / "model.safetensors").write_bytes(safetensors_bytes({"w": 3}))
            write_torch_file(root / f"checkpoint-{step}" / "optimizer.pt", {"s": step}, archive="optimizer")
        assert sorted(rows(root)) == [("checkpoint-10", "foreign", None), ("checkpoint-20", "foreign", None)]
        assert not plan_retention(scan(root), rules=RetentionRules(keep_last=1), disk=DISK, now=1e10).deletions

    def test_the_trainers_first_sharded_save_is_known_by_its_model_dir(self, tmp_path):
        """pytorch_model_fsdp_0/ complete, optimizer_0/ still being written: partial (issue 35, item 11)."""
        root = tmp_path / "out"
        write_trainer_checkpoint(root, 10, upto="pytorch_model_fsdp_0")
        assert rows(root) == [("checkpoint-10", "partial", 10)]


class TestNestedNotTheTrainer:
    def test_accelerates_checkpoint_n_needs_no_trainer_state(self, tmp_path):
        """The commit rule is the Trainer's, by its name: Accelerate's checkpoint_<N> is complete with its DCP dirs."""
        root = tmp_path / "checkpoints"
        for part in ("pytorch_model_fsdp_0", "optimizer_0"):
            write_checkpoint(root / "checkpoint_0", 5, name=part, manifest=False)
        assert rows(root) == [("checkpoint_0", "complete", None)]
