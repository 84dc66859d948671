"""Write valid DCP checkpoints without torch, for tests and benchmarks across the project.

The `.metadata` written here is byte-for-byte the shape torch's FileSystemWriter pickles (protocol 4,
NEWOBJ + BUILD for the dataclasses, REDUCE for torch.Size, dtypes by name), so real torch loads it
too (`tests/integration/test_checkpoints_testing.py` checks that in a subprocess). Shards hold zeros.
The clients' layouts on top of it: Lightning's `meta.pt` (a torch.save zip, protocol 2, tensors as
persistent ids: `write_torch_file`, `write_lightning_checkpoint`) and transformers' `checkpoint-N/`
(`write_trainer_checkpoint`).

Test-only (never shipped): it lives beside the jobs so that they import it as a sibling; tests and `bench/`
import it as `tests.jobs.dcp_files` from the repo root.
"""
from __future__ import annotations

import json
import os
import pickle
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from supervisor.checkpoints.manifest import build_manifest
from supervisor.checkpoints.manifest import write_manifest as _write_manifest
from supervisor.layout import METADATA_NAME, step_dir_name

__all__ = ["dcp_metadata_bytes", "storage_metadata_bytes", "write_checkpoint", "write_manifest", "DEFAULT_TENSORS",
           "tensor", "write_torch_file", "lightning_meta", "write_lightning_checkpoint", "write_trainer_checkpoint"]

DEFAULT_TENSORS: dict[str, int] = {"model.w": 64, "model.b": 8, "optim.w.exp_avg": 64}  # fqn -> float32 elems


class _Global:
    """A (module, name) the pickle refers to, emitted as STACK_GLOBAL without importing it."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self) -> None:  # pragma: no cover - only its identity is pickled
        raise TypeError("placeholder")


class _New:
    """An instance built like pickle builds dataclasses: cls.__new__(cls) then BUILD(state)."""

    def __init__(self, cls: _Global, state: Any) -> None:
        self.cls, self.state = cls, state


class _Call:
    """func(*args), emitted as REDUCE."""

    def __init__(self, func: _Global, *args: Any) -> None:
        self.func, self.args = func, args


class _Stored:
    """A storage torch.save keeps outside the pickle: emitted as a persistent id."""

    def __init__(self, key: str) -> None:
        self.pid = ("storage", _Global("torch", "FloatStorage"), key, "cpu", 1)


if TYPE_CHECKING:
    class _PurePickler(pickle._Pickler):
        """The pure pickler's undocumented internals that _Pickler uses (typeshed declares only the public API)."""

        memo: dict[int, tuple[int, Any]]
        proto: int

        def write(self, data: bytes) -> None: ...
        def get(self, i: int) -> bytes: ...
        def memoize(self, obj: Any) -> None: ...
        def save(self, obj: Any, save_persistent_id: bool = True) -> None: ...
else:
    _PurePickler = pickle._Pickler


class _Pickler(_PurePickler):  # the pure pickler lets us emit opcodes
    def _memoized(self, obj: Any) -> bool:
        hit = self.memo.get(id(obj))
        if hit is not None:
            self.write(self.get(hit[0]))
        return hit is not None

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, (_Global, _New, _Call)):
            if self._memoized(obj):
                return
            if isinstance(obj, _Global) and self.proto < 4:  # torch.save's protocol 2: GLOBAL, as torch writes it
                self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
                self.memoize(obj)
            elif isinstance(obj, _Global):
                self.save(obj.module)
                self.save(obj.name)
                self.write(pickle.STACK_GLOBAL)
                self.memoize(obj)
            elif isinstance(obj, _New):
                self.save(obj.cls)
                self.save(())
                self.write(pickle.NEWOBJ)
                self.memoize(obj)
                self.save(obj.state)
                self.write(pickle.BUILD)
            else:
                self.save(obj.func)
                self.save(obj.args)
                self.write(pickle.REDUCE)
                self.memoize(obj)
            return
        super().save(obj, save_persistent_id)

    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if isinstance(obj, _Stored) else None


_DCP = "torch.distributed.checkpoint.metadata"
_G = {n: _Global(_DCP, n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                     "TensorStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")}
_STORAGE_INFO = _Global("torch.distributed.checkpoint.filesystem", "_StorageInfo")
_SIZE = _Global("torch", "Size")
_F32 = _Global("torch", "float32")
_LAYOUT = _Call(_Global("torch.serialization", "_get_layout"), "torch.strided")
_CONTIGUOUS = _Call(_G["_MEM_FORMAT_ENCODING"], 0)


def dcp_metadata_bytes(tensors: Mapping[str, int] | None = None, *, shards: int = 1) -> tuple[bytes, dict[str, int]]:
    """A DCP `.metadata` for 1-D float32 tensors (fqn -> elements), each split over `shards` files.

    Returns the pickle and the size each `__<rank>_0.distcp` file must have.
    """
    tensors = dict(DEFAULT_TENSORS if tensors is None else tensors)
    sizes = {f"__{r}_0.distcp": 0 for r in range(shards)}
    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    props = _New(_G["TensorProperties"], (_F32, _LAYOUT, False, _CONTIGUOUS, False))
    for fqn, numel in tensors.items():
        per = -(-numel // shards)
        chunks = []
        for r in range(shards):
            start, n = r * per, max(0, min(per, numel - r * per))
            offsets = _Call(_SIZE, (start,))
            chunks.append(_New(_G["ChunkStorageMetadata"], {"offsets": offsets, "sizes": _Call(_SIZE, (n,))}))
            rel = f"__{r}_0.distcp"
            index = _New(_G["MetadataIndex"], {"fqn": fqn, "offset": offsets, "index": r})
            storage[index] = _New(_STORAGE_INFO, {"relative_path": rel, "offset": sizes[rel], "length": 4 * n})
            sizes[rel] += 4 * n
        sdm[fqn] = _New(_G["TensorStorageMetadata"],
                        {"properties": props, "size": _Call(_SIZE, (numel,)), "chunks": chunks})
    meta = _New(_G["Metadata"], {
        "state_dict_metadata": sdm,
        "planner_data": {fqn: tuple(fqn.split(".")) for fqn in tensors},
        "storage_data": storage,
        "storage_meta": _New(_G["StorageMeta"],
                             {"checkpoint_id": None, "save_id": "synthetic", "load_id": None, "modules": []}),
        "version": "1.0.0",
    })
    return _dumps(meta), sizes


def storage_metadata_bytes(items: Sequence[tuple[Any, Any, Any]]) -> bytes:
    """A `.metadata` whose storage_data holds one _StorageInfo(relative_path, offset, length) per item.

    The values are pickled exactly as given, so tests can craft hostile ones (`..`, negative offsets).
    """
    storage = {
        _New(_G["MetadataIndex"], {"fqn": f"t{i}", "offset": _Call(_SIZE, (0,)), "index": 0}):
        _New(_STORAGE_INFO, {"relative_path": rel, "offset": off, "length": length})
        for i, (rel, off, length) in enumerate(items)
    }
    meta = _New(_G["Metadata"], {"state_dict_metadata": {f"t{i}": None for i in range(len(items))},
                                 "storage_data": storage, "version": "1.0.0"})
    return _dumps(meta)


def _dumps(obj: Any, protocol: int = 4) -> bytes:
    buf = _BytesSink()
    _Pickler(buf, protocol=protocol).dump(obj)
    return bytes(buf.data)


class _BytesSink:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, b: bytes) -> int:
        self.data += b
        return len(b)


def write_manifest(
    directory: Path,
    step: int,
    *,
    metrics: Mapping[str, float] | None = None,
    world_size: int = 1,
    sha256: bool = False,
    when: float | None = None,
) -> Path:
    """Write the trainer's manifest for `directory` as it is now, through the trainer's own writer."""
    manifest = build_manifest(directory, step=step, world_size=world_size, torch_version="synthetic",
                              metrics=dict(metrics or {}), sha256=sha256, now=when)
    return _write_manifest(directory, manifest)


def write_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    *,
    name: str | None = None,
    shards: int = 2,
    tensors: Mapping[str, int] | None = None,
    manifest: bool = True,
    metrics: Mapping[str, float] | None = None,
    sha256: bool = False,
    prebuilt: tuple[bytes, Mapping[str, int]] | None = None,
) -> Path:
    """Write a complete checkpoint `root/<name or step_%08d>`: shards, `.metadata` last but the manifest."""
    directory = Path(root) / (name or step_dir_name(step))
    directory.mkdir(parents=True)
    # `prebuilt` (from dcp_metadata_bytes) lets a benchmark clone one pickle into many dirs.
    data, sizes = prebuilt or dcp_metadata_bytes(tensors, shards=shards)
    for rel, size in sizes.items():
        with open(directory / rel, "wb") as f:
            f.truncate(size)
    (directory / METADATA_NAME).write_bytes(data)
    if manifest:
        write_manifest(directory, step, metrics=metrics, world_size=shards, sha256=sha256)
    return directory


# ---- the clients' layouts ------------------------------------------------------------------------------------

def tensor() -> Any:
    """A 0-d float tensor as torch.save pickles it (`_rebuild_tensor_v2` of a persistent storage of zeros)."""
    return _Call(_Global("torch._utils", "_rebuild_tensor_v2"),
                 _Stored("0"), 0, (), (), False, _Call(_Global("collections", "OrderedDict")))


def write_torch_file(path: Path, obj: Any, *, archive: str = "meta") -> Path:
    """Write `obj` as torch.save does (protocol 2 in `<archive>/data.pkl`, storages beside it, stored zip)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr(f"{archive}/data.pkl", _dumps(obj, protocol=2))
        z.writestr(f"{archive}/.format_version", "1")
        z.writestr(f"{archive}/byteorder", "little")
        z.writestr(f"{archive}/data/0", bytes(4))
        z.writestr(f"{archive}/version", "3\n")
    return path


def lightning_meta(step: int, *, epoch: int = 0, dirpath: Path | None = None, top_k: Sequence[str] = (),
                   best: str = "", last: str = "") -> dict[str, Any]:
    """What Lightning 2.6's sharded save puts in `meta.pt`: the step, and one ModelCheckpoint's state (names in
    `dirpath`)."""
    def where(name: str) -> str:
        return str(Path(dirpath or ".") / name) if name else ""

    state = {"monitor": "train_loss" if top_k else None, "best_model_score": tensor(), "best_model_path": where(best),
             "current_score": tensor(), "dirpath": str(dirpath or ""),
             "best_k_models": {where(n): tensor() for n in top_k}, "kth_best_model_path": "", "kth_value": tensor(),
             "last_model_path": where(last)}
    key = "ModelCheckpoint{'monitor': 'train_loss', 'mode': 'min', 'every_n_train_steps': 5, 'every_n_epochs': 0}"
    return {"epoch": epoch, "global_step": step, "pytorch-lightning_version": "2.6.6", "loops": {"fit_loop": {}},
            "callbacks": {key: state}, "lr_schedulers": []}


def write_lightning_checkpoint(root: str | os.PathLike[str], step: int, *, name: str | None = None,
                               meta: Mapping[str, Any] | None = None, with_meta: bool = True) -> Path:
    """Lightning's sharded `epoch=0-step=<step>.ckpt/`: a DCP dir, then `meta.pt` (unless `with_meta=False`:
    a save cut between the two)."""
    directory = write_checkpoint(root, step, name=name or f"epoch=0-step={step}.ckpt", manifest=False)
    if with_meta:
        write_torch_file(directory / "meta.pt", dict(meta) if meta is not None else lightning_meta(step))
    return directory


def write_trainer_checkpoint(root: str | os.PathLike[str], step: int, *, upto: str = "trainer_state.json",
                             ranks: int = 2) -> Path:
    """transformers' Trainer `checkpoint-<step>/` (FSDP, SHARDED_STATE_DICT), written in its order and stopped
    after `upto` (one of pytorch_model_fsdp_0, optimizer_0, scheduler.pt, rng_state, trainer_state.json)."""
    directory = Path(root) / f"checkpoint-{step}"
    order = ["pytorch_model_fsdp_0", "optimizer_0", "scheduler.pt", "rng_state", "trainer_state.json"]
    for part in order[: order.index(upto) + 1]:
        if part in ("pytorch_model_fsdp_0", "optimizer_0"):
            write_checkpoint(directory, step, name=part, manifest=False)
        elif part == "scheduler.pt":
            write_torch_file(directory / part, {"last_epoch": step}, archive="scheduler")
        elif part == "rng_state":
            for r in range(ranks):
                write_torch_file(directory / f"rng_state_{r}.pth", {"python": None}, archive=f"rng_state_{r}")
        else:
            (directory / part).write_text(json.dumps({"global_step": step, "log_history": []}, indent=2,
                                                     sort_keys=True) + "\n")
    return directory


def safetensors_bytes(tensors: Mapping[str, int]) -> bytes:
    """A safetensors file of float32 tensors `name -> element count`: header length, JSON header, data."""
    header, offset = {}, 0
    for name, count in tensors.items():
        header[name] = {"dtype": "F32", "shape": [count], "data_offsets": [offset, offset + 4 * count]}
        offset += 4 * count
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + bytes(offset)


FULL_TRAINER_ORDER = ("model", "optimizer.pt", "scheduler.pt", "rng_state", "trainer_state.json")


def write_full_trainer_checkpoint(root: str | os.PathLike[str], step: int, *, upto: str = "trainer_state.json",
                                  weights: str = "model.safetensors", ranks: int = 2) -> Path:
    """transformers' Trainer `checkpoint-<step>/` with its default full state dict (no FSDP sharding), written in
    `_save_checkpoint`'s order and stopped after `upto` (one of FULL_TRAINER_ORDER). `weights`: model.safetensors,
    pytorch_model.bin, or a sharded model.safetensors.index.json with two shards."""
    directory = Path(root) / f"checkpoint-{step}"
    directory.mkdir(parents=True, exist_ok=True)
    for part in FULL_TRAINER_ORDER[: FULL_TRAINER_ORDER.index(upto) + 1]:
        if part == "model" and weights == "pytorch_model.bin":
            write_torch_file(directory / weights, {"w": step}, archive="pytorch_model")
        elif part == "model" and weights.endswith(".index.json"):
            shards = [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
            for i, shard in enumerate(shards):
                (directory / shard).write_bytes(safetensors_bytes({f"w{i}": 4 + step}))
            (directory / weights).write_text(json.dumps({"weight_map": {"w0": shards[0], "w1": shards[1]}}))
        elif part == "model":
            (directory / weights).write_bytes(safetensors_bytes({"w": 4 + step, "b": 2}))
        if part == "model":
            (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
            write_torch_file(directory / "training_args.bin", {"output_dir": str(root)}, archive="training_args")
        elif part in ("optimizer.pt", "scheduler.pt"):
            write_torch_file(directory / part, {"state": step}, archive=part.split(".")[0])
        elif part == "rng_state":
            for r in range(ranks):
                write_torch_file(directory / f"rng_state_{r}.pth", {"python": None}, archive=f"rng_state_{r}")
        elif part == "trainer_state.json":
            (directory / part).write_text(json.dumps({"global_step": step, "log_history": []}, indent=2) + "\n")
    return directory
