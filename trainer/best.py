"""The best model by validation loss, kept across restarts: `DIR/model.safetensors` and `DIR/best.json`.

`best.json` is `{"step", "val_loss", "checkpoint"}`: the step whose evaluation gave the lowest `val_loss`
so far, and the checkpoint dir saved at that step. That checkpoint always exists because an evaluated step
is always saved, and the export happens only after that save committed (trainer/loop.py). The weights are
the full model gathered from the shards (the same bits an export of that checkpoint gives) and are
written first; `best.json` is renamed into place last, so a reader that trusts `best.json` never sees
weights older than it says.

A restarted run reads `best.json` back and replaces the model only with a strictly lower `val_loss`. A
corrupt or unreadable `best.json` (a FIFO or a device included: it is never opened blocking), or one without
its weights file, is reported and ignored, never a crash. If a run died after committing a new best's
checkpoint but before `best.json` was renamed, the resumed checkpoint's manifest holds a `val_loss` better
than `best.json`: `missed_export` says so and the trainer exports the loaded weights at once.

Runs may share DIR (a sweep pointing every run at one `--export-best`). Each write holds an exclusive
`flock` on DIR itself (nothing is left behind) and compares with `best.json` as it is on disk then: a run
never puts a worse model over a better one another run wrote meanwhile, and the weights and `best.json` in
DIR always come from one write. With the lock held, temporaries of a write killed midway (as large as the
model) are removed, by our own temporary names only (trainer/exportfiles.py): another program's files in DIR
are never touched, and a shard or index of another model beside `model.safetensors` makes the write refuse.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from supervisor.checkpoints import open_capped
from supervisor.errors import BestFileError
from supervisor.host.atomic import temporaries, write_atomic
from trainer.exportfiles import locked
from trainer.exportfiles import remove_leftovers as remove_export_leftovers

__all__ = ["BEST_FILE", "WEIGHTS_FILE", "Best", "BestFileError", "parse_best", "read_best", "improves",
           "missed_export", "write_best", "remove_leftovers"]

BEST_FILE = "best.json"
WEIGHTS_FILE = "model.safetensors"
_MAX_BYTES = 64 * 1024  # a best.json is ~150 bytes


@dataclass(frozen=True)
class Best:
    """One best model: the step it was evaluated at, its val_loss, and the checkpoint dir of that step."""

    step: int
    val_loss: float
    checkpoint: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def parse_best(data: bytes) -> Best:
    """Validate best.json bytes; raise BestFileError naming the bad field."""
    if len(data) > _MAX_BYTES:
        raise BestFileError(f"{len(data)} bytes, more than a best.json ever holds")
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise BestFileError("not JSON") from None
    if not isinstance(raw, dict):
        raise BestFileError("not a JSON object")
    step, val, ckpt = raw.get("step"), raw.get("val_loss"), raw.get("checkpoint")
    if type(step) is not int or step < 0:
        raise BestFileError(f"step {step!r:.40} is not a non-negative integer")
    if not (type(val) is int or type(val) is float) or not math.isfinite(val):  # not a bool, not a str
        raise BestFileError(f"val_loss {val!r:.40} is not a finite number")
    if not isinstance(ckpt, str) or not ckpt:
        raise BestFileError(f"checkpoint {ckpt!r:.40} is not a path")
    return Best(step, float(val), ckpt)


def read_best(directory: str | os.PathLike[str]) -> tuple[Best | None, str | None]:
    """(the best so far, None), (None, None) when there is none yet, or (None, why it is ignored)."""
    directory = Path(directory)
    try:
        f, _ = open_capped(directory / BEST_FILE, _MAX_BYTES, BestFileError)
        with f:
            best = parse_best(f.read(_MAX_BYTES + 1))
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"{directory / BEST_FILE}: cannot be read ({exc.strerror or exc})"
    except BestFileError as exc:
        return None, f"{directory / BEST_FILE}: {exc}"
    if not (directory / WEIGHTS_FILE).is_file():
        return None, f"{directory / BEST_FILE}: its {WEIGHTS_FILE} is missing"
    return best, None


def improves(best: Best | None, val_loss: float | None) -> bool:
    """Is `val_loss` a new best? Strictly lower, and finite (a diverged evaluation never is)."""
    if val_loss is None or not math.isfinite(val_loss):
        return False
    return best is None or val_loss < best.val_loss


def missed_export(best: Best | None, step: int, val_loss: float | None, eval_every: int) -> bool:
    """Resuming at `step` whose manifest says `val_loss`: did the run die between this new best's save and its export?

    Only an evaluated step's own save carries a `val_loss` (a manifest written by an older version may
    repeat an older one on an emergency save), so only steps that are multiples of `eval_every` count.
    """
    return eval_every > 0 and step > 0 and step % eval_every == 0 and improves(best, val_loss)


def write_best(directory: str | os.PathLike[str], weights: Mapping[str, Any], best: Best) -> Best:
    """Unless DIR already holds a lower val_loss, write the weights, then best.json, each atomically; DIR locked.

    Returns the best now in DIR: `best`, or the better one another run sharing DIR wrote. OSError when a
    write fails (a full disk), ExportConflictError when DIR holds another model's shards or index beside
    `model.safetensors`: DIR then holds what it held before.
    """
    from trainer.export import write_safetensors

    directory = Path(directory)
    with locked(directory):
        _remove_leftovers(directory)
        current, _ = read_best(directory)
        if current is not None and not improves(current, best.val_loss):
            return current
        write_safetensors(weights, directory / WEIGHTS_FILE)
        write_atomic(directory / BEST_FILE, json.dumps(best.to_json(), indent=1, sort_keys=True).encode() + b"\n")
    return best


def remove_leftovers(directory: str | os.PathLike[str]) -> None:
    """Remove the temporaries of a write killed midway (a restarted run calls it; so does every write)."""
    with locked(Path(directory)):
        _remove_leftovers(Path(directory))


def _remove_leftovers(directory: Path) -> None:
    remove_export_leftovers(directory / WEIGHTS_FILE)
    for path in temporaries(directory / BEST_FILE):
        path.unlink(missing_ok=True)
