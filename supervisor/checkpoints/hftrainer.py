"""transformers' `Trainer` checkpoints (clients.TRANSFORMERS): `checkpoint-<global_step>/`, finished by `trainer_state.json`.

`Trainer._save_checkpoint` writes the model, optimizer, scheduler and RNG files (or the DCP dirs
`pytorch_model_fsdp_0/`, `optimizer_0/`), and last, on rank 0, `trainer_state.json`, which its resume reads first
(docs/clients.md has the order). Past MAX_PARSED bytes (it grows with `log_history`) only its ends are read.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from supervisor.checkpoints import torchzip
from supervisor.checkpoints._files import open_capped, read_small_json

if TYPE_CHECKING:
    from supervisor.checkpoints.ranking import CheckpointInfo

__all__ = ["TRAINER_STATE", "JIT_SENTINEL", "NAMES", "MARKS", "state_whole", "files_problem", "keeps"]

TRAINER_STATE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME
JIT_SENTINEL = "checkpoint-is-incomplete.txt"  # transformers.trainer_jit_checkpoint.CheckpointManager
NAMES = re.compile(r"checkpoint-(\d+)")  # transformers.trainer_utils._re_checkpoint (PREFIX_CHECKPOINT_DIR-step)
# What only the Trainer writes, early in a save: a `checkpoint-N` is its save only with one (a script's own saves of
# that name, DCP or `model.safetensors` + `optimizer.pt`, stay as before: never judged by trainer_state.json).
MARKS = ("pytorch_model_fsdp_0", "training_args.bin", TRAINER_STATE, JIT_SENTINEL)  # looked up: no listing's limit
_WEIGHTS = re.compile(r".*\.(safetensors|bin|pt|pth)", re.DOTALL)  # torch.save zips, or safetensors
_INDEX = re.compile(r".*\.(safetensors|bin)\.index\.json", re.DOTALL)  # a model sharded into several files
MAX_PARSED = 4 << 20
_MAX_HEADER = 100 << 20  # safetensors refuses a larger header
_MAX_ENTRIES = 1024
_HEAD_KEYS = re.compile(rb'\n  "(best_model_checkpoint|global_step)": ("(?:[^"\\]|\\.)*"|\d{1,20})')  # top level
_ENDS_AT = re.compile(rb'"data_offsets":\s*\[\s*\d{1,20}\s*,\s*(\d{1,20})\s*\]')  # a tensor's [begin, end]
_ENDS = 4096  # bytes read from each end of a large file


def _state(path: Path) -> object:
    """trainer_state.json's document, or None when it is cut short or not JSON. Past MAX_PARSED only its ends are
    read: whole when `{` comes first and a `}` alone on the last line (save_to_json: indent=2), and its sorted keys put
    best_model_checkpoint and global_step before log_history, in the head."""
    doc = read_small_json(path, MAX_PARSED)
    try:
        f, st = open_capped(path, 1 << 62, OSError)
        with f:
            if doc is not None or st.st_size <= MAX_PARSED:
                return doc
            head = f.read(_ENDS)
            f.seek(max(0, st.st_size - _ENDS))
            whole = head.lstrip().startswith(b"{") and f.read(_ENDS).rstrip().endswith(b"\n}")
            return {k.decode(): json.loads(v) for k, v in _HEAD_KEYS.findall(head)} if whole else None
    except (OSError, ValueError):
        return None


def state_whole(path: Path, size: int) -> tuple[bool, str] | None:
    """(invalid?, why) when a `checkpoint-N`'s trainer_state.json is cut short, or names another step than N."""
    doc = _state(path)
    if not isinstance(doc, dict):
        return False, f"{TRAINER_STATE} is cut short or not JSON: the save did not finish"
    step, match = doc.get("global_step"), NAMES.fullmatch(path.parent.name)
    if match and type(step) is int and step != int(match.group(1)):
        return True, f"{TRAINER_STATE} says global_step {step}, the name says {match.group(1)}"
    return None


def _safetensors_end(path: Path) -> tuple[int, int]:
    """(the size a safetensors file must have, its size): 8 bytes of header length, the JSON header, then the
    tensors, the last one ending at the largest `data_offsets` end (found, not parsed: a header may be 100 MB)."""
    f, st = open_capped(path, 1 << 62, OSError)
    with f:
        length = int.from_bytes(f.read(8), "little")
        if not 0 < length <= min(_MAX_HEADER, st.st_size - 8):
            return 8 + max(length, st.st_size), st.st_size  # cut in its header, or no header: never whole
        header = f.read(length)
    if not header.lstrip().startswith(b"{"):
        raise ValueError("its header is not JSON")
    return 8 + length + max(map(int, _ENDS_AT.findall(header)), default=0), st.st_size


def _weight_problem(path: Path) -> str | None:
    if not path.name.endswith(".safetensors"):
        why = torchzip.zip_problem(path)  # torch.save writes the zip's directory last
        return None if why is None else f"{path.name} is not whole ({why})"
    try:
        want, size = _safetensors_end(path)
    except FileNotFoundError:
        return f"{path.name} is missing"
    except (OSError, ValueError) as exc:
        return f"{path.name} is not whole ({exc})"
    return None if size >= want else f"{path.name} is short: {size} of {want} bytes"


def files_problem(directory: Path) -> str | None:
    """Why a save of plain files is torn (a weight file cut short, a shard its index names missing), or None."""
    try:
        with os.scandir(directory) as it:
            names = sorted(e.name for _, e in zip(range(_MAX_ENTRIES), it))
    except OSError as exc:
        return f"cannot be read: {exc.strerror}"
    wanted = {n for n in names if _WEIGHTS.fullmatch(n)}
    for index in filter(_INDEX.fullmatch, names):
        doc = read_small_json(directory / index, MAX_PARSED)
        shards = doc.get("weight_map") if isinstance(doc, dict) else None
        named = shards.values() if isinstance(shards, dict) else ()
        wanted |= {s for s in named if type(s) is str and _WEIGHTS.fullmatch(s) and "/" not in s and "\0" not in s}
    problems = [why for n in sorted(wanted) if (why := _weight_problem(directory / n)) is not None]
    return "; ".join(problems[:3]) or None


def keeps(root: Path, infos: Sequence[CheckpointInfo]) -> tuple[dict[str, str], dict[str, str]]:
    """The folder the newest save's trainer_state.json names `best_model_checkpoint`: its own rotation keeps it."""
    trainer = [c for c in infos if c.complete and NAMES.fullmatch(c.name)]
    if not trainer:
        return {}, {}
    doc = _state(max(trainer, key=lambda c: c.step or 0).path / TRAINER_STATE)
    best = doc.get("best_model_checkpoint") if isinstance(doc, dict) else None
    if type(best) is not str or not best:
        return {}, {}
    path = os.path.normpath(best)
    # A relative output_dir is relative to the job's cwd, which the store does not know: the name alone then
    # decides (keeping one folder too many is the safe mistake).
    in_root = not os.path.isabs(path) or os.path.dirname(path) in {os.path.abspath(root), os.path.realpath(root)}
    why = "transformers' best_model_checkpoint (trainer_state.json): its own rotation keeps it too"
    return ({os.path.basename(path): why} if in_root else {}), {}
