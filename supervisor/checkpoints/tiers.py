"""Two roots, one job: the durable checkpoint root and an optional node-local tier (tmpfs, a local NVMe).

Both roots are judged by the same store, and one ordering decides across them: the newest complete
checkpoint by step, at the same step the durable one (a local one wins only when newer, and only of the
root's lineage: lineage.py). Retention runs per root, each with every guard of plan_retention; the two are
never mixed. The rules as users see them: docs/checkpoints.md, 'The local tier'.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from supervisor.checkpoints.lineage import foreign
from supervisor.checkpoints.ranking import CheckpointInfo, Tier, newest_complete, scan

if TYPE_CHECKING:  # retention needs pydantic, claims psutil: the trainer's `--resume auto` must not pay for them
    from supervisor.checkpoints.claim import RootClaim
    from supervisor.checkpoints.retention import RetentionRules

__all__ = ["Tier", "TierClaims", "tier_order", "tagged", "merged", "scan_local", "scan_tiers", "newest_across",
           "local_rules"]

PathLike = str | os.PathLike[str]


def tier_order(c: CheckpointInfo) -> tuple[bool, int, bool, bool, float]:
    """The ordering across tiers, oldest first: the store's (save ordinal, else step, then an alias before the save
    it repeats: ranking.age_order), then durable after local at the same rank (so it comes first newest-first),
    then mtime."""
    rank = c.ordinal if c.ordinal is not None else c.step
    return (rank is not None, rank or 0, c.alias_of is None, c.tier == Tier.DURABLE, c.mtime)


def tagged(infos: Iterable[CheckpointInfo], tier: Tier) -> list[CheckpointInfo]:
    return [c if c.tier == tier else dataclasses.replace(c, tier=tier) for c in infos]


def merged(durable: Sequence[CheckpointInfo], local: Sequence[CheckpointInfo]) -> list[CheckpointInfo]:
    """Both tiers' entries in one list, newest first (ties: the durable one first)."""
    return sorted([*tagged(durable, Tier.DURABLE), *tagged(local, Tier.LOCAL)], key=tier_order, reverse=True)


def scan_local(root: PathLike | None, *, verify_all: bool = True) -> list[CheckpointInfo]:
    """scan() of the local tier, tagged `local`; nothing when there is no tier or its root does not exist."""
    if root is None or not os.path.lexists(root):
        return []
    return tagged(scan(root, verify_all=verify_all), Tier.LOCAL)


def scan_tiers(durable: PathLike, local: PathLike | None, *, verify_all: bool = True) -> list[CheckpointInfo]:
    """Every entry of both roots, newest first (the durable root must exist: scan() raises otherwise)."""
    return merged(scan(durable, verify_all=verify_all), scan_local(local, verify_all=verify_all))


def newest_across(durable: PathLike, local: PathLike | None) -> CheckpointInfo | None:
    """The newest complete, non-quarantined checkpoint of either tier (the durable one at equal steps), or None.

    Roots that do not exist hold nothing (a trainer's first start creates them later).
    """
    found = []
    if os.path.isdir(durable):
        found += tagged(filter(None, [newest_complete(durable)]), Tier.DURABLE)
    if local is not None and os.path.isdir(local):  # of this run only (lineage.py)
        found += tagged([c for c in [newest_complete(local)] if c and foreign(Path(durable), c.path) is None], Tier.LOCAL)
    return max(found, key=tier_order, default=None)


def local_rules(base: RetentionRules, keep: int) -> RetentionRules:
    """The local tier's retention: its `keep` newest complete checkpoints; debris after `partial_max_age_s`."""
    from supervisor.checkpoints.retention import RetentionRules

    return RetentionRules(keep_last=keep, partial_max_age_s=base.partial_max_age_s)



class TierClaims:
    """One job's claims on each of its roots (the durable root, the local tier): used wherever one RootClaim is.

    Two jobs on one local tier would prune and resume each other's checkpoints as surely as on one durable root,
    so the local tier is claimed like it (checkpoints/claim.py). Taking them is all or nothing.
    """

    def __init__(self, claims: Sequence[RootClaim]) -> None:
        self.claims = list(claims)
        self.root = self.claims[0].root  # the durable root: what the logs name

    def acquire(self) -> list[tuple[str, str]]:
        notes: list[tuple[str, str]] = []
        taken: list[RootClaim] = []
        try:
            for claim in self.claims:
                notes += claim.acquire()
                taken.append(claim)
        except BaseException:
            for claim in taken:
                claim.release()
            raise
        return notes

    def check(self) -> str | None:
        return next(filter(None, (claim.check() for claim in self.claims)), None)

    def refresh(self) -> None:
        for claim in self.claims:
            claim.refresh()

    def release(self) -> None:
        for claim in self.claims:
            claim.release()
