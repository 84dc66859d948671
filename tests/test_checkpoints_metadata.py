"""Tests for supervisor.checkpoints.metadata: the allowlisting, torch-free DCP metadata reader."""
from __future__ import annotations

import io
import os
import pickle
import pkgutil
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

import supervisor.checkpoints
from supervisor.checkpoints import metadata as md
from supervisor.checkpoints.testing import dcp_metadata_bytes, storage_metadata_bytes

from checkpoints_dcp_writer import run_writer


class _Evil:
    """Pickles as `func(*args)`: what an attacker would plant in `.metadata`."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


@pytest.fixture(scope="module")
def torch_written(tmp_path_factory) -> dict:
    """Checkpoints written by the installed torch: dcp.save, async_save, FSDP2 and FSDP1 (2 ranks)."""
    out = tmp_path_factory.mktemp("torch-written")
    single = run_writer("single", out / "single")
    fsdp = run_writer("fsdp", out / "fsdp")
    return {
        "dirs": [Path(d) for d in single["dirs"] + fsdp["dirs"]],
        "globals": {tuple(g) for g in single["globals"] + fsdp["globals"]},
        "dtypes": set(single["dtypes"]),
    }


class TestTorchFree:
    def test_importing_every_store_module_does_not_import_torch(self):
        """Importing each module of supervisor.checkpoints in a fresh interpreter leaves torch unimported."""
        names = [m.name for m in pkgutil.iter_modules(supervisor.checkpoints.__path__, "supervisor.checkpoints.")]
        code = f"import importlib, sys\nfor n in {names!r}: importlib.import_module(n)\nprint('torch' in sys.modules)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
        assert len(names) >= 6
        assert out.stdout.strip() == "False"


@pytest.mark.integration
class TestAllowlistAgainstInstalledTorch:
    def test_recorded_globals_are_all_allowed(self, torch_written):
        """Every global the real unpickler resolves in torch-written metadata is on the allowlist."""
        missing = torch_written["globals"] - set(md.ALLOWED_GLOBALS)
        assert not missing, f"torch pickles globals the store refuses: {sorted(missing)}"

    def test_recording_saw_the_dcp_classes(self, torch_written):
        """The recording is real: it saw DCP's Metadata and the filesystem _StorageInfo."""
        assert ("torch.distributed.checkpoint.metadata", "Metadata") in torch_written["globals"]
        assert ("torch.distributed.checkpoint.filesystem", "_StorageInfo") in torch_written["globals"]

    def test_every_installed_dtype_is_allowed(self, torch_written):
        """Every dtype of the installed torch can appear in metadata, so each must be allowlisted."""
        assert torch_written["dtypes"] and torch_written["dtypes"] <= md.DTYPE_NAMES

    def test_torch_written_metadata_parses_with_its_shards(self, torch_written):
        """Each torch-written .metadata parses and references shard files that exist with enough bytes."""
        assert len(torch_written["dirs"]) == 4
        for d in torch_written["dirs"]:
            meta = md.read_metadata(d / ".metadata")
            assert meta.entries > 0 and meta.storage
            for ref in meta.storage:
                assert (d / ref.relative_path).stat().st_size >= ref.min_size > 0

    def test_torch_written_checkpoints_verify_complete(self, torch_written):
        """verify() calls every torch-written checkpoint (single, async, FSDP2, FSDP1 epoch_N) complete."""
        verdicts = {d.name: supervisor.checkpoints.verify(d) for d in torch_written["dirs"]}
        assert {n: v.state for n, v in verdicts.items()} == {
            "step_00000010": "complete", "step_00000020": "complete", "step_00000003": "complete", "epoch_2": "complete",
        }


class TestRefusedGlobals:
    @pytest.mark.parametrize("func,args", [
        (os.system, ("true",)),
        (eval, ("1+1",)),
        (subprocess.Popen, (["true"],)),
        (getattr, (Path("x"), "unlink")),
        (__import__, ("os",)),
    ])
    def test_dangerous_callables_are_refused(self, func, args):
        """A pickle calling os.system, eval, subprocess.Popen, getattr or __import__ is refused as unsafe."""
        with pytest.raises(md.UnsafeMetadataError, match="refused global"):
            md.parse_metadata(pickle.dumps(_Evil(func, *args)))

    def test_file_creating_pickle_never_creates_the_file(self, tmp_path):
        """A pickle that creates a file when loaded by pickle is refused and the file never appears."""
        bomb = pickle.dumps(_Evil(open, str(tmp_path / "pwned"), "w"))
        pickle.loads(bomb).close()  # the trap is live: plain pickle does create it
        assert (tmp_path / "pwned").exists()
        (tmp_path / "pwned").unlink()
        with pytest.raises(md.UnsafeMetadataError):
            md.parse_metadata(bomb)
        assert not (tmp_path / "pwned").exists()

    def test_persistent_ids_are_refused(self):
        """A pickle with a persistent id (BINPERSID) is refused."""
        data = b"\x80\x04\x8c\x01x\x94Q."
        with pytest.raises(md.UnsafeMetadataError, match="persistent"):
            md.parse_metadata(data)

    def test_allowed_class_cannot_be_abused_via_reduce_on_a_dtype(self):
        """A dtype stand-in is inert: calling it through REDUCE fails instead of doing anything."""
        data = b"\x80\x04\x8c\x05torch\x8c\x07float32\x93\x8c\x01x\x85R."
        with pytest.raises(md.MetadataError):
            md.parse_metadata(data)


class TestHostileBytes:
    def test_garbage_is_unparseable(self):
        """Random bytes are a MetadataError naming the failure, not a crash."""
        with pytest.raises(md.MetadataError, match="unparseable"):
            md.parse_metadata(b"\x00garbage\xff" * 10)

    def test_truncated_metadata_is_unparseable(self):
        """A metadata pickle cut in half is a MetadataError."""
        data, _ = dcp_metadata_bytes()
        with pytest.raises(md.MetadataError):
            md.parse_metadata(data[: len(data) // 2])

    def test_non_metadata_top_level_is_rejected(self):
        """A safe pickle of a plain dict is not DCP metadata."""
        with pytest.raises(md.MetadataError, match="not DCP Metadata"):
            md.parse_metadata(pickle.dumps({"state_dict_metadata": {}}))

    def test_huge_memo_index_stays_small(self):
        """LONG_BINPUT with index 2**31 (which makes C pickle zero 16 GiB) uses little memory here."""
        data = b"\x80\x04N" + b"r" + struct.pack("<I", 2**31) + b"."
        tracemalloc.start()
        try:
            with pytest.raises(md.MetadataError):
                md.parse_metadata(data)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 16 * 1024 * 1024

    def test_huge_declared_bytes_length_stays_small(self):
        """BINBYTES8 claiming 2**40 bytes fails on the short input without allocating it."""
        data = b"\x80\x04\x8e" + struct.pack("<Q", 2**40) + b"abc."
        tracemalloc.start()
        try:
            with pytest.raises(md.MetadataError):
                md.parse_metadata(data)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 16 * 1024 * 1024

    def test_deep_nesting_is_an_error_not_a_crash(self):
        """A pickle nesting lists very deeply is reported, not a RecursionError escaping."""
        data = b"\x80\x04" + b"]" * 200_000 + b"a" * 199_999 + b"."
        with pytest.raises(md.MetadataError):
            md.parse_metadata(data)


class TestStorageShape:
    def test_synthetic_metadata_lists_each_shard_with_its_end(self):
        """Storage refs sum each shard's items to the byte count the file must hold."""
        data, sizes = dcp_metadata_bytes({"a": 10, "b": 6}, shards=2)
        meta = md.parse_metadata(data)
        assert meta.entries == 2
        assert {r.relative_path: r.min_size for r in meta.storage} == sizes == {"__0_0.distcp": 32, "__1_0.distcp": 32}
        assert all(r.items == 2 for r in meta.storage)

    @pytest.mark.parametrize("item,match", [
        (("__0_0.distcp", -1, 4), "offset"),
        (("__0_0.distcp", 0, True), "length"),
        ((7, 0, 4), "not a string"),
    ])
    def test_malformed_storage_items_are_rejected(self, item, match):
        """A _StorageInfo with a negative offset, a bool length or a non-string path is a MetadataError."""
        assert md.parse_metadata(storage_metadata_bytes([("__0_0.distcp", 0, 4)])).storage  # the shape is valid
        with pytest.raises(md.MetadataError, match=match):
            md.parse_metadata(storage_metadata_bytes([item]))

    def test_items_sharing_a_file_need_the_furthest_end(self):
        """Several items in one file require max(offset + length), not the sum or the last one."""
        meta = md.parse_metadata(storage_metadata_bytes([("f", 100, 50), ("f", 0, 10), ("g", 5, 5)]))
        assert {(r.relative_path, r.min_size, r.items) for r in meta.storage} == {("f", 150, 2), ("g", 10, 1)}


class TestReadMetadata:
    def test_oversized_file_is_refused_before_reading(self, tmp_path, monkeypatch):
        """A .metadata over the size cap is refused with its size in the message."""
        data, _ = dcp_metadata_bytes()
        (tmp_path / ".metadata").write_bytes(data)
        monkeypatch.setattr(md, "MAX_METADATA_BYTES", len(data) - 1)
        with pytest.raises(md.MetadataError, match="cap"):
            md.read_metadata(tmp_path / ".metadata")

    def test_symlinked_metadata_is_refused(self, tmp_path):
        """A .metadata that is a symlink is not followed."""
        data, _ = dcp_metadata_bytes()
        (tmp_path / "real").write_bytes(data)
        (tmp_path / ".metadata").symlink_to(tmp_path / "real")
        with pytest.raises(md.MetadataError, match="symlink"):
            md.read_metadata(tmp_path / ".metadata")

    def test_fifo_metadata_is_refused_without_blocking(self, tmp_path):
        """A FIFO planted as .metadata is refused instead of hanging on open."""
        os.mkfifo(tmp_path / ".metadata")
        with pytest.raises(md.MetadataError, match="regular"):
            md.read_metadata(tmp_path / ".metadata")

    def test_rewritten_file_is_parsed_again(self, tmp_path):
        """The cache is keyed by file identity, so a rewritten .metadata is not served stale."""
        path = tmp_path / ".metadata"
        path.write_bytes(dcp_metadata_bytes({"a": 4})[0])
        assert md.read_metadata(path).entries == 1
        tmp = tmp_path / "new"
        tmp.write_bytes(dcp_metadata_bytes({"a": 4, "b": 4, "c": 4})[0])
        os.replace(tmp, path)
        assert md.read_metadata(path).entries == 3

    def test_unpickler_is_the_pure_python_one(self):
        """The reader must not use the C unpickler, whose memo pre-sizing is a memory bomb."""
        assert issubclass(md._SafeUnpickler, pickle._Unpickler)
        assert not isinstance(md._SafeUnpickler(io.BytesIO(b".")), pickle.Unpickler)
