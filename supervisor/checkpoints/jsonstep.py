"""The training step a checkpoint folder records without a pickle: `global_step`/`step` in a small JSON file.

Accelerate names its folders `checkpoint_<N>` with N a save ordinal; its own copies of the step are pickles
(`random_states_<rank>.pkl`, `custom_checkpoint_<k>.pkl`), which the supervisor never unpickles. Scripts
often write a JSON sidecar next to them (transformers' `Trainer` writes `trainer_state.json` with
`global_step`), and that is where the store looks: the first `*.json` file directly in the folder, in name
order, holding an integer `global_step` (preferred) or `step`. Bounded: a few small files, no symlinks.
"""
from __future__ import annotations

import os
from pathlib import Path

from supervisor.checkpoints._files import read_small_json

__all__ = ["json_step"]

_MAX_BYTES = 64 * 1024  # a sidecar is a few hundred bytes; a larger JSON file is not one
_MAX_FILES = 8  # JSON files opened per folder, at most
_MAX_ENTRIES = 256  # entries of the folder looked at, at most
_KEYS = ("global_step", "step")


def _json_names(directory: Path) -> list[str]:
    names: list[str] = []
    try:
        with os.scandir(directory) as it:
            for i, entry in enumerate(it):
                if i >= _MAX_ENTRIES:
                    break
                if entry.name.endswith(".json"):
                    names.append(entry.name)
    except OSError:
        return []
    return sorted(names)[:_MAX_FILES]


def _step_in(path: Path) -> int | None:
    doc = read_small_json(path, _MAX_BYTES)
    if not isinstance(doc, dict):
        return None
    for key in _KEYS:
        value = doc.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def json_step(directory: Path) -> int | None:
    """The step recorded in a JSON sidecar directly inside `directory`, or None."""
    for name in _json_names(directory):
        step = _step_in(directory / name)
        if step is not None:
            return step
    return None
