"""Checkpoint loads that read each tensor record straight into its destination, at the disk's speed.

DCP's `FileSystemReader` `torch.load`s every tensor record into a fresh tensor (read, allocate, copy) and
then copies that into the destination, with ~2 ms of Python per record on top; measured on a 1.2 GB
2-rank checkpoint it loads at ~0.7 GB/s from the page cache and ~0.4-0.7x `dd` cold. `CheckpointReader`
reads a record's bytes straight into the destination tensor when the record is exactly that tensor
(same dtype and shape, contiguous, little-endian, no conj or neg bit, a data record of exactly its size:
what a load at the world size of the save asks for),
after reading only the record's zip directory and its ~150-byte pickle, which a stub unpickler that
knows nothing but the tensor-rebuild call decodes (no code from the file runs; anything else is
refused). Every other item (resharding, other dtypes or layouts, non-tensor values) goes through DCP's
own path, unchanged. Records are read on a worker thread with positional reads while the calling thread
resolves the next destinations (`threads` > 1 reads several records at once: slower on 2 cores).
Figures and method: docs/performance-scale.md.
"""
from __future__ import annotations

import io
import os
import pickle
import sys
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from supervisor.checkpoints.integrity import Hasher, check_bytes, covering, mismatch
from supervisor.checkpoints.manifest import read_manifest
from supervisor.host.regularfile import open_regular
from trainer.checksums import VerifyingFileSystem

__all__ = ["CheckpointReader", "record_layout", "RecordLayout", "READ_THREADS"]

READ_THREADS = 1  # reading threads per rank: 2 and 4 were slower here (2 cores; docs/performance-scale.md)
_MAX_PICKLE_BYTES = 4096  # a tensor's pickle is ~150 bytes; a larger one is not what we read in place
_STORAGE_DTYPES = {name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()}


@dataclass(frozen=True)
class RecordLayout:
    """Where a single-tensor `torch.save` record keeps its data, and what the data is."""

    data_offset: int  # of the storage bytes, from the record's start
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage_numel: int
    little_endian: bool


class _Storage:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


def _rebuild(storage: Any, storage_offset: int, size: tuple[int, ...], stride: tuple[int, ...],
             requires_grad: Any = False, backward_hooks: Any = None, metadata: Any = None, *_: Any) -> Any:
    return ("tensor", storage, storage_offset, tuple(size), tuple(stride), metadata)


class _LayoutUnpickler(pickle.Unpickler):
    """Decodes `torch.save(tensor)`'s pickle into the rebuild call's arguments; refuses every other global.

    The C unpickler, not the supervisor's walker (supervisor/checkpoints/metadata/scan.py), on purpose: these
    are the records of the checkpoint this trainer is loading, which DCP would `torch.load` anyway (every item
    this fast path does not take goes there); the walker exists for the daemon, which reads any file under the
    root and must survive it. A hostile record costs no more here than in torch's own load: `find_class` keeps
    the allowlist, and at most _MAX_PICKLE_BYTES are unpickled."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _Storage(_STORAGE_DTYPES[name])
        raise pickle.UnpicklingError(f"not a plain tensor record: {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Storage)):
            raise pickle.UnpicklingError("not a storage reference")
        return ("storage", pid[1].dtype, pid[2], pid[4])  # dtype, key, numel


def record_layout(record: io.IOBase) -> RecordLayout | None:
    """The layout of a `torch.save` record holding one tensor with one storage; None for anything else."""
    try:
        # Its stub names str or IO[bytes]; any object with read/seek/tell does (a RawIOBase view here).
        reader = torch._C.PyTorchFileReader(cast(IO[bytes], record))
        if [r for r in reader.get_all_records() if r.startswith("data/")] != ["data/0"]:
            return None
        pickled = reader.get_record("data.pkl")
        if len(pickled) > _MAX_PICKLE_BYTES:
            return None
        tensor = _LayoutUnpickler(io.BytesIO(pickled)).load()
        # A crafted pickle may decode to any shape of tuple: unpack it here, where a misfit means None.
        _, (_, dtype, key, numel), storage_offset, size, stride, metadata = tensor
        # metadata holds bits the raw bytes do not show (`{"conj": True}`): torch.load applies them, we cannot.
        if tensor[0] != "tensor" or key != "0" or not isinstance(numel, int) or metadata:
            return None
        # torch.load refuses a storage whose record is not exactly its size; so do we (no reading past it).
        if reader.get_record_size("data/0") != numel * dtype.itemsize:
            return None
        # has_record and get_record_offset are bound by pybind but missing from torch/_C/__init__.pyi.
        order = reader.get_record("byteorder") if reader.has_record("byteorder") else b"little"  # type: ignore[attr-defined]
        offset = reader.get_record_offset("data/0")  # type: ignore[attr-defined]
    except (RuntimeError, pickle.UnpicklingError, ValueError, TypeError, EOFError, IndexError, AttributeError):
        return None
    return RecordLayout(offset, dtype, size, stride, storage_offset, numel, order == b"little")


def _pread_into(fd: int, buf: memoryview, offset: int) -> None:
    """Fill `buf` from `fd` at `offset` (positional reads: threads share the fd, not a file position)."""
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if not n:
            raise OSError(f"checkpoint file ends {len(buf) - got} bytes early")
        got += n


class _PreadView(io.RawIOBase):
    """A read-only window [offset, offset + length) of `fd` with its own position (safe across threads)."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self.fd, self.offset, self.length, self.pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.length}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")[:max(0, self.length - self.pos)]
        n = os.preadv(self.fd, [view], self.offset + self.pos) if len(view) else 0
        self.pos += n
        return n


class CheckpointReader(FileSystemReader):
    """DCP's file reader that reads tensor records straight into their destination (see the module doc).

    Records are read by `threads` threads (header, then data, with positional reads, in file order);
    destinations are resolved and committed on the calling thread.
    """

    def __init__(self, path: str | os.PathLike[str], *, direct: bool = True, threads: int = READ_THREADS) -> None:
        super().__init__(path)
        self.direct, self.threads = direct, max(1, threads)
        self.direct_items = 0  # how many items the last read_data read in place (the rest: DCP's path)
        # The ranges hashed at save (trainer/checksums.py): every byte read is checked as it is read.
        manifest = read_manifest(Path(path))
        self.checksums = manifest.checksums if manifest is not None else None
        self.where = os.path.join(os.fspath(path), "")
        if self.checksums:
            self.fs = VerifyingFileSystem(self.checksums, self.where)

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        """DCP's path: an item's bytes, checked against their checksums before DCP decodes them."""
        if not self.checksums:
            return super()._slice_file(file, sinfo)
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        check_bytes(self.checksums, sinfo.relative_path, sinfo.offset, data, self.where)
        return io.BytesIO(data)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self.direct_items = 0
        if not self.direct:
            return super().read_data(plan, planner)
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        rest: list[ReadItem] = []
        with ThreadPoolExecutor(self.threads, thread_name_prefix="ckpt-read") as pool:
            for relative_path, items in per_file.items():
                items.sort(key=lambda i: self.storage_data[i.storage_index].offset)  # one pass through the file
                fd = open_regular(self.fs.concat_path(self.path, relative_path))  # a FIFO would block forever
                jobs: list[tuple[ReadItem, torch.Tensor, Any]] = []
                try:
                    for item in items:
                        dest = self._destination(item, planner)
                        if dest is None:
                            rest.append(item)
                        else:
                            jobs.append((item, dest, pool.submit(self._read_record, fd, item, dest)))
                    for item, dest, job in jobs:
                        if job.result():  # re-raises a short read
                            planner.commit_tensor(item, dest)
                            self.direct_items += 1
                        else:
                            rest.append(item)
                finally:  # never close the fd under a running read
                    for _, _, job in jobs:
                        job.cancel()
                    wait([job for _, _, job in jobs])
                    os.close(fd)
        if rest:
            return super().read_data(replace(plan, items=rest), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _destination(self, item: ReadItem, planner: LoadPlanner) -> torch.Tensor | None:
        """The tensor an item may be read straight into (CPU, contiguous, a whole record); None: DCP's path."""
        info = self.storage_data[item.storage_index]
        if item.type != LoadItemType.TENSOR or info.transform_descriptors or any(item.storage_offsets):
            return None
        dest = planner.resolve_tensor(item).detach()
        if dest.device.type != "cpu" or not dest.is_contiguous() or sys.byteorder != "little":
            return None
        return dest

    def _read_record(self, fd: int, item: ReadItem, dest: torch.Tensor) -> bool:
        """On a pool thread: read the record into `dest` if it is exactly that tensor; False: leave it to DCP."""
        info = self.storage_data[item.storage_index]
        layout = record_layout(_PreadView(fd, info.offset, info.length))
        nbytes = dest.numel() * dest.element_size()
        if (layout is None or not layout.little_endian or layout.dtype != dest.dtype
                or layout.size != tuple(dest.size()) or tuple(item.lengths) != layout.size
                or layout.stride != tuple(dest.stride()) or layout.storage_offset != 0
                or layout.storage_numel != dest.numel() or layout.data_offset + nbytes > info.length):
            return False
        hasher = None
        if self.checksums:
            ranges = covering(self.checksums, info.relative_path, info.offset, info.length, self.where)
            if len(ranges) != 1:
                return False  # several ranges in one record: DCP's path checks each
            hasher, head = Hasher(), bytearray(layout.data_offset)
            _pread_into(fd, memoryview(head), info.offset)
            hasher.update(head)
        data = dest.reshape(-1).view(torch.uint8).numpy().data
        if nbytes:
            _pread_into(fd, data, info.offset + layout.data_offset)
        if hasher is not None:
            tail = bytearray(info.length - layout.data_offset - nbytes)
            _pread_into(fd, memoryview(tail), info.offset + layout.data_offset + nbytes)
            hasher.update(data)
            hasher.update(tail)
            if hasher.hexdigest() != ranges[0][2]:
                raise mismatch(info.relative_path, info.offset, info.length, self.where)
        return True
