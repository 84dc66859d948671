"""Run a pickle's opcodes without running code, keeping only what the store needs: the one safe-pickle walker.

What a pickle names goes through a `Policy`: the default is DCP `.metadata`'s allowlist; torchzip.py's keeps every
global an inert name (Lightning's `meta.pt`). Why not `pickle`, the value model's invariants and the cost bound
(MEMORY_FACTOR, MEMORY_SLACK) that every edit here must keep: docs/design.md, 'Notes for maintainers'.
"""
from __future__ import annotations

import struct
from typing import Any, BinaryIO

from supervisor.checkpoints.metadata.allowlist import INERT, SIZE, CallStandIn, ClassStandIn, find_global, printable
from supervisor.checkpoints.metadata.records import Records, StorageInfo
from supervisor.errors import MetadataError, UnsafeMetadataError

__all__ = ["MEMORY_FACTOR", "MEMORY_SLACK", "MAX_DEPTH", "MAX_STACK", "DCP", "Policy", "Scanned", "ScannedDict",
           "StorageInfo", "scan"]

MEMORY_FACTOR = 8  # charged bytes per input byte a file may use (legitimate files: 2.8 to 4.6)
MEMORY_SLACK = 16 << 20
MAX_DEPTH = 1000  # MARK nesting; torch's pickles nest about 8 deep
MAX_STACK = 1 << 16  # items on the stack; the pickler batches dicts and lists by 1000
_BLOCK = 1 << 18
_PAD = 1024  # bytes kept beyond the safe limit: every 1-byte-length argument and GLOBAL line fits
_PAD_BYTE = b"\xff"  # not an opcode (and the loop never runs padding as one, see _Reader.refill)

_U32 = struct.Struct("<I").unpack_from
_I32 = struct.Struct("<i").unpack_from
_U64 = struct.Struct("<Q").unpack_from
# Opcodes with a length-prefixed argument -> the width of the length: BINUNICODE, BINUNICODE8, BINBYTES,
# BINBYTES8, SHORT_BINBYTES, BYTEARRAY8, LONG4.
_LONG_ARGS = {0x58: 4, 0x8D: 8, 0x42: 4, 0x8E: 8, 0x43: 1, 0x96: 8, 0x8B: 4}


class ScannedDict(list[Any]):
    """A pickled dict as [k0, v0, k1, v1, ...]: no hashing of hostile keys; `slot` is its memo index."""

    __slots__ = ("slot",)
    slot: int


class Scanned:
    """The pickled `Metadata`: the three fields completeness reads, as the scanner left them."""

    __slots__ = ("state_dict_metadata", "storage_data", "version")

    def __init__(self) -> None:
        self.state_dict_metadata: Any = None
        self.storage_data: Any = None
        self.version: Any = None


def _describe(value: Any) -> str:
    """What a value is, for an error message, without formatting hostile content."""
    if type(value) is str:
        return repr(printable(value, 40))
    if type(value) is int:
        return str(value) if -(10**18) < value < 10**18 else "a huge integer"
    if value is INERT:
        return "an opaque value"
    return type(value).__name__.lstrip("_")


def _fields(state: Any, names: tuple[str, ...], what: str) -> list[Any]:
    """The values of `names` in a dataclass state (last write wins, like a dict); empties the state."""
    if type(state) is not ScannedDict:
        raise MetadataError(f"{what} state is {_describe(state)}, not a dict")
    out = [None] * len(names)
    for j in range(0, len(state) - 1, 2):
        key = state[j]
        if type(key) is str and key in names:
            out[names.index(key)] = state[j + 1]
    state.clear()
    return out


def _build_storage_info(info: StorageInfo, state: Any) -> None:
    rel, off, length = _fields(state, ("relative_path", "offset", "length"), "_StorageInfo")
    if type(rel) is not str:
        raise MetadataError(f"storage relative_path {_describe(rel)} is not a string")
    if type(off) is not int or type(length) is not int or off < 0 or length < 0:
        raise MetadataError(f"storage item in {_describe(rel)} has offset {_describe(off)} length {_describe(length)}")
    info.relative_path, info.end = rel, off + length


def _build(inst: Any, state: Any) -> None:
    """BUILD on something other than INERT: only DCP's two records take state."""
    if type(inst) is StorageInfo:
        _build_storage_info(inst, state)
    elif type(inst) is Scanned:  # its slots are Metadata's field names
        inst.state_dict_metadata, inst.storage_data, inst.version = _fields(state, Scanned.__slots__, "Metadata")
    else:
        raise MetadataError(f"BUILD on {_describe(inst)}")


def _no_persistent_id(pid: Any) -> Any:
    raise UnsafeMetadataError("refuses a persistent id (could load external objects)", "persistent id")


def _reduce(func: Any, args: Any) -> Any:
    """REDUCE on an allowlisted callable: check the argument shape, return INERT, run nothing."""
    if type(func) is not CallStandIn:
        raise MetadataError(f"REDUCE calls {_describe(func)}, which is not an allowed function")
    role = func.role
    if role == "size" or role == "enum":  # Size(tuple of ints) / _MEM_FORMAT_ENCODING(int): INERT args
        if args is INERT:
            return INERT
        raise MetadataError(f"{func.qualname} of something other than integers")
    if type(args) is not tuple:
        raise MetadataError(f"{func.qualname} called with {_describe(args)}")
    if role == "layout" and len(args) == 1 and type(args[0]) is str and len(args[0]) <= 64:
        return INERT
    if role == "path" and len(args) <= 256 and all(type(a) is str for a in args):
        return INERT  # the path is never joined, touched or kept
    if role == "getattr" and len(args) == 2:
        owner, attr = args
        if type(owner) is CallStandIn and owner.role == "enum" and type(attr) is str and attr in owner.members:
            return INERT
        what = owner.qualname if isinstance(owner, (CallStandIn, ClassStandIn)) else _describe(owner)
        raise UnsafeMetadataError(f"refuses builtins.getattr on {printable(what)} (could run code)", "builtins.getattr")
    raise MetadataError(f"{func.qualname} called with arguments of the wrong shape")


def _new(cls: Any) -> Any:
    """NEWOBJ / NEWOBJ_EX on a stand-in class: its empty instance (INERT for the classes we ignore)."""
    if type(cls) is not ClassStandIn:
        raise MetadataError(f"NEWOBJ on {_describe(cls)}, which is not an allowed class")
    if cls.role == "storage_info":
        return StorageInfo.empty()
    if cls.role == "metadata":
        return Scanned()
    return INERT


def _opname(op: int) -> str:
    import pickletools  # only to name the opcode in an error message

    for o in pickletools.opcodes:
        if o.code.encode("latin-1")[0] == op:
            return o.name
    return f"byte 0x{op:02x}"


class Policy:
    """What the walker makes of what a pickle names; the default is DCP `.metadata`'s allowlist (refuse the rest).

    find_global(module, name) -> a stand-in (or raise); reduce(func, args) and new(cls) -> the value REDUCE and
    NEWOBJ push (nothing is ever called); build(inst, state) for BUILD on anything but INERT; persistent_id(pid)
    -> the value BINPERSID pushes. Each must do O(1) work and may raise MetadataError.
    """

    find_global = staticmethod(find_global)
    reduce = staticmethod(_reduce)
    new = staticmethod(_new)
    build = staticmethod(_build)
    persistent_id = staticmethod(_no_persistent_id)


DCP = Policy()

_HOSTILE = f"refused: would need more than {MEMORY_FACTOR}x its size in memory (hostile?)"


class _Reader:
    """The input, a block at a time, with the count of bytes before the current block (for errors)."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f, self.left, self.consumed = f, size, 0

    def refill(self, buf: bytes, i: int, end: int, need: int) -> tuple[bytes, int, int, int]:
        """(buf, 0, end, limit) holding buf[i:end] plus the next block (at least `need` bytes if the input has them).

        Past `limit` there are always _PAD more bytes (padding at the end of the input), so an opcode
        that starts at or before `limit` reads its fixed-size argument without a bounds check; at the
        end of the input `limit` is the last real byte, so padding is never run as an opcode.
        """
        self.consumed += i
        tail = buf[i:end]
        want = min(max(_BLOCK, need - len(tail) + _PAD), self.left)
        chunk = self.f.read(want) if want > 0 else b""
        if len(chunk) < want:
            raise MetadataError("unparseable pickle: the file shrank while being read")
        self.left -= len(chunk)
        buf = tail + chunk
        end = len(buf)
        if self.left > 0:
            return buf, 0, end, end - _PAD
        return buf + _PAD_BYTE * _PAD, 0, end, end - 1


def scan(f: BinaryIO, size: int, *, fast: bool = True, policy: Policy = DCP) -> Any:
    """The root object of the pickle in the first `size` bytes of `f` (MetadataError if it is no pickle).

    fast=False runs every opcode through the loop (tests compare both ways on the same bytes; other policies
    than DCP's use it: the fast path knows DCP's records only).
    """
    find, reduce, new, build, persistent = policy.find_global, policy.reduce, policy.new, policy.build, \
        policy.persistent_id
    r = _Reader(f, size)
    memo: list[Any] = []
    memo_append = memo.append
    stack: list[Any] = []
    metastack: list[list[Any]] = []
    frozen = 0  # items in the frames below the current MARK
    used = 0  # bytes charged for objects that may outlive their opcode
    budget = MEMORY_FACTOR * size + MEMORY_SLACK
    u32, i32, u64 = _U32, _I32, _U64
    buf, i, end, limit, op, at = b"", 0, 0, -1, 0, 0
    records, in_storage = Records(), False  # the fast path, and which record kind came last
    try:
        while True:  # one loop on purpose: a function call per opcode would double the cost
            if i > limit:
                if i > end or (i == end and r.left == 0):
                    raise MetadataError("unparseable pickle: truncated (no STOP opcode)")
                buf, i, end, limit = r.refill(buf, i, end, _PAD)
                if len(metastack) > MAX_DEPTH or len(stack) + frozen > MAX_STACK:
                    raise MetadataError("unparseable pickle: nested or stacked too deeply")
                if used + records.cost + 8 * (len(memo) + len(stack) + frozen) > budget:
                    raise MetadataError(_HOSTILE)
                continue
            at = i
            op = buf[i]
            i += 1
            if op == 0x94:  # MEMOIZE
                memo_append(stack[-1])
            elif op == 0x6A or op == 0x68:  # LONG_BINGET, BINGET
                j = i + 4 if op == 0x6A else i + 1
                if buf[j] == 0x29 and buf[j + 1] == 0x81 and fast:  # a class is instantiated: maybe whole records
                    depth = len(stack)
                    if in_storage:
                        k = records.pairs(buf, at, end, memo, stack)
                        if k == at:
                            k = records.chunks(buf, at, end, memo, stack)
                            in_storage = k == at
                    else:
                        k = records.chunks(buf, at, end, memo, stack)
                        if k == at:
                            k = records.pairs(buf, at, end, memo, stack)
                            in_storage = k > at
                    if k > at:
                        used += 160 * (len(stack) - depth)
                        i = k
                        continue
                stack.append(memo[u32(buf, i)[0] if op == 0x6A else buf[i]])
                i = j
            elif op == 0x85:  # TUPLE1
                v = stack[-1]
                if v is INERT or type(v) is int or v is None:
                    stack[-1] = INERT
                else:
                    stack[-1] = (v,)
                    used += 64
                if buf[i] == 0x94:
                    memo_append(stack[-1])
                    i += 1
            elif op == 0x4D:  # BININT2
                stack.append(buf[i] | buf[i + 1] << 8)
                i += 2
                used += 32
            elif op == 0x28:  # MARK
                metastack.append(stack)
                frozen += len(stack)
                stack = []
            elif op == 0x29:  # EMPTY_TUPLE
                stack.append(INERT)
            elif op == 0x81:  # NEWOBJ: cls.__new__(cls, *args); the args of a dataclass are ()
                stack.pop()
                cls = stack[-1]
                if type(cls) is ClassStandIn and cls.role == "inert":
                    stack[-1] = INERT
                else:
                    stack[-1] = new(cls)
                    used += 96
                if buf[i] == 0x94:
                    memo_append(stack[-1])
                    i += 1
            elif op == 0x62:  # BUILD: the state dict is consumed (a torch pickle never refers to it again)
                state = stack.pop()
                inst = stack[-1]
                if type(state) is ScannedDict and state.slot >= 0 and memo[state.slot] is state:
                    memo[state.slot] = INERT
                if inst is INERT:
                    if type(state) is ScannedDict:
                        state.clear()
                else:
                    build(inst, state)
            elif op == 0x75:  # SETITEMS
                items = stack
                stack = metastack.pop()
                frozen -= len(stack)
                d = stack[-1]
                if type(d) is ScannedDict and not len(items) & 1:
                    d.extend(items)
                    used += 8 * len(items)
                elif d is not INERT or len(items) & 1:  # onto INERT (a dict subclass nobody reads): dropped
                    raise MetadataError(f"SETITEMS on {_describe(d)} with {len(items)} items")
            elif op == 0x7D:  # EMPTY_DICT
                d = ScannedDict()
                d.slot = -1
                used += 96
                if buf[i] == 0x94:
                    d.slot = len(memo)
                    memo_append(d)
                    i += 1
                stack.append(d)
            elif op == 0x52:  # REDUCE
                args = stack.pop()
                func = stack[-1]
                stack[-1] = INERT if func is SIZE and args is INERT else reduce(func, args)
                if buf[i] == 0x94:
                    memo_append(stack[-1])
                    i += 1
            elif op == 0x4B:  # BININT1
                stack.append(buf[i])
                i += 1
            elif op == 0x86:  # TUPLE2
                b = stack.pop()
                a = stack[-1]
                if (a is INERT or type(a) is int) and (b is INERT or type(b) is int):
                    stack[-1] = INERT
                else:
                    stack[-1] = (a, b)
                    used += 72
                if buf[i] == 0x94:
                    memo_append(stack[-1])
                    i += 1
            elif op == 0x8C:  # SHORT_BINUNICODE
                n = buf[i]
                j = i + 1 + n
                s = str(buf[i + 1:j], "utf-8", "surrogatepass")
                stack.append(s)
                used += 80 + n
                i = j
                if buf[i] == 0x94:
                    memo_append(s)
                    i += 1
            elif op == 0x8A:  # LONG1
                n = buf[i]
                j = i + 1 + n
                stack.append(int.from_bytes(buf[i + 1:j], "little", signed=True))
                used += 40 + n
                i = j
            elif op == 0x4A:  # BININT
                stack.append(i32(buf, i)[0])
                i += 4
                used += 32
            elif op == 0x89:  # NEWFALSE
                stack.append(False)
            elif op == 0x88:  # NEWTRUE
                stack.append(True)
            elif op == 0x4E:  # NONE
                stack.append(None)
            elif op == 0x74 or op == 0x87:  # TUPLE (items since MARK), TUPLE3
                if op == 0x74:
                    items = stack
                    stack = metastack.pop()
                    frozen -= len(stack)
                else:
                    if len(stack) < 3:
                        raise IndexError
                    items = stack[-3:]
                    del stack[-3:]
                if all(x is INERT or type(x) is int or x is None or type(x) is bool for x in items):
                    stack.append(INERT)
                else:
                    stack.append(tuple(items))
                    used += 64 + 8 * len(items)
            elif op == 0x5D or op == 0x8F:  # EMPTY_LIST, EMPTY_SET: their items are never needed
                stack.append(INERT)
            elif op == 0x65 or op == 0x90:  # APPENDS, ADDITEMS
                stack = metastack.pop()
                frozen -= len(stack)
                if stack[-1] is not INERT:
                    raise MetadataError(f"APPENDS on {_describe(stack[-1])}")
            elif op == 0x61:  # APPEND
                stack.pop()
                if stack[-1] is not INERT:
                    raise MetadataError(f"APPEND on {_describe(stack[-1])}")
            elif op == 0x73:  # SETITEM
                value = stack.pop()
                key = stack.pop()
                d = stack[-1]
                if type(d) is ScannedDict:
                    d.append(key)
                    d.append(value)
                    used += 16
                elif d is not INERT:
                    raise MetadataError(f"SETITEM on {_describe(d)}")
            elif op == 0x91:  # FROZENSET
                stack = metastack.pop()
                frozen -= len(stack)
                stack.append(INERT)
            elif op == 0x93:  # STACK_GLOBAL
                name = stack.pop()
                stack[-1] = find(stack[-1], name)
                if buf[i] == 0x94:
                    memo_append(stack[-1])
                    i += 1
            elif op == 0x63:  # GLOBAL (protocols 2-3): "module\nname\n", each at most 256 bytes
                j = buf.index(b"\n", i, i + 257)
                k = buf.index(b"\n", j + 1, j + 258)
                stack.append(find(str(buf[i:j], "utf-8"), str(buf[j + 1:k], "utf-8")))
                i = k + 1
            elif op == 0x71 or op == 0x72:  # BINPUT, LONG_BINPUT (protocols 2-3)
                if op == 0x71:
                    index = buf[i]
                    i += 1
                else:
                    index = u32(buf, i)[0]
                    i += 4
                # CPython's pickler numbers the memo densely: refusing gaps keeps the memo a plain list.
                if index == len(memo):
                    memo_append(stack[-1])
                elif index < len(memo):
                    memo[index] = stack[-1]
                    records.forget()
                else:
                    raise MetadataError(f"unparseable pickle: memo index {index} skips ahead")
            elif op == 0x30:  # POP
                if stack:
                    stack.pop()
                else:
                    stack = metastack.pop()
                    frozen -= len(stack)
            elif op == 0x31:  # POP_MARK
                stack = metastack.pop()
                frozen -= len(stack)
            elif op == 0x2E:  # STOP
                if len(stack) != 1 or metastack:
                    raise MetadataError("unparseable pickle: stray items on the stack at STOP")
                if used + records.cost + 8 * len(memo) > budget:
                    raise MetadataError(_HOSTILE)
                return stack[0]
            elif op == 0x95:  # FRAME: framing does not change meaning
                i += 8
            elif op == 0x80:  # PROTO
                if buf[i] > 5:
                    raise MetadataError(f"unparseable pickle: unsupported protocol {buf[i]}")
                i += 1
            elif op == 0x47:  # BINFLOAT
                stack.append(INERT)
                i += 8
            elif op in _LONG_ARGS:  # BINUNICODE(8), (SHORT_)BINBYTES(8), BYTEARRAY8, LONG4
                width = _LONG_ARGS[op]
                n = buf[i] if width == 1 else (u32(buf, i)[0] if width == 4 else u64(buf, i)[0])
                i += width
                if op == 0x8B and n > 64:
                    raise MetadataError("unparseable pickle: an integer of more than 64 bytes")
                if n > r.left + (end - i):
                    raise MetadataError("unparseable pickle: truncated (an argument runs past the end)")
                if i + n > end:
                    used += n
                    if used > budget:
                        raise MetadataError(_HOSTILE)
                    buf, i, end, limit = r.refill(buf, i, end, n)
                raw = buf[i:i + n]
                i += n
                if op == 0x58 or op == 0x8D:
                    stack.append(str(raw, "utf-8", "surrogatepass"))
                    used += 80 + 4 * n
                elif op == 0x8B:
                    stack.append(int.from_bytes(raw, "little", signed=True))
                    used += 40 + n
                else:
                    stack.append(INERT)  # bytes are never needed
            elif op == 0x92:  # NEWOBJ_EX: cls, args, kwargs
                del stack[-2:]
                stack[-1] = new(stack[-1])
                used += 96
            elif op == 0x51:  # BINPERSID
                stack[-1] = persistent(stack[-1])
            elif op == 0x50:  # PERSID (protocol 0)
                _no_persistent_id(None)
            elif op == 0x82 or op == 0x83 or op == 0x84:  # EXT1, EXT2, EXT4
                raise UnsafeMetadataError("refuses an extension-registry global (could run code)", "extension code")
            else:
                raise MetadataError(f"unparseable pickle: unsupported opcode {_opname(op)} at byte {r.consumed + at}")
    except MetadataError:
        raise
    except (IndexError, KeyError, ValueError, TypeError, AttributeError, UnicodeDecodeError, struct.error) as exc:
        what = "a reference to nothing" if isinstance(exc, IndexError) else type(exc).__name__
        raise MetadataError(f"unparseable pickle: {what} at byte {r.consumed + at} ({_opname(op)})") from None
