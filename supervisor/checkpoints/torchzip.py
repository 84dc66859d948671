"""Files written by `torch.save` (a zip holding `<archive>/data.pkl` and the storages), read without torch.

Lightning's sharded checkpoint ends with `meta.pt` (everything but the model and the optimizer), written
by `torch.save` on rank 0 after the DCP files. The store needs two things from such a file:

- `zip_problem`: is it whole? torch's zip writer (PyTorchFileWriter) writes the members first and the
  central directory last, on close, so a save killed in the middle leaves no end-of-central-directory
  record. Checked from the zip's structure only: the end record, every member stored uncompressed (torch
  never compresses) with its local header where the directory says and its data inside the file, and a
  `data.pkl`. Nothing is unpickled; the cost is one read of the directory and one small read per member.
- `read_pickle`: a few plain values from `data.pkl` (Lightning's `global_step`, its ModelCheckpoint state).
  The pickle is walked opcode by opcode and nothing it names is imported or called: every global, every
  persistent id (a tensor's storage), every object built by REDUCE/NEWOBJ/BUILD becomes the inert `OPAQUE`
  (except `collections.OrderedDict`, which stays a dict). dicts, lists, tuples, str, int, bool and None stay
  what they are. Bounded: `data.pkl` at most MAX_PICKLE_BYTES, at most MAX_ITEMS values kept, MARK nesting
  at most MAX_DEPTH, protocol 2-5 opcodes only (torch.save writes protocol 2). Anything else is a reason
  string, never an exception.

Standard library only: completeness imports this, and the trainer's `--resume auto` imports completeness.
"""
from __future__ import annotations

import errno
import os
import stat
import struct
import zipfile
from pathlib import Path
from typing import Any

__all__ = ["OPAQUE", "MAX_FILE_BYTES", "MAX_PICKLE_BYTES", "zip_problem", "read_pickle"]

MAX_FILE_BYTES = 1 << 30  # a meta.pt is a few KB; hyperparameters can make it MBs
MAX_PICKLE_BYTES = 16 << 20
MAX_MEMBERS = 1 << 16
MAX_ITEMS = 1 << 20  # values kept while walking the pickle
MAX_DEPTH = 1000
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # zip local file header: signature ... name length, extra length
_LOCAL_SIGNATURE = b"PK\x03\x04"


class _Opaque:
    """Whatever the store never builds: objects, tensors, storages, floats, bytes."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<opaque>"


OPAQUE = _Opaque()


class _Unreadable(Exception):
    """Why the file cannot be used (internal: the public functions return the reason)."""


def _open(path: Path) -> tuple[Any, int]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise _Unreadable("missing") from None
    except OSError as exc:
        raise _Unreadable("a symlink" if exc.errno == errno.ELOOP else f"cannot be read: {exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _Unreadable("not a regular file")
    if st.st_size > MAX_FILE_BYTES:
        os.close(fd)
        raise _Unreadable(f"{st.st_size} bytes, over the {MAX_FILE_BYTES} byte cap")
    return os.fdopen(fd, "rb"), st.st_size


def _members(f: Any, size: int) -> tuple[zipfile.ZipFile, list[zipfile.ZipInfo]]:
    try:
        z = zipfile.ZipFile(f)
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, struct.error):
        raise _Unreadable("not a whole zip (no end-of-central-directory record: cut short?)") from None
    infos = z.infolist()
    if len(infos) > MAX_MEMBERS:
        raise _Unreadable(f"{len(infos)} zip members, over {MAX_MEMBERS}")
    return z, infos


def _check_member(f: Any, size: int, info: zipfile.ZipInfo) -> None:
    if info.compress_type != zipfile.ZIP_STORED:
        raise _Unreadable(f"member {info.filename[:80]!r} is compressed (torch.save never compresses)")
    f.seek(info.header_offset)
    head = f.read(_LOCAL_HEADER.size)
    if len(head) < _LOCAL_HEADER.size or head[:4] != _LOCAL_SIGNATURE:
        raise _Unreadable(f"member {info.filename[:80]!r} has no local header where the directory says")
    fields = _LOCAL_HEADER.unpack(head)
    end = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10] + info.compress_size
    if end > size:
        raise _Unreadable(f"member {info.filename[:80]!r} runs past the end of the file")


def _data_pkl(infos: list[zipfile.ZipInfo]) -> zipfile.ZipInfo:
    found = [i for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
    if len(found) != 1:
        raise _Unreadable("no <archive>/data.pkl member: not a torch.save file")
    return found[0]


def zip_problem(path: Path) -> str | None:
    """Why `path` is not a whole torch.save zip (missing, a symlink, cut short, ...), or None when it is."""
    try:
        f, size = _open(path)
        with f:
            _, infos = _members(f, size)
            _data_pkl(infos)
            for info in infos:
                _check_member(f, size, info)
    except _Unreadable as exc:
        return str(exc)
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"
    return None


def read_pickle(path: Path) -> tuple[Any, None] | tuple[None, str]:
    """(the root value of `path`'s data.pkl, None), or (None, why it cannot be read). Runs no code."""
    try:
        f, size = _open(path)
        with f:
            z, infos = _members(f, size)
            info = _data_pkl(infos)
            if info.file_size > MAX_PICKLE_BYTES:
                raise _Unreadable(f"data.pkl is {info.file_size} bytes, over {MAX_PICKLE_BYTES}")
            _check_member(f, size, info)
            data = z.read(info)  # stored: no decompression; the CRC is checked
        return _Walk(data).run(), None
    except _Unreadable as exc:
        return None, str(exc)
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        return None, f"cannot be read: {exc}"


class _Walk:
    """One pass over a pickle's opcodes with the value model of the module docstring."""

    def __init__(self, data: bytes) -> None:
        self.data, self.i = data, 0
        self.stack: list[Any] = []
        self.marks: list[list[Any]] = []
        self.memo: dict[int, Any] = {}
        self.items = 0

    def take(self, n: int) -> bytes:
        j = self.i + n
        if n < 0 or j > len(self.data):
            raise _Unreadable("data.pkl is cut short")
        out, self.i = self.data[self.i:j], j
        return out

    def int_arg(self, fmt: str) -> int:
        s = struct.Struct(fmt)
        value: int = s.unpack(self.take(s.size))[0]
        return value

    def line(self) -> str:
        j = self.data.find(b"\n", self.i, self.i + 512)
        if j < 0:
            raise _Unreadable("data.pkl has an unterminated line")
        out, self.i = self.data[self.i:j], j + 1
        return out.decode("utf-8", "replace")

    def push(self, value: Any) -> None:
        self.items += 1
        if self.items > MAX_ITEMS:
            raise _Unreadable(f"data.pkl holds more than {MAX_ITEMS} values")
        self.stack.append(value)

    def pop_mark(self) -> list[Any]:
        if not self.marks:
            raise _Unreadable("data.pkl is malformed (no MARK)")
        items, self.stack = self.stack, self.marks.pop()
        return items

    def run(self) -> Any:
        while True:
            op = self.take(1)[0]
            if op == 0x2E:  # STOP
                if len(self.stack) != 1 or self.marks:
                    raise _Unreadable("data.pkl is malformed (stray items at STOP)")
                return self.stack[0]
            handler = _OPS.get(op)
            if handler is None:
                raise _Unreadable(f"data.pkl uses opcode 0x{op:02x}, which this reader does not know")
            try:
                handler(self)
            except IndexError:
                raise _Unreadable("data.pkl is malformed (stack underflow)") from None


def _setitems(w: _Walk, items: list[Any]) -> None:
    target = w.stack[-1]
    if len(items) % 2:
        raise _Unreadable("data.pkl is malformed (odd SETITEMS)")
    if type(target) is dict:
        for k, v in zip(items[0::2], items[1::2]):
            if type(k) in (str, int):
                target[k] = v
    elif target is not OPAQUE:
        raise _Unreadable("data.pkl is malformed (SETITEMS on a non-dict)")


def _setitem(w: _Walk) -> None:
    value = w.stack.pop()
    key = w.stack.pop()
    _setitems(w, [key, value])


def _dict(w: _Walk) -> None:
    items = w.pop_mark()
    w.push({})
    _setitems(w, items)


def _append(w: _Walk, items: list[Any]) -> None:
    target = w.stack[-1]
    if type(target) is list:
        target.extend(items)
    elif target is not OPAQUE:  # a set (ADDITEMS), or a list subclass built by NEWOBJ
        raise _Unreadable("data.pkl is malformed (APPENDS on a non-list)")


def _mark(w: _Walk) -> None:
    if len(w.marks) >= MAX_DEPTH:
        raise _Unreadable("data.pkl nests too deeply")
    w.marks.append(w.stack)
    w.stack = []


def _pop(w: _Walk) -> None:
    if w.stack:
        w.stack.pop()
    else:
        w.pop_mark()


def _put(w: _Walk, index: int) -> None:
    w.memo[index] = w.stack[-1]


def _get(w: _Walk, index: int) -> None:
    if index not in w.memo:
        raise _Unreadable("data.pkl refers to a memo entry it never stored")
    w.push(w.memo[index])


def _text(w: _Walk, n: int) -> None:
    w.items += n // 64  # long strings count against the budget by their size
    w.push(w.take(n).decode("utf-8", "surrogatepass"))


def _skip(w: _Walk, n: int) -> None:
    """An argument the store never reads (bytes, a float, a huge integer): skipped, an opaque value pushed."""
    w.take(n)
    w.push(OPAQUE)


def _long1(w: _Walk) -> None:
    raw = w.take(w.int_arg("<B"))
    w.push(int.from_bytes(raw, "little", signed=True) if len(raw) <= 8 else OPAQUE)


def _global(w: _Walk, module: Any, name: Any) -> None:
    """A global is only a name here: kept as (module, name) for REDUCE to recognise OrderedDict, never imported."""
    w.push((module, name) if type(module) is str and type(name) is str else OPAQUE)


def _stack_global(w: _Walk) -> None:
    name = w.stack.pop()
    _global(w, w.stack.pop(), name)


def _reduce(w: _Walk) -> None:
    w.stack.pop()  # the arguments: never used, nothing is called
    func = w.stack.pop()
    w.push({} if func == ("collections", "OrderedDict") else OPAQUE)


def _newobj(w: _Walk, args: int) -> None:
    del w.stack[-args:]
    w.stack[-1] = OPAQUE


def _tuple(w: _Walk, n: int) -> None:
    if len(w.stack) < n:
        raise IndexError
    items = tuple(w.stack[len(w.stack) - n:])
    del w.stack[len(w.stack) - n:]
    w.push(items)


def _replace_marked(w: _Walk) -> None:
    """FROZENSET, OBJ: the items since MARK become one opaque value."""
    w.pop_mark()
    w.push(OPAQUE)


def _persid(w: _Walk) -> None:
    w.stack.pop()  # a storage's key: the storage is never loaded
    w.push(OPAQUE)


_OPS: dict[int, Any] = {
    0x80: lambda w: w.take(1),  # PROTO
    0x95: lambda w: w.take(8),  # FRAME
    0x28: _mark,  # MARK
    0x30: _pop,  # POP
    0x31: lambda w: w.pop_mark(),  # POP_MARK
    0x32: lambda w: w.push(w.stack[-1]),  # DUP
    0x4E: lambda w: w.push(None),  # NONE
    0x88: lambda w: w.push(True),  # NEWTRUE
    0x89: lambda w: w.push(False),  # NEWFALSE
    0x4A: lambda w: w.push(w.int_arg("<i")),  # BININT
    0x4B: lambda w: w.push(w.int_arg("<B")),  # BININT1
    0x4D: lambda w: w.push(w.int_arg("<H")),  # BININT2
    0x8A: _long1,  # LONG1
    0x8B: lambda w: _skip(w, w.int_arg("<I")),  # LONG4
    0x47: lambda w: _skip(w, 8),  # BINFLOAT
    0x58: lambda w: _text(w, w.int_arg("<I")),  # BINUNICODE
    0x8C: lambda w: _text(w, w.int_arg("<B")),  # SHORT_BINUNICODE
    0x8D: lambda w: _text(w, w.int_arg("<Q")),  # BINUNICODE8
    0x54: lambda w: _skip(w, w.int_arg("<i")),  # BINSTRING
    0x55: lambda w: _skip(w, w.int_arg("<B")),  # SHORT_BINSTRING
    0x42: lambda w: _skip(w, w.int_arg("<I")),  # BINBYTES
    0x43: lambda w: _skip(w, w.int_arg("<B")),  # SHORT_BINBYTES
    0x8E: lambda w: _skip(w, w.int_arg("<Q")),  # BINBYTES8
    0x96: lambda w: _skip(w, w.int_arg("<Q")),  # BYTEARRAY8
    0x97: lambda w: w.push(OPAQUE),  # NEXT_BUFFER
    0x98: lambda w: None,  # READONLY_BUFFER
    0x7D: lambda w: w.push({}),  # EMPTY_DICT
    0x5D: lambda w: w.push([]),  # EMPTY_LIST
    0x29: lambda w: w.push(()),  # EMPTY_TUPLE
    0x8F: lambda w: w.push(OPAQUE),  # EMPTY_SET
    0x64: _dict,  # DICT
    0x6C: lambda w: w.push(w.pop_mark()),  # LIST
    0x74: lambda w: w.push(tuple(w.pop_mark())),  # TUPLE
    0x85: lambda w: _tuple(w, 1),  # TUPLE1
    0x86: lambda w: _tuple(w, 2),  # TUPLE2
    0x87: lambda w: _tuple(w, 3),  # TUPLE3
    0x91: _replace_marked,  # FROZENSET
    0x6F: _replace_marked,  # OBJ
    0x61: lambda w: _append(w, [w.stack.pop()]),  # APPEND
    0x65: lambda w: _append(w, w.pop_mark()),  # APPENDS
    0x90: lambda w: _append(w, w.pop_mark()),  # ADDITEMS (onto an opaque set)
    0x73: _setitem,  # SETITEM
    0x75: lambda w: _setitems(w, w.pop_mark()),  # SETITEMS
    0x68: lambda w: _get(w, w.int_arg("<B")),  # BINGET
    0x6A: lambda w: _get(w, w.int_arg("<I")),  # LONG_BINGET
    0x71: lambda w: _put(w, w.int_arg("<B")),  # BINPUT
    0x72: lambda w: _put(w, w.int_arg("<I")),  # LONG_BINPUT
    0x94: lambda w: _put(w, len(w.memo)),  # MEMOIZE
    0x63: lambda w: _global(w, w.line(), w.line()),  # GLOBAL
    0x93: _stack_global,  # STACK_GLOBAL
    0x52: _reduce,  # REDUCE
    0x62: lambda w: w.stack.pop(),  # BUILD: the state is dropped, the object stays opaque
    0x81: lambda w: _newobj(w, 1),  # NEWOBJ
    0x92: lambda w: _newobj(w, 2),  # NEWOBJ_EX
    0x51: _persid,  # BINPERSID
    0x82: lambda w: _skip(w, 1),  # EXT1: the extension registry is never consulted
    0x83: lambda w: _skip(w, 2),  # EXT2
    0x84: lambda w: _skip(w, 4),  # EXT4
}
