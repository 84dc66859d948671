"""The checkpoint store: the one place that knows what a complete DCP checkpoint is (never imports torch).

identify() tells a checkpoint of a known layout from a foreign folder, verify() classifies one dir,
scan()/newest_complete() rank a root (check_root() refuses a root one level too high), markers pin and
quarantine, in-use markers protect a running job's resume point from every prune, retention plans (pure)
and executes deletions into a trash next to the root. See each module, and docs/checkpoints.md.
"""
from __future__ import annotations

import importlib
from typing import Any

# Names are loaded on first use (PEP 562): a trainer worker that only validates `--resume PATH` imports
# `completeness` (standard library only), not pydantic and structlog, before its own `import torch`.
_HOME = {
    **dict.fromkeys(("COMPLETE", "FOREIGN", "INVALID", "PARTIAL", "STATES", "TORN", "Verdict", "verify"),
                    "completeness"),
    **dict.fromkeys(("CheckpointDirectoryError", "identify"), "shapes"),
    **dict.fromkeys(("IN_USE_MAX_AGE_S", "clear_in_use", "in_use", "mark_in_use", "refresh_in_use"), "inuse"),
    **dict.fromkeys(("is_pinned", "is_quarantined", "pin", "quarantine", "quarantine_reason", "unpin",
                     "unquarantine"), "markers"),
    **dict.fromkeys(("clear_trash", "disk_usage", "execute_retention", "migrate_legacy_trash", "trash_dir"), "pruning"),
    **dict.fromkeys(("UNVERIFIED", "CheckpointInfo", "age_order", "check_root", "judge", "newest_complete", "scan"),
                    "ranking"),
    **dict.fromkeys(("GIB", "Deletion", "DiskUsage", "Finding", "KeepBest", "RetentionPlan", "RetentionRules",
                     "plan_retention"), "retention"),
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))


__all__ = sorted(_HOME)  # the package's public names are exactly the lazily exported ones
