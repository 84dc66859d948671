"""Whole DCP records in one regex match: the scanner's fast path for the two shapes that fill `.metadata`.

Why: docs/performance-scale.md, 'The loop'. A record is taken here only when its effect is provably what the
opcode loop would do with the same bytes; the exactness rules: docs/design.md, 'Notes for maintainers'.
"""
from __future__ import annotations

import operator
import re
import struct
from collections.abc import Callable
from typing import Any

from supervisor.checkpoints.metadata.allowlist import INERT, SIZE, ClassStandIn

__all__ = ["StorageInfo", "Records"]

# One int each (typeshed's unpack_from returns tuple[Any, ...]).
_U32: Callable[[bytes, int], tuple[int]] = struct.Struct("<I").unpack_from
_I32: Callable[[bytes, int], tuple[int]] = struct.Struct("<i").unpack_from

_REF = rb"(?:h.|j....)"  # BINGET / LONG_BINGET
_LONG1 = rb"\x8a(?:\x00|\x01.|\x02..|\x03.{3}|\x04.{4}|\x05.{5}|\x06.{6}|\x07.{7}|\x08.{8}|\x09.{9})"
_INT = rb"(?:K.|M..|J....|" + _LONG1 + rb")"  # BININT1 / BININT2 / BININT / LONG1
# torch.Size(dims) after the Size reference: dims of 0-3 ints (one capture: empty when 0-d), args, REDUCE.
_DIMS = rb"(\)|" + _INT + rb"\x85\x94|" + _INT + _INT + rb"\x86\x94|" + _INT * 3 + rb"\x87\x94)\x85\x94R\x94"
_NEW = rb"\)\x81\x94}\x94\("  # EMPTY_TUPLE NEWOBJ MEMOIZE EMPTY_DICT MEMOIZE MARK

# ChunkStorageMetadata(offsets=Size, sizes=Size). Groups: (cls, key, Size), dims, (key, Size), dims.
_CHUNK = re.compile(rb"(" + _REF + _NEW + _REF + _REF + rb")" + _DIMS + rb"(" + _REF + _REF + rb")" + _DIMS + rb"ub",
                    re.DOTALL)
# MetadataIndex(fqn, index, offset) -> _StorageInfo(relative_path, offset, length). The fqn is an ASCII
# SHORT_BINUNICODE whose length byte is checked against the match (no other string can match the run,
# as MEMOIZE is not ASCII); the relative path is a reference to the rank's file name. Groups:
# (cls, key), length, fqn, (key), (key, Size), dims, (info cls, key, path, key), offset, (key), length.
_PAIR = re.compile(
    rb"(" + _REF + _NEW + _REF + rb")\x8c(.)([\x00-\x7f]{0,255})\x94(" + _REF + rb")(?:" + _INT + rb"|N)("
    + _REF + _REF + rb")" + _DIMS + rb"ub(" + _REF + _NEW + _REF + _REF + _REF + rb")(" + _INT + rb")("
    + _REF + rb")(" + _INT + rb")ub",
    re.DOTALL,
)
_PAIR_REFS = operator.itemgetter(0, 3, 4, 6, 8)  # the groups that are runs of references


class StorageInfo:
    """A `_StorageInfo`: the file it points into and the end of its byte range (offset + length).

    No __init__ on purpose (a Python-level one costs a tenth of the fast path): `empty()` for BUILD.
    """

    __slots__ = ("end", "relative_path")
    relative_path: str | None  # None only as built by empty(), until BUILD sets it
    end: int

    @classmethod
    def empty(cls) -> StorageInfo:
        info = cls()
        info.relative_path, info.end = None, -1
        return info


def _index(ref: bytes, top: int) -> int:
    """The memo index of a BINGET / LONG_BINGET, or -1 when it points at or past `top`."""
    i = ref[1] if ref[0] == 0x68 else _U32(ref, 1)[0]
    return i if i < top else -1


def _int(raw: bytes) -> int:
    """The value of a BININT1 / BININT2 / BININT / LONG1 opcode with its argument."""
    op = raw[0]
    if op == 0x4A:
        return _I32(raw, 1)[0]
    if op == 0x8A:
        return int.from_bytes(raw[2:], "little", signed=True)
    return int.from_bytes(raw[1:], "little")


_MISSING = object()


def _resolve(memo: list[Any], refs: tuple[bytes, ...]) -> list[Any]:
    """The memo entries a tuple of reference runs points at (_MISSING past the end: the loop would fail)."""
    out = []
    top = len(memo)
    for run in refs:
        i = 0
        while i < len(run):  # the constant bytes between references are never "h" or "j"
            if run[i] == 0x68 or run[i] == 0x6A:
                width = 2 if run[i] == 0x68 else 5
                j = _index(run[i:i + width], top)
                out.append(memo[j] if j >= 0 else _MISSING)
                i += width
            else:
                i += 1
    return out


def _is_class(value: Any, role: str) -> bool:
    return type(value) is ClassStandIn and value.role == role


_INERTS = [[INERT] * n for n in range(16)]


class Records:
    """The fast path of one scan. Remembers which reference tuples it has checked against the memo.

    Memo entries never change once written except through BINPUT / LONG_BINPUT (the scanner calls
    `forget()` then) and BUILD dropping a state dict (its slot is never a class, a key or Size, so a
    remembered tuple stays true).
    """

    def __init__(self) -> None:
        self._chunks: set[tuple[bytes, ...]] = set()
        self._pairs: dict[tuple[bytes, ...], str] = {}
        self.cost = 0  # bytes the remembered tuples hold, for the scanner's memory budget

    def forget(self) -> None:
        self._chunks.clear()
        self._pairs.clear()

    def chunks(self, buf: bytes, at: int, end: int, memo: list[Any], stack: list[Any]) -> int:
        """Run consecutive ChunkStorageMetadata records from `at`, pushing INERT for each; the end of the last."""
        match, known, inerts = _CHUNK.match, self._chunks, _INERTS
        while True:
            m = match(buf, at, end)
            if m is None:
                return at
            refs1, d1, refs2, d2 = m.groups()
            if (refs1, refs2) not in known:
                cls, k1, s1, k2, s2 = _resolve(memo, (refs1, refs2))
                if not _is_class(cls, "inert") or s1 is not SIZE or s2 is not SIZE or _MISSING in (k1, k2):
                    return at
                known.add((refs1, refs2))
                self.cost += 512
            # instance, its state dict (dropped by BUILD), and 2 or 3 entries per size (dims, args, result)
            memo += inerts[(6 if d1 == b")" else 7) + (0 if d2 == b")" else 1)]
            stack.append(INERT)
            at = m.end()

    def pairs(self, buf: bytes, at: int, end: int, memo: list[Any], stack: list[Any]) -> int:
        """Run consecutive MetadataIndex -> _StorageInfo pairs from `at`, pushing (INERT, StorageInfo) each."""
        match, known, push, new = _PAIR.match, self._pairs, stack.append, StorageInfo
        while True:
            m = match(buf, at, end)
            if m is None:
                return at
            g = m.groups()
            fqn = g[2]
            if len(fqn) != g[1][0]:
                return at
            refs = _PAIR_REFS(g)
            path = known.get(refs)
            if path is None:
                cls, k_fqn, k_index, k_offset, size, info_cls, k_rel, rel, k_off, k_len = _resolve(memo, refs)
                if (not _is_class(cls, "inert") or size is not SIZE or not _is_class(info_cls, "storage_info")
                        or type(rel) is not str or _MISSING in (k_fqn, k_index, k_offset)
                        or [type(k) for k in (k_rel, k_off, k_len)] != [str, str, str]
                        or [k_rel, k_off, k_len] != ["relative_path", "offset", "length"]):
                    return at
                known[refs] = path = rel
                self.cost += 1024
            o, n = g[7], g[9]  # BININT (small files) and LONG1 (offsets past 2 GiB) inline, the rest by _int
            offset = _I32(o, 1)[0] if o[0] == 0x4A else (
                int.from_bytes(o[2:], "little", signed=True) if o[0] == 0x8A else _int(o))
            nbytes = _I32(n, 1)[0] if n[0] == 0x4A else _int(n)
            if offset < 0 or nbytes < 0:
                return at  # the loop reports the error
            info = new()
            info.relative_path, info.end = path, offset + nbytes
            # MetadataIndex, its state dict, the fqn, the size's entries, the StorageInfo, its state dict
            if g[5] == b")":
                memo += (INERT, INERT, fqn.decode("ascii"), INERT, INERT, info, INERT)
            else:
                memo += (INERT, INERT, fqn.decode("ascii"), INERT, INERT, INERT, info, INERT)
            push(INERT)
            push(info)
            at = m.end()
