"""The checkpoint store: the one place that knows what a complete DCP checkpoint is (never imports torch).

verify() classifies one dir, scan()/newest_complete() rank a root, markers pin and quarantine,
retention plans (pure) and executes deletions; see each module for the rules.
"""
from __future__ import annotations

from supervisor.checkpoints.completeness import COMPLETE, INVALID, PARTIAL, STATES, TORN, Verdict, verify
from supervisor.checkpoints.markers import (
    is_pinned,
    is_quarantined,
    pin,
    quarantine,
    quarantine_reason,
    unpin,
    unquarantine,
)
from supervisor.checkpoints.pruning import clear_trash, disk_usage, execute_retention
from supervisor.checkpoints.ranking import UNVERIFIED, CheckpointInfo, newest_complete, scan
from supervisor.checkpoints.retention import (
    GIB,
    Deletion,
    DiskUsage,
    Finding,
    KeepBest,
    RetentionPlan,
    RetentionPolicy,
    plan_retention,
)

__all__ = [
    "COMPLETE",
    "PARTIAL",
    "TORN",
    "INVALID",
    "UNVERIFIED",
    "STATES",
    "Verdict",
    "verify",
    "CheckpointInfo",
    "scan",
    "newest_complete",
    "pin",
    "unpin",
    "is_pinned",
    "quarantine",
    "unquarantine",
    "is_quarantined",
    "quarantine_reason",
    "GIB",
    "KeepBest",
    "RetentionPolicy",
    "DiskUsage",
    "Deletion",
    "Finding",
    "RetentionPlan",
    "plan_retention",
    "execute_retention",
    "disk_usage",
    "clear_trash",
]
