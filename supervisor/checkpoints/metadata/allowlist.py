"""Which pickle globals DCP's `.metadata` may name, the inert stand-in each becomes, and why others are refused.

Nothing is imported: each allowed (module, name) resolves to a stand-in the scanner knows (metadata/scan.py). The
two errors and where the list comes from: docs/design.md, 'Notes for maintainers'.
"""
from __future__ import annotations

from supervisor.errors import MetadataError, RefusedGlobalError, UnknownClassError, UnsafeMetadataError

__all__ = [
    "INERT",
    "SIZE",
    "GETATTR",
    "ClassStandIn",
    "CallStandIn",
    "ALLOWED_GLOBALS",
    "DTYPE_NAMES",
    "find_global",
    "printable",
]


class _Inert:
    """The value of everything the store never looks at (sizes, dtypes, lists, floats, opaque objects)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<inert>"


INERT = _Inert()


class _StandIn:
    """An allowlisted global: only its identity and role matter; calling it does nothing."""

    __slots__ = ("qualname", "role")

    def __init__(self, qualname: str, role: str) -> None:
        self.qualname, self.role = qualname, role

    def __repr__(self) -> str:
        return f"<stand-in {self.qualname}>"


class ClassStandIn(_StandIn):
    """A class built by NEWOBJ + BUILD. role: "inert" (content ignored), "storage_info" or "metadata"."""

    __slots__ = ()


class CallStandIn(_StandIn):
    """A callable used by REDUCE. role: "size", "layout", "enum", "path" or "getattr"; enums list members."""

    __slots__ = ("members",)

    def __init__(self, qualname: str, role: str, members: frozenset[str] = frozenset()) -> None:
        super().__init__(qualname, role)
        self.members = members


# Canonical names (what `torch.<dtype>.__reduce__()` returns) of every dtype in torch 2.13.
DTYPE_NAMES = frozenset(
    """bfloat16 bits16 bits1x8 bits2x4 bits4x2 bits8 bool complex128 complex32 complex64 float16
    float32 float4_e2m1fn_x2 float64 float8_e4m3fn float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz
    float8_e8m0fnu int1 int16 int2 int3 int32 int4 int5 int6 int64 int7 int8 qint32 qint8 quint2x4
    quint4x2 quint8 uint1 uint16 uint2 uint3 uint32 uint4 uint5 uint6 uint64 uint7 uint8""".split()
)

_DCP = "torch.distributed.checkpoint.metadata"
_MEM_FORMAT = CallStandIn(f"{_DCP}._MEM_FORMAT_ENCODING", "enum",
                          frozenset({"TORCH_CONTIGUOUS_FORMAT", "TORCH_CHANNELS_LAST", "TORCH_PRESERVE_FORMAT"}))
GETATTR = CallStandIn("builtins.getattr", "getattr")
SIZE = CallStandIn("torch.Size", "size")


def _path(module: str, name: str) -> tuple[tuple[str, str], CallStandIn]:
    return (module, name), CallStandIn(f"{module}.{name}", "path")


ALLOWED_GLOBALS: dict[tuple[str, str], object] = {
    (_DCP, "Metadata"): ClassStandIn(f"{_DCP}.Metadata", "metadata"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"):
        ClassStandIn("torch.distributed.checkpoint.filesystem._StorageInfo", "storage_info"),
    **{(_DCP, n): ClassStandIn(f"{_DCP}.{n}", "inert") for n in (
        "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata")},
    (_DCP, "_MEM_FORMAT_ENCODING"): _MEM_FORMAT,
    ("torch", "Size"): SIZE,
    ("torch.serialization", "_get_layout"): CallStandIn("torch.serialization._get_layout", "layout"),
    # StorageMeta.checkpoint_id may be a path; CPython 3.13 moved the classes to pathlib._local.
    **dict(_path(m, n) for m in ("pathlib", "pathlib._local") for n in ("PosixPath", "PurePosixPath")),
    # CPython 3.11.0-3.11.4 pickle enum members as getattr(EnumClass, "NAME"): checked on use (scanner).
    ("builtins", "getattr"): GETATTR,
    **{("torch", name): INERT for name in DTYPE_NAMES},
}

# Roots of modules whose globals can run code, touch files or processes, or load more pickles.
_DANGEROUS_ROOTS = frozenset("""
    __builtin__ __main__ _codecs _io _operator _pickle _posixsubprocess _thread asyncio builtins code codecs
    codeop commands copyreg ctypes dill distutils functools gc http imp importlib inspect io joblib marshal
    multiprocessing nt numpy operator os pdb pickle pip posix pty runpy setuptools shelve shutil signal site
    socket subprocess sys tempfile threading types urllib webbrowser zipimport
""".split())
# torch entry points that load code or pickles, write files, or reach other processes.
_DANGEROUS_TORCH = ("torch._C", "torch._dynamo", "torch._inductor", "torch.compile", "torch.cuda", "torch.hub",
                    "torch.jit", "torch.load", "torch.multiprocessing", "torch.ops", "torch.package", "torch.save",
                    "torch.serialization", "torch.utils", "torch.distributed.rpc", "torch.distributed.elastic",
                    "torch.classes", "torch.library", "torch.fx")
_NAME_MAX = 256


def printable(text: str, limit: int = 80) -> str:
    """`text` cut to `limit` characters with anything unprintable replaced: safe in one log line."""
    cut = text[:limit]
    out = "".join(c if c.isprintable() else "?" for c in cut)
    return out + ("..." if len(text) > limit else "")


def _refusal(module: str, name: str) -> RefusedGlobalError:
    dotted = printable(f"{module}.{name}", 120)
    full = f"{module}.{name}"
    if module.split(".", 1)[0] in _DANGEROUS_ROOTS or any(full == p or full.startswith(p + ".") for p in _DANGEROUS_TORCH):
        return UnsafeMetadataError(f"refuses {dotted} (could run code)", dotted)
    if module == "torch" or module.startswith("torch."):
        return UnknownClassError(f"unknown class {dotted} in .metadata (written by a newer torch?)", dotted)
    return UnsafeMetadataError(f"refuses {dotted} (not a DCP class)", dotted)


def find_global(module: object, name: object) -> object:
    """The stand-in for an allowed global; raise the RefusedGlobalError that fits any other."""
    if type(module) is not str or type(name) is not str:
        raise MetadataError("a global's module or name is not a string")
    if len(module) > _NAME_MAX or len(name) > _NAME_MAX:
        raise UnsafeMetadataError(f"refuses a global with a {max(len(module), len(name))}-character name",
                                  printable(f"{module}.{name}"))
    found = ALLOWED_GLOBALS.get((module, name))
    if found is None:
        raise _refusal(module, name)
    return found
