"""`python -m trainer.export CHECKPOINT_DIR OUT.pt`: consolidated model weights, no process group needed.

The output is a flat `{parameter name: tensor}` dict, names without FSDP wrapper prefixes (identical for
FSDP1 and FSDP2 checkpoints), loadable with `torch.load(path, weights_only=True)` into an unwrapped model.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from supervisor.errors import EXIT_USAGE, UsageError

__all__ = ["load_model_weights", "export", "main"]

MODEL_KEY = "model"


def load_model_weights(checkpoint_dir: str | os.PathLike) -> dict:
    """Read only the model entries of a DCP checkpoint into full (unsharded) CPU tensors."""
    import torch
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is unavailable.*")
        loaded = _load_state_dict_from_keys({MODEL_KEY}, checkpoint_id=os.fspath(checkpoint_dir))
    weights = loaded.get(MODEL_KEY)
    if not isinstance(weights, dict) or not weights:
        raise UsageError(f"{checkpoint_dir}: no {MODEL_KEY!r} entries in this checkpoint")
    return {name: t.detach().cpu().contiguous() for name, t in weights.items() if isinstance(t, torch.Tensor)}


def export(checkpoint_dir: str | os.PathLike, out: str | os.PathLike) -> int:
    """Write the weights of `checkpoint_dir` to `out` atomically; returns the number of tensors."""
    import torch

    weights = load_model_weights(checkpoint_dir)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        torch.save(weights, tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return len(weights)


def _validate(args: argparse.Namespace) -> None:
    from supervisor.checkpoints import verify

    if not args.checkpoint.is_dir():
        raise UsageError(f"{args.checkpoint}: no such checkpoint directory")
    verdict = verify(args.checkpoint)
    if not verdict.complete:
        raise UsageError(f"{args.checkpoint}: incomplete checkpoint ({verdict.reason})")
    parent = args.out.parent if str(args.out.parent) else Path(".")
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise UsageError(f"{args.out}: its directory does not exist or is not writable")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a complete checkpoint dir (e.g. ckpts/step_00000200)")
    parser.add_argument("out", type=Path, help="output .pt file")
    args = parser.parse_args(argv)
    try:
        _validate(args)
        count = export(args.checkpoint, args.out)
    except UsageError as exc:
        print(f"trainer.export: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"trainer.export: wrote {count} tensors to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
