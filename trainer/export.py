"""`python -m trainer.export CHECKPOINT_DIR OUT`: consolidated model weights for deployment, no process group needed.

OUT ending in `.safetensors` (any case) gets safetensors (what inference servers and model hubs load); any
other name gets a torch `.pt` file. Either holds a flat `{parameter name: tensor}` map, names without FSDP wrapper
prefixes (identical for FSDP1 and FSDP2 checkpoints), that an unwrapped `TinyLM` loads strictly.

`--dtype` casts floating-point tensors (a value the cast would turn into inf is refused); `--sharded-max-gb G`
splits a safetensors export larger than G GiB into `<stem>-0000k-of-0000n.safetensors` plus
`<stem>.safetensors.index.json` (`{"metadata": {"total_size"}, "weight_map": {name: file}}`), the layout model
hubs use. Every file is written atomically and readable like any file written here (0o666 less the umask).
A new export replaces the whole previous one under that name: the old index goes first (until the new one is
written, no index names a mix of two exports), then the shards, then the index; a leftover single file or
shards of the old export are removed, because loaders prefer a single file over an index, or glob every shard.
Only our own, though: a shard or index name that no earlier export recorded (a downloaded hub model's
`model-00001-of-00002.safetensors`) makes the export refuse, naming it, before anything is written; and a
killed export's leftovers are removed by our own temporary names only (trainer/exportfiles.py says how).
The trainer's `--export-best` writes its `model.safetensors` through `write_safetensors` too.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import stat
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from supervisor.errors import EXIT_USAGE, UsageError
from supervisor.host.atomic import replacing
from trainer import exportfiles as files
from trainer.args import OneLineParser, positive_float
from trainer.exportfiles import SAFETENSORS_SUFFIX, index_name, is_safetensors, shard_file_names

__all__ = ["load_model_weights", "export", "main", "unshared", "plan_shards", "shard_file_names", "index_name",
           "is_safetensors", "write_safetensors", "DTYPES", "SAFETENSORS_SUFFIX"]

MODEL_KEY = "model"
DTYPES = ("float32", "bfloat16", "float16")
_GIB = 2**30
_MAX_SHARD_GIB = 2**30  # an exbibyte: any limit above it means one file anyway (and never overflows an int)


def load_model_weights(checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Read only the model entries of a DCP checkpoint into full (unsharded) CPU tensors."""
    import torch
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"torch\.distributed is unavailable.*")
            loaded = _load_state_dict_from_keys({MODEL_KEY}, checkpoint_id=os.fspath(checkpoint_dir))
    except CheckpointException as exc:  # a shard of the right size but garbage: DCP's per-rank traceback
        raise UsageError(f"{checkpoint_dir}: cannot read the model ({_cause(str(exc))})") from None
    weights = loaded.get(MODEL_KEY)
    if not isinstance(weights, dict) or not weights:
        raise UsageError(f"{checkpoint_dir}: no {MODEL_KEY!r} entries in this checkpoint")
    return {name: t.detach().cpu().contiguous() for name, t in weights.items() if isinstance(t, torch.Tensor)}


def _cause(traceback_text: str, limit: int = 160) -> str:
    """The last `SomeError: message` line of a traceback, shortened: one line a user can act on."""
    lines = [line.strip() for line in traceback_text.splitlines() if line.strip()] or ["unknown error"]
    causes = [line for line in lines if re.match(r"[\w.]+(Error|Exception): ", line)]
    cause = (causes or lines)[-1]
    return cause if len(cause) <= limit else cause[: limit - 3] + "..."


def unshared(weights: Mapping[str, Any]) -> dict[str, Any]:
    """Contiguous CPU tensors, no two sharing storage: safetensors refuses tied tensors, so later ones are cloned.

    A tied pair (an output head sharing the embedding) is written twice; loading restores both names, and
    `load_state_dict` copies into the model's own (still tied) parameters.
    """
    import torch

    seen: set[int] = set()
    out: dict[str, Any] = {}
    for name, tensor in weights.items():
        t = tensor.detach().cpu()
        if t.untyped_storage().data_ptr() in seen or not t.is_contiguous():
            t = t.clone(memory_format=torch.contiguous_format)
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def plan_shards(sizes: Sequence[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Pack tensors, in order, into shards of at most `max_bytes` each (a larger tensor gets a shard of its own)."""
    shards: list[list[str]] = []
    used = 0
    for name, size in sizes:
        if not shards or (used + size > max_bytes and shards[-1]):
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _save_file(tensors: Mapping[str, Any], path: Path) -> None:
    """One safetensors file at `path`, a new name in our staging folder (safetensors' own temporary lands there too),
    readable like any file written here and fsynced; a failed write (full disk) is an OSError like any other."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    # Created first like open() would (0o666 less the umask), to learn that mode: safetensors writes 0o600.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    os.close(fd)
    try:
        save_file(dict(tensors), os.fspath(path), metadata={"format": "pt"})
    except SafetensorError as exc:
        raise OSError(str(exc)) from None
    os.chmod(path, mode)
    _fsync(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    """A new file in our staging folder (renamed into place later: no temporary of its own needed)."""
    with open(path, "xb") as f:
        f.write(data)
    _fsync(path)


def write_safetensors(weights: Mapping[str, Any], out: str | os.PathLike[str], *,
                      max_shard_bytes: int | None = None) -> list[Path]:
    """Write `weights` as one safetensors file, or as hub-style shards plus an index; returns the files written.

    ExportConflictError (nothing written) when a shard or index name beside `out` holds a file no earlier export
    of ours recorded. The caller holds `exportfiles.locked` on the folder.
    """
    out = Path(out)
    tensors = unshared(weights)
    sizes = [(name, t.numel() * t.element_size()) for name, t in tensors.items()]
    groups = plan_shards(sizes, max_shard_bytes) if max_shard_bytes else [list(tensors)]
    record = files.read_record(out)
    files.refuse_foreign(record)
    sharded, token, index_path = len(groups) > 1, files.new_token(), index_name(out)
    targets = shard_file_names(out, len(groups)) if sharded else [out]
    written = [*targets, index_path] if sharded else targets
    stale = [p for p in record.present() if p not in written]
    with files.staging(out, token) as stage:
        for path, names in zip(targets, groups):
            _save_file({n: tensors[n] for n in names}, stage / path.name)
        if sharded:
            index = {"metadata": {"total_size": sum(size for _, size in sizes)},
                     "weight_map": {n: path.name for path, names in zip(targets, groups) for n in names}}
            _write_file(stage / index_path.name, json.dumps(index, indent=2, sort_keys=True).encode())
            # On disk before any file it names: whatever moment a kill comes, every shard and index of ours
            # beside `out` (the old export's or the new one's) is listed, so the next export may remove it.
            new = [files.identify(stage / p.name, p.name) for p in written]
            files.write_record(out, [*record.files, *(i for i in new if i is not None)], token)
        files.remove_owned(record, [index_path])  # first: no index may name a mix of the old shards and the new
        for path in written:
            os.replace(stage / path.name, path)
    files.remove_owned(record, stale)
    if sharded:
        out.unlink(missing_ok=True)  # a single file of an earlier export to this name: loaders would prefer it
        files.write_record(out, [i for i in (files.identify(p) for p in written) if i is not None], token)
    else:
        files.drop_record(out)
    return written


def _cast(weights: dict[str, Any], dtype: str | None) -> dict[str, Any]:
    """Floating-point tensors in `dtype`; UsageError when a finite value would become inf (float16 tops at 65504)."""
    import torch

    if dtype is None:
        return weights
    target = getattr(torch, dtype)
    out = {}
    for name, t in weights.items():
        if t.is_floating_point():
            cast = t.to(target)
            overflow = int((torch.isfinite(t) & ~torch.isfinite(cast)).sum())
            if overflow:
                raise UsageError(f"--dtype {dtype}: {overflow} values of {name} are beyond its range "
                                 f"(max {torch.finfo(target).max:g}) and would become inf")
            t = cast
        out[name] = t
    return out


def export(checkpoint_dir: str | os.PathLike[str], out: str | os.PathLike[str], *, dtype: str | None = None,
           max_shard_bytes: int | None = None) -> tuple[int, list[Path]]:
    """Write the weights of `checkpoint_dir` to `out` atomically; returns (number of tensors, files written)."""
    import torch

    weights = _cast(load_model_weights(checkpoint_dir), dtype)
    out = Path(out)
    with files.locked(out.parent):
        files.remove_leftovers(out)  # an export to the same name killed midway (as large as the model)
        if is_safetensors(out):
            return len(weights), write_safetensors(weights, out, max_shard_bytes=max_shard_bytes)
        with replacing(out) as tmp:
            try:
                torch.save(weights, tmp)
            except RuntimeError as exc:  # torch's zip writer on a full disk: "unexpected pos ..."
                raise OSError(f"torch.save failed: {str(exc).splitlines()[-1]}") from None
    return len(weights), [out]


def _validate(args: argparse.Namespace) -> None:
    from supervisor.checkpoints import verify

    if not args.checkpoint.is_dir():
        raise UsageError(f"{args.checkpoint}: no such checkpoint directory")
    verdict = verify(args.checkpoint)
    if not verdict.complete:
        raise UsageError(f"{args.checkpoint}: incomplete checkpoint ({verdict.reason})")
    if args.out.is_dir():
        raise UsageError(f"{args.out}: is a directory; name the output file (model.safetensors or model.pt)")
    if args.out.exists() and not args.out.is_file():  # a FIFO or a device: the final rename would replace it
        raise UsageError(f"{args.out}: exists and is not a regular file")
    if args.out.exists() and args.out.resolve().parent == args.checkpoint.resolve():
        raise UsageError(f"{args.out}: is a file of the checkpoint itself; name a new file")
    parent = args.out.parent if str(args.out.parent) else Path(".")
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise UsageError(f"{args.out}: its directory does not exist or is not writable")
    if args.sharded_max_gb is not None and not is_safetensors(args.out):
        raise UsageError(f"--sharded-max-gb: only for a {SAFETENSORS_SUFFIX} output, not {args.out.name}")
    problem = files.conflict(args.out) if is_safetensors(args.out) else None
    if problem:  # checked again when writing; here before the weights are loaded (minutes for a large model)
        raise UsageError(problem)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m trainer.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a complete checkpoint dir (e.g. ckpts/step_00000200)")
    parser.add_argument("out", type=Path, help="output file: *.safetensors for safetensors, else a torch .pt")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="cast floating-point weights (default: as saved)")
    parser.add_argument("--sharded-max-gb", type=positive_float, default=None, metavar="G",
                        help="split a safetensors export into shards of at most G GiB plus an index")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    gib = args.sharded_max_gb
    max_bytes = max(1, int(min(gib, _MAX_SHARD_GIB) * _GIB)) if gib is not None else None
    try:
        _validate(args)
        count, files = export(args.checkpoint, args.out, dtype=args.dtype, max_shard_bytes=max_bytes)
    except UsageError as exc:
        print(f"trainer.export: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # e.g. the disk filled up: the temporary file is gone, OUT is as it was
        print(f"trainer.export: error: {args.out}: cannot write ({exc.strerror or exc})", file=sys.stderr)
        return EXIT_USAGE
    where = args.out if len(files) == 1 else f"{len(files) - 1} shards + {files[-1]}"
    print(f"trainer.export: wrote {count} tensors to {where}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
