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
from supervisor.host.atomic import replacing, temporaries, write_atomic
from trainer.args import OneLineParser, positive_float

__all__ = ["load_model_weights", "export", "main", "unshared", "plan_shards", "shard_file_names", "index_name",
           "is_safetensors", "write_safetensors", "writer_leftovers", "DTYPES", "SAFETENSORS_SUFFIX"]

MODEL_KEY = "model"
SAFETENSORS_SUFFIX = ".safetensors"
DTYPES = ("float32", "bfloat16", "float16")
_GIB = 2**30
_SAFETENSORS_TMP = re.compile(r"\.tmp[A-Za-z0-9]{6}")  # safetensors (Rust tempfile) writes there, then renames
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


def is_safetensors(out: Path) -> bool:
    return out.name.lower().endswith(SAFETENSORS_SUFFIX)


def _split(out: Path) -> tuple[str, str]:
    """(stem, suffix as the user spelt it): `MODEL.SAFETENSORS` -> ("MODEL", ".SAFETENSORS")."""
    cut = len(out.name) - len(SAFETENSORS_SUFFIX)
    return out.name[:cut], out.name[cut:]


def shard_file_names(out: Path, count: int) -> list[Path]:
    """`model.safetensors` split in 3: `model-00001-of-00003.safetensors`, ... (1-based, 5 digits, hub style)."""
    stem, suffix = _split(out)
    return [out.with_name(f"{stem}-{k:05d}-of-{count:05d}{suffix}") for k in range(1, count + 1)]


def index_name(out: Path) -> Path:
    return out.with_name(f"{out.name}.index.json")


def _old_shards(out: Path) -> list[Path]:
    """Shards of any earlier sharded export to `out` (any shard count)."""
    stem, suffix = _split(out)
    pattern = re.compile(rf"{re.escape(stem)}-\d{{5}}-of-\d{{5}}{re.escape(suffix)}")
    return [p for p in out.parent.iterdir() if pattern.fullmatch(p.name)] if out.parent.is_dir() else []


def writer_leftovers(out: Path) -> list[Path]:
    """Temporaries a writer of `out` killed midway left beside it: ours (`replacing`) and safetensors' own
    (`.tmp` + 6 letters or digits, renamed over ours when done; as large as the file). Only for a directory
    the caller owns: the second kind has no name of its own."""
    theirs = [p for p in out.parent.iterdir() if _SAFETENSORS_TMP.fullmatch(p.name) and p.is_file()]
    return [*temporaries(out), *sorted(theirs)]


def _save_file(tensors: Mapping[str, Any], path: Path) -> None:
    """One safetensors file, atomically; a failed write (full disk) is an OSError like any other."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    with replacing(path) as tmp:
        mode = stat.S_IMODE(os.stat(tmp).st_mode)  # what `replacing` created: 0o666 less the umask
        try:
            save_file(dict(tensors), os.fspath(tmp), metadata={"format": "pt"})
        except SafetensorError as exc:
            raise OSError(str(exc)) from None
        os.chmod(tmp, mode)  # safetensors writes its own file with 0o600


def write_safetensors(weights: Mapping[str, Any], out: str | os.PathLike[str], *,
                      max_shard_bytes: int | None = None) -> list[Path]:
    """Write `weights` as one safetensors file, or as hub-style shards plus an index; returns the files written."""
    out = Path(out)
    tensors = unshared(weights)
    sizes = [(name, t.numel() * t.element_size()) for name, t in tensors.items()]
    groups = plan_shards(sizes, max_shard_bytes) if max_shard_bytes else [list(tensors)]
    index_path, stale = index_name(out), _old_shards(out)
    index_path.unlink(missing_ok=True)  # first: no index may name a mix of the old shards and the new
    if len(groups) <= 1:
        _save_file(tensors, out)
        _remove(stale)
        return [out]
    files = shard_file_names(out, len(groups))
    for path, names in zip(files, groups):
        _save_file({n: tensors[n] for n in names}, path)
    index = {"metadata": {"total_size": sum(size for _, size in sizes)},
             "weight_map": {n: path.name for path, names in zip(files, groups) for n in names}}
    write_atomic(index_path, json.dumps(index, indent=2, sort_keys=True).encode())
    _remove([out, *(p for p in stale if p not in files)])
    return [*files, index_path]


def _remove(paths: Sequence[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


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
