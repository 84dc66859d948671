"""The clients' layouts beyond DCP, on crafted files (torch-free): Lightning's meta.pt and last*.ckpt, its top-k,
transformers' trainer_state.json.

What each client writes and in which order: docs/clients.md; the real libraries: tests/clients.
"""
from __future__ import annotations

import collections
import json
import os
import pickle
import time
import zipfile
from pathlib import Path

import pytest

from supervisor.checkpoints import DiskUsage, RetentionRules, newest_complete, plan_retention, scan, torchzip
from supervisor.checkpoints.retention import GIB
from supervisor.config import load_config
from supervisor.daemon.housekeeping import Housekeeper
from tests.fakes import RecordingLog
from tests.jobs.dcp_files import (
    lightning_meta,
    write_lightning_checkpoint,
    write_torch_file,
    write_trainer_checkpoint,
)

DISK = DiskUsage(total_bytes=1000 * GIB, free_bytes=900 * GIB)


def rows(root: Path) -> list[tuple[str, str, int | None]]:
    return [(c.name, c.state, c.step) for c in scan(root)]


def deleted_by(root: Path, **rules: object) -> set[str]:
    plan = plan_retention(scan(root), rules=RetentionRules(**rules), disk=DISK, now=1e10)
    return {d.name for d in plan.deletions}


def housekeeper(tmp_path: Path, root: Path, rules: str = "") -> Housekeeper:
    cfg = tmp_path / "job.toml"
    cfg.write_text(f'[job]\ncommand = ["true"]\n\n[checkpoints]\ndir = {json.dumps(str(root))}\n{rules}')
    return Housekeeper(load_config(cfg), RecordingLog(), now=time.time)


def lightning_root(tmp_path: Path, steps: tuple[int, ...] = (10, 20, 30)) -> Path:
    root = tmp_path / "ckpts"
    for s in steps:
        write_lightning_checkpoint(root, s, meta=lightning_meta(s, dirpath=root, best=f"epoch=0-step={s}.ckpt"))
    return root


def unreadable_meta(directory: Path) -> None:
    """A whole zip whose data.pkl uses protocol 0's INT, an opcode torch.save never writes: not walked."""
    with zipfile.ZipFile(directory / "meta.pt", "w") as z:
        z.writestr("meta/data.pkl", b"\x80\x02I30\n.")


def copy_last(root: Path, step: int) -> Path:
    """`save_last=True`: last.ckpt is a second full save of step `step`."""
    return write_lightning_checkpoint(root, step, name="last.ckpt", meta=lightning_meta(
        step, dirpath=root, best=f"epoch=0-step={step}.ckpt", last="last.ckpt"))


class TestLightningMeta:
    def test_a_save_without_meta_pt_is_partial(self, tmp_path):
        """Lightning writes meta.pt on rank 0 after the DCP files: a dir killed between them is not complete."""
        root = lightning_root(tmp_path, (10,))
        write_lightning_checkpoint(root, 20, with_meta=False)
        assert rows(root) == [("epoch=0-step=20.ckpt", "partial", 20), ("epoch=0-step=10.ckpt", "complete", 10)]
        assert "no meta.pt" in scan(root)[0].reason
        assert newest_complete(root).name == "epoch=0-step=10.ckpt"

    def test_a_meta_pt_cut_short_is_partial(self, tmp_path):
        """torch.save writes the zip's directory last: a meta.pt cut while being written has none."""
        root = lightning_root(tmp_path, (10, 20))
        meta = root / "epoch=0-step=20.ckpt" / "meta.pt"
        data = meta.read_bytes()
        meta.write_bytes(data[: len(data) - 40])
        assert rows(root)[0] == ("epoch=0-step=20.ckpt", "partial", 20)
        assert "meta.pt is not whole" in scan(root)[0].reason
        assert newest_complete(root).name == "epoch=0-step=10.ckpt"

    def test_a_symlinked_meta_pt_is_invalid(self, tmp_path):
        """A meta.pt borrowed by symlink is not this save's own."""
        root = lightning_root(tmp_path, (10, 20))
        meta = root / "epoch=0-step=20.ckpt" / "meta.pt"
        meta.unlink()
        meta.symlink_to(root / "epoch=0-step=10.ckpt" / "meta.pt")
        assert rows(root)[0] == ("epoch=0-step=20.ckpt", "invalid", 20)

    def test_the_commit_is_registered_only_with_meta_pt(self, tmp_path):
        """The daemon's pass sees a new checkpoint only once meta.pt is whole, not when the DCP files are."""
        root = lightning_root(tmp_path, (10,))
        house = housekeeper(tmp_path, root)
        house.absorb(house.run_pass(generation=0, protect=()))  # the baseline
        directory = write_lightning_checkpoint(root, 20, with_meta=False)
        assert house.absorb(house.run_pass(generation=1, protect=())) is None
        write_torch_file(directory / "meta.pt", lightning_meta(20))
        assert house.concerns(directory / "meta.pt"), "the file event of meta.pt must start a pass"
        committed = house.absorb(house.run_pass(generation=2, protect=()))
        assert committed is not None and committed.name == "epoch=0-step=20.ckpt"

    def test_another_dcp_dir_needs_no_meta_pt(self, tmp_path):
        """Only `.ckpt` dirs are Lightning's: a plain DCP dir stays complete without one."""
        root = tmp_path / "ckpts"
        write_lightning_checkpoint(root, 10, name="step_10", with_meta=False)
        assert rows(root) == [("step_10", "complete", 10)]


class TestLightningLast:
    def test_a_copied_last_ckpt_is_an_alias_with_its_step(self, tmp_path):
        """save_last=True: last.ckpt lists with the step in its meta.pt, as an alias of the named save."""
        root = lightning_root(tmp_path)
        copy_last(root, 30)
        infos = {c.name: c for c in scan(root)}
        assert (infos["last.ckpt"].state, infos["last.ckpt"].step, infos["last.ckpt"].alias_of) == \
            ("complete", 30, "epoch=0-step=30.ckpt")
        assert newest_complete(root).name == "epoch=0-step=30.ckpt"

    def test_last_ckpt_is_never_deleted_nor_counted(self, tmp_path):
        """keep_last = 2 keeps the two newest saves and last.ckpt: one save, one place in keep_last."""
        root = lightning_root(tmp_path)
        copy_last(root, 30)
        assert deleted_by(root, keep_last=2) == {"epoch=0-step=10.ckpt"}
        assert deleted_by(root, keep_last=1) == {"epoch=0-step=10.ckpt", "epoch=0-step=20.ckpt"}

    def test_last_ckpt_stays_while_a_newer_save_is_complete(self, tmp_path):
        """Between the top-k save and the last.ckpt rewrite, last.ckpt is older than the newest: still kept
        (a kill right then must not leave ckpt_path="last" without a last.ckpt: a silent fresh start)."""
        root = lightning_root(tmp_path)
        copy_last(root, 20)
        assert "last.ckpt" not in deleted_by(root, keep_last=1)

    def test_a_linked_last_ckpt_is_an_alias_of_its_target(self, tmp_path):
        """save_last="link": listed complete with its target's step, never selected, and its target is kept."""
        root = lightning_root(tmp_path)
        os.symlink("epoch=0-step=20.ckpt", root / "last.ckpt")
        infos = {c.name: c for c in scan(root)}
        assert (infos["last.ckpt"].state, infos["last.ckpt"].step, infos["last.ckpt"].alias_of) == \
            ("complete", 20, "epoch=0-step=20.ckpt")
        assert newest_complete(root).name == "epoch=0-step=30.ckpt"
        assert deleted_by(root, keep_last=1) == {"epoch=0-step=10.ckpt"}

    @pytest.mark.parametrize("link", [True, False])
    def test_the_daemon_resumes_from_the_named_save_not_last_ckpt(self, tmp_path, link):
        """A pass merges both tiers' lists, and that order ignored aliases: last.ckpt, made after the named save of
        its step, came first, so `{checkpoint}` passed last.ckpt (seen with Lightning 2.6.6, save_last="link")."""
        root = lightning_root(tmp_path)
        time.sleep(0.01)  # last.ckpt is made after the save it repeats
        if link:
            os.symlink("epoch=0-step=30.ckpt", root / "last.ckpt")
        else:
            copy_last(root, 30)
        house = housekeeper(tmp_path, root)
        assert house.run_pass(generation=0, protect=()).newest.name == "epoch=0-step=30.ckpt"

    def test_a_torn_last_ckpt_is_said_before_a_launch(self, tmp_path):
        """save_last=True rewrites last.ckpt in place after each named save: a kill then leaves it torn, and
        `ckpt_path="last"` (resume_args = []) fails to load it at every start (seen with Lightning 2.6.6:
        CheckpointException). It stays (without it Lightning starts from scratch); the pass before a launch says
        why the job will fail and what to do, naming the newest complete save."""
        root = lightning_root(tmp_path)
        shard = sorted(copy_last(root, 30).glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[:3])
        found = plan_retention(scan(root), rules=RetentionRules(keep_last=1), disk=DISK, now=1e10, settled=True)
        assert "last.ckpt" not in {d.name for d in found.deletions}
        said = [f for f in found.findings if f.kind == "lightning_last_unfinished"]
        assert len(said) == 1 and "last.ckpt" in said[0].message and "epoch=0-step=30.ckpt" in said[0].message
        running = plan_retention(scan(root), rules=RetentionRules(keep_last=1), disk=DISK, now=1e10)
        assert not running.findings  # the job is up: Lightning may be rewriting it right now

    def test_a_link_out_of_the_root_is_still_invalid(self, tmp_path):
        """A last.ckpt pointing anywhere but a sibling is not followed."""
        root = lightning_root(tmp_path, (10,))
        other = lightning_root(tmp_path / "elsewhere", (99,))
        os.symlink(other / "epoch=0-step=99.ckpt", root / "last.ckpt")
        assert ("last.ckpt", "invalid", None) in rows(root)


class TestLightningTopK:
    def test_retention_keeps_what_model_checkpoint_counts_in_its_top_k(self, tmp_path):
        """save_top_k=3 by train_loss kept step 10; keep_last = 2 must not delete it."""
        root = tmp_path / "ckpts"
        for s in (10, 20, 30, 40):
            write_lightning_checkpoint(root, s)
        top = ["epoch=0-step=10.ckpt", "epoch=0-step=30.ckpt", "epoch=0-step=40.ckpt"]
        write_torch_file(root / "epoch=0-step=40.ckpt" / "meta.pt",
                         lightning_meta(40, dirpath=root, top_k=top, best=top[0]))
        assert deleted_by(root, keep_last=2) == {"epoch=0-step=20.ckpt"}
        assert "top-k" in {c.name: c for c in scan(root)}["epoch=0-step=10.ckpt"].hold

    def test_names_in_another_dirpath_are_not_ours(self, tmp_path):
        """A top-k path in another folder (a copied meta.pt) protects nothing here."""
        root = tmp_path / "ckpts"
        for s in (10, 20):
            write_lightning_checkpoint(root, s)
        write_torch_file(root / "epoch=0-step=20.ckpt" / "meta.pt",
                         lightning_meta(20, dirpath=tmp_path / "other", top_k=["epoch=0-step=10.ckpt"]))
        assert deleted_by(root, keep_last=1) == {"epoch=0-step=10.ckpt"}

    def test_unreadable_state_deletes_by_the_rules_and_warns_once(self, tmp_path):
        """A meta.pt whose pickle this reader cannot walk: the keep rules still apply, with one warning per run."""
        root = lightning_root(tmp_path, (10, 20, 30))
        unreadable_meta(root / "epoch=0-step=30.ckpt")
        plan = plan_retention(scan(root), rules=RetentionRules(keep_last=1), disk=DISK, now=1e10)
        assert {d.name for d in plan.deletions} == {"epoch=0-step=10.ckpt", "epoch=0-step=20.ckpt"}
        assert [f.kind for f in plan.findings] == ["client_keeps_unknown"]
        assert "keep_last = 0" in plan.findings[0].message
        house = housekeeper(tmp_path, root, "keep_last = 1\n")
        house.absorb(house.run_pass(generation=0, protect=()))
        unreadable_meta(write_lightning_checkpoint(root, 40))
        house.absorb(house.run_pass(generation=1, protect=()))
        assert [c.name for c in scan(root)] == ["epoch=0-step=40.ckpt"]
        assert house.log.names().count("client_keeps_unknown") == 1


class TestTrainerState:
    @pytest.mark.parametrize("upto", ["pytorch_model_fsdp_0", "optimizer_0", "scheduler.pt", "rng_state"])
    def test_a_save_cut_before_trainer_state_json_is_partial(self, tmp_path, upto):
        """transformers writes trainer_state.json last: a checkpoint-N without it is a save cut short."""
        root = tmp_path / "out"
        write_trainer_checkpoint(root, 10)
        write_trainer_checkpoint(root, 20, upto=upto)
        assert rows(root) == [("checkpoint-20", "partial", 20), ("checkpoint-10", "complete", 10)]
        assert newest_complete(root).name == "checkpoint-10"

    def test_the_first_save_cut_after_its_own_files_is_partial(self, tmp_path):
        """No sibling to compare with: the Trainer's own rng_state files say whose layout it is."""
        root = tmp_path / "out"
        write_trainer_checkpoint(root, 10, upto="rng_state")
        assert rows(root) == [("checkpoint-10", "partial", 10)]

    def test_trainer_state_cut_short_is_partial(self, tmp_path):
        """save_to_json writes in place: a cut file is not JSON."""
        root = tmp_path / "out"
        write_trainer_checkpoint(root, 10)
        state = write_trainer_checkpoint(root, 20) / "trainer_state.json"
        state.write_text(state.read_text()[:-5])
        assert rows(root)[0] == ("checkpoint-20", "partial", 20)

    def test_a_step_that_disagrees_with_the_name_is_invalid(self, tmp_path):
        """checkpoint-N is named after global_step: a mismatch is not the Trainer's save."""
        root = tmp_path / "out"
        state = write_trainer_checkpoint(root, 20) / "trainer_state.json"
        state.write_text(json.dumps({"global_step": 30}))
        assert rows(root) == [("checkpoint-20", "invalid", 20)]

    def test_a_large_trainer_state_is_judged_by_its_ends(self, tmp_path, monkeypatch):
        """Past MAX_PARSED bytes only the ends are read: whole when it closes, partial when cut."""
        import supervisor.checkpoints.hftrainer as hftrainer

        monkeypatch.setattr(hftrainer, "MAX_PARSED", 16)
        root = tmp_path / "out"
        write_trainer_checkpoint(root, 10)
        state = write_trainer_checkpoint(root, 20) / "trainer_state.json"
        assert rows(root)[0] == ("checkpoint-20", "complete", 20)
        state.write_text(state.read_text()[:-3])
        assert rows(root)[0] == ("checkpoint-20", "partial", 20)


class _RunsCode:
    """Pickles as a call to os.system: what a hostile meta.pt could hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def torch_zip(path: Path, data_pkl: bytes, compression: int = zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", compression=compression) as z:
        z.writestr("archive/data.pkl", data_pkl)
    return path


class TestTorchZip:
    def test_nothing_named_in_the_pickle_runs(self, tmp_path):
        """A global that would run code is only a name: the value comes back opaque, the command never runs."""
        marker = tmp_path / "ran"
        path = torch_zip(tmp_path / "meta.pt", pickle.dumps({"global_step": 3, "x": _RunsCode(marker)}, protocol=2))
        value, why = torchzip.read_pickle(path)
        assert why is None and value == {"global_step": 3, "x": torchzip.OPAQUE} and not marker.exists()

    def test_dicts_stay_dicts_and_what_is_built_on_a_name_is_opaque(self, tmp_path):
        """An OrderedDict is a dict; a dict subclass (Lightning's AttributeDict hparams) is opaque, its items dropped."""
        meta = {"global_step": 3, "hp": collections.defaultdict(int, lr=1), "cb": collections.OrderedDict(k={"a": 1})}
        value, why = torchzip.read_pickle(torch_zip(tmp_path / "meta.pt", pickle.dumps(meta, protocol=2)))
        assert why is None and value == {"global_step": 3, "hp": torchzip.OPAQUE, "cb": {"k": {"a": 1}}}

    @pytest.mark.parametrize(("data", "said"), [
        (b"\x80\x02" + b"(" * (1 << 19) + b".", "too deeply"),
        (b"\x80\x02h\x05.", "a reference to nothing"),
        (b"\x80\x02X\xff\xff\xff\x7f", "truncated"),
        (b"\x80\x02}q\x00", "truncated"),
        (b"\x80\x02c__builtin__\neval\n" + b"q\x00h\x00" * 10**6 + b".", "stacked too deeply"),
    ])
    def test_bad_pickles_cost_a_reason_not_a_crash(self, tmp_path, data, said):
        """Hostile or cut pickles: a one-line reason, bounded work."""
        value, why = torchzip.read_pickle(torch_zip(tmp_path / "meta.pt", data))
        assert value is None and said in why

    def test_a_compressed_member_is_not_torch_s(self, tmp_path):
        """torch.save never compresses: a deflated member (a zip bomb's tool) is refused before reading."""
        path = torch_zip(tmp_path / "meta.pt", pickle.dumps({}, protocol=2), zipfile.ZIP_DEFLATED)
        assert "compressed" in torchzip.zip_problem(path)


class TestTrainerExtras:
    def test_a_jit_checkpoint_in_progress_is_partial(self, tmp_path):
        """enable_jit_checkpoint: the sentinel stays in checkpoint-N until the SIGTERM save is done."""
        root = tmp_path / "out"
        write_trainer_checkpoint(root, 10)
        sentinel = write_trainer_checkpoint(root, 12) / "checkpoint-is-incomplete.txt"
        sentinel.write_text("in progress")
        assert rows(root) == [("checkpoint-12", "partial", 12), ("checkpoint-10", "complete", 10)]
        assert housekeeper(tmp_path, root).concerns(sentinel), "its removal completes the save: a file event to see"

    def test_best_model_checkpoint_is_kept(self, tmp_path):
        """load_best_model_at_end: the Trainer's rotation keeps best_model_checkpoint, and so does ours."""
        root = tmp_path / "out"
        for s in (10, 20, 30):
            write_trainer_checkpoint(root, s)
        state = root / "checkpoint-30" / "trainer_state.json"
        state.write_text(json.dumps({"global_step": 30, "best_model_checkpoint": str(root / "checkpoint-10")}))
        assert deleted_by(root, keep_last=1) == {"checkpoint-20"}

    def test_best_model_checkpoint_is_kept_past_the_parsed_size(self, tmp_path):
        """A long run's log_history makes trainer_state.json MBs (past MAX_PARSED): save_to_json sorts its keys, so
        best_model_checkpoint is still read from its head, and the Trainer's best is not deleted."""
        root = tmp_path / "out"
        for s in (10, 20, 30):
            write_trainer_checkpoint(root, s)
        doc = {"global_step": 30, "best_model_checkpoint": str(root / "checkpoint-10"),
               "log_history": [{"loss": 1.0, "step": i} for i in range(200_000)]}
        (root / "checkpoint-30" / "trainer_state.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        assert deleted_by(root, keep_last=1) == {"checkpoint-20"}
