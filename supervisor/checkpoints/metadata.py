"""Read DCP's `.metadata` pickle without torch and without ever running code from it.

`.metadata` is a plain pickle of `torch.distributed.checkpoint.metadata.Metadata`. Loading it with
`pickle.load` would import whatever globals it names and call them, so we use an unpickler that
resolves only an allowlist of (module, name) pairs, each mapped to an inert stand-in defined here;
every other global (`os.system`, `builtins.eval`, `subprocess.Popen`, ...) is refused.

How the allowlist was derived: `tests/checkpoints_dcp_writer.py` writes checkpoints with the
installed torch (2.13.0) in every way the project uses DCP: single-process `dcp.save`,
`dcp.async_save`, 2-rank FSDP2 (`fully_shard` + `get_state_dict`) and FSDP1 `SHARDED_STATE_DICT`
under torchrun, and records every `find_class` call the real unpickler makes on their `.metadata`.
`tests/test_checkpoints_metadata.py` re-runs that recording, so a torch upgrade that pickles a new
class fails loudly instead of silently marking every checkpoint invalid. Dtypes are the one open
set: any tensor may have any dtype, so every canonical dtype name of torch 2.13 is allowed (the
test also checks that list against the installed torch).

We subclass the pure-Python `pickle._Unpickler` rather than the C one on purpose: the C unpickler
pre-sizes its memo from the index in a LONG_BINPUT opcode, so a 7-byte file makes it allocate and
zero gigabytes (measured: 2 GiB and 6 s for index 2**27). The Python one keeps its memo in a dict and
reads strings from an in-memory copy of a size-capped file, so memory stays bounded by the input.
It is ~8x slower (about 0.5 s per MB of metadata); `read_metadata` caches results per file identity.
"""
from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.checkpoints._files import open_regular

__all__ = [
    "MAX_METADATA_BYTES",
    "ALLOWED_GLOBALS",
    "DTYPE_NAMES",
    "MetadataError",
    "UnsafeMetadataError",
    "StorageRef",
    "DcpMetadata",
    "parse_metadata",
    "read_metadata",
]

MAX_METADATA_BYTES = 256 * 1024 * 1024  # a 64-rank 70B model writes a few MB; anything this big is hostile
_CACHE_MAX = 4096  # parsed summaries are small; a root of 1,000+ checkpoints must not thrash


class MetadataError(Exception):
    """`.metadata` could not be read or does not have DCP's shape; the message says why."""


class UnsafeMetadataError(MetadataError):
    """`.metadata` names a global outside the allowlist: loading it could run code."""


# ---- inert stand-ins -------------------------------------------------------------------------------


class _Record:
    """A pickled dataclass instance: keeps its state as data, never as attributes it could shadow."""

    __slots__ = ("state",)

    def __new__(cls, *args: Any, **kwargs: Any) -> _Record:
        obj = object.__new__(cls)
        obj.state = {}
        return obj

    def __setstate__(self, state: Any) -> None:
        # dataclasses pickle a dict; TensorProperties pickles a tuple via its own __getstate__.
        self.state = dict(state) if isinstance(state, Mapping) else {"_tuple": state}

    def get(self, key: str, default: Any = None) -> Any:
        return self.state.get(key, default)


class Metadata(_Record):
    __slots__ = ()


class StorageInfo(_Record):
    __slots__ = ()


class _Opaque(_Record):
    """Allowed DCP classes whose content the store does not need (index keys, tensor properties)."""

    __slots__ = ()


def _size(dims: Any = ()) -> tuple[int, ...]:
    """torch.Size(dims): a tuple of ints."""
    out = tuple(dims)
    if not all(type(d) is int for d in out):
        raise MetadataError("torch.Size with a non-integer dimension")
    return out


def _layout(name: Any) -> str:
    """torch.serialization._get_layout(name): layouts are pickled by their string name."""
    if not isinstance(name, str) or len(name) > 64:
        raise MetadataError("layout name is not a short string")
    return name


def _mem_format(value: Any) -> int:
    """_MEM_FORMAT_ENCODING(value): an enum of 0 (contiguous), 1 (channels_last), 2 (preserve)."""
    if type(value) is not int or value not in (0, 1, 2):
        raise MetadataError(f"unknown memory format encoding {value!r:.40}")
    return value


def _path(*parts: Any) -> str:
    """pathlib.PosixPath(*parts): kept as a string, never touched on disk."""
    if not all(isinstance(p, str) for p in parts):
        raise MetadataError("path part is not a string")
    return "/".join(parts)


class _DType(str):
    """torch.<dtype>: pickled by name, kept as that name."""


# Canonical names (what `torch.<dtype>.__reduce__()` returns) of every dtype in torch 2.13.
DTYPE_NAMES = frozenset(
    """bfloat16 bits16 bits1x8 bits2x4 bits4x2 bits8 bool complex128 complex32 complex64 float16
    float32 float4_e2m1fn_x2 float64 float8_e4m3fn float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz
    float8_e8m0fnu int1 int16 int2 int3 int32 int4 int5 int6 int64 int7 int8 qint32 qint8 quint2x4
    quint4x2 quint8 uint1 uint16 uint2 uint3 uint32 uint4 uint5 uint6 uint64 uint7 uint8""".split()
)

_DCP = "torch.distributed.checkpoint.metadata"
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    (_DCP, "Metadata"): Metadata,
    (_DCP, "MetadataIndex"): _Opaque,
    (_DCP, "StorageMeta"): _Opaque,
    (_DCP, "TensorProperties"): _Opaque,
    (_DCP, "TensorStorageMetadata"): _Opaque,
    (_DCP, "BytesStorageMetadata"): _Opaque,
    (_DCP, "ChunkStorageMetadata"): _Opaque,
    (_DCP, "_MEM_FORMAT_ENCODING"): _mem_format,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfo,
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _layout,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    **{("torch", name): _DType(name) for name in DTYPE_NAMES},
}


class _SafeUnpickler(pickle._Unpickler):  # type: ignore[name-defined]  # see module docstring
    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except (KeyError, TypeError):
            raise UnsafeMetadataError(f"refused global {str(module)[:80]}.{str(name)[:80]}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeMetadataError("refused persistent id")


# ---- what the store needs from the metadata ---------------------------------------------------------


@dataclass(frozen=True)
class StorageRef:
    """One storage file the metadata points into, and how many bytes it must hold."""

    relative_path: str
    min_size: int  # max(offset + length) over every item stored in it
    items: int


@dataclass(frozen=True)
class DcpMetadata:
    """The parts of DCP's Metadata that decide completeness."""

    version: str | None
    entries: int  # keys in state_dict_metadata
    storage: tuple[StorageRef, ...]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _storage_refs(storage_data: Any) -> tuple[StorageRef, ...]:
    if not isinstance(storage_data, dict):
        raise MetadataError(f"storage_data is {type(storage_data).__name__}, not a dict")
    need: dict[str, list[int]] = {}
    for info in storage_data.values():
        if not isinstance(info, StorageInfo):
            raise MetadataError(f"storage_data value is {type(info).__name__}, not _StorageInfo")
        rel, off, length = info.get("relative_path"), info.get("offset"), info.get("length")
        if not isinstance(rel, str):
            raise MetadataError(f"storage relative_path {_short(rel)} is not a string")
        if type(off) is not int or type(length) is not int or off < 0 or length < 0:
            raise MetadataError(f"storage item in {_short(rel)} has offset {_short(off)} length {_short(length)}")
        slot = need.setdefault(rel, [0, 0])
        slot[0] = max(slot[0], off + length)
        slot[1] += 1
    return tuple(StorageRef(rel, end, n) for rel, (end, n) in sorted(need.items()))


def parse_metadata(data: bytes) -> DcpMetadata:
    """Parse `.metadata` bytes; raise MetadataError (UnsafeMetadataError for refused globals)."""
    try:
        root = _SafeUnpickler(io.BytesIO(data)).load()
    except MetadataError:
        raise
    except RecursionError:
        raise MetadataError("unparseable pickle: nested too deeply") from None
    except Exception as exc:  # noqa: BLE001 - any failure of hostile input is just "invalid"
        raise MetadataError(f"unparseable pickle: {type(exc).__name__}: {str(exc)[:120]}") from None
    if not isinstance(root, Metadata):
        raise MetadataError(f"top-level object is {type(root).__name__}, not DCP Metadata")
    sdm = root.get("state_dict_metadata")
    if not isinstance(sdm, dict):
        raise MetadataError("state_dict_metadata is missing or not a dict")
    version = root.get("version")
    return DcpMetadata(
        version=version if isinstance(version, str) else None,
        entries=len(sdm),
        storage=_storage_refs(root.get("storage_data")),
    )


_cache: dict[tuple[int, int, int, int], DcpMetadata] = {}


def read_metadata(path: Path) -> DcpMetadata:
    """Read and parse one `.metadata` file (not following a symlink); cached per file identity."""
    try:
        f, st = open_regular(path, MAX_METADATA_BYTES, MetadataError)
    except FileNotFoundError:
        raise MetadataError(f"{path.name} is missing") from None
    with f:
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        cached = _cache.get(key)
        if cached is not None:
            return cached
        data = f.read(MAX_METADATA_BYTES + 1)
    parsed = parse_metadata(data)
    if len(_cache) >= _CACHE_MAX:
        _cache.pop(next(iter(_cache)))
    _cache[key] = parsed
    return parsed
