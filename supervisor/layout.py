"""Names on disk shared by the supervisor, the reference trainer and the CLI (torch-free).

The trainer writes `step_<N>` under a temporary sibling name and renames it into place; the store
treats anything with the temporary prefix as `partial`, whatever it contains.
"""
from __future__ import annotations

__all__ = [
    "METADATA_NAME",
    "MANIFEST_NAME",
    "MANIFEST_FORMAT",
    "TMP_PREFIX",
    "TRASH_DIR",
    "PIN_MARKER",
    "QUARANTINE_MARKER",
    "step_dir_name",
    "tmp_dir_name",
]

METADATA_NAME = ".metadata"  # DCP's completion marker, written last by the coordinator
MANIFEST_NAME = "manifest.json"  # the reference trainer's manifest (step, world size, file sizes, ...)
MANIFEST_FORMAT = "fsdp-supervisor/1"
TMP_PREFIX = ".tmp-"  # in-flight saves: `.tmp-step_00000120-<nonce>`; never complete
TRASH_DIR = ".trash"  # retention renames here first, then removes
PIN_MARKER = ".pinned"  # file inside a checkpoint dir: retention never deletes it
QUARANTINE_MARKER = ".quarantined"  # file inside a checkpoint dir: never selected for resume


def step_dir_name(step: int) -> str:
    """Final name of the reference trainer's checkpoint for `step` (zero-padded so `ls` sorts)."""
    return f"step_{step:08d}"


def tmp_dir_name(step: int, nonce: str) -> str:
    """Temporary sibling name a save is written under before its atomic rename."""
    return f"{TMP_PREFIX}{step_dir_name(step)}-{nonce}"
