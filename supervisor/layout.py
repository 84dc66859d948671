"""Names on disk shared by the supervisor, the reference trainer and the CLI (torch-free).

The trainer writes `step_<N>` under a temporary sibling name and renames it into place; the store treats
anything with the temporary prefix as `partial`, whatever it contains. Nothing of the supervisor's lives
inside the checkpoint root (docs/checkpoints.md, 'What the supervisor keeps next to the root' says why and
where); only the pin and quarantine markers are files inside a checkpoint dir, where loaders do not look.
"""
from __future__ import annotations

__all__ = [
    "METADATA_NAME",
    "RANK_METADATA_NAME",
    "MANIFEST_NAME",
    "MANIFEST_FORMAT",
    "TMP_PREFIX",
    "TRASH_SUFFIX",
    "IN_USE_SUFFIX",
    "CLAIM_SUFFIX",
    "SEAL_SUFFIX",
    "LINEAGE_FILE",
    "PIN_MARKER",
    "QUARANTINE_MARKER",
    "step_dir_name",
    "tmp_dir_name",
    "sidecar_name",
    "is_sidecar_name",
]

METADATA_NAME = ".metadata"  # DCP's completion marker, written last by the coordinator
RANK_METADATA_NAME = "__0.metadata"  # rank 0's own metadata, written instead by dcp.save(use_collectives=False)
MANIFEST_NAME = "manifest.json"  # the reference trainer's manifest (step, world size, file sizes, ...)
MANIFEST_FORMAT = "fsdp-supervisor/1"
TMP_PREFIX = ".tmp-"  # in-flight saves: `.tmp-step_00000120-<nonce>`; never complete
TRASH_SUFFIX = ".fsdp-trash"  # `<parent>/.<root-name>.fsdp-trash/`: retention renames here first, then removes
IN_USE_SUFFIX = ".fsdp-inuse"  # `<parent>/.<root-name>.fsdp-inuse/<host>-<pid>.json`: checkpoints a job resumed from
LINEAGE_FILE = ".fsdp-lineage.json"  # in a root the trainer library saves to: the run's identity (lineage.py)
SEAL_SUFFIX = ".fsdp-seals"  # `<parent>/.<root-name>.fsdp-seals/<name>.json`: checksums of checkpoints we sealed
CLAIM_SUFFIX = ".fsdp-claim"  # `<parent>/.<root-name>.fsdp-claim/<host>-<pid>.json`: the supervisor(s) of the root's job
PIN_MARKER = ".pinned"  # file inside a checkpoint dir: retention never deletes it
QUARANTINE_MARKER = ".quarantined"  # file inside a checkpoint dir: never selected for resume


def step_dir_name(step: int) -> str:
    """Final name of the reference trainer's checkpoint for `step` (zero-padded so `ls` sorts)."""
    return f"step_{step:08d}"


def tmp_dir_name(step: int, nonce: str) -> str:
    """Temporary sibling name a save is written under before its atomic rename."""
    return f"{TMP_PREFIX}{step_dir_name(step)}-{nonce}"


def sidecar_name(root_name: str, suffix: str) -> str:
    """The hidden sibling of a checkpoint root named `root_name` that holds the supervisor's `suffix` data."""
    return f".{root_name}{suffix}"


def is_sidecar_name(name: str) -> bool:
    """Is `name` one of the supervisor's own sidecars (of any root)? Listings leave them out."""
    return name.startswith(".") and name.endswith((TRASH_SUFFIX, IN_USE_SUFFIX, CLAIM_SUFFIX, SEAL_SUFFIX))
