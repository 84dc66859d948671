"""Good, not only complete, in a housekeeping pass (off the loop): seal what has no checksums, before a launch
read the resume point's bytes against its checksums, and every `scrub_interval_s` every kept checkpoint's
(supervisor/checkpoints/seals.py, docs/checkpoints.md).

A resume point whose bytes fail is quarantined with the reason `corrupt: <file> bytes A-B ...` (never resumed, the
marker says why, nothing deleted for it) and the next newest is read in its place, until one matches.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
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
_sealing: set[Path] = set()  # the checkpoint a background seal is reading now (one at a time)
_lock = threading.Lock()
_idle = threading.Event()  # set while no background seal runs
_idle.set()


def seals_idle(timeout: float | None = None) -> bool:
    """Wait until no background seal runs (tests, benchmarks); False if one still does after `timeout`."""
    return _idle.wait(timeout)


def _seal_later(root: Path, path: Path) -> None:
    """Seal `path` (or see that it is sealed) on a thread of its own, idle and at bounded bandwidth: a pass, and so
    a commit's detection or a job exit's judgement, never waits while a large checkpoint is hashed (789 GB at
    SEAL_MB_S is an hour). A daemon thread: the supervisor's exit never waits for it either; a seal cut short is
    never written (seals.py writes it whole), and the next pass starts it again."""
    with _lock:
        if _sealing:
            return
        _sealing.add(path)
        _idle.clear()

    def work() -> None:
        try:
            seal(root, path, mb_s=SEAL_MB_S)
        except (CheckpointError, SidecarError, OSError):
            pass  # gone (retention), or unreadable: the next pass tries again and says why
        finally:
            with _lock:
                _sealing.discard(path)
                _idle.set()

    threading.Thread(target=work, name="seal", daemon=True).start()


def good_ones(found: Infos, usable: Infos, *, verify: bool, roots: Sequence[Path | None],
              scrub: bool = False, seal_new: bool = True) -> tuple[Infos, Infos, list[store.Finding]]:
    """(found, usable, findings) after, with `verify`, reading the newest usable ones until one matches its
    checksums (the others quarantined as corrupt; one without checksums is sealed first, at full speed) and, with
    `seal_new`, starting a background seal of one that has none yet; `scrub`: reading every usable one, idle and at
    bounded bandwidth. A local checkpoint of another lineage is set aside whatever the flags."""
    findings: list[store.Finding] = []
    bad: dict[Path, str] = {}
    aside: dict[Path, str] = {}
    good: list[store.CheckpointInfo] = []
    hashed = False  # one background seal (or look for a re-commit) started per pass
    for c in usable:
        root = roots[0] if c.tier is Tier.DURABLE else roots[1]
        if c.tier is Tier.LOCAL and roots[0] is not None and (why := foreign(roots[0], c.path)) is not None:
            findings.append(store.Finding("local_tier_foreign", why))
            aside[c.path] = why  # never the resume point, never deleted: the launch plans from `found`
            continue
        if root is None or c.path.is_symlink():  # a link (an alias: clients.py) is its target's save
            good.append(c)
            continue
        try:
            sums = expected(root, c.path)
            launch = verify and all(g.path.is_symlink() for g in good)  # the resume point: full speed, a launch waits
            # New, or its files rewritten since: sealed now if it is the resume point, else on a thread (idle).
            fresh = False  # sealed just now: the bytes were just read, and are what the seal says
            if (sums is None or sums[0] == "seal") and launch:
                if fresh := seal(root, c.path):
                    sums = expected(root, c.path)
            elif (sums is None or sums[0] == "seal") and seal_new and not hashed:
                hashed = True
                _seal_later(root, c.path)
            problem = (check(root, c.path, sums[1], mb_s=None if launch else SEAL_MB_S)
                       if sums is not None and (launch or scrub) and not fresh else None)
        except (CheckpointError, SidecarError, OSError) as exc:
            findings.append(store.Finding("seal_failed", f"{c.path}: {exc}"))
            problem = None
        if problem is None:
            good.append(c)
            continue
        reason = f"{CORRUPT_PREFIX}{problem}"
        try:
            store.quarantine(c.path, reason)
        except (CheckpointError, OSError) as exc:
            reason += f" (the quarantine marker could not be written: {exc})"
        bad[c.path] = reason
        findings.append(store.Finding("checkpoint_corrupt", f"{c.path} is never resumed: {reason}"))
    for c in usable:  # an alias link is as corrupt as its target
        if c.path.is_symlink() and (why := bad.get(c.path.resolve())) is not None:
            bad[c.path], good = why, [g for g in good if g.path != c.path]
    found = [dataclasses.replace(c, quarantined=True, state=CORRUPT, reason=bad[c.path].removeprefix(CORRUPT_PREFIX))
             if c.path in bad else dataclasses.replace(c, state=FOREIGN, reason=aside[c.path]) if c.path in aside
             else c for c in found]
    return found, good, findings
