"""Tiny hostile `.metadata` files must cost bounded time and memory: each is parsed in a subprocess under limits.

The subprocess runs `read_metadata` under RLIMIT_AS (so a memory regression dies with MemoryError instead of
eating the machine) and a timeout (so a time regression fails in seconds). Each bomb must come back as an
ordinary MetadataError, with the peak RSS it took reported and checked against a generous budget.
"""
from __future__ import annotations

import struct
from typing import Any

from tests.jobs.dcp_files import storage_metadata_bytes

PROTO = b"\x80\x04"
MEMOIZE = b"\x94"


def _get(i: int) -> bytes:
    return b"h" + bytes([i]) if i < 256 else b"j" + struct.pack("<I", i)


def _str(s: str) -> bytes:
    raw = s.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def _global(module: str, name: str) -> bytes:
    return _str(module) + MEMOIZE + _str(name) + MEMOIZE + b"\x93" + MEMOIZE


def path_doubler(rounds: int = 30) -> bytes:
    """PosixPath(p, p), memoized, fed back `rounds` times: a 2**rounds-character path if the stand-in joins."""
    out = PROTO + _global("pathlib", "PosixPath") + _str("ab") + MEMOIZE  # memo 0-2: global, 3: "ab"
    cur = 3
    for _ in range(rounds):
        out += _get(2) + _get(cur) + _get(cur) + b"\x86" + b"R" + MEMOIZE
        cur += 1
    return out + b"."


def _nested(kind: str, depth: int) -> Any:
    value: Any = "leaf" if kind == "tuple" else ([] if kind == "list" else {})
    for _ in range(depth):
        value = (value, value) if kind == "tuple" else ([value, value] if kind == "list" else {"a": value, "b": value})
    return value


BOMBS = {
    # A _StorageInfo whose relative_path is a self-nested container: repr of it is 2**depth long.
    "self-nesting lists": lambda: storage_metadata_bytes([(_nested("list", 25), 0, 4)]),
    "self-nesting tuples": lambda: storage_metadata_bytes([(_nested("tuple", 25), 0, 4)]),
    "self-nesting dicts": lambda: storage_metadata_bytes([(_nested("dict", 25), 0, 4)]),
    "path doubler": path_doubler,
    # LONG_BINPUT 2**30: the C unpickler sizes its memo to 2**31 slots (16 GiB) for these 8 bytes.
    "LONG_BINPUT 2**30": lambda: PROTO + b"N" + b"r" + struct.pack("<I", 2**30) + b".",
    "BINBYTES declaring 4 GB": lambda: PROTO + b"B" + struct.pack("<I", 2**32 - 1) + b"abc.",
    "BINUNICODE8 declaring 1 TB": lambda: PROTO + b"\x8d" + struct.pack("<Q", 2**40) + b"abc.",
    "FRAME declaring 2**62": lambda: PROTO + b"\x95" + struct.pack("<Q", 2**62) + b"N.",
    "LONG4 of 100 MB": lambda: PROTO + b"\x8b" + struct.pack("<I", 100 << 20) + b"\x01.",
    "MARK nested 1M deep": lambda: PROTO + b"(" * 1_000_000 + b".",
    "TUPLE1 nested 2M deep": lambda: PROTO + _str("x") + b"\x85" * 2_000_000 + b".",
    "EMPTY_DICT 1M times": lambda: PROTO + b"}" * 1_000_000 + b".",
    "memoized strings": lambda: PROTO + (_str("0123456789abcdef") + MEMOIZE + b"0") * 200_000 + b"N.",
    "dict grown by SETITEMS": lambda: PROTO + b"}" + MEMOIZE + (b"(" + b"NN" * 500 + b"u") * 2000 + b".",
}


def test_the_bombs_are_small() -> None:
    """The nesting and doubling bombs are each under 1 KB: their cost would come from amplification alone."""
    for name in ("self-nesting lists", "self-nesting tuples", "self-nesting dicts", "path doubler"):
        assert len(BOMBS[name]()) < 1024, name
