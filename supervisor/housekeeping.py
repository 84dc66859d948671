"""The supervisor's view of the checkpoint root: newest complete, commits seen, quarantine, retention runs.

All judgement lives in `supervisor.checkpoints` (complete, ranking, retention plan); this class only
remembers what was seen and which checkpoint the running attempt resumed from, so it is never pruned.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor import checkpoints as store
from supervisor.checkpoints.layout import MANIFEST_NAME, METADATA_NAME
from supervisor.config import Config
from supervisor.errors import CheckpointError

__all__ = ["Housekeeper"]


class Housekeeper:
    def __init__(self, cfg: Config, log: Any, now: Callable[[], float]) -> None:
        self.root = cfg.checkpoints.dir
        self.cfg, self.log, self.now = cfg, log, now
        self.latest: store.CheckpointInfo | None = None
        self.in_use: Path | None = None  # resumed from by the running attempt: protected
        self.disk_free: int | None = None
        self.checkpoint_bytes: int | None = None  # bytes in complete checkpoints, as of the last pass
        self._emptier: threading.Thread | None = None

    def concerns(self, path: Path) -> bool:
        """Is this file event a possible checkpoint commit (a top-level rename/create, or DCP's .metadata)?"""
        try:
            rel = path.relative_to(self.root)
        except ValueError:
            return False
        return len(rel.parts) == 1 or rel.name in (METADATA_NAME, MANIFEST_NAME)

    def _read_newest(self) -> store.CheckpointInfo | None:
        try:
            return store.newest_complete(self.root) if self.root.is_dir() else None
        except CheckpointError as exc:
            self.log.warning("checkpoint_scan_failed", root=str(self.root), error=str(exc))
            return None

    def newest(self) -> store.CheckpointInfo | None:
        """The newest complete, non-quarantined checkpoint; also the baseline later commits are compared to."""
        self.latest = self._read_newest()
        return self.latest

    def refresh(self) -> store.CheckpointInfo | None:
        """Re-read the newest complete checkpoint; return it only when it is newer than the last one seen."""
        cur, old = self._read_newest(), self.latest
        self.latest = cur
        return cur if cur is not None and _newer(cur, old) else None

    def latest_step(self) -> int | None:
        return self.latest.step if self.latest else None

    def full_disk_note(self) -> str | None:
        """A note for a failed attempt when the checkpoint file system cannot hold one more checkpoint.

        A save that hits ENOSPC does not always say so: torch's zip writer reports it as "unexpected pos".
        """
        if self.latest is None:
            return None
        try:
            free = store.disk_usage(self.root).free_bytes
        except CheckpointError:
            return None
        need = self.latest.size_bytes
        return f"checkpoint disk full: {free} bytes free, a checkpoint takes {need}" if free < need else None

    def latest_json(self) -> dict[str, Any] | None:
        c = self.latest
        return None if c is None else {"path": str(c.path), "step": c.step, "mtime": c.mtime}

    def quarantine(self, path: Path, reason: str) -> None:
        store.quarantine(path, reason)
        if self.latest is not None and self.latest.path == path:
            self.latest = None

    def quarantined(self) -> list[str]:
        if not self.root.is_dir():
            return []
        try:
            return [str(c.path) for c in store.scan(self.root, verify_all=False) if c.quarantined]
        except CheckpointError:
            return []

    def prune(self) -> None:
        """One retention pass (if this node prunes), protecting the checkpoint in use; logs every deletion."""
        if not self.root.is_dir():
            return
        try:
            usage = store.disk_usage(self.root)
            self.disk_free = usage.free_bytes
            found = store.scan(self.root, verify_all=True)
            self.checkpoint_bytes = sum(c.size_bytes for c in found if c.complete)
            if not self.cfg.checkpoints.prune:
                return
            plan = store.plan_retention(
                found, policy=self.cfg.checkpoints, disk=usage,
                protect=[self.in_use] if self.in_use else [], now=self.now(),
            )
            for f in plan.findings:
                self.log.warning(f.kind, message=f.message)
            complete = {c.path for c in found if c.complete}
            for d in store.execute_retention(self.root, plan, empty_trash=False):
                self.log.info("retention_deleted", path=str(d.path), reason=d.reason, size_bytes=d.size_bytes)
                if d.path in complete:
                    self.checkpoint_bytes -= d.size_bytes
            self._empty_trash()
        except (CheckpointError, OSError) as exc:
            self.log.error("retention_failed", root=str(self.root), error=str(exc))

    def _empty_trash(self) -> None:
        """Remove `.trash` contents on a worker thread: a slow rmtree must not stall the loop (or its watchdog)."""
        if self._emptier is not None and self._emptier.is_alive():
            return  # it will find what was parked since it started, or the next pass will

        def work() -> None:
            try:
                store.clear_trash(self.root)
                self.disk_free = store.disk_usage(self.root).free_bytes  # picked up by the next publish
            except (CheckpointError, OSError) as exc:
                self.log.warning("trash_clear_failed", root=str(self.root), error=str(exc))

        self._emptier = threading.Thread(target=work, name="trash-emptier", daemon=True)
        self._emptier.start()

    def wait_idle(self, timeout: float | None = None) -> None:
        """Let a running trash removal finish (at shutdown and in tests)."""
        if self._emptier is not None:
            self._emptier.join(timeout)


def _newer(cur: store.CheckpointInfo, old: store.CheckpointInfo | None) -> bool:
    """Is `cur` a later save than `old` (a fallback to an older one after quarantine is not)?"""
    if old is None:
        return True
    if cur.path == old.path:
        return cur.mtime > old.mtime  # the same step saved again
    if cur.step is not None and old.step is not None:
        return cur.step > old.step
    return cur.mtime > old.mtime
