"""`python -m trainer.export`: safetensors (single or hub-style shards) and .pt, dtype casts, bad input.

A plain `TinyLM` is saved as a single-process DCP checkpoint (the layout the trainer writes, keys
`model.<name>`), so these tests need no process group and no torchrun.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from supervisor.layout import step_dir_name
from trainer import export as export_module
from trainer.export import load_model_weights, main, plan_shards, write_safetensors
from trainer.model import ModelConfig, TinyLM

CFG = ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16)
RECORD = ".model.safetensors.export.json"  # what a sharded export to model.safetensors wrote (trainer/exportfiles.py)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[TinyLM, Path]:
    """A TinyLM after two optimizer steps, and its DCP checkpoint."""
    torch.manual_seed(3)
    model = TinyLM(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        batch = torch.randint(0, 256, (4, CFG.seq_len + 1))
        logits = model(batch[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    ckpt = tmp_path_factory.mktemp("export") / step_dir_name(2)
    dcp.save({"model": model.state_dict()}, checkpoint_id=ckpt)
    return model, ckpt


def logits(model: TinyLM) -> torch.Tensor:
    tokens = torch.arange(2 * CFG.seq_len).reshape(2, CFG.seq_len) % 256
    with torch.no_grad():
        return model(tokens)


def plain_model(weights: dict) -> TinyLM:
    model = TinyLM(CFG)
    model.load_state_dict(weights, strict=True)
    return model


class TestSafetensors:
    def test_reloads_into_a_plain_model_with_identical_logits(self, trained, tmp_path) -> None:
        """`safetensors.torch.load_file` + a plain TinyLM gives exactly the trained model's logits."""
        model, ckpt = trained
        out = tmp_path / "model.safetensors"
        assert main([str(ckpt), str(out)]) == 0
        assert torch.equal(logits(plain_model(load_file(out))), logits(model))

    def test_pt_output_holds_the_same_tensors(self, trained, tmp_path) -> None:
        """Any other suffix is a torch file with the same names and bits."""
        _, ckpt = trained
        assert main([str(ckpt), str(tmp_path / "m.safetensors")]) == 0
        assert main([str(ckpt), str(tmp_path / "m.pt")]) == 0
        st, pt = load_file(tmp_path / "m.safetensors"), torch.load(tmp_path / "m.pt", weights_only=True)
        assert st.keys() == pt.keys() and all(torch.equal(st[k], pt[k]) for k in st)

    def test_dtype_casts_every_floating_tensor(self, trained, tmp_path) -> None:
        """`--dtype bfloat16` writes bf16 tensors equal to the weights rounded to bf16."""
        model, ckpt = trained
        out = tmp_path / "bf16.safetensors"
        assert main([str(ckpt), str(out), "--dtype", "bfloat16"]) == 0
        loaded = load_file(out)
        assert {t.dtype for t in loaded.values()} == {torch.bfloat16}
        assert all(torch.equal(loaded[k], v.to(torch.bfloat16)) for k, v in model.state_dict().items())

    def test_tied_and_sliced_tensors_are_written(self, tmp_path) -> None:
        """Shared storage (a tied head, a slice of another tensor) is cloned: safetensors refuses it otherwise."""
        base = torch.arange(12, dtype=torch.float32)
        weights = {"tok.weight": base.view(3, 4), "head.weight": base.view(3, 4), "part": base[4:8]}
        write_safetensors(weights, tmp_path / "tied.safetensors")
        loaded = load_file(tmp_path / "tied.safetensors")
        assert all(torch.equal(loaded[k], v) for k, v in weights.items())
        assert weights["tok.weight"].data_ptr() == weights["head.weight"].data_ptr()  # the caller's stay tied


    @pytest.mark.parametrize("name", ["model.safetensors", "MODEL.SAFETENSORS"])
    def test_safetensors_files_are_readable_like_any_written_file(self, trained, tmp_path, name) -> None:
        """0o666 less the umask, as a .pt gets (safetensors alone writes 0o600: a server under another user
        could not read the model); the suffix counts whatever its case."""
        _, ckpt = trained
        old = os.umask(0o022)
        try:
            assert main([str(ckpt), str(tmp_path / name)]) == 0
            assert main([str(ckpt), str(tmp_path / "m.pt")]) == 0
        finally:
            os.umask(old)
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644 == stat.S_IMODE((tmp_path / "m.pt").stat().st_mode)
        assert load_file(tmp_path / name).keys() == torch.load(tmp_path / "m.pt", weights_only=True).keys()

    def test_float16_overflow_is_refused(self, tmp_path) -> None:
        """A value beyond float16's range would become inf: exit 2 naming the tensor, nothing written."""
        ckpt = tmp_path / step_dir_name(1)
        dcp.save({"model": {"big.weight": torch.tensor([1e6, 1.0]), "ok": torch.ones(2)}}, checkpoint_id=ckpt)
        out = tmp_path / "model.safetensors"
        assert main([str(ckpt), str(out), "--dtype", "float16"]) == 2
        assert not out.exists()
        assert main([str(ckpt), str(out), "--dtype", "bfloat16"]) == 0


class TestShards:
    def test_sharded_layout_matches_the_hub_format(self, trained, tmp_path) -> None:
        """Shards named model-0000k-of-0000n, an index whose total_size is the tensor bytes, every tensor once."""
        model, ckpt = trained
        out = tmp_path / "model.safetensors"
        assert main([str(ckpt), str(out), "--sharded-max-gb", str(40_000 / 2**30)]) == 0
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        n = len(files)
        assert n >= 3 and files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
        assert not out.exists()
        shards = {f: load_file(tmp_path / f) for f in files}
        names = [name for tensors in shards.values() for name in tensors]
        assert sorted(names) == sorted(index["weight_map"]) == sorted(model.state_dict())  # each exactly once
        assert all(name in shards[f] for name, f in index["weight_map"].items())
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in model.state_dict().values())
        merged = {k: v for tensors in shards.values() for k, v in tensors.items()}
        assert torch.equal(logits(plain_model(merged)), logits(model))

    def test_an_export_under_the_limit_is_one_file(self, trained, tmp_path) -> None:
        """Below the limit there is no index: one model.safetensors, as hubs do."""
        _, ckpt = trained
        assert main([str(ckpt), str(tmp_path / "model.safetensors"), "--sharded-max-gb", "1"]) == 0
        assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]

    def test_a_new_export_replaces_the_whole_previous_one(self, trained, tmp_path) -> None:
        """Re-exporting to the same name leaves only the new export: a stale model.safetensors beside a new
        index (hub loaders prefer it) or stale shards beside a new single file (loaders that glob) would be
        loaded instead of, or along with, the new weights."""
        _, ckpt = trained
        out = tmp_path / "model.safetensors"
        other = tmp_path / "other.safetensors"
        assert main([str(ckpt), str(other)]) == 0
        total = sum(t.numel() * t.element_size() for t in load_model_weights(ckpt).values())
        tiny, few = str(20_000 / 2**30), str(0.6 * total / 2**30)  # many shards, then two
        assert main([str(ckpt), str(out)]) == 0
        assert main([str(ckpt), str(out), "--sharded-max-gb", tiny]) == 0
        many = sorted(p.name for p in tmp_path.iterdir())
        assert "model.safetensors" not in many and "model.safetensors.index.json" in many
        assert main([str(ckpt), str(out), "--sharded-max-gb", few]) == 0
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            {*index["weight_map"].values(), "model.safetensors.index.json", "other.safetensors", RECORD})
        assert main([str(ckpt), str(out)]) == 0
        assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "other.safetensors"]

    def test_an_interrupted_sharded_export_leaves_the_previous_one_whole(self, trained, tmp_path, monkeypatch) -> None:
        """Shards are written aside and renamed into place only when all are: a write that fails leaves the previous
        export whole (its index names exactly its shards) and no temporary; the next export goes through."""
        _, ckpt = trained
        out = tmp_path / "model.safetensors"
        limit = str(40_000 / 2**30)
        assert main([str(ckpt), str(out), "--sharded-max-gb", limit]) == 0
        before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
        real, calls = export_module._save_file, []

        def fail_second(tensors, path) -> None:
            calls.append(path)
            if len(calls) == 2:
                raise OSError(28, "No space left on device")
            real(tensors, path)

        monkeypatch.setattr(export_module, "_save_file", fail_second)
        assert main([str(ckpt), str(out), "--sharded-max-gb", str(20_000 / 2**30)]) == 2
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
        monkeypatch.undo()
        assert main([str(ckpt), str(out)]) == 0
        assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]

    @pytest.mark.parametrize(("sizes", "limit", "expected"), [
        ([("a", 4), ("b", 4), ("c", 4)], 8, [["a", "b"], ["c"]]),
        ([("a", 10), ("b", 1)], 4, [["a"], ["b"]]),  # a tensor over the limit gets a shard of its own
        ([("a", 1), ("b", 10), ("c", 1)], 4, [["a"], ["b"], ["c"]]),
        ([("a", 4)], 4, [["a"]]),
    ])
    def test_plan_shards(self, sizes, limit, expected) -> None:
        """Tensors are packed in order; a shard never exceeds the limit unless one tensor alone does."""
        assert plan_shards(sizes, limit) == expected


HUB = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json")
# Runs `trainer.export ARGV` and SIGKILLs itself at one point of the write: after the second shard is staged,
# after the record is written (before any rename), or after the first shard is renamed into place.
KILLED_AT = """
import os, signal, sys
from trainer import export, exportfiles
point, die = sys.argv[1], lambda: os.kill(os.getpid(), signal.SIGKILL)
real_save, real_record, real_replace, saved = export._save_file, exportfiles.write_record, os.replace, []
def save(tensors, path):
    real_save(tensors, path)
    saved.append(path)
    if point == "save" and len(saved) == 2:
        die()
def record(*args, **kwargs):
    real_record(*args, **kwargs)
    if point == "record":
        die()
def replace(src, dst):
    real_replace(src, dst)
    if point == "rename" and str(dst).endswith(".safetensors"):
        die()
export._save_file, exportfiles.write_record, os.replace = save, record, replace
sys.exit(export.main(sys.argv[2:]))
"""


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


class TestOnlyOurs:
    """An export deletes or replaces only files an earlier export of ours recorded, and only our temporaries."""

    @pytest.mark.parametrize("sharded", [False, True])
    def test_a_hub_models_files_survive_an_export_into_its_folder(self, trained, tmp_path, sharded) -> None:
        """A downloaded model's shards and index beside OUT (today: deleted): exit 2, one line naming one of them,
        every file as it was, nothing written."""
        _, ckpt = trained
        for name in HUB:
            (tmp_path / name).write_bytes(b"the hub's " + name.encode())
        before = snapshot(tmp_path)
        shards = ["--sharded-max-gb", str(20_000 / 2**30)] if sharded else []
        proc = run_export(str(ckpt), str(tmp_path / "model.safetensors"), *shards)
        err = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(err) == 1 and "not written by an export of ours" in err[0], proc.stderr
        assert any(name in err[0] for name in HUB) and snapshot(tmp_path) == before
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(HUB)

    def test_a_shard_replaced_since_our_export_is_not_ours_any_more(self, trained, tmp_path) -> None:
        """The record proves a file ours by its identity: a download over one of our shards makes it someone
        else's (refused, kept); the rest of our export goes once it is moved away."""
        _, ckpt = trained
        out = tmp_path / "model.safetensors"
        assert main([str(ckpt), str(out), "--sharded-max-gb", str(40_000 / 2**30)]) == 0
        theirs = sorted(tmp_path.glob("model-*.safetensors"))[0]
        theirs.write_bytes(b"downloaded")
        assert main([str(ckpt), str(out)]) == 2 and theirs.read_bytes() == b"downloaded"
        theirs.rename(tmp_path / "kept.bin")
        assert main([str(ckpt), str(out)]) == 0
        assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.bin", "model.safetensors"]

    @pytest.mark.parametrize("point", ["save", "record", "rename"])
    def test_an_export_killed_anywhere_is_cleaned_up_by_the_next(self, trained, tmp_path, point) -> None:
        """SIGKILL mid-export: the previous export stays whole until renames begin, no index ever names a mix,
        and the next export removes every leftover of ours (another program's `.tmpAb12Cd` stays)."""
        model, ckpt = trained
        out = tmp_path / "model.safetensors"
        assert main([str(ckpt), str(out), "--sharded-max-gb", str(40_000 / 2**30)]) == 0
        (tmp_path / ".tmpAb12Cd").write_bytes(b"another program's")
        before = snapshot(tmp_path)
        proc = subprocess.run([sys.executable, "-c", KILLED_AT, point, str(ckpt), str(out), "--sharded-max-gb",
                               str(20_000 / 2**30)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        assert any(p.name.startswith(".model.safetensors.export-") for p in tmp_path.iterdir())  # left behind
        after = snapshot(tmp_path)
        if point == "rename":
            assert "model.safetensors.index.json" not in after
        else:
            assert {k: v for k, v in after.items() if k != RECORD} == {k: v for k, v in before.items() if k != RECORD}
        assert main([str(ckpt), str(out)]) == 0
        assert sorted(p.name for p in tmp_path.iterdir()) == [".tmpAb12Cd", "model.safetensors"]
        assert torch.equal(logits(plain_model(load_file(out))), logits(model))


class TestBadInput:
    @pytest.mark.parametrize(("args", "culprit"), [
        (["{ckpt}", "{tmp}/model.pt", "--sharded-max-gb", "1"], "--sharded-max-gb"),
        (["{ckpt}", "{tmp}/model.safetensors", "--sharded-max-gb", "0"], "--sharded-max-gb"),
        (["{ckpt}", "{tmp}/model.safetensors", "--dtype", "int8"], "--dtype"),
        (["{ckpt}", "{tmp}"], "is a directory"),
        (["{tmp}/nope", "{tmp}/model.safetensors"], "no such checkpoint"),
        (["{ckpt}", "{tmp}/missing/model.safetensors"], "not writable"),
        (["{ckpt}", "{tmp}/model.safetensors", "--sharded-max-gb", "inf"], "--sharded-max-gb"),
        (["{ckpt}", "{tmp}/model.safetensors", "--sharded-max-gb", "nan"], "--sharded-max-gb"),
    ])
    def test_one_line_exit_2_nothing_written(self, trained, tmp_path, args, culprit) -> None:
        """Bad input to the CLI: exit 2, one line naming the culprit, no file created."""
        _, ckpt = trained
        argv = [a.format(ckpt=ckpt, tmp=tmp_path) for a in args]
        proc = subprocess.run([sys.executable, "-m", "trainer.export", *argv], capture_output=True, text=True,
                              timeout=120)
        err = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(err) == 1 and culprit in err[0], proc.stderr
        assert list(tmp_path.iterdir()) == []


    def test_huge_shard_limit_is_one_file(self, trained, tmp_path) -> None:
        """--sharded-max-gb 1e300 (finite, beyond any byte count) writes one file, no traceback."""
        _, ckpt = trained
        assert main([str(ckpt), str(tmp_path / "model.safetensors"), "--sharded-max-gb", "1e300"]) == 0
        assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]

    def test_an_existing_special_file_is_never_replaced(self, trained, tmp_path) -> None:
        """OUT naming a FIFO or a device (`/dev/full` as root) is refused: a rename would replace the node."""
        _, ckpt = trained
        fifo = tmp_path / "model.safetensors"
        os.mkfifo(fifo)
        proc = run_export(str(ckpt), str(fifo))
        assert proc.returncode == 2 and "not a regular file" in proc.stderr and stat.S_ISFIFO(fifo.stat().st_mode)

    def test_a_file_of_the_checkpoint_is_never_replaced(self, trained, tmp_path) -> None:
        """OUT naming the checkpoint's own .metadata (or a shard) would destroy it: exit 2; a new file beside is fine."""
        _, ckpt = trained
        copy = tmp_path / ckpt.name
        shutil.copytree(ckpt, copy)
        before = (copy / ".metadata").read_bytes()
        proc = run_export(str(copy), str(copy / ".metadata"))
        assert proc.returncode == 2 and "of the checkpoint" in proc.stderr and (copy / ".metadata").read_bytes() == before
        assert main([str(copy), str(copy / "model.safetensors")]) == 0

    def test_unreadable_checkpoint_is_one_line(self, trained, tmp_path) -> None:
        """A complete-looking checkpoint whose shard is garbage: exit 2, one line, not DCP's traceback."""
        _, ckpt = trained
        bad = tmp_path / ckpt.name
        shutil.copytree(ckpt, bad)
        shard = next(bad.glob("*.distcp"))
        shard.write_bytes(bytes(shard.stat().st_size))
        proc = run_export(str(bad), str(tmp_path / "model.safetensors"))
        err = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(err) == 1 and "cannot read" in err[0], proc.stderr
        assert not (tmp_path / "model.safetensors").exists()

    def test_full_disk_is_one_line_and_leaves_nothing(self, trained, tmp_path) -> None:
        """A write that fails (here a file size limit, as a full disk fails): exit 2, one line, no temp file."""
        _, ckpt = trained
        for name in ("model.safetensors", "model.pt"):
            proc = run_export(str(ckpt), str(tmp_path / name), limit_bytes=20_000)
            err = proc.stderr.strip().splitlines()
            assert proc.returncode == 2 and len(err) == 1 and "cannot write" in err[0], proc.stderr
            assert list(tmp_path.iterdir()) == []


def run_export(*argv: str, limit_bytes: int | None = None) -> subprocess.CompletedProcess[str]:
    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return subprocess.run([sys.executable, "-m", "trainer.export", *argv], capture_output=True, text=True,
                          timeout=120, preexec_fn=limit if limit_bytes else None)


def test_load_model_weights_reads_only_the_model(trained) -> None:
    """The export's reader returns the model's names and bits."""
    model, ckpt = trained
    weights = load_model_weights(ckpt)
    assert weights.keys() == model.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
