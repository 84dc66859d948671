"""One housekeeping pass over the checkpoint root: scan once, prune, and report what was found.

`run_pass` does the store work and touches no supervisor state, so the event loop runs it on a worker thread
(the loop never blocks on store work: docs/design.md); `Housekeeper.absorb` takes its `PassResult` back on the
loop. All judgement lives in `supervisor.checkpoints`. The Housekeeper also keeps the running attempt's in-use
marker (refreshed each pass, like the root claim). A root that is missing, re-pointed or on another file system
than at start fails the pass (`look_at_root`) - never an empty result that would start the job from scratch
(docs/design.md, 'The picture'; docs/operations.md, 'What happens when things go wrong'). Retention that cannot
delete is not a failed pass (docs/checkpoints.md, 'What the supervisor keeps next to the root', "Trash"); the
local tier: docs/checkpoints.md, 'The local tier'.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor import checkpoints as store
from supervisor.checkpoints.claim import RootClaim
from supervisor.checkpoints.clients import WATCHED
from supervisor.checkpoints.integrity import CORRUPT_PREFIX
from supervisor.checkpoints.inuse import in_use_dir
from supervisor.checkpoints.metadata import cache as metadata_cache
from supervisor.checkpoints.pruning import parking_problem
from supervisor.checkpoints.sidecars import open_sidecar, resolved, trusted_owners
from supervisor.checkpoints.tiers import TierClaims
from supervisor.config import Config
from supervisor.daemon.integrity import good_ones
from supervisor.errors import CheckpointError, SidecarError
from supervisor.host.log import Log
from supervisor.host.mounts import mount_id
from supervisor.layout import MANIFEST_NAME, METADATA_NAME

__all__ = ["Housekeeper", "PassResult", "best_checkpoint", "look_at_root", "retention_problem"]

_SAID_ONCE = frozenset({"client_keeps_unknown"})  # findings about the config, not the moment: one warning per run


@dataclass(frozen=True)
class PassResult:
    """What one pass saw and did. `generation` is the file-event count when it started (freshness)."""

    generation: int
    checkpoints: list[store.CheckpointInfo] = field(default_factory=list)
    newest: store.CheckpointInfo | None = None  # newest complete, non-quarantined
    deleted: list[store.Deletion] = field(default_factory=list)
    findings: list[store.Finding] = field(default_factory=list)
    disk_free: int | None = None
    checkpoint_bytes: int | None = None  # in complete checkpoints, after the deletions
    error: str | None = None  # the root could not be read; nothing else in the result is meaningful
    root_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the root this pass looked at
    retention_stopped: str | None = None  # why retention deletes nothing (no usable trash), when it cannot
    settled: bool = False  # planned with no save in flight (retention.plan_retention's `settled`)
    verified: bool = False  # its resume point's bytes were read and matched their checksums (daemon/integrity.py)
    corrupt: list[tuple[str, str]] = field(default_factory=list)  # (path, reason) quarantined as corrupt by this pass

    @property
    def quarantined(self) -> list[str]:
        return [str(c.path) for c in self.checkpoints if c.quarantined]


def look_at_root(spelled: Path, root: Path, device: int | None, mount: int | None = None,
                 ) -> tuple[tuple[int, int] | None, str | None]:
    """The root's (st_dev, st_ino), or why this pass cannot trust what it would find there. `device`, `mount`:
    the root's file system and mount at start (host/mounts.py: a bind mount over the root keeps the device)."""
    now = resolved(spelled)
    if now != root:
        return None, (f"checkpoint root {spelled} now resolves to {now}, not to {root} as when the supervisor "
                      "started; restart the supervisor to follow it")
    try:
        st = os.stat(root)
    except FileNotFoundError:
        return None, f"checkpoint root {root} does not exist (deleted, or its file system is not mounted)"
    except OSError as exc:
        return None, f"checkpoint root {root} cannot be read: {exc.strerror or exc}"
    if not stat.S_ISDIR(st.st_mode):
        return None, f"checkpoint root {root} is not a directory"
    if device is not None and st.st_dev != device:
        return None, (f"checkpoint root {root} is on another file system than when the supervisor started "
                      "(unmounted?); restart the supervisor if that is intended")
    now_mount = mount_id(root) if mount is not None else None
    if now_mount is not None and now_mount != mount:
        return None, (f"checkpoint root {root} is on another mount than when the supervisor started (something "
                      "was mounted over it, or unmounted from it); restart the supervisor if that is intended")
    return (st.st_dev, st.st_ino), None


def retention_problem(root: Path, fallback: Path) -> str | None:
    """Why retention cannot delete anything under `root` now (no usable trash, an in-use folder not ours)."""
    problem = parking_problem(root, fallback)
    if problem is not None:
        return problem
    try:
        open_sidecar(in_use_dir(root), trusted_owners(root), create=False)
    except SidecarError as exc:
        return str(exc)
    except OSError:
        pass  # unreadable: in_use() honours nothing, as before; the trash decides
    return None


class Housekeeper:
    def __init__(self, cfg: Config, log: Log, now: Callable[[], float],
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.spelled = cfg.checkpoints.dir  # as the config writes it, for the look at the root's identity
        self.root = resolved(cfg.checkpoints.dir)  # resolved once: scanned, watched, compared by this path
        try:
            self.device: int | None = os.stat(self.root).st_dev
        except OSError:
            self.device = None  # learnt from the first pass that finds the root
        self.mount = mount_id(self.root) if self.device is not None else None  # likewise
        self.local_root = resolved(cfg.checkpoints.local_dir) if cfg.checkpoints.local_dir is not None else None
        self.claim: RootClaim | TierClaims | None = None  # refreshed by every pass (set by the composition root)
        self.retention_stopped: str | None = None  # as of the last pass; said once when it changes
        # More to protect, judged on each pass's own scan (the checkpoints an open divergence keeps: the first pass
        # of a restarted supervisor has no earlier list to name them from). Set by Core: Guard.protected.
        self.hold: Callable[[Sequence[store.CheckpointInfo]], list[Path]] | None = None
        self.cfg, self.log, self.now, self.monotonic = cfg, log, now, monotonic
        self._idle: dict[Path, tuple[float, float, float]] = {}  # unfinished save: (its mtime, idle then, monotonic then)
        self._idle_lock = threading.Lock()
        self.latest: store.CheckpointInfo | None = None  # newest complete, non-quarantined: the resume point
        self._high: store.CheckpointInfo | None = None  # newest ever seen: a fallback after quarantine is no commit
        self.last: PassResult | None = None
        self.disk_free: int | None = None  # as of the last pass, or of the trash emptied since
        self._emptier: threading.Thread | None = None
        self._trash_lock = threading.Lock()
        self._more_trash = False  # something was parked since the emptier last looked
        self._emptying = False
        self._marker: tuple[Path, int, Path] | None = None  # the running attempt's in-use marker, job pid, its root
        self._said: set[str] = set()  # kinds of _SAID_ONCE already warned about
        self.verify_launch = False  # a launch waits: the next pass reads its resume point's bytes (the core sets it)
        self.loads_checked = False  # the job's heartbeat said its load checks the manifest's checksums (the core sets it)
        self._scrubbed = now()  # the last scrub (daemon/integrity.py): the first one a scrub_interval_s after start

    def concerns(self, path: Path) -> bool:
        """Is this file event a possible checkpoint commit (a top-level rename/create, DCP's .metadata, or a
        client's commit file or sentinel: clients.WATCHED)?"""
        for root in filter(None, (self.root, self.local_root)):
            try:
                rel = path.relative_to(root)
                break
            except ValueError:
                continue
        else:
            return False
        # A JSON file in a checkpoint folder may be the sidecar that says a nested checkpoint's step.
        return len(rel.parts) == 1 or rel.name in (METADATA_NAME, MANIFEST_NAME, *WATCHED) or (
            len(rel.parts) == 2 and rel.suffix == ".json")

    # ---- off the loop ------------------------------------------------------------------------------------
    def run_pass(self, *, generation: int, protect: Collection[Path], may_delete: bool = True,
                 unless_newest: Path | None = None, settled: bool = False) -> PassResult:
        """Scan the root once and prune it (if this node prunes), protecting `protect`; thread-safe, no state.

        With `may_delete=False` retention runs only when the newest complete checkpoint is no longer
        `unless_newest`, i.e. on a new commit (a file event in the root that committed nothing is no
        reason to delete anything). `settled`: no save can be in flight (the core says when), so the
        unfinished saves a job that picks its own checkpoint would load go now (retention.py, rule 3).
        """
        root_id, problem = look_at_root(self.spelled, self.root, self.device, self.mount)
        if problem is not None:
            return PassResult(generation, error=problem)
        marker, claim = self._marker, self.claim
        if marker is not None:
            store.refresh_in_use(marker[0])
        if claim is not None:
            claim.refresh()
        stopped = retention_problem(self.root, self.cfg.run_dir) if self.cfg.checkpoints.prune else None
        try:
            usage = store.disk_usage(self.root)
            durable = store.scan(self.root, verify_all=True)
            local = store.scan_local(self.local_root)
            found = store.merged(durable, local)
            protect = [*protect, *self.hold(found)] if self.hold is not None else protect
            usable = [c for c in found if c.complete and not c.quarantined]
            on, every = self.cfg.checkpoints.integrity, self.cfg.checkpoints.scrub_interval_s
            verify, scrub = self.verify_launch and on, on and every > 0 and self.now() - self._scrubbed >= every
            self._scrubbed = self.now() if scrub else self._scrubbed
            was = {c.path for c in found if c.quarantined}
            found, usable, findings = good_ones(found, usable, verify=verify, roots=(self.root, self.local_root),
                                                scrub=scrub, seal_new=on, loads_checked=self.loads_checked)
            judged = {c.path: c for c in found}  # found corrupt just now: retention keeps it, and the newest good
            durable, local = [judged.get(c.path, c) for c in durable], [judged.get(c.path, c) for c in local]
            newest = usable[0] if usable else None  # newest first, the durable one first at equal steps
            plan, deleted = store.RetentionPlan(), list[store.Deletion]()
            committed = newest is not None and newest.path != unless_newest
            if self.cfg.checkpoints.prune and (may_delete or committed or settled) and stopped is None:
                plan, deleted, stopped = self._retention(self.root, self._aged(durable), self.cfg.checkpoints, usage,
                                                         protect, settled)
            if self.cfg.checkpoints.prune and (may_delete or committed or settled) and local:
                deleted += self._local_retention(local, protect, settled)
        except (CheckpointError, OSError) as exc:
            return PassResult(generation, error=str(exc), root_id=root_id)
        gone = {d.path for d in deleted}
        metadata_cache.MEMORY.forget_gone()  # retention's deletions, and any other: their parsed `.metadata` too
        return PassResult(
            generation, checkpoints=[c for c in found if c.path not in gone], newest=newest, deleted=deleted,
            findings=[*findings, *plan.findings], verified=verify or not on, disk_free=usage.free_bytes,
            checkpoint_bytes=sum(c.size_bytes for c in durable if c.complete and c.path not in gone),
            root_id=root_id, retention_stopped=stopped, settled=settled, corrupt=[
                (str(c.path), CORRUPT_PREFIX + (c.reason or "")) for c in found if c.quarantined and c.path not in was],
        )

    def _aged(self, found: list[store.CheckpointInfo]) -> list[store.CheckpointInfo]:
        """`found`, its unfinished saves (partial, torn) idle since their mtime by the file clock when a pass first
        saw that mtime, and by the monotonic clock from then on: a step of the wall clock since ages none of them."""
        now, mono, seen, out = self.now(), self.monotonic(), {}, []
        with self._idle_lock:
            for c in found:
                if c.state in (store.PARTIAL, store.TORN):
                    mtime, idle, then = self._idle.get(c.path, (None, 0.0, 0.0))
                    if mtime != c.mtime:
                        mtime, idle, then = c.mtime, now - c.mtime, mono
                    seen[c.path] = (mtime, idle, then)
                    c = dataclasses.replace(c, mtime=now - (idle + mono - then))
                out.append(c)
            self._idle = seen
        return out

    def _retention(self, root: Path, found: list[store.CheckpointInfo], rules: store.RetentionRules,
                   usage: store.DiskUsage, protect: Collection[Path], settled: bool,
                   ) -> tuple[store.RetentionPlan, list[store.Deletion], str | None]:
        """Plan and carry out retention in one root: (plan, deleted, why it stopped). A sidecar that cannot be used
        stops retention only (SidecarError), never the pass."""
        plan = store.RetentionPlan()
        try:
            plan = store.plan_retention(found, rules=rules, disk=usage, protect={*protect, *store.in_use(root)},
                                        now=self.now(), settled=settled)
            deleted = (store.execute_retention(root, plan, empty_trash=False, fallback=self.cfg.run_dir)
                       if plan.deletions else [])
        except SidecarError as exc:
            return plan, [], str(exc)
        return plan, deleted, None

    def _local_retention(self, local: list[store.CheckpointInfo], protect: Collection[Path],
                         settled: bool) -> list[store.Deletion]:
        """The local tier keeps its `local_keep` newest complete (tiers.local_rules); it has no disk floor of its own,
        and a tier whose deletions cannot be parked just keeps what it has (the durable root's retention decides
        `retention_stopped`)."""
        root = self.local_root
        assert root is not None
        if retention_problem(root, self.cfg.run_dir) is not None:
            return []
        rules = store.local_rules(self.cfg.checkpoints, self.cfg.checkpoints.local_keep)
        return self._retention(root, local, rules, store.disk_usage(root), protect, settled)[1]

    def empty_trash(self) -> None:
        """Remove trash contents on a worker thread: a slow rmtree must not stall the loop (or its watchdog)."""
        with self._trash_lock:
            self._more_trash = True  # a running emptier looks again before it ends: nothing parked is left behind
            if self._emptying:
                return
            self._emptying = True

        def work() -> None:
            while True:
                with self._trash_lock:
                    if not self._more_trash:
                        self._emptying = False
                        return
                    self._more_trash = False
                try:
                    for root in filter(None, (self.root, self.local_root)):
                        store.clear_trash(root, fallback=self.cfg.run_dir)
                except (CheckpointError, OSError) as exc:
                    self.log.warning("trash_clear_failed", root=str(self.root), error=str(exc))
                    continue
                try:  # picked up by the next publish
                    self.disk_free = store.disk_usage(self.root).free_bytes
                except CheckpointError:
                    pass  # a root that is not there (yet): nothing to do with the trash; the next pass says

        self._emptier = threading.Thread(target=work, name="trash-emptier", daemon=True)
        self._emptier.start()

    # ---- in-use marker ------------------------------------------------------------------------------------
    def mark_in_use(self, path: Path, pid: int, start: float | None) -> None:
        """The attempt `pid` (its start ticks: `start`) resumed from `path`: tell every prune of its root (either tier)."""
        self.clear_in_use()
        try:
            self._marker = (store.mark_in_use(path.parent, path, pid=pid, start=int(start) if start else None), pid,
                            path.parent)
        except CheckpointError as exc:  # the daemon's own retention still protects it (core's in_use)
            self.log.warning("in_use_marker_failed", path=str(path), error=str(exc))

    def clear_in_use(self) -> None:
        """The attempt ended or committed past its resume point: drop its marker."""
        marker, self._marker = self._marker, None
        if marker is not None:
            try:
                store.clear_in_use(marker[2], pid=marker[1])
            except CheckpointError as exc:
                self.log.warning("in_use_marker_failed", path=str(marker[0]), error=str(exc))

    def wait_idle(self, timeout: float | None = None) -> None:
        """Let a running trash removal finish (at shutdown and in tests)."""
        if self._emptier is not None:
            self._emptier.join(timeout)

    # ---- on the loop -------------------------------------------------------------------------------------
    def absorb(self, result: PassResult) -> store.CheckpointInfo | None:
        """Take a finished pass in; returns the newest checkpoint when it is a new commit since the last pass."""
        if result.error is not None:
            self.log.error("checkpoint_scan_failed", root=str(self.root), error=result.error)
            return None
        self._say_retention(result.retention_stopped)
        self._say_vanished(self.last, result)
        if self.device is None and result.root_id is not None:
            self.device, self.mount = result.root_id[0], mount_id(self.root)
        first = self.last is None
        self.latest, self.last, self.disk_free = result.newest, result, result.disk_free
        for f in result.findings:
            if f.kind not in self._said:
                self.log.warning(f.kind, message=f.message)
            if f.kind in _SAID_ONCE:
                self._said.add(f.kind)
        for d in result.deleted:
            self.log.info("retention_deleted", path=str(d.path), reason=d.reason, size_bytes=d.size_bytes)
        # The first pass also empties what a predecessor killed mid-delete left parked: waiting for the next
        # deletion could hold a whole checkpoint's disk space for as long as nothing else is pruned. With
        # `prune = false` nothing is ever deleted, leftovers included.
        if result.deleted or (first and self.cfg.checkpoints.prune and result.retention_stopped is None):
            self.empty_trash()
        new = result.newest
        if new is None or not _newer(new, self._high):
            return None
        self._high = new
        return None if first else new  # what the first pass finds was there before us: the baseline

    def _say_vanished(self, before: PassResult | None, now: PassResult) -> None:
        """A complete or pinned checkpoint of the last pass gone though retention did not delete it (a client's own
        rotation, pins included, a person's `rm`, a root moved aside: docs/checkpoints.md); not said on a node that
        does not prune (another node's retention deletes from the shared root)."""
        if not self.cfg.checkpoints.prune:
            return
        kept = {c.path for c in now.checkpoints} | {d.path for d in now.deleted}
        gone = [c for c in (before.checkpoints if before else [])
                if (c.complete or c.pinned) and c.path not in kept]
        if gone:
            self.log.warning("checkpoints_vanished", count=len(gone), paths=[str(c.path) for c in gone[:20]],
                             steps=[c.step for c in gone[:20]], pinned=[str(c.path) for c in gone if c.pinned][:20],
                             detail="not deleted by this run's retention (the job's own rotation, or by hand)")

    def check_retention(self) -> None:
        """At start-up: say now (once) when retention will not be able to delete anything."""
        if self.cfg.checkpoints.prune:
            self._say_retention(retention_problem(self.root, self.cfg.run_dir))

    def _say_retention(self, stopped: str | None) -> None:
        """Retention stopping (or going again) is said once, loudly, when it changes; status shows it meanwhile."""
        if stopped == self.retention_stopped:
            return
        if stopped is not None:
            self.log.error("retention_stopped", root=str(self.root), reason=stopped,
                           effect="nothing is deleted; discovery, resume and commits go on")
        else:
            self.log.info("retention_resumed", root=str(self.root))
        self.retention_stopped = stopped

    def latest_step(self) -> int | None:
        return self.latest.step if self.latest else None

    def latest_json(self) -> dict[str, Any] | None:
        c = self.latest
        return None if c is None else {"path": str(c.path), "step": c.step, "mtime": c.mtime}

    def best_json(self) -> dict[str, Any] | None:
        """The best checkpoint of the last pass (`best_checkpoint`), for status."""
        if self.last is None or self.last.error is not None:
            return None
        return best_checkpoint(self.last.checkpoints, self.cfg.checkpoints.keep_best)

    def full_disk_note(self, low_free: int | None = None) -> str | None:
        """A note for a failed attempt when the checkpoint file system cannot hold one more checkpoint (or is read-only).

        A save that hits ENOSPC does not always say so: torch's zip writer reports it as "unexpected pos".
        `low_free` is the least free space a pass saw during the attempt: retention may have freed space
        between the failed save and the exit.
        """
        with contextlib.suppress(OSError):  # remount,ro: the save's EROFS is in the workers' output only
            if os.statvfs(self.root).f_flag & os.ST_RDONLY:
                return f"checkpoint root {self.root} is on a read-only file system"
        if self.latest is None:
            return None
        try:
            free = store.disk_usage(self.root).free_bytes
        except CheckpointError:
            return None
        free = min(free, low_free) if low_free is not None else free
        need = self.latest.size_bytes
        return f"checkpoint disk full: {free} bytes free, a checkpoint takes {need}" if free < need else None

    def quarantine(self, path: Path, reason: str) -> None:
        store.quarantine(path, reason)
        if self.latest is not None and self.latest.path == path:
            self.latest = None  # until the next pass names the fallback


def best_checkpoint(checkpoints: Sequence[store.CheckpointInfo], rule: store.KeepBest | None) -> dict[str, Any] | None:
    """`{path, step, metric, value}` of the best usable checkpoint by a manifest metric, or None.

    The metric and mode are `keep_best`'s; without keep_best, `val_loss` (lower is better) when checkpoints
    carry it. Complete, non-quarantined checkpoints only, ranked as retention's keep_best ranks them.
    """
    metric, mode = ("val_loss", "min") if rule is None else (rule.metric, rule.mode)
    ranked = store.by_metric([c for c in checkpoints if c.complete and not c.quarantined], metric, mode)
    if not ranked:
        return None
    best = ranked[0]
    return {"path": str(best.path), "step": best.step, "metric": metric, "value": best.metrics[metric]}


def _newer(cur: store.CheckpointInfo, old: store.CheckpointInfo | None) -> bool:
    """Is `cur` a later save than `old` (a fallback to an older one after quarantine is not)?

    Compared by the store's one ordering (a name's save ordinal, else step), so
    a nested-layout commit whose step is not known yet still counts as new.
    """
    if old is None:
        return True
    if cur.path == old.path:
        return cur.mtime > old.mtime  # the same step saved again
    cur_rank, old_rank = store.age_order(cur), store.age_order(old)
    if cur_rank[0] and old_rank[0]:
        return cur_rank[1] > old_rank[1]
    return cur.mtime > old.mtime
