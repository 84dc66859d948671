"""A job that saves somewhere else: never a silent fresh start, and a root that stays empty.

The rules (`checkpoints_elsewhere`, exit 3; `checkpoint_root_idle`): docs/configuration.md, 'Notes' ("Never a
silent fresh start"). The search runs off the loop and is bounded (depth, entries, time); the store's judge
decides what a complete checkpoint is.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from supervisor.checkpoints import verify
from supervisor.contract import Beat, Phase
from supervisor.errors import CheckpointError
from supervisor.host.log import Log
from supervisor.layout import is_sidecar_name

__all__ = ["Elsewhere", "find_checkpoints"]

MAX_DEPTH, MAX_ENTRIES, MAX_SECONDS = 4, 20_000, 5.0
_SKIP = frozenset({".git", ".hg", ".venv", "venv", "__pycache__", "node_modules", "site-packages", ".fsdp-supervisor"})
SAVES_WITHOUT_COMMIT, IDLE_WITHOUT_BEATS_S = 3, 1800.0


def find_checkpoints(starts: Sequence[Path], *, exclude: Sequence[Path], since: float) -> list[Path]:
    """Complete DCP dirs (a `.metadata` no older than `since`) under `starts`, none inside `exclude` (bounded: the
    directories looked into, the depth and the time; files beside them cost no budget, symlinked dirs are followed)."""
    skip = [os.path.realpath(p).rstrip(os.sep) for p in exclude]
    deadline, entries, found = time.monotonic() + MAX_SECONDS, 0, []
    queue = [(str(p), 0) for p in dict.fromkeys(starts)]
    seen: set[str] = set()
    while queue and entries < MAX_ENTRIES and time.monotonic() < deadline:
        here, depth = queue.pop(0)
        here = os.path.realpath(here)
        if here in seen or any(here == r or here.startswith(r + os.sep) for r in skip):
            continue
        seen.add(here)
        with contextlib.suppress(OSError, CheckpointError):
            meta = os.stat(os.path.join(here, ".metadata"))  # ours: another user's (in /tmp, say) is no reason to stop
            if meta.st_mtime >= since and meta.st_uid == os.geteuid() and verify(here).complete:
                found.append(Path(here))
                continue
        with contextlib.suppress(OSError), os.scandir(here) as it:
            for entry in it:
                skipped = entry.name in _SKIP or is_sidecar_name(entry.name)  # our trash holds checkpoints
                if depth < MAX_DEPTH and not skipped and _is_dir(entry):
                    entries += 1
                    queue.append((entry.path, depth + 1))
                if entries >= MAX_ENTRIES or time.monotonic() >= deadline:
                    break
    return found


def _is_dir(entry: os.DirEntry[str]) -> bool:
    """A dir, or our own symlink to one (`ckpts -> /scratch/ckpts`; realpath and `seen` stop loops)."""
    with contextlib.suppress(OSError):
        return entry.is_dir() and (not entry.is_symlink() or entry.stat(follow_symlinks=False).st_uid == os.geteuid())
    return False


def named_dirs(cwd: Path, argv: Sequence[str]) -> list[Path]:
    """The job's working directory and the directories its arguments name (`--out ckpts`, `--out=ckpts`)."""
    values = [a.split("=", 1)[1] if a.startswith("-") and "=" in a else a for a in argv[1:]]
    named = [cwd / v for v in values if v and not v.startswith("-") and (cwd / v).is_dir()]
    return [*named, cwd]  # the named ones first: a crowded working directory cannot spend their budget


class Elsewhere:
    """What Core needs: the search before a fresh relaunch, and the idle root's one warning per attempt."""

    def __init__(self, cwd: Path, argv: Sequence[str], roots: Sequence[Path], *, since: float) -> None:
        self.cwd, self.argv, self.roots, self.since = cwd, list(argv), list(roots), since
        self.looked = -1  # the number of attempts when the search last ran (once per relaunch)
        self.saves, self.quiet_since, self.warned = 0, 0.0, False

    def must_look(self, attempts: int) -> bool:
        """A relaunch without resume after `attempts` > 0 ended: search once for it."""
        if attempts == 0 or self.looked == attempts:
            return False
        self.looked = attempts
        return True

    def look(self) -> list[Path]:
        """Off the loop: the complete checkpoints this run's job wrote outside the roots."""
        return find_checkpoints(named_dirs(self.cwd, self.argv), exclude=self.roots, since=self.since)

    def refusal(self, found: Sequence[Path], log: Log) -> str | None:
        """The give-up reason for `found` (logged as `checkpoints_elsewhere`), or None."""
        if not found:
            return None
        where, count = Counter(p.parent for p in found).most_common(1)[0]
        newest = max((p for p in found if p.parent == where), key=lambda p: p.stat().st_mtime if p.exists() else 0)
        log.error("checkpoints_elsewhere", dir=str(where), checkpoints=len(found), newest=str(newest),
                  root=str(self.roots[0]))
        return (f"checkpoints_elsewhere: {where} holds {count} complete checkpoint(s) written since this run started "
                f"(newest {newest.name}), outside [checkpoints] dir = {self.roots[0]}: not relaunching from scratch; "
                f"set [checkpoints] dir = \"{where}\" (or make the job save into the root)")

    def started(self, now: float) -> None:
        self.saves, self.quiet_since, self.warned = 0, now, False

    def committed(self, now: float) -> None:
        self.saves, self.quiet_since = 0, now

    def beat(self, old: Beat | None, new: Beat) -> None:
        if new.phase == Phase.SAVE and (old is None or old.phase != Phase.SAVE or old.step != new.step):
            self.saves += 1

    def idle(self, now: float, *, beats: bool) -> str | None:
        """The one warning for a root that receives nothing while the job saves (or, without beats, for 30 min)."""
        quiet = not beats and now - self.quiet_since >= IDLE_WITHOUT_BEATS_S
        if self.warned or not (self.saves >= SAVES_WITHOUT_COMMIT or quiet):
            return None
        self.warned = True
        why = (f"the job's heartbeat said `save` {self.saves} times" if self.saves else
               f"the job (no heartbeat) ran {int(now - self.quiet_since) // 60} minutes")
        return (f"{why} and nothing was committed under {self.roots[0]}: does it save somewhere else? "
                "([checkpoints] dir)")
