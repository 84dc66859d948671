"""What torchtitan 0.3.0 and Accelerate 1.16.0 put in their checkpoint folders (2 ranks), as observed.

The real-client tier asserts the real programs still write exactly this, and the fast reproductions
(tests/jobs/titan_like.py, tests/jobs/accelerate_like.py) are checked against the same lists, so the two
cannot drift apart silently. Torch-free.
"""
from __future__ import annotations

import re
from pathlib import Path

__all__ = ["TITAN_ENTRY", "TITAN_FILES", "ACCELERATE_ENTRY", "ACCELERATE_FILES", "tree", "layout_problems"]

# <dump_folder>/checkpoint/step-<N>/: one flat DCP dir (torchtitan.components.checkpointer.dcp)
TITAN_ENTRY = re.compile(r"step-\d+")
TITAN_FILES = frozenset({".metadata", "__0_0.distcp", "__1_0.distcp"})

# <project_dir>/checkpoints/checkpoint_<i>/ (accelerate.Accelerator.save_state, FSDP SHARDED_STATE_DICT)
ACCELERATE_ENTRY = re.compile(r"checkpoint_\d+")
ACCELERATE_FILES = frozenset({
    "pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_0/__0_0.distcp", "pytorch_model_fsdp_0/__1_0.distcp",
    "optimizer_0/.metadata", "optimizer_0/__0_0.distcp", "optimizer_0/__1_0.distcp",
    "scheduler.bin", "random_states_0.pkl", "random_states_1.pkl", "custom_checkpoint_0.pkl",
    "trainer_state.json",  # the user script's sidecar, not Accelerate's
})


def tree(directory: Path) -> frozenset[str]:
    """Every file under `directory`, as slash-separated relative paths."""
    return frozenset(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


def layout_problems(root: Path, entry: re.Pattern[str], files: frozenset[str],
                    ignore: frozenset[str] = frozenset()) -> list[str]:
    """Everything in `root` that the client did not write: foreign entries, and extra or missing files.

    `ignore`: top-level names to pass over (a check of the client's own layout, not of the supervisor's).
    """
    problems = []
    for child in sorted(root.iterdir()):
        if child.name in ignore:
            continue
        if not entry.fullmatch(child.name) or not child.is_dir():
            problems.append(f"{child.name}: not written by the client")
            continue
        got = tree(child)
        if got - files:
            problems.append(f"{child.name}: extra {sorted(got - files)}")
        if files - got:
            problems.append(f"{child.name}: missing {sorted(files - got)}")
    return problems
