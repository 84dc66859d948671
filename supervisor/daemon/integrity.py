"""Good, not only complete, in a housekeeping pass (off the loop): seal, check before a launch, scrub.

What is read when, and what a checkpoint that fails becomes: docs/checkpoints.md, 'Good, not only complete'.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from supervisor import checkpoints as store
from supervisor.checkpoints.completeness import CORRUPT, FOREIGN
from supervisor.checkpoints.integrity import CORRUPT_PREFIX
from supervisor.checkpoints.lineage import foreign
from supervisor.checkpoints.seals import SEAL_MB_S, check, expected, seal
from supervisor.checkpoints.tiers import Tier
from supervisor.errors import CheckpointError, SidecarError

__all__ = ["good_ones", "seals_idle"]


Infos = list[store.CheckpointInfo]
_running: set[str] = set()  # the kinds of background work running now: at most one seal and one scrub
_reading = threading.Lock()  # held by the background read in progress: one at a time, each at SEAL_MB_S at most
_found: dict[Path, str] = {}  # what the scrub found rotten, for the next pass to quarantine (setitem and pop: atomic)
_lock = threading.Lock()
_idle = threading.Event()  # set while no background work runs
_idle.set()


def seals_idle(timeout: float | None = None) -> bool:
    """Wait until no background seal or scrub runs (tests, benchmarks); False if one still does after `timeout`."""
    return _idle.wait(timeout)


def _later(kind: str, work: Callable[[], object]) -> None:
    """Run `work` (a seal, a scrub) on a daemon thread, idle and at bounded bandwidth, unless one of its kind runs (the
    next pass asks again): neither a pass (a commit's detection, a job exit's judgement) nor the supervisor's exit waits
    while a large checkpoint is hashed (789 GB at SEAL_MB_S is an hour); a seal cut short is never written."""
    with _lock:
        if kind in _running:
            return
        _running.add(kind)
        _idle.clear()

    def run() -> None:
        try:
            with _reading:
                work()
        except (CheckpointError, SidecarError, OSError):
            pass  # gone (retention), or unreadable: the next pass tries again and says why
        finally:
            with _lock:
                _running.discard(kind)
                if not _running:
                    _idle.set()

    threading.Thread(target=run, name=kind, daemon=True).start()


def _background(kept: list[tuple[Path, Path]], scrub: bool) -> None:
    """Seal each (root, checkpoint) without checksums, or re-committed since its seal; with `scrub`, read every other
    against its checksums (what fails, the next pass quarantines, before its retention)."""
    for root, path in kept:
        try:
            sums = expected(root, path)
            fresh = (sums is None or sums[0] == "seal") and seal(root, path, mb_s=SEAL_MB_S)  # read just now: as sealed
            problem = (check(root, path, sums[1], mb_s=SEAL_MB_S, sealed=sums[0] == "seal")
                       if scrub and sums and not fresh else None)
            if problem is not None and path.is_dir():
                _found[path] = problem
        except (CheckpointError, SidecarError, OSError):
            continue  # gone (retention), or unreadable: the launch's check, or the next pass, says why


def _problem(root: Path, path: Path, loads_checked: bool) -> str | None:
    """Before a launch, what is wrong with the resume point's bytes (None: nothing found), unless its job's own load
    checks them: the trainer library's checksums, and a job whose heartbeat said its load checks them (no second
    read; a job that saves with the library but loads with plain `dcp.load` never says so). Sealed first, at full
    speed, when it has no checksums of its own and no seal, or was re-committed since."""
    sums = expected(root, path)
    if sums is not None and sums[0] == "manifest":
        return None if loads_checked else check(root, path, sums[1])
    if seal(root, path, mb_s=None):
        return None  # or sealed just now: its bytes were just read, and are what its seal says
    return check(root, path, sums[1], sealed=True) if sums is not None else None


def good_ones(found: Infos, usable: Infos, *, verify: bool, roots: Sequence[Path | None],
              scrub: bool = False, seal_new: bool = True, loads_checked: bool = False,
              ) -> tuple[Infos, Infos, list[store.Finding]]:
    """(found, usable, findings) after, with `verify`, reading the newest usable ones until one matches its
    checksums (`_problem`; the others quarantined as corrupt) and, with `seal_new`, starting a background seal of
    those that have none yet; `scrub`: also a background read of every usable one, idle and at bounded bandwidth
    (what it finds, the next pass quarantines). A local checkpoint of another lineage is set aside whatever the flags."""
    findings: list[store.Finding] = []
    bad: dict[Path, str] = {}
    aside: dict[Path, str] = {}
    good: list[store.CheckpointInfo] = []
    kept: list[tuple[Path, Path]] = []  # (root, checkpoint) of the good ones, for the scrub
    scrubbed = {p: _found.pop(p) for p in list(_found)}  # what the scrub found since the last pass
    for c in usable:
        root = roots[0] if c.tier is Tier.DURABLE else roots[1]
        if c.tier is Tier.LOCAL and roots[0] is not None and (why := foreign(roots[0], c.path)) is not None:
            findings.append(store.Finding("local_tier_foreign", why))
            aside[c.path] = why  # never the resume point, never deleted: the launch plans from `found`
            continue
        if root is None or c.path.is_symlink():  # a link (an alias: clients.py) is its target's save
            good.append(c)
            continue
        launch = verify and all(g.path.is_symlink() for g in good)  # the resume point: full speed, a launch waits
        try:
            problem = scrubbed.get(c.path) or (_problem(root, c.path, loads_checked) if launch else None)
        except (CheckpointError, SidecarError, OSError) as exc:  # never resumed unchecked: the pass fails, the
            raise CheckpointError(f"cannot check {c.path} before the launch: {exc}") from exc  # launch waits
        if problem is None:
            good.append(c)
            kept.append((root, c.path))
            continue
        reason = f"{CORRUPT_PREFIX}{problem}"
        try:
            store.quarantine(c.path, reason)
        except (CheckpointError, OSError) as exc:
            reason += f" (the quarantine marker could not be written: {exc})"
        bad[c.path] = reason
        findings.append(store.Finding("checkpoint_corrupt", f"{c.path} is never resumed: {reason}"))
    if kept and (seal_new or scrub):
        _later("scrub" if scrub else "seal", lambda: _background(kept, scrub))
    for c in usable:  # an alias link is as corrupt as its target
        if c.path.is_symlink() and (why := bad.get(c.path.resolve())) is not None:
            bad[c.path], good = why, [g for g in good if g.path != c.path]
    found = [dataclasses.replace(c, quarantined=True, state=CORRUPT, reason=bad[c.path].removeprefix(CORRUPT_PREFIX))
             if c.path in bad else dataclasses.replace(c, state=FOREIGN, reason=aside[c.path]) if c.path in aside
             else c for c in found]
    return found, good, findings
