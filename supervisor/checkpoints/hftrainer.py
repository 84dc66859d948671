"""transformers' `Trainer` checkpoints: `checkpoint-<global_step>/`, finished by `trainer_state.json`.

transformers 5.17 (`Trainer._save_checkpoint`) with torch FSDP and `SHARDED_STATE_DICT` writes, in order:
`pytorch_model_fsdp_0/` and `optimizer_0/` (DCP dirs, Accelerate's `save_fsdp_model`/`save_fsdp_optimizer`),
`scheduler.pt` (rank 0), `scaler.pt` (fp16 only), `rng_state_<rank>.pth` (every rank), and last, on rank 0,
`trainer_state.json` (`TrainerState.save_to_json`, written in place, `global_step` inside), then its own
rotation (`save_total_limit`). Resuming (`Trainer.train(resume_from_checkpoint=...)`) reads
`trainer_state.json` unconditionally and fails without it. So a `checkpoint-N` folder of the Trainer is
complete only when its DCP dirs are and its `trainer_state.json` is whole (`state_problem`); a folder without
one is partial when it holds the Trainer's own files (the save was cut after them), or when its reference
sibling has one (ranking.py compares `markers`).

`trainer_state.json` grows with `log_history`: up to MAX_PARSED bytes it is parsed, beyond that only its
ends are read (`{` first, the closing `}` last: `save_to_json` writes `indent=2`, so a cut file ends inside).

On SIGTERM with `TrainingArguments(enable_jit_checkpoint=True)` the Trainer saves `checkpoint-<step>/` at once
(trainer_jit_checkpoint.py), with a `checkpoint-is-incomplete.txt` inside until the save is done: a folder
that still has it is partial. With `load_best_model_at_end` its own rotation always keeps
`best_model_checkpoint` (in trainer_state.json); `held_by_trainer` says which folder that is, so the
supervisor's retention keeps it too.
"""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from supervisor.checkpoints._files import open_capped, read_small_json

__all__ = ["TRAINER_STATE", "JIT_SENTINEL", "is_trainer_name", "state_problem", "markers", "held_by_trainer"]

TRAINER_STATE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME
JIT_SENTINEL = "checkpoint-is-incomplete.txt"  # transformers.trainer_jit_checkpoint.CheckpointManager
MAX_PARSED = 4 << 20
_NAME = re.compile(r"checkpoint-(\d+)")  # transformers.trainer_utils._re_checkpoint (PREFIX_CHECKPOINT_DIR-step)
_OWN_FILES = re.compile(r"scheduler\.pt|scaler\.pt|training_args\.bin|rng_state(_\d+)?\.pth")
_HEAD_STEP = re.compile(rb'"global_step":\s*(\d+)')
_ENDS = 4096  # bytes read from each end of a large file


def is_trainer_name(name: str) -> bool:
    """`checkpoint-500`: the name transformers' Trainer gives a checkpoint (and picks with resume=True)."""
    return _NAME.fullmatch(name) is not None


def _has_own_files(directory: Path) -> bool:
    try:
        with os.scandir(directory) as it:
            return any(_OWN_FILES.fullmatch(e.name) for e in it)
    except OSError:
        return False


def _whole_step(path: Path, size: int) -> tuple[int | None, bool]:
    """(global_step, whole?) of a regular trainer_state.json."""
    if size <= MAX_PARSED:
        doc = read_small_json(path, MAX_PARSED)
        if not isinstance(doc, dict):
            return None, False
        step = doc.get("global_step")
        return (step if type(step) is int else None), True
    try:
        f, _ = open_capped(path, size, OSError)
        with f:
            head = f.read(_ENDS)
            f.seek(max(0, size - _ENDS))
            tail = f.read(_ENDS)
    except OSError:
        return None, False
    found = _HEAD_STEP.search(head)
    whole = head.lstrip().startswith(b"{") and tail.rstrip().endswith(b"\n}")
    return (int(found.group(1)) if found else None), whole


def state_problem(directory: Path) -> tuple[bool, str] | None:
    """For a complete nested `checkpoint-N` folder: (invalid?, why) when its trainer_state.json is wanting."""
    if os.path.lexists(directory / JIT_SENTINEL):
        return False, (f"{JIT_SENTINEL} is still there: transformers' JIT checkpoint (on SIGTERM) did not finish")
    path = directory / TRAINER_STATE
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if _has_own_files(directory):
            return False, (f"no {TRAINER_STATE}: transformers' Trainer writes it last (after scheduler.pt and "
                           "rng_state_*.pth), so the save did not finish")
        return None
    except OSError as exc:
        return True, f"{TRAINER_STATE} cannot be read: {exc.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return True, f"{TRAINER_STATE} is a symlink or not a regular file"
    step, whole = _whole_step(path, st.st_size)
    if not whole:
        return False, f"{TRAINER_STATE} is cut short or not JSON: the save did not finish"
    match = _NAME.fullmatch(directory.name)
    if match and step is not None and step != int(match.group(1)):
        return True, f"{TRAINER_STATE} says global_step {step}, the name says {match.group(1)}"
    return None


def markers(directory: Path) -> frozenset[str]:
    """The commit files this folder has: {trainer_state.json} for a Trainer checkpoint that has it."""
    if not is_trainer_name(directory.name):
        return frozenset()
    return frozenset({TRAINER_STATE}) if os.path.isfile(directory / TRAINER_STATE) else frozenset()


def held_by_trainer(root: Path, newest: Path) -> str | None:
    """The folder in `root` that the newest save's trainer_state.json names `best_model_checkpoint`, or None."""
    doc = read_small_json(newest / TRAINER_STATE, MAX_PARSED)
    best = doc.get("best_model_checkpoint") if isinstance(doc, dict) else None
    if type(best) is not str or not best:
        return None
    path = os.path.normpath(best)
    # A relative output_dir is relative to the job's cwd, which the store does not know: the name alone then
    # decides (keeping one folder too many is the safe mistake).
    in_root = not os.path.isabs(path) or os.path.dirname(path) in {os.path.abspath(root), os.path.realpath(root)}
    return os.path.basename(path) if in_root else None
