"""A synthetic DCP checkpoint shaped like Llama-3 under FSDP2, built from torch's real classes (no data).

Why: the supervisor must read `.metadata` of checkpoints far larger than this machine can train (70B x
1024 ranks), fast and safely. Those files cannot be saved here by `dcp.save`, so this module builds the
same object graph DCP's FileSystemWriter.finish() pickles (`Metadata`, `TensorStorageMetadata`,
`ChunkStorageMetadata`, `MetadataIndex`, `_StorageInfo`, `StorageMeta`, torch.Size, dtypes) and
pickles it with the same call (`pickle.dump(metadata, file)`, the default protocol). The shards are
sparse files (`truncate`) of the sizes the storage data claims, so a checkpoint of any size costs only
the `.metadata`.

Shape, as `torch.distributed.checkpoint.state_dict.get_state_dict` + `dcp.save` of an FSDP2
(`fully_shard`, dim-0 `Shard(0)`) Llama-3 with AdamW would write it:
- `model.<fqn>` for every parameter and `optimizer.state.<fqn>.exp_avg` / `.exp_avg_sq`: one chunk per
  rank (ceil(dim0 / ranks) rows each; trailing ranks may hold empty chunks), float32;
- `optimizer.state.<fqn>.step`: a replicated 0-dim tensor, deduplicated onto one rank (round robin);
- `optimizer.param_groups.0.*` and the trainer's `step`: small bytes entries;
- one storage file `__<rank>_0.distcp` per rank; each item's length is its bytes plus torch.save's
  per-item framing (measured on torch 2.13: about 1.5 KB).

    python -m bench.synthetic --model 70b --ranks 64 OUT      # prints a JSON summary
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import pickle
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["MODELS", "ModelShape", "parameters", "build_metadata", "write_checkpoint", "main"]

TORCH_SAVE_FRAMING = 1577  # bytes torch.save adds around one tensor item in a .distcp file (torch 2.13)
BYTES_ITEM = 1261  # a small pickled value (lr, betas, step) as DCP writes it
_ADAMW_GROUP = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
                "differentiable", "fused", "decoupled_weight_decay", "params")


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama-3 transformer that decide its parameter shapes."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab: int = 128256


MODELS: dict[str, ModelShape] = {
    "tiny": ModelShape(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab=256),
    "8b": ModelShape(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336),
    "70b": ModelShape(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
    "405b": ModelShape(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248),
}


def parameters(m: ModelShape) -> list[tuple[str, tuple[int, ...]]]:
    """(fqn, shape) of every parameter, in torchtitan's Llama-3 naming and order."""
    kv = m.n_kv_heads * (m.dim // m.n_heads)
    out = [("tok_embeddings.weight", (m.vocab, m.dim))]
    for i in range(m.n_layers):
        p = f"layers.{i}."
        out += [
            (p + "attention.wq.weight", (m.dim, m.dim)), (p + "attention.wk.weight", (kv, m.dim)),
            (p + "attention.wv.weight", (kv, m.dim)), (p + "attention.wo.weight", (m.dim, m.dim)),
            (p + "feed_forward.w1.weight", (m.ffn_dim, m.dim)), (p + "feed_forward.w2.weight", (m.dim, m.ffn_dim)),
            (p + "feed_forward.w3.weight", (m.ffn_dim, m.dim)),
            (p + "attention_norm.weight", (m.dim,)), (p + "ffn_norm.weight", (m.dim,)),
        ]
    return out + [("norm.weight", (m.dim,)), ("output.weight", (m.vocab, m.dim))]


def build_metadata(model: ModelShape, ranks: int, checkpoint_id: Path) -> tuple[Any, dict[str, int]]:
    """DCP's Metadata for an FSDP2 save of `model` + AdamW over `ranks` ranks, and each file's size."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    files = [f"__{r}_0.distcp" for r in range(ranks)]  # one str object per rank, as each rank's results share it
    ends = [0] * ranks
    per_rank: list[list[tuple[Any, Any]]] = [[] for _ in range(ranks)]  # each rank's write results, in order

    def store(rank: int, index: Any, nbytes: int) -> None:
        info = _StorageInfo(relative_path=files[rank], offset=ends[rank], length=nbytes)
        ends[rank] += nbytes
        per_rank[rank].append((index, info))

    sdm: dict[str, Any] = {}
    planner: dict[str, tuple[Any, ...]] = {}
    params = parameters(model)
    sharded = [(f"model.{fqn}", ("model", fqn), shape) for fqn, shape in params]
    for fqn, shape in params:
        for kind in ("exp_avg", "exp_avg_sq"):
            sharded.append((f"optimizer.state.{fqn}.{kind}", ("optimizer", "state", fqn, kind), shape))
    for key, path, shape in sharded:
        rows = math.ceil(shape[0] / ranks)
        chunks = []
        for r in range(ranks):
            start = min(r * rows, shape[0])
            local = (min(rows, shape[0] - start), *shape[1:])
            offsets = (start,) + (0,) * (len(shape) - 1)
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(local)))
            # Each rank's results reach rank 0 through an object collective: fresh str and Size objects.
            store(r, MetadataIndex("".join(key), torch.Size(offsets), r), 4 * math.prod(local) + TORCH_SAVE_FRAMING)
        sdm[key] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), chunks)
        planner[key] = path
    for i, (fqn, _) in enumerate(params):  # AdamW's step: replicated, deduplicated onto one rank
        key = f"optimizer.state.{fqn}.step"
        scalar = torch.Size(())
        sdm[key] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(()),
                                         [ChunkStorageMetadata(offsets=scalar, sizes=torch.Size(()))])
        planner[key] = ("optimizer", "state", fqn, "step")
        store(i % ranks, MetadataIndex("".join(key), torch.Size(()), 0), 4 + TORCH_SAVE_FRAMING)
    byte_keys = [(f"optimizer.param_groups.0.{k}", ("optimizer", "param_groups", 0, k)) for k in _ADAMW_GROUP]
    for j, (key, path) in enumerate([*byte_keys, ("step", ("step",))]):
        sdm[key] = BytesStorageMetadata()
        planner[key] = path
        store((len(params) + j) % ranks, MetadataIndex("".join(key)), BYTES_ITEM)

    storage = {index: info for results in per_rank for index, info in results}
    meta = Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=str(uuid.uuid4())),
                    version="1.0.0")
    return meta, dict(zip(files, ends))


def write_checkpoint(out: Path, model: str, ranks: int) -> dict[str, Any]:
    """Write `out/.metadata` and sparse `out/__<rank>_0.distcp` files; return a summary."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    gc.disable()  # millions of small objects and no cycles: the collector would only rescan them
    try:
        meta, sizes = build_metadata(MODELS[model], ranks, out.resolve())
        for name, size in sizes.items():
            with open(out / name, "wb") as f:
                f.truncate(size)
        with open(out / ".metadata", "wb") as f:  # what FileSystemWriter.finish does
            pickle.dump(meta, f)
        chunks = sum(len(v.chunks) for v in meta.state_dict_metadata.values() if hasattr(v, "chunks"))
        entries = len(meta.state_dict_metadata)
        del meta
    finally:
        gc.enable()
    return {"model": model, "ranks": ranks, "entries": entries, "chunks": chunks,
            "metadata_bytes": (out / ".metadata").stat().st_size, "shard_bytes": sum(sizes.values()),
            "seconds": round(time.perf_counter() - start, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.synthetic", description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="70b")
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("out", type=Path, help="the checkpoint dir to write (created)")
    a = p.parse_args(argv)
    if a.ranks < 1:
        p.error("--ranks must be at least 1")
    print(json.dumps(write_checkpoint(a.out, a.model, a.ranks)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
