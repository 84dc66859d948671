"""Command-line flags of the reference trainer and their validation (torch-free, so bad input fails fast).

Validation runs before `import torch` and before any process group exists: a bad flag costs a fraction
of a second, prints one line naming the culprit and exits 2 without creating or overwriting anything.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from supervisor.contract import ENV_LOCAL_DIR, ENV_SKIP_STEPS
from supervisor.errors import EXIT_USAGE, UsageError

__all__ = ["build_parser", "parse_args", "validate", "positive_int", "non_negative_int", "positive_float",
           "OneLineParser"]


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite float > 0 (inf would overflow a timeout or a byte count later, with a traceback)."""
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


class OneLineParser(argparse.ArgumentParser):
    """Keep argparse's exit code 2 and one-line message, without the usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="trainer", description="Reference FSDP trainer: tiny byte-level LM, DCP checkpoints.",
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint-dir", required=True, type=Path, help="where step_<N> checkpoints go")
    p.add_argument("--steps", type=non_negative_int, default=200, help="total optimizer steps")
    p.add_argument("--save-every", type=positive_int, default=50, help="checkpoint every K steps")
    p.add_argument("--seed", type=non_negative_int, default=0, help="model init, data and RNG seed")
    p.add_argument("--resume", default="auto", metavar="{auto,none,PATH}",
                   help="auto: newest complete checkpoint in --checkpoint-dir; none; or one checkpoint dir")
    p.add_argument("--fsdp", type=int, choices=(1, 2), default=2, help="FSDP2 (fully_shard) or FSDP1")
    p.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    p.add_argument("--log-every", type=positive_int, default=10, help="progress line every N steps")
    p.add_argument("--data", type=Path, default=None, help="byte-level text file (default: synthetic)")
    p.add_argument("--pg-timeout-s", type=positive_float, default=120.0,
                   help="bound on any collective, incl. stop agreement and checkpoint coordination")
    p.add_argument("--manifest-sha256", action="store_true", help="also record sha256 of every file")
    p.add_argument("--skip-steps", type=non_negative_int, default=None, metavar="N",
                   help=f"after loading, skip N steps of the global batch without training on them (default: "
                   f"${ENV_SKIP_STEPS}, set by the supervisor when it rolls a divergence back, else 0)")
    local = p.add_argument_group("node-local tier (single node)")
    local.add_argument("--local-save-every", type=non_negative_int, default=0, metavar="K",
                       help="also checkpoint every K steps into the node-local tier (0 = off); --checkpoint-dir keeps "
                       "--save-every, the last step and a stop's save")
    local.add_argument("--local-checkpoint-dir", type=Path, default=None, metavar="DIR",
                       help=f"the node-local tier, e.g. on tmpfs (default: ${ENV_LOCAL_DIR}, set by the supervisor's "
                       "[checkpoints] local_dir); --resume auto also looks here")
    val = p.add_argument_group("validation and the best model")
    val.add_argument("--eval-every", type=non_negative_int, default=0, metavar="N",
                     help="evaluate on held-out data every N steps (0 = off); an evaluated step is always saved")
    val.add_argument("--eval-batches", type=positive_int, default=4, metavar="K", help="batches per rank in one evaluation")
    val.add_argument("--export-best", type=Path, default=None, metavar="DIR",
                     help="write DIR/model.safetensors and DIR/best.json whenever val_loss improves")
    model = p.add_argument_group("model and optimization")
    model.add_argument("--d-model", type=positive_int, default=64, help="transformer width")
    model.add_argument("--n-layers", type=positive_int, default=2, help="transformer blocks (one FSDP unit each)")
    model.add_argument("--n-heads", type=positive_int, default=4, help="attention heads (divide --d-model)")
    model.add_argument("--seq-len", type=positive_int, default=64, help="bytes of context per sample")
    model.add_argument("--batch-size", type=positive_int, default=8, help="sequences per rank per step")
    model.add_argument("--lr", type=positive_float, default=3e-3, help="peak learning rate")
    model.add_argument("--warmup-steps", type=non_negative_int, default=10, help="linear warmup, then cosine decay")
    model.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr as a fraction of --lr")
    return p


def _check_resume(value: str) -> None:
    if value in ("auto", "none"):
        return
    # Imported here: supervisor.checkpoints is torch-free, but only --resume PATH needs it.
    from supervisor.checkpoints import verify

    path = Path(value)
    if not path.is_dir():
        raise UsageError(f"--resume {value}: no such checkpoint directory")
    result = verify(path)
    if not result.complete:
        raise UsageError(f"--resume {value}: incomplete checkpoint ({result.reason})")


def _check_writable(root: Path, flag: str = "--checkpoint-dir") -> None:
    """Create `root` if needed and prove we can create (and remove) a file in it."""
    if root.exists() and not root.is_dir():
        raise UsageError(f"{flag} {root}: exists and is not a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(f"{flag} {root}: not writable ({exc.strerror or exc})") from None


def _check_eval(args: argparse.Namespace) -> None:
    if args.export_best is not None and not args.eval_every:
        raise UsageError(f"--export-best {args.export_best}: needs --eval-every N (the best is chosen by val_loss)")
    if args.data is not None and args.eval_every:
        from trainer.data import split_point  # numpy: only when there is a file to split

        size = args.data.stat().st_size
        if split_point(size, args.seq_len) < args.seq_len + 2:
            raise UsageError(f"--data {args.data}: {size} bytes are too few to hold out a validation region "
                             f"(--eval-every needs at least {2 * (args.seq_len + 2)})")


def _same_or_nested(a: Path, b: Path) -> bool:
    ra, rb = os.path.realpath(a), os.path.realpath(b)
    return ra == rb or ra.startswith(rb.rstrip(os.sep) + os.sep) or rb.startswith(ra.rstrip(os.sep) + os.sep)


def _check_local_tier(args: argparse.Namespace) -> None:
    """The local tier: a root of its own, and one node (a resume must never pick a step another node lacks)."""
    if args.local_checkpoint_dir is None and os.environ.get(ENV_LOCAL_DIR):
        args.local_checkpoint_dir = Path(os.environ[ENV_LOCAL_DIR])
    if not args.local_save_every:
        return
    local = args.local_checkpoint_dir
    if local is None:
        raise UsageError(f"--local-save-every {args.local_save_every}: needs --local-checkpoint-dir DIR "
                         f"(or ${ENV_LOCAL_DIR}, set by the supervisor's [checkpoints] local_dir)")
    if _same_or_nested(local, args.checkpoint_dir):
        raise UsageError(f"--local-checkpoint-dir {local}: overlaps --checkpoint-dir {args.checkpoint_dir}; each tier "
                         "is a root of its own")
    world, here = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    if world is not None and here is not None and world != here:
        raise UsageError(f"--local-save-every {args.local_save_every}: the local tier is for single-node jobs, and "
                         f"this one has {world} ranks over nodes of {here} (docs/checkpoints.md, The local tier)")


def validate(args: argparse.Namespace) -> None:
    """Raise UsageError (naming the flag) for input argparse cannot judge alone; creates the checkpoint dir."""
    if args.d_model % args.n_heads:
        raise UsageError(f"--d-model {args.d_model}: not divisible by --n-heads {args.n_heads}")
    if not 0.0 <= args.min_lr_ratio <= 1.0:
        raise UsageError(f"--min-lr-ratio {args.min_lr_ratio}: must be within [0, 1]")
    if args.data is not None:
        if not args.data.is_file():
            raise UsageError(f"--data {args.data}: no such file")
        if args.data.stat().st_size < args.seq_len + 2:
            raise UsageError(f"--data {args.data}: shorter than --seq-len + 2 bytes")
    _check_eval(args)
    # Resume is checked before the checkpoint dir is created: a bad --resume leaves the disk untouched.
    _check_resume(args.resume)
    _check_local_tier(args)
    _check_skip(args)
    _check_writable(args.checkpoint_dir)
    args.local_tier_problem = None
    if args.local_save_every:  # an optimisation, never a reason not to train: run() goes on without it, and says so
        try:
            _check_writable(args.local_checkpoint_dir, "--local-checkpoint-dir")
        except UsageError as exc:
            args.local_tier_problem = str(exc)
    if args.export_best is not None:
        _check_writable(args.export_best, "--export-best")
        _check_export_best(args.export_best)


def _check_skip(args: argparse.Namespace) -> None:
    if args.skip_steps is None:
        value = os.environ.get(ENV_SKIP_STEPS, "0") or "0"
        if not value.isdecimal() or len(value) > 15:
            raise UsageError(f"${ENV_SKIP_STEPS}={value[:20]!r}: not a non-negative integer")
        args.skip_steps = int(value)


def _check_export_best(directory: Path) -> None:
    """DIR must not hold another model's shards or index beside the `model.safetensors` the trainer writes there."""
    from trainer.best import WEIGHTS_FILE
    from trainer.exportfiles import conflict

    problem = conflict(directory / WEIGHTS_FILE)
    if problem:
        raise UsageError(f"--export-best {directory}: {problem}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate; on bad input print one line and exit 2 (argparse does the same for its errors)."""
    args = build_parser().parse_args(argv)
    try:
        validate(args)
    except UsageError as exc:
        print(f"trainer: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    return args
