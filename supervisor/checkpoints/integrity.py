"""Checksums of a checkpoint's bytes: xxh3_64 over byte ranges, recorded while a save writes them (torch-free).

A checkpoint's checksums are a map `file name -> [(offset, length, hex digest), ...]`: one range per item DCP
wrote (a tensor record, a bytes item), one for the whole `.metadata`. A loader checks exactly the ranges it
reads, so a load by another world size (resharding) verifies too. The ranges are computed on the bytes as they
are written (trainer/checksums.py wraps DCP's file streams), never by reading the files back.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import xxhash

from supervisor.contract import CHECKSUM_ALGORITHM as ALGORITHM
from supervisor.errors import CheckpointCorruptError

__all__ = ["ALGORITHM", "Segment", "Checksums", "Hasher", "digest", "covering", "check_bytes", "mismatch", "CORRUPT_PREFIX",
           "CheckpointCorruptError"]

CORRUPT_PREFIX = "corrupt: "  # the quarantine reason of a checkpoint whose bytes failed: its state is `corrupt`
Segment = tuple[int, int, str]  # offset, length, hex digest
Checksums = Mapping[str, Sequence[Segment]]


Hasher = xxhash.xxh3_64  # one running checksum; `update` takes any bytes-like object


def digest(*chunks: bytes | bytearray | memoryview) -> str:
    h = Hasher()
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def covering(checksums: Checksums, name: str, start: int, length: int, where: str = "") -> list[Segment]:
    """The recorded ranges that make up exactly [start, start + length) of `name`.

    Raises CheckpointCorruptError when they do not tile it (a range no save wrote, or checksums that were
    edited): a checkpoint that carries checksums has one for every byte a loader reads.
    """
    inside = sorted(s for s in checksums.get(name, ()) if s[0] >= start and s[0] + s[1] <= start + length)
    at = start
    for offset, size, _ in inside:
        if offset != at:
            break
        at += size
    if at != start + length:
        raise CheckpointCorruptError(f"checkpoint corrupt: {where}{name} bytes {start}-{start + length}: "
                                     "no checksum recorded for them")
    return inside


def check_bytes(checksums: Checksums, name: str, start: int, data: bytes | bytearray | memoryview,
                where: str = "") -> None:
    """Check `data`, read from `name` at `start`, against every recorded range it is made of."""
    view = memoryview(data).cast("B")
    for offset, size, expected in covering(checksums, name, start, len(view), where):
        if digest(view[offset - start:offset - start + size]) != expected:
            raise mismatch(name, offset, size, where)


def mismatch(name: str, offset: int, size: int, where: str = "") -> CheckpointCorruptError:
    return CheckpointCorruptError(f"checkpoint corrupt: {where}{name} bytes {offset}-{offset + size} do not match "
                                  f"their {ALGORITHM} checksum recorded at save")
