"""What torchtitan, Accelerate, Lightning and transformers put in their checkpoint folders (2 ranks), as observed.

The real-client tier asserts the real programs still write exactly this, and the fast reproductions
(tests/jobs/titan_like.py, tests/jobs/accelerate_like.py) are checked against the same lists, so the two
cannot drift apart silently. Torch-free.
"""
from __future__ import annotations

import re
from pathlib import Path

__all__ = ["TITAN_ENTRY", "TITAN_FILES", "ACCELERATE_ENTRY", "ACCELERATE_FILES", "LIGHTNING_ENTRY", "LIGHTNING_FILES",
           "HF_ENTRY", "HF_FILES", "tree", "layout_problems"]

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

# <dirpath>/epoch=<E>-step=<S>.ckpt/ and last.ckpt (lightning 2.6.6, FSDPStrategy(state_dict_type="sharded")): one flat
# DCP dir (model + optimizer_0) and meta.pt (torch.save of everything else, rank 0, written last). A version suffix
# (-v1) when the name exists already; last.ckpt a copy (save_last=True) or a symlink to a sibling (save_last="link").
LIGHTNING_ENTRY = re.compile(r"(epoch=\d+-step=\d+(-v\d+)?|last)\.ckpt")
LIGHTNING_FILES = frozenset({".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"})

# <output_dir>/checkpoint-<global_step>/ (transformers 5.17 Trainer, torch FSDP, SHARDED_STATE_DICT), in the order
# written: two DCP dirs, the scheduler, one RNG state per rank, trainer_state.json last.
HF_ENTRY = re.compile(r"checkpoint-\d+")
HF_FILES = frozenset({
    "pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_0/__0_0.distcp", "pytorch_model_fsdp_0/__1_0.distcp",
    "optimizer_0/.metadata", "optimizer_0/__0_0.distcp", "optimizer_0/__1_0.distcp",
    "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth", "trainer_state.json",
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
