"""trainer/reader.py: tensor records read in place when they are exactly their destination, DCP's path otherwise."""
from __future__ import annotations

import io
import os
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import CheckpointException, FileSystemReader  # noqa: E402

from tests.helpers import returns_despite_fifo  # noqa: E402
from trainer import checkpoint, reader  # noqa: E402
from trainer.checkpoint import _Writer  # noqa: E402
from trainer.reader import CheckpointReader, record_layout  # noqa: E402


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(64, 32, generator=g), "h": torch.randn(8, dtype=torch.float64, generator=g),
                      "bf": torch.randn(16, 4, generator=g).to(torch.bfloat16), "step": torch.tensor(7),
                      "empty": torch.zeros(0, 3)},
            "train": {"step": 3, "note": "x"}}


def _zeros_like(state: dict) -> dict:
    return {k: _zeros_like(v) if isinstance(v, dict) else torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
            for k, v in state.items()}


def _tensors(state: dict) -> list:
    return [t for v in state.values() for t in (_tensors(v) if isinstance(v, dict) else [v])
            if isinstance(t, torch.Tensor)]


class TestRecordLayout:
    def test_plain_tensor_and_view(self) -> None:
        """A saved tensor's dtype, shape and data offset; a saved view keeps its storage offset."""
        buf = io.BytesIO()
        torch.save(torch.arange(12, dtype=torch.int32).reshape(3, 4), buf)
        layout = record_layout(io.BytesIO(buf.getvalue()))
        assert layout is not None and layout.dtype == torch.int32 and layout.size == (3, 4)
        assert layout.stride == (4, 1) and layout.storage_offset == 0 and layout.little_endian
        data = buf.getvalue()[layout.data_offset:layout.data_offset + 48]
        assert torch.equal(torch.frombuffer(bytearray(data), dtype=torch.int32), torch.arange(12, dtype=torch.int32))
        buf = io.BytesIO()
        torch.save(torch.arange(10.0)[2:5], buf)
        view = record_layout(io.BytesIO(buf.getvalue()))
        assert view is not None and view.storage_offset == 2 and view.storage_numel == 10

    def test_anything_else_is_refused(self) -> None:
        """Records that are not one plain tensor (a dict, two storages, a subclass) get None, nothing runs."""
        for obj in ({"a": torch.ones(2)}, [torch.ones(2), torch.zeros(2)], torch.nn.Parameter(torch.ones(2))):
            buf = io.BytesIO()
            torch.save(obj, buf)
            assert record_layout(io.BytesIO(buf.getvalue())) is None, obj
        assert record_layout(io.BytesIO(b"not a zip")) is None


class TestCheckpointReader:
    def test_round_trip_reads_every_tensor_in_place(self, tmp_path: Path) -> None:
        """Saved by the trainer's writer, loaded by its reader: equal values, every tensor read in place."""
        state = _state()
        dcp.save(state, storage_writer=_Writer(tmp_path / "c"))
        target = _zeros_like(state)
        ours = CheckpointReader(tmp_path / "c", threads=3)
        dcp.load(target, storage_reader=ours)
        assert all(torch.equal(a, b) for a, b in zip(_tensors(target), _tensors(state)))
        assert target["train"] == state["train"]
        assert ours.direct_items == sum(1 for t in _tensors(state) if t.numel())  # DCP reads no empty tensor

    def test_other_layouts_go_through_dcp(self, tmp_path: Path) -> None:
        """A destination of another dtype or a non-contiguous one is filled by DCP's path, converting."""
        w = torch.arange(12.0).reshape(3, 4)
        dcp.save({"w": w, "v": w.clone()}, storage_writer=_Writer(tmp_path / "c"))
        target = {"w": torch.zeros(3, 4, dtype=torch.float64), "v": torch.zeros(4, 3).t()}
        ours = CheckpointReader(tmp_path / "c")
        dcp.load(target, storage_reader=ours)
        assert ours.direct_items == 0
        assert torch.equal(target["w"], w.double()) and torch.equal(target["v"], w)

    def test_load_checkpoint_uses_it(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """The trainer's load_checkpoint reads through CheckpointReader, in place."""
        used: list[CheckpointReader] = []

        class Spy(CheckpointReader):
            def __init__(self, *a: object, **kw: object) -> None:
                super().__init__(*a, **kw)  # type: ignore[arg-type]
                used.append(self)

        monkeypatch.setattr(checkpoint, "CheckpointReader", Spy)
        state = {"w": torch.randn(256, 256)}
        dcp.save(state, storage_writer=_Writer(tmp_path / "c"))
        target = _zeros_like(state)
        checkpoint.load_checkpoint(tmp_path / "c", target)
        assert torch.equal(target["w"], state["w"]) and [r.direct_items for r in used] == [1]

    def test_load_checkpoint_pauses_the_collector(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """The cyclic collector is off while the records are read (a full collection stalled a third of the
        cold loads by 0.2-0.35 s) and back on afterwards, also when the load fails."""
        import gc
        seen: list[bool] = []
        real_read = CheckpointReader.read_data

        def spying_read(self, plan, planner):  # type: ignore[no-untyped-def]
            seen.append(gc.isenabled())
            return real_read(self, plan, planner)

        monkeypatch.setattr(CheckpointReader, "read_data", spying_read)
        state = {"w": torch.randn(16, 16)}
        dcp.save(state, storage_writer=_Writer(tmp_path / "c"))
        assert gc.isenabled()
        checkpoint.load_checkpoint(tmp_path / "c", _zeros_like(state))
        assert seen == [False] and gc.isenabled()
        with pytest.raises(CheckpointException):
            checkpoint.load_checkpoint(tmp_path / "c", {"missing": torch.zeros(2)})
        assert gc.isenabled()

    def test_a_short_file_is_an_error(self, tmp_path: Path) -> None:
        """A record whose bytes end early raises instead of leaving part of the tensor unread."""
        (tmp_path / "f").write_bytes(b"x" * 100)
        buf = bytearray(80)
        with open(tmp_path / "f", "rb") as f:
            reader._pread_into(f.fileno(), memoryview(buf), 10)
            assert bytes(buf) == b"x" * 80
            with pytest.raises(OSError, match="early"):
                reader._pread_into(f.fileno(), memoryview(buf), 50)


def _with_pickle(record: bytes, edit: Callable[[bytes], bytes]) -> bytes:
    """`record` (one `torch.save` zip) with its data.pkl replaced by `edit(data.pkl)`, padded to the same size."""
    entry = next(i for i in zipfile.ZipFile(io.BytesIO(record)).infolist() if i.filename.endswith("data.pkl"))
    name_len, extra_len = struct.unpack("<HH", record[entry.header_offset + 26:entry.header_offset + 30])
    start = entry.header_offset + 30 + name_len + extra_len
    new = edit(record[start:start + entry.file_size])
    assert len(new) <= entry.file_size
    return record[:start] + new.ljust(entry.file_size, b".") + record[start + entry.file_size:]


class TestCraftedRecords:
    def test_malformed_rebuild_arguments_are_refused_not_raised(self) -> None:
        """A pickle whose rebuild call gets an int or a short tuple for its storage gives None, no exception."""
        buf = io.BytesIO()
        torch.save(torch.ones(4), buf)
        rebuild = b"ctorch._utils\n_rebuild_tensor_v2\n"
        for storage in (b"J\x05\x00\x00\x00", b"(J\x01\x00\x00\x00J\x02\x00\x00\x00t", b"X\x02\x00\x00\x00ab"):
            pk = b"\x80\x02" + rebuild + b"(" + storage + b"K\x00(K\x04t(K\x01ttR."
            assert record_layout(io.BytesIO(_with_pickle(buf.getvalue(), lambda _: pk))) is None, storage  # noqa: B023

    def test_a_storage_type_that_misfits_its_record_is_an_error_as_in_dcp(self, tmp_path: Path) -> None:
        """A record whose pickle names a storage type its data/0 bytes do not fit fails like DCP's load.

        (Read in place, the first half of the float32 bytes would silently load as float16.)
        """
        dcp.save({"w": torch.randn(64, 32)}, storage_writer=_Writer(tmp_path / "c"))
        info = next(iter(FileSystemReader(tmp_path / "c").read_metadata().storage_data.values()))
        shard = tmp_path / "c" / info.relative_path
        data = shard.read_bytes()
        record = data[info.offset:info.offset + info.length]
        crafted = _with_pickle(record, lambda pk: pk.replace(b"FloatStorage", b"HalfStorage"))
        shard.write_bytes(data[:info.offset] + crafted + data[info.offset + info.length:])
        assert record_layout(io.BytesIO(crafted)) is None
        for reader_ in (FileSystemReader(tmp_path / "c"), CheckpointReader(tmp_path / "c")):
            with pytest.raises(CheckpointException):
                dcp.load({"w": torch.zeros(64, 32, dtype=torch.float16)}, storage_reader=reader_)

    def test_a_shard_replaced_by_a_fifo_is_an_error_not_a_hang(self, tmp_path: Path) -> None:
        """A shard file that is a FIFO fails the load at once (DCP's own reader would block in open())."""
        dcp.save({"w": torch.randn(8, 4)}, storage_writer=_Writer(tmp_path / "c"))
        info = next(iter(FileSystemReader(tmp_path / "c").read_metadata().storage_data.values()))
        shard = tmp_path / "c" / info.relative_path
        shard.unlink()
        os.mkfifo(shard)

        def load() -> str:
            try:
                dcp.load({"w": torch.zeros(8, 4)}, storage_reader=CheckpointReader(tmp_path / "c"))
            except CheckpointException as e:
                return str(e)
            return "loaded"

        assert "not a regular file" in str(returns_despite_fifo(shard, load))

    def test_a_zip_directory_lying_about_the_data_size_is_refused(self) -> None:
        """A record whose zip directory gives data/0 another size than its pickle's storage is not read in place."""
        buf = io.BytesIO()
        torch.save(torch.ones(64), buf)
        record = bytearray(buf.getvalue())
        entry = record.find(b"PK\x01\x02")  # walk the central directory to data/0's entry
        while not bytes(record[entry + 46:entry + 46 + struct.unpack("<H", record[entry + 28:entry + 30])[0]]).endswith(
                b"data/0"):
            entry = record.find(b"PK\x01\x02", entry + 4)
        size = struct.unpack("<I", record[entry + 24:entry + 28])[0]
        record[entry + 20:entry + 28] = struct.pack("<II", size - 4, size - 4)  # compressed, uncompressed
        with pytest.raises(RuntimeError, match="record size"):
            torch.load(io.BytesIO(bytes(record)), weights_only=True)
        assert record_layout(io.BytesIO(bytes(record))) is None

    def test_a_conjugated_tensor_loads_its_values_not_its_raw_bytes(self, tmp_path: Path) -> None:
        """A saved tensor with the conj bit (its pickle's metadata) goes through DCP's path: the values load."""
        c = torch.randn(6, dtype=torch.complex64, generator=torch.Generator().manual_seed(0)).conj()
        dcp.save({"c": c}, storage_writer=_Writer(tmp_path / "c"))
        target = {"c": torch.zeros(6, dtype=torch.complex64)}
        ours = CheckpointReader(tmp_path / "c")
        dcp.load(target, storage_reader=ours)
        assert torch.equal(target["c"], c.resolve_conj()) and ours.direct_items == 0
