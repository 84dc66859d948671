"""The checkpoint store: the one place that knows what a complete DCP checkpoint is (never imports torch).

Its modules: docs/design.md, 'Module map'; what it decides: docs/checkpoints.md.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Names are loaded on first use (PEP 562): a trainer worker that only validates `--resume PATH` imports
# `completeness` (standard library only), not pydantic and structlog, before its own `import torch`.
_HOME = {
    **dict.fromkeys(("COMPLETE", "CORRUPT", "FOREIGN", "INVALID", "PARTIAL", "STATES", "TORN", "verify"),
                    "completeness"),
    **dict.fromkeys(("CheckpointDirectoryError", "identify"), "shapes"),
    **dict.fromkeys(("IN_USE_MAX_AGE_S", "clear_in_use", "in_use", "mark_in_use", "refresh_in_use"), "inuse"),
    **dict.fromkeys(("checkpoint_in_root", "is_pinned", "is_quarantined", "pin", "quarantine", "quarantine_reason",
                     "unpin", "unquarantine"), "markers"),
    **dict.fromkeys(("clear_trash", "disk_usage", "execute_retention", "trash_dir"), "pruning"),
    **dict.fromkeys(("CheckpointInfo", "Tier", "age_order", "check_root", "judge", "newest_complete", "scan"),
                    "ranking"),
    **dict.fromkeys(("local_rules", "merged", "newest_across", "scan_local", "scan_tiers"), "tiers"),
    **dict.fromkeys(("GIB", "Deletion", "DiskUsage", "Finding", "KeepBest", "RetentionPlan", "RetentionRules",
                     "plan_retention", "by_metric"), "retention"),
    # The careful open (no symlink, no FIFO, a size cap) for the trainer's own small files (best.json).
    "open_capped": "_files",
}

if TYPE_CHECKING:
    # What mypy sees: the same names with their types (through __getattr__ they would all be Any). A name
    # added to _HOME but not here is a mypy error where it is used, as mypy is not shown __getattr__.
    from supervisor.checkpoints._files import open_capped as open_capped
    from supervisor.checkpoints.completeness import COMPLETE as COMPLETE
    from supervisor.checkpoints.completeness import CORRUPT as CORRUPT
    from supervisor.checkpoints.completeness import FOREIGN as FOREIGN
    from supervisor.checkpoints.completeness import INVALID as INVALID
    from supervisor.checkpoints.completeness import PARTIAL as PARTIAL
    from supervisor.checkpoints.completeness import STATES as STATES
    from supervisor.checkpoints.completeness import TORN as TORN
    from supervisor.checkpoints.completeness import verify as verify
    from supervisor.checkpoints.inuse import IN_USE_MAX_AGE_S as IN_USE_MAX_AGE_S
    from supervisor.checkpoints.inuse import clear_in_use as clear_in_use
    from supervisor.checkpoints.inuse import in_use as in_use
    from supervisor.checkpoints.inuse import mark_in_use as mark_in_use
    from supervisor.checkpoints.inuse import refresh_in_use as refresh_in_use
    from supervisor.checkpoints.markers import checkpoint_in_root as checkpoint_in_root
    from supervisor.checkpoints.markers import is_pinned as is_pinned
    from supervisor.checkpoints.markers import is_quarantined as is_quarantined
    from supervisor.checkpoints.markers import pin as pin
    from supervisor.checkpoints.markers import quarantine as quarantine
    from supervisor.checkpoints.markers import quarantine_reason as quarantine_reason
    from supervisor.checkpoints.markers import unpin as unpin
    from supervisor.checkpoints.markers import unquarantine as unquarantine
    from supervisor.checkpoints.pruning import clear_trash as clear_trash
    from supervisor.checkpoints.pruning import disk_usage as disk_usage
    from supervisor.checkpoints.pruning import execute_retention as execute_retention
    from supervisor.checkpoints.pruning import trash_dir as trash_dir
    from supervisor.checkpoints.ranking import CheckpointInfo as CheckpointInfo
    from supervisor.checkpoints.ranking import Tier as Tier
    from supervisor.checkpoints.ranking import age_order as age_order
    from supervisor.checkpoints.ranking import check_root as check_root
    from supervisor.checkpoints.ranking import judge as judge
    from supervisor.checkpoints.ranking import newest_complete as newest_complete
    from supervisor.checkpoints.ranking import scan as scan
    from supervisor.checkpoints.retention import GIB as GIB
    from supervisor.checkpoints.retention import Deletion as Deletion
    from supervisor.checkpoints.retention import DiskUsage as DiskUsage
    from supervisor.checkpoints.retention import Finding as Finding
    from supervisor.checkpoints.retention import KeepBest as KeepBest
    from supervisor.checkpoints.retention import RetentionPlan as RetentionPlan
    from supervisor.checkpoints.retention import RetentionRules as RetentionRules
    from supervisor.checkpoints.retention import by_metric as by_metric
    from supervisor.checkpoints.retention import plan_retention as plan_retention
    from supervisor.checkpoints.shapes import CheckpointDirectoryError as CheckpointDirectoryError
    from supervisor.checkpoints.shapes import identify as identify
    from supervisor.checkpoints.tiers import local_rules as local_rules
    from supervisor.checkpoints.tiers import merged as merged
    from supervisor.checkpoints.tiers import newest_across as newest_across
    from supervisor.checkpoints.tiers import scan_local as scan_local
    from supervisor.checkpoints.tiers import scan_tiers as scan_tiers
else:
    def __getattr__(name: str) -> Any:
        home = _HOME.get(name)
        if home is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
        globals()[name] = value  # later lookups skip this function
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))


__all__ = sorted(_HOME)  # noqa: PLE0605 - the package's public names are exactly the lazily exported ones
