"""Checksums computed on a checkpoint's bytes as DCP writes them, and checked as DCP reads them back.

Writing: `HashingFileSystem` replaces a `FileSystemWriter`'s file system; every file it creates is a
`_HashingStream` that hashes each write before passing it on, and starts a new range whenever DCP asks for
the position (`_write_item` does so before and after every item): one range per item, no second read. Each
rank's write results carry their ranges (`CheckedWriteResult`) to the coordinator, which records them in the
manifest (supervisor.checkpoints.integrity has the format and the checks).

Reading: trainer/reader.py checks every item's bytes against its ranges as it reads them, and `.metadata`
through `VerifyingFileSystem`; a mismatch raises `CheckpointCorruptError` naming the file and the range.
"""
from __future__ import annotations

import io
import os
import threading
from collections.abc import Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.storage import WriteResult

from supervisor.checkpoints.integrity import Checksums, Hasher, Segment, check_bytes
from supervisor.layout import METADATA_NAME

__all__ = ["HashingFileSystem", "CheckedWriteResult", "VerifyingFileSystem", "checked_results", "collect"]


_OVERLAP_BYTES = 1 << 20
_HASHER = ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash")  # one writer thread per rank: one hasher


class _HashingStream:
    """A binary file being written, hashed range by range: a range ends wherever the position is asked for."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.segments: list[Segment] = []
        self._start = int(raw.tell())
        self._pos = self._start
        self._hasher = Hasher()

    def write(self, data: Any) -> int:
        if memoryview(data).nbytes < _OVERLAP_BYTES:
            self._hasher.update(data)
            n = int(self.raw.write(data))
        else:  # a tensor's bytes: hashed on another core while they are written (both release the GIL)
            hashed = _HASHER.submit(self._hasher.update, data)
            try:
                n = int(self.raw.write(data))
            finally:
                hashed.result()
        self._pos += n
        return n

    def tell(self) -> int:
        self.cut()
        return self._pos

    def cut(self) -> None:
        if self._pos > self._start:
            self.segments.append((self._start, self._pos - self._start, self._hasher.hexdigest()))
            self._hasher, self._start = Hasher(), self._pos

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        self.cut()
        self.raw.close()

    def fileno(self) -> int:
        return int(self.raw.fileno())

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False  # a seek would make the ranges lie: nothing DCP writes seeks


class HashingFileSystem(FileSystem):
    """DCP's local file system; the files it writes are hashed as written (`segments`: path -> ranges)."""

    def __init__(self) -> None:
        super().__init__()
        self.segments: dict[str, list[Segment]] = {}
        self._lock = threading.Lock()  # DCP may write files from several threads

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        with super().create_stream(path, mode) as raw:
            if mode != "wb":
                yield raw
                return
            stream = _HashingStream(raw)
            try:
                yield stream  # type: ignore[misc]  # duck-typed: write, tell, flush, fileno
            finally:
                stream.cut()
                with self._lock:
                    self.segments[os.fspath(path)] = stream.segments


@dataclass(frozen=True)
class CheckedWriteResult(WriteResult):
    """DCP's write result plus the checksummed ranges of the item's bytes (pickled to the coordinator)."""

    checksums: tuple[Segment, ...] = ()


def checked_results(results: list[WriteResult], fs: HashingFileSystem, directory: Path) -> list[WriteResult]:
    """Each result with the ranges that were written inside its item's bytes."""
    out: list[WriteResult] = []
    for wr in results:
        info = wr.storage_data
        segments = fs.segments.get(os.fspath(directory / info.relative_path), [])
        inside = tuple(s for s in segments if s[0] >= info.offset and s[0] + s[1] <= info.offset + info.length)
        out.append(CheckedWriteResult(wr.index, wr.size_in_bytes, wr.storage_data, checksums=inside))
    return out


def collect(results: list[list[WriteResult]], fs: HashingFileSystem, directory: Path) -> dict[str, list[Segment]]:
    """On the coordinator, after `.metadata` is written: every rank's ranges by file name, and `.metadata`'s."""
    files: dict[str, list[Segment]] = {}
    for wr in (wr for rank in results for wr in rank):
        files.setdefault(wr.storage_data.relative_path, []).extend(getattr(wr, "checksums", ()))
    meta = [v for k, v in fs.segments.items() if Path(k).name == f"{METADATA_NAME}.tmp"]
    if meta:
        files[METADATA_NAME] = meta[-1]
    return files


class VerifyingFileSystem(FileSystem):
    """DCP's local file system for reading; `.metadata` is checked against its checksum as it is read."""

    def __init__(self, checksums: Checksums, where: str) -> None:
        super().__init__()
        self.checksums, self.where = checksums, where

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as raw:
            if mode != "rb" or Path(path).name != METADATA_NAME or METADATA_NAME not in self.checksums:
                yield raw
                return
            data = raw.read()
            check_bytes(self.checksums, METADATA_NAME, 0, data, self.where)
            yield io.BytesIO(data)
