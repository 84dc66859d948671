"""Retention: a pure function from (checkpoints, disk, rules) to deletions with reasons, plus findings.

The rules, in order: docs/checkpoints.md, 'Retention'. Foreign entries are never deleted nor counted, and the
guards (the newest complete, `protect`, pinned, `hold`, young unfinished saves, invalid, unverified) never go.
"""
from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from supervisor.checkpoints.clients import is_alias, layout_of
from supervisor.checkpoints.completeness import COMPLETE, FOREIGN, PARTIAL, TORN
from supervisor.checkpoints.ranking import CheckpointInfo, age_order

__all__ = [
    "GIB",
    "KeepBest",
    "RetentionRules",
    "DiskUsage",
    "Deletion",
    "Finding",
    "RetentionPlan",
    "plan_retention",
    "by_metric",
]

GIB = 2**30  # *_gb settings are GiB: what `df -h` shows as G


class KeepBest(BaseModel):
    """Keep the k best checkpoints by a manifest metric."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    metric: str = Field(min_length=1, description="manifest metric name, e.g. \"loss\"")
    mode: Literal["min", "max"] = Field(description="min: lower is better; max: higher is better")
    k: int = Field(ge=0, le=1_000_000, description="how many to keep (0 = rule off)")


class RetentionRules(BaseModel):
    """Which checkpoints to keep; the `[checkpoints]` config section extends this model."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    keep_last: int = Field(
        default=3, ge=0, le=1_000_000, description="keep the N newest complete checkpoints (0 = rule off)")
    keep_every: int = Field(
        default=0, ge=0, le=10**12, description="keep checkpoints whose step is divisible by K (0 = off)")
    keep_best: KeepBest | None = Field(default=None, description="keep the k best by a manifest metric")
    min_free_gb: float = Field(
        default=0, ge=0, description="delete oldest deletable until this many GiB are free (0 = off)"
    )
    max_total_gb: float = Field(
        default=0, ge=0, description="delete oldest deletable while checkpoints exceed this many GiB (0 = off)"
    )
    partial_max_age_s: float = Field(
        default=3600, ge=0, le=30 * 86400,
        description="partial/torn dirs idle longer than this many seconds are deleted (those "
        "above the newest complete at once, before a launch whose job picks its own checkpoint)"
    )

    def keep_rules_on(self) -> bool:
        return bool(self.keep_last or self.keep_every or (self.keep_best and self.keep_best.k))


@dataclass(frozen=True)
class DiskUsage:
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class Deletion:
    path: Path
    name: str
    reason: str
    size_bytes: int
    inode: int = 0  # the dir judged (0: unknown); one renamed into its place since is not deleted


@dataclass(frozen=True)
class Finding:
    """Something retention could not do or wants a human to see (kind: e.g. "disk_pressure")."""

    kind: str
    message: str
    needed_bytes: int = 0


@dataclass(frozen=True)
class RetentionPlan:
    deletions: list[Deletion] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    kept: dict[Path, str] = field(default_factory=dict)  # why each non-deleted dir stays


def _newest(cps: Sequence[CheckpointInfo]) -> CheckpointInfo | None:
    usable = [c for c in cps if c.complete and not c.quarantined]
    return max(usable, key=age_order) if usable else None


def _unfinished_above(cps: Sequence[CheckpointInfo], settled: bool) -> set[Path]:
    """With `settled`: the partial and torn dirs that rank above the newest complete checkpoint."""
    newest = _newest(cps)
    if not settled or newest is None:
        return set()
    return {c.path for c in cps if c.state in (PARTIAL, TORN) and age_order(c) > age_order(newest)}


def _guards(cps: Sequence[CheckpointInfo], rules: RetentionRules, protect: set[str], now: float,
            early: set[Path]) -> dict[Path, str]:
    newest = _newest(cps)
    guards: dict[Path, str] = {}
    for c in cps:
        if newest is not None and c.path == newest.path:
            guards[c.path] = "newest complete"
        elif os.path.abspath(c.path) in protect:
            guards[c.path] = "in use by the running job"
        elif c.pinned:
            guards[c.path] = "pinned"
        elif c.hold is not None:
            guards[c.path] = c.hold
        elif c.state in (PARTIAL, TORN):
            if c.path not in early and now - c.mtime <= rules.partial_max_age_s:
                guards[c.path] = f"{c.state}, idle {max(0.0, now - c.mtime):.0f} s: may be in flight"
        elif c.state != COMPLETE:
            guards[c.path] = f"{c.state}: left for a human"
    return guards


def _rule_keeps(cps: Sequence[CheckpointInfo], rules: RetentionRules) -> dict[Path, list[str]]:
    complete = sorted((c for c in cps if c.complete and c.alias_of is None), key=age_order, reverse=True)
    keeps: dict[Path, list[str]] = {}
    for c in complete[: rules.keep_last]:
        keeps.setdefault(c.path, []).append(f"keep_last={rules.keep_last}")
    if rules.keep_every:
        for c in complete:
            if c.step is not None and c.step % rules.keep_every == 0:
                keeps.setdefault(c.path, []).append(f"keep_every={rules.keep_every}")
    best = rules.keep_best
    if best and best.k:
        for c in by_metric(complete, best.metric, best.mode)[: best.k]:
            keeps.setdefault(c.path, []).append(f"keep_best {best.metric} {best.mode} k={best.k}")
    return keeps


def by_metric(checkpoints: Sequence[CheckpointInfo], metric: str, mode: str) -> list[CheckpointInfo]:
    """The checkpoints that carry `metric`, best first; among equal values the older one first.

    The older one is the save that reached the value first: the one a best-model export names. An
    emergency save repeats the last evaluation's value and must not push it out of `keep_best`.
    """
    sign = 1 if mode == "min" else -1
    scored = sorted((c for c in checkpoints if metric in c.metrics), key=age_order)  # oldest first
    return sorted(scored, key=lambda c: sign * c.metrics[metric])  # stable: ties stay oldest first


def _disk_message(free: int, total: int, rules: RetentionRules) -> tuple[str, int] | None:
    """Which floor is unmet and by how many bytes, or None when both are met."""
    if rules.min_free_gb and free < rules.min_free_gb * GIB:
        need = int(rules.min_free_gb * GIB) - free
        return f"free {free / GIB:.2f} GiB < min_free_gb={rules.min_free_gb:g}", need
    if rules.max_total_gb and total > rules.max_total_gb * GIB:
        need = total - int(rules.max_total_gb * GIB)
        return f"checkpoints use {total / GIB:.2f} GiB > max_total_gb={rules.max_total_gb:g}", need
    return None


def _unknown_keeps(cps: Sequence[CheckpointInfo], deletions: list[Deletion], rules: RetentionRules) -> list[Finding]:
    """A warning when the keep rules delete a checkpoint whose client's own keep list could not be read."""
    gone = {d.path for d in deletions}
    unsure = [c for c in cps if c.path in gone and c.keeps_unknown]
    if not unsure:
        return []
    layout, c = layout_of(unsure[0].name), unsure[0]
    advice = (layout.keeps_advice if layout else "") or "whose client's own keep list could not be read ({why})"
    return [Finding("client_keeps_unknown", f"keep_last={rules.keep_last} deletes {c.name}, "
                    + advice.format(why=c.keeps_unknown))]


def _unfinished_pointer(cps: Sequence[CheckpointInfo], settled: bool) -> list[Finding]:
    """With `settled`: a warning when the alias the client loads itself (the newest last*.ckpt) is not complete."""
    pointers = [c for c in cps if is_alias(c.name)]
    picked = max(pointers, key=lambda c: c.mtime) if settled and pointers else None
    if picked is None or picked.complete:
        return []
    newest, layout = _newest(cps), layout_of(picked.name)
    kind, message, fallback = layout.alias_unfinished if layout else ("", "", "")
    if not kind:
        return []
    back = fallback.format(newest=newest.name, name=picked.name) if newest else "no complete save to go back to"
    return [Finding(kind, message.format(name=picked.name, state=picked.state, reason=picked.reason, fallback=back))]


def plan_retention(
    checkpoints: Sequence[CheckpointInfo],
    *,
    rules: RetentionRules,
    disk: DiskUsage,
    protect: Collection[str | os.PathLike[str]] = (),
    now: float,
    settled: bool = False,
) -> RetentionPlan:
    """Decide what to delete and why (pure: no I/O; see the module docstring for the rules)."""
    foreign = {c.path: "foreign: not a checkpoint, never deleted" for c in checkpoints if c.state == FOREIGN}
    cps = sorted((c for c in checkpoints if c.state != FOREIGN), key=age_order)  # oldest first: deletion order
    early = _unfinished_above(cps, settled)
    guards = _guards(cps, rules, {os.path.abspath(p) for p in protect}, now, early)
    keeps = _rule_keeps(cps, rules)
    any_rule_on = rules.keep_rules_on()
    deletions: list[Deletion] = []
    kept: dict[Path, str] = {**foreign, **guards}
    for c in cps:
        if c.path in guards:
            continue
        if c.complete:
            if not any_rule_on or c.path in keeps:
                kept[c.path] = ", ".join(keeps.get(c.path, ["no keep rule on"]))
                continue
            reason = "kept by no keep rule"
        elif c.path in early:
            reason = (f"{c.state} and newer than the newest complete checkpoint, with the job down: the job picks "
                      "its own checkpoint and would load this one")
        else:  # partial/torn and idle past the limit (younger ones are guarded)
            reason = f"{c.state} and idle {now - c.mtime:.0f} s > partial_max_age_s={rules.partial_max_age_s:g}"
        deletions.append(Deletion(c.path, c.name, reason, c.size_bytes, c.inode))
    freed = sum(d.size_bytes for d in deletions)
    free, total = disk.free_bytes + freed, sum(c.size_bytes for c in cps) - freed
    findings = _unknown_keeps(cps, deletions, rules) + _unfinished_pointer(cps, settled)
    by_age = iter([c for c in cps if c.path in kept and c.path not in guards])  # oldest rule-kept first
    while (unmet := _disk_message(free, total, rules)) is not None:
        victim = next(by_age, None)
        if victim is None:
            msg, need = unmet
            findings.append(Finding("disk_pressure", f"{msg}; nothing left that may be deleted "
                                    f"({len(guards)} guarded: newest complete, in use, pinned, in flight)", need))
            break
        del kept[victim.path]
        deletions.append(Deletion(victim.path, victim.name, f"disk: {unmet[0]}", victim.size_bytes, victim.inode))
        free, total = free + victim.size_bytes, total - victim.size_bytes
    return RetentionPlan(deletions, findings, kept)
