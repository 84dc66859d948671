"""Tests for supervisor.checkpoints.metadata.reader: the allowlisting, torch-free, bounded-cost DCP metadata reader."""
from __future__ import annotations

import io
import json
import os
import pickle
import re
import struct
import subprocess
from pathlib import Path

import pytest

import supervisor.checkpoints
from supervisor.checkpoints.metadata import reader as md
from supervisor.checkpoints.metadata import scan as metadata_scan
from tests.jobs.dcp_files import dcp_metadata_bytes, storage_metadata_bytes, write_checkpoint

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metadata"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())


class _Evil:
    """Pickles as `func(*args)`: what an attacker would plant in `.metadata`."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


class _Global:
    """Pickles as the global `module.name`, whatever is (or is not) importable here."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __reduce__(self):
        return self.name


def _str(s: str) -> bytes:
    return b"\x8c" + bytes([len(s)]) + s.encode()


def stack_global(module: str, name: str) -> bytes:
    return _str(module) + _str(name) + b"\x93"


def global_pickle(module: str, name: str) -> bytes:
    """A protocol-4 pickle naming the global module.name (then calling it with no arguments)."""
    return b"\x80\x04" + stack_global(module, name) + b")R."


def summary(meta: md.DcpMetadata) -> dict:
    return {"version": meta.version, "entries": meta.entries,
            "storage": [[r.relative_path, r.min_size, r.items] for r in meta.storage]}


class TestInterpreterFixtures:
    """`.metadata` from CPython 3.10-3.13 (real torch 2.13 on 3.11.2 and 3.11.7; see fixtures/metadata/README.md)."""

    @pytest.mark.parametrize("name", sorted(EXPECTED))
    def test_fixture_parses_to_torchs_storage_refs(self, name):
        """Every fixture parses, and its storage refs, entry count and version are what torch computes."""
        meta = md.parse_metadata((FIXTURES / name).read_bytes())
        assert summary(meta) == EXPECTED[name]

    def test_fixtures_cover_every_interpreter_and_both_writers(self):
        """The set is complete: 3.10.13, 3.11.2, 3.11.7, 3.12.1, 3.13.0, each with a dcp.save and an FSDP2 file."""
        made = {"3.11.2": "torch2.13.0", "3.11.7": "torch2.13.0", "3.10.13": "repro", "3.12.1": "repro",
                "3.13.0": "repro"}
        assert set(EXPECTED) == {f"py{v}-{how}-{k}.metadata" for v, how in made.items() for k in ("single", "fsdp2")}
        assert set(EXPECTED) == {p.name for p in FIXTURES.glob("*.metadata")}

    def test_debian_3_11_2_fixture_uses_the_getattr_enum_form(self):
        """Real torch under 3.11.2 pickles the memory-format enum via builtins.getattr: the form we must accept."""
        for kind in ("single", "fsdp2"):
            data = (FIXTURES / f"py3.11.2-torch2.13.0-{kind}.metadata").read_bytes()
            assert b"\x8c\x08builtins\x94\x8c\x07getattr" in data
            assert b"getattr" not in (FIXTURES / f"py3.11.7-torch2.13.0-{kind}.metadata").read_bytes()

    def test_3_13_fixture_pickles_paths_from_pathlib_local(self):
        """CPython 3.13 names StorageMeta.checkpoint_id's class pathlib._local.PosixPath, which must be allowed."""
        assert b"pathlib._local" in (FIXTURES / "py3.13.0-repro-fsdp2.metadata").read_bytes()

    @pytest.mark.parametrize("name", sorted(EXPECTED))
    def test_fast_path_and_opcode_loop_agree_on_fixture(self, name):
        """The regex fast path is an accelerator only: with it off, every fixture gives the same summary."""
        data = (FIXTURES / name).read_bytes()
        slow = md._summarize(metadata_scan.scan(io.BytesIO(data), len(data), fast=False))
        assert slow == md.parse_metadata(data)


class TestRefusedGlobals:
    @pytest.mark.parametrize("func,args", [
        (os.system, ("true",)), (eval, ("1+1",)), (exec, ("pass",)), (subprocess.Popen, (["true"],)),
        (__import__, ("os",)), (open, ("/tmp/x", "w")), (pickle.loads, (b"N.",)),
    ])
    def test_dangerous_callables_are_refused_as_unsafe(self, func, args):
        """A pickle calling os.system, eval, exec, subprocess.Popen, __import__, open or pickle.loads: unsafe.

        The refusal names the global as the pickle does, which is the interpreter's: `open` is io.open on 3.11 and
        _io.open on 3.13 (`make lint` runs this file on both)."""
        shown = re.escape(f"{func.__module__}.{func.__qualname__}")
        with pytest.raises(md.UnsafeMetadataError, match=rf"^refuses {shown} \(could run code\)$"):
            md.parse_metadata(pickle.dumps(_Evil(func, *args)))

    @pytest.mark.parametrize("module,name", [
        ("importlib", "import_module"), ("sys", "modules"), ("codecs", "encode"), ("os", "system"),
        ("posix", "system"), ("builtins", "open"), ("torch", "load"), ("torch.hub", "load"),
    ])
    def test_named_dangerous_globals_are_refused_as_unsafe(self, module, name):
        """Globals from modules that can run code, touch files or load pickles (torch.load too) are unsafe."""
        with pytest.raises(md.UnsafeMetadataError, match="could run code"):
            md.parse_metadata(global_pickle(module, name))

    @pytest.mark.parametrize("module,name", [
        ("torch.distributed.checkpoint.metadata", "Foo"), ("torch", "float128"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfoV2"),
    ])
    def test_unknown_torch_classes_are_unknown_not_unsafe(self, module, name):
        """A torch name the allowlist does not know is UnknownClassError (a newer torch?), not UnsafeMetadataError."""
        with pytest.raises(md.UnknownClassError) as info:
            md.parse_metadata(global_pickle(module, name))
        assert str(info.value) == f"unknown class {module}.{name} in .metadata (written by a newer torch?)"
        assert not isinstance(info.value, md.UnsafeMetadataError)

    def test_other_globals_are_refused_as_not_dcp(self):
        """A harmless but foreign global (collections.OrderedDict) is refused too, as not a DCP class."""
        with pytest.raises(md.UnsafeMetadataError, match=r"^refuses collections.OrderedDict \(not a DCP class\)$"):
            md.parse_metadata(global_pickle("collections", "OrderedDict"))

    def test_getattr_is_allowed_only_on_an_allowlisted_enum_member(self):
        """getattr(_MEM_FORMAT_ENCODING, member) is fine; another member name or another object is unsafe."""
        dcp = "torch.distributed.checkpoint.metadata"

        def getattr_pickle(owner: tuple[str, str], attr: str) -> bytes:
            return b"\x80\x04" + stack_global("builtins", "getattr") + stack_global(*owner) + _str(attr) + b"\x86R."

        with pytest.raises(md.MetadataError, match="not DCP Metadata"):  # accepted; just not a Metadata
            md.parse_metadata(getattr_pickle((dcp, "_MEM_FORMAT_ENCODING"), "TORCH_CHANNELS_LAST"))
        for owner, attr in [((dcp, "_MEM_FORMAT_ENCODING"), "__class__"), ((dcp, "_MEM_FORMAT_ENCODING"), "mro"),
                            (("torch", "Size"), "__reduce__"), ((dcp, "Metadata"), "__init__")]:
            with pytest.raises(md.UnsafeMetadataError, match=r"refuses builtins.getattr on .* \(could run code\)"):
                md.parse_metadata(getattr_pickle(owner, attr))

    def test_getattr_on_a_path_is_refused(self):
        """getattr(Path("x"), "unlink") (a path method) is unsafe."""
        with pytest.raises(md.UnsafeMetadataError, match="builtins.getattr"):
            md.parse_metadata(pickle.dumps(_Evil(getattr, Path("x"), "unlink")))

    def test_file_creating_pickle_never_creates_the_file(self, tmp_path):
        """A pickle that creates a file when loaded by pickle is refused and the file never appears."""
        bomb = pickle.dumps(_Evil(open, str(tmp_path / "pwned"), "w"))
        pickle.loads(bomb).close()  # the trap is live: plain pickle does create it
        assert (tmp_path / "pwned").exists()
        (tmp_path / "pwned").unlink()
        with pytest.raises(md.UnsafeMetadataError):
            md.parse_metadata(bomb)
        assert not (tmp_path / "pwned").exists()

    @pytest.mark.parametrize("data,match", [
        (b"\x80\x04\x8c\x01x\x94Q.", "persistent id"),
        (b"\x80\x02\x82\x01.", "extension"),
        (b"\x80\x02cos\nsystem\n)R.", "os.system"),  # GLOBAL, the protocol 2-3 form
    ])
    def test_indirect_global_forms_are_unsafe(self, data, match):
        """Persistent ids, extension-registry codes and text GLOBALs are refused as unsafe too."""
        with pytest.raises(md.UnsafeMetadataError, match=match):
            md.parse_metadata(data)

    def test_an_allowed_class_cannot_be_called_through_reduce(self):
        """A dtype or class stand-in is inert: calling it through REDUCE fails instead of doing anything."""
        for data in (b"\x80\x04\x8c\x05torch\x8c\x07float32\x93\x8c\x01x\x85R.", global_pickle(
                "torch.distributed.checkpoint.metadata", "Metadata")):
            with pytest.raises(md.MetadataError, match="not an allowed function"):
                md.parse_metadata(data)


def metadata_dir(tmp_path: Path, data: bytes) -> Path:
    """A one-shard checkpoint whose `.metadata` is `data` and which has no manifest (the metadata decides)."""
    d = write_checkpoint(tmp_path, 5, shards=1)
    (d / ".metadata").write_bytes(data)
    (d / "manifest.json").unlink()
    return d


class TestVerdictKinds:
    def _dir(self, tmp_path: Path, data: bytes) -> Path:
        return metadata_dir(tmp_path, data)

    def test_unsafe_metadata_verdict(self, tmp_path):
        """verify(): a code-running global is `invalid`, kind "unsafe", reason naming it and saying why."""
        v = supervisor.checkpoints.verify(self._dir(tmp_path, pickle.dumps(_Evil(os.system, "true"))))
        assert (v.state, v.kind, v.reason) == ("invalid", "unsafe",
                                               "unsafe .metadata: refuses posix.system (could run code)")

    def test_unknown_class_verdict(self, tmp_path):
        """verify(): an unknown torch class is `invalid`, kind "unknown_class", reason suggesting a newer torch."""
        v = supervisor.checkpoints.verify(self._dir(tmp_path, global_pickle("torch.distributed.checkpoint.metadata", "Foo")))
        assert (v.state, v.kind) == ("invalid", "unknown_class")
        assert v.reason == "unknown class torch.distributed.checkpoint.metadata.Foo in .metadata (written by a newer torch?)"

    def test_unparseable_metadata_verdict(self, tmp_path):
        """verify(): garbage is `invalid`, kind "bad_metadata"; a complete checkpoint has no kind."""
        v = supervisor.checkpoints.verify(self._dir(tmp_path, b"\x00garbage"))
        assert (v.state, v.kind) == ("invalid", "bad_metadata") and v.reason.startswith("bad .metadata: ")
        assert supervisor.checkpoints.verify(write_checkpoint(tmp_path, 6)).kind is None


class TestHostileBytes:
    def test_garbage_is_unparseable(self):
        """Random bytes are a MetadataError naming the failure, not a crash."""
        with pytest.raises(md.MetadataError, match="unparseable"):
            md.parse_metadata(b"\x00garbage\xff" * 10)

    def test_truncated_metadata_is_unparseable(self):
        """A metadata pickle cut anywhere is a MetadataError."""
        data = (FIXTURES / "py3.11.7-torch2.13.0-fsdp2.metadata").read_bytes()
        for cut in (1, 11, len(data) // 3, len(data) // 2, len(data) - 1):
            with pytest.raises(md.MetadataError):
                md.parse_metadata(data[:cut])

    def test_non_metadata_top_level_is_rejected(self):
        """A safe pickle of a plain dict is not DCP metadata."""
        with pytest.raises(md.MetadataError, match="not DCP Metadata"):
            md.parse_metadata(pickle.dumps({"state_dict_metadata": {}}))

    def test_memo_may_not_skip_ahead(self):
        """LONG_BINPUT to an index past the memo's end is refused (the C unpickler would allocate for it)."""
        with pytest.raises(md.MetadataError, match="skips ahead"):
            md.parse_metadata(b"\x80\x04N" + b"r" + struct.pack("<I", 2**31) + b".")

    def test_deep_nesting_is_an_error_not_a_crash(self):
        """A pickle nesting lists very deeply is reported, not a RecursionError escaping."""
        data = b"\x80\x04" + b"](" * 200_000 + b"e" * 200_000 + b"."
        with pytest.raises(md.MetadataError, match="too deeply"):
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
    def test_cap_fits_405b_on_1024_ranks(self):
        """The size cap admits the largest shape bench.synthetic writes (405B x 1024 ranks: ~0.62 GB) with margin."""
        assert md.MAX_METADATA_BYTES >= 1.5 * 620e6

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

    def test_input_is_read_in_blocks_never_whole(self):
        """The scanner reads a 1.5 MB file 256 KiB at a time: the input never sits in memory at once."""
        data = dcp_metadata_bytes({f"w{i}": 1 << 16 for i in range(256)}, shards=32)[0]
        assert len(data) > 1 << 20
        sizes: list[int] = []

        class Counting(io.BytesIO):
            def read(self, n=-1):
                sizes.append(n)
                return super().read(n)

        metadata_scan.scan(Counting(data), len(data))
        assert len(sizes) > 4 and max(sizes) <= (1 << 18) + 4096


class TestCollectorPaused:
    def test_off_while_parsing_restored_after_even_on_refusal(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The cyclic collector is off during a parse (it stalled the loop thread) and back on afterwards,
        also when the parse refuses its input."""
        import gc
        seen: list[bool] = []
        real_scan = md.scan

        def spying_scan(f, size):  # type: ignore[no-untyped-def]
            seen.append(gc.isenabled())
            return real_scan(f, size)

        monkeypatch.setattr(md, "scan", spying_scan)
        assert gc.isenabled()
        md.parse_metadata(dcp_metadata_bytes()[0])
        with pytest.raises(md.MetadataError):
            md.parse_metadata(global_pickle("os", "system"))
        assert seen == [False, False] and gc.isenabled()

    def test_the_scanned_graph_is_freed_in_slices(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The parse empties the scanned containers itself (a slice at a time) rather than dropping the whole
        graph in one deallocation cascade, which held the GIL ~100 ms at 70B x 256."""
        roots: list[object] = []
        real_scan = md.scan
        monkeypatch.setattr(md, "scan", lambda f, size: roots.append(real_scan(f, size)) or roots[-1])
        meta = md.parse_metadata(dcp_metadata_bytes({f"t{i}": 8 for i in range(600)}, shards=2)[0])
        assert meta.entries == 600
        root = roots[0]
        assert len(root.state_dict_metadata) == 0 and len(root.storage_data) == 0  # type: ignore[attr-defined]
