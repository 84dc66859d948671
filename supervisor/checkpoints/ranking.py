"""List the children of a checkpoint root, newest first, judge them, and find the newest complete one fast.

Only immediate children count; the supervisor's sidecars are left out, a symlink is `invalid` and never followed,
a foreign child (shapes.py) or a copy is never walked, sized, counted or selected. The order, copies, the nested
folders' reference sibling and a root set one level too high: docs/checkpoints.md, 'States', 'Layouts' and
'A root set one level too high'.
"""
from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path

from supervisor.checkpoints.clients import inner_step, is_alias, json_step, layout_of, link_target, with_holds
from supervisor.checkpoints.completeness import (
    COMPLETE,
    CORRUPT,
    FOREIGN,
    INVALID,
    CheckpointState,
    Verdict,
    against_reference,
    verify,
)
from supervisor.checkpoints.integrity import CORRUPT_PREFIX
from supervisor.checkpoints.manifest import Manifest, read_manifest
from supervisor.checkpoints.markers import is_pinned, is_quarantined, quarantine_reason
from supervisor.checkpoints.naming import embedded_steps, is_temporary, name_ordinal, name_step
from supervisor.checkpoints.shapes import DIRECTORY, NESTED, CheckpointDirectoryError, Shape, identify
from supervisor.checkpoints.shapes import FOREIGN as FOREIGN_SHAPE
from supervisor.errors import CheckpointError, ManifestError
from supervisor.layout import METADATA_NAME, is_sidecar_name
from supervisor.vocabulary import Vocabulary

__all__ = ["UNVERIFIED", "CheckpointInfo", "Tier", "age_order", "scan", "newest_complete", "judge", "check_root",
           "checkpoint_step"]

UNVERIFIED = CheckpointState.UNVERIFIED  # only from scan(verify_all=False): older than the newest complete


class Tier(Vocabulary):
    """Which root a checkpoint is in: the durable one, or the node-local tier (supervisor/checkpoints/tiers.py)."""

    DURABLE = "durable"
    LOCAL = "local"


def age_order(c: CheckpointInfo | _Candidate) -> tuple[bool, int, bool, float]:
    """The one ordering of checkpoints, oldest first: unranked dirs before ranked ones, then the rank (save
    ordinal, else step), then an alias before the checkpoint it repeats (Lightning's `last.ckpt`: the named
    save of the same step is the one to pick), then mtime."""
    rank = c.ordinal if c.ordinal is not None else c.step
    return (rank is not None, rank or 0, c.alias_of is None, c.mtime)


@dataclass(frozen=True)
class CheckpointInfo:
    """One child of the checkpoint root, as the supervisor, retention and the CLI see it."""

    name: str
    path: Path  # absolute, not resolved: a symlinked child stays the symlink
    step: int | None  # the training step, when known
    state: CheckpointState  # unverified only from scan(verify_all=False)
    reason: str | None
    size_bytes: int  # 0 for foreign entries: they are never walked
    mtime: float
    pinned: bool = False
    quarantined: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    ordinal: int | None = None  # Accelerate's save number N of `checkpoint_<N>` (not a step)
    inode: int = 0  # of the dir when it was judged (0: unknown); retention deletes only that very dir
    tier: Tier = Tier.DURABLE  # a scan of one root says durable; tiers.py tags the local tier's
    alias_of: str | None = None  # the sibling holding the same save (Lightning's last.ckpt: a copy or a link)
    hold: str | None = None  # why the training program itself needs it kept (retention never deletes it)
    keeps_unknown: str | None = None  # why the program's own keep list (Lightning's top-k) could not be read

    @property
    def complete(self) -> bool:
        return self.state == COMPLETE


@dataclass(frozen=True)
class _Candidate:
    name: str
    path: Path
    is_link: bool
    step: int | None
    mtime: float
    ordinal: int | None = None
    inode: int = 0
    named: bool = False  # the step comes from the name (not from a manifest or sidecar inside)
    alias_of: str | None = None
    target: str | None = None  # for a Lightning last*.ckpt symlink: the sibling it names


def _open_root(root: str | os.PathLike[str]) -> tuple[Path, os._ScandirIterator[str]]:
    path = Path(os.path.abspath(root))
    try:
        return path, os.scandir(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint root {path} does not exist") from None
    except NotADirectoryError:
        raise CheckpointError(f"checkpoint root {path} is not a directory") from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint root {path} cannot be read: {exc.strerror}") from None


def _lmtime(path: Path) -> float | None:
    try:
        return os.lstat(path).st_mtime
    except OSError:
        return None


def checkpoint_step(directory: Path, manifest: Manifest | None = None) -> int | None:
    """The training step of a checkpoint dir: its manifest's, else its name's, else what its files record
    (clients.inner_step), else None."""
    if manifest is None:
        with contextlib.suppress(ManifestError):
            manifest = read_manifest(directory)
    step = manifest.step if manifest is not None else name_step(directory.name)
    return step if step is not None else inner_step(directory)


def _list_root(root: str | os.PathLike[str]) -> tuple[Path, list[_Candidate]]:
    """The children of `root` that may be checkpoints, newest first, with no verification (cheap)."""
    path, entries = _open_root(root)
    found = []
    with entries:
        for entry in entries:
            if is_sidecar_name(entry.name):
                continue  # ours
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # vanished between listing and stat: a rename by retention or the trainer
            is_link = stat.S_ISLNK(st.st_mode)
            if not (is_link or stat.S_ISDIR(st.st_mode)):
                continue
            child = path / entry.name
            step, ordinal = name_step(entry.name), name_ordinal(entry.name)
            named = step is not None
            target = link_target(child) if is_link and is_alias(entry.name) else None
            if target is not None:
                step = name_step(target)
            elif step is None and ordinal is None and not is_link:
                step = checkpoint_step(child)
            mtime = st.st_mtime if is_link else (_lmtime(child / METADATA_NAME) or st.st_mtime)
            found.append(_Candidate(entry.name, child, is_link, step, mtime, ordinal, st.st_ino, named, target=target))
    found = _with_aliases(found)
    found.sort(key=age_order, reverse=True)
    return path, found


def _with_aliases(found: list[_Candidate]) -> list[_Candidate]:
    """Mark an alias (Lightning's `last*.ckpt`) as one of the sibling holding the same save: the one a link names, or
    for a copy the named checkpoint of the same step (so it is never selected over it, nor counted twice)."""
    names = {c.name for c in found}
    by_step = {c.step: c.name for c in sorted(found, key=lambda c: c.name)
               if c.step is not None and not c.is_link and not is_alias(c.name)}
    out = []
    for c in found:
        if c.target is not None:  # a name without `step=` (`ckpt-30.ckpt`): the step its target has
            step = c.step if c.step is not None else next((o.step for o in found if o.name == c.target), None)
            c = replace(c, alias_of=c.target if c.target in names else None, step=step)
        elif is_alias(c.name) and not c.is_link and c.step is not None:
            c = replace(c, alias_of=by_step.get(c.step))
        out.append(c)
    return out


def _usage(directory: Path) -> tuple[int, float]:
    """Total bytes under `directory` (no symlinks followed) and the newest mtime seen (last activity)."""
    total, newest = 0, 0.0
    stack = [directory]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    newest = max(newest, st.st_mtime)
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(Path(entry.path))
                    elif not stat.S_ISLNK(st.st_mode):
                        total += st.st_size
        except OSError:
            continue
    return total, newest


def _settled_mtime(c: _Candidate, verdict: Verdict | None, newest: float) -> float:
    """A complete save's age is its commit (`.metadata`); anything else's is its last write, so a slow save in
    flight is not mistaken for debris, nor is a torn dir being written again in place (DCP overwrites the
    shards of an existing checkpoint_id, its old `.metadata` still there, when a step is saved again)."""
    if verdict is None:  # unverified (scan with verify_all=False): only shown, never deleted
        return c.mtime if os.path.lexists(c.path / METADATA_NAME) else max(c.mtime, newest)
    if verdict.complete and verdict.members:
        stamps = [_lmtime(c.path / m / METADATA_NAME) for m in sorted(verdict.members)]
        if all(s is not None for s in stamps):
            return max(s for s in stamps if s is not None)
    elif verdict.complete and os.path.lexists(c.path / METADATA_NAME):
        return c.mtime
    return max(c.mtime, newest)


def _foreign(c: _Candidate, reason: str | None) -> CheckpointInfo:
    return CheckpointInfo(c.name, c.path, None, FOREIGN, reason or "not a checkpoint", 0, c.mtime)


def _info(c: _Candidate, verdict: Verdict | None) -> CheckpointInfo:
    if c.is_link and c.alias_of is not None and verdict is not None:  # an alias link (clients.py)
        why = f"a link to {c.alias_of} (its client's resume pointer)"
        return CheckpointInfo(c.name, c.path, c.step, verdict.state, why if verdict.complete else
                              f"{why}, which is {verdict.state}: {verdict.reason}", 0, c.mtime, alias_of=c.alias_of)
    if c.is_link:
        return CheckpointInfo(c.name, c.path, c.step, INVALID, "the checkpoint dir is a symlink", 0, c.mtime,
                              ordinal=c.ordinal)
    if verdict is not None and verdict.state == FOREIGN:
        return _foreign(c, verdict.reason)
    size, newest = _usage(c.path)
    manifest = verdict.manifest if verdict else None
    reason: str | None
    if verdict is None:
        state, reason = UNVERIFIED, "not verified: older than the newest complete checkpoint"
    else:
        state, reason = verdict.state, verdict.reason
    held = quarantine_reason(c.path) if state == COMPLETE and is_quarantined(c.path) else None
    if held and held.startswith(CORRUPT_PREFIX):  # its bytes failed their checksums (daemon/integrity.py)
        state, reason = CORRUPT, held.removeprefix(CORRUPT_PREFIX)
    step = manifest.step if manifest else c.step
    if step is None and c.ordinal is not None:
        step = json_step(c.path)
    return CheckpointInfo(c.name, c.path, step, state, reason, size, _settled_mtime(c, verdict, newest),
                          pinned=is_pinned(c.path), quarantined=is_quarantined(c.path),
                          metrics=dict(manifest.metrics) if manifest else {}, ordinal=c.ordinal, inode=c.inode,
                          alias_of=c.alias_of)


class _Judge:
    """Judges the children of one root, each at most once (shape and verdict are cached per call)."""

    def __init__(self, root: Path, candidates: list[_Candidate]) -> None:
        self.root, self.candidates = root, candidates
        self._index = {c.name: i for i, c in enumerate(candidates)}  # newest first
        self._shapes: dict[str, Shape] = {}
        self._own: dict[str, Verdict | None] = {}
        self._named: dict[int, _Candidate] = {}  # step -> the newest child whose name carries it
        for c in candidates:
            if c.named and not c.is_link and c.step is not None:
                self._named.setdefault(c.step, c)

    def _identify(self, c: _Candidate) -> Shape:
        if c.name not in self._shapes:
            self._shapes[c.name] = identify(c.path)
        return self._shapes[c.name]

    def shape(self, c: _Candidate) -> Shape:
        """identify() once per child; a directory of checkpoints is a copy beside the root's own checkpoints,
        and stops everything in a root that has none (the root is set too high)."""
        shape = self._identify(c)
        if shape.kind != DIRECTORY:
            return self._copy_beside(c, shape) or shape
        if any(not o.is_link and self._identify(o).ours for o in self.candidates):
            within = f"{c.name}/{shape.within}" if shape.within else c.name
            return Shape(FOREIGN_SHAPE, reason=f"holds a series of checkpoints ({within}: {', '.join(shape.series[:3])}"
                                               f"{', ...' if len(shape.series) > 3 else ''}), a copy: never touched")
        raise CheckpointDirectoryError(self.root, c.path / shape.within, shape.series)

    def _copy_beside(self, c: _Candidate, shape: Shape) -> Shape | None:
        """Foreign when `c` is a copy under a name without its step: its manifest's step is a sibling's named step
        (`cp -a step_30 latest`), or its name holds that step with something after it (`step_30.bak`)."""
        if not shape.ours or c.named or c.is_link or c.step is None or c.ordinal is not None or c.alias_of:
            return None  # Lightning's last.ckpt is a copy by design: an alias (_with_aliases), not a stray one
        twin = self._named.get(c.step)
        if twin is not None and self._identify(twin).ours:
            return Shape(FOREIGN_SHAPE, reason=f"a copy of {twin.name} (its step {c.step}, under a name without "
                                               "it): never touched")
        # The trainer's set-aside is its own; a client's names carry what its template says (Lightning's
        # `ckpt-{step}` gives `ckpt-30.ckpt`), and a hand copy has none of them (`...ckpt.bak`).
        if c.step in embedded_steps(c.name) and not (is_temporary(c.name) or layout_of(c.name)):
            return Shape(FOREIGN_SHAPE, reason=f"a copy of a checkpoint of step {c.step} (its name says so): "
                                               "never touched")
        return None

    def own(self, c: _Candidate) -> Verdict | None:
        """verify() of the child alone; None when it vanished after listing (renamed by retention or the trainer)."""
        if c.name not in self._own:
            try:
                self._own[c.name] = verify(c.path, shape=self.shape(c))
            except CheckpointDirectoryError:
                raise
            except CheckpointError:
                self._own[c.name] = None
        return self._own[c.name]

    def shaped(self) -> _Judge:
        """Every child's shape, before anything is verified: a root set too high raises here."""
        for c in self.candidates:
            if not c.is_link:
                self.shape(c)
        return self

    def _settled(self, c: _Candidate) -> Verdict | None:
        """The verdict of a nested sibling whose DCP dirs are all complete, else None."""
        if c.is_link or self.shape(c).kind != NESTED:
            return None
        v = self.own(c)
        return v if v is not None and v.complete else None

    def reference(self, name: str) -> tuple[frozenset[str], str] | None:
        """The members of the nearest older nested sibling whose DCP dirs are all complete (else the nearest newer
        one), and its name."""
        at = self._index.get(name)
        if at is None:
            return None
        for other in (*self.candidates[at + 1:], *reversed(self.candidates[:at])):
            v = self._settled(other)
            if v is not None:
                return v.members, other.name
        return None

    def _confirmed(self, name: str, members: frozenset[str]) -> bool:
        """Does a newer nested sibling have exactly these members? Then it is the layout now (a model was
        dropped on purpose), not a save cut short."""
        for other in self.candidates[: self._index.get(name, 0)]:
            v = self._settled(other)
            if v is not None and v.members == members:
                return True
        return False

    def linked(self, c: _Candidate) -> Verdict | None:
        """The verdict of the sibling a Lightning `last*.ckpt` link names (None: not such a link, or it is gone)."""
        at = self._index.get(c.alias_of) if c.is_link and c.alias_of else None
        return None if at is None else self.verdict(self.candidates[at])

    def verdict(self, c: _Candidate) -> Verdict | None:
        v = self.own(c)
        if v is None or not (v.complete and v.members):
            return v
        ref = self.reference(c.name)
        if ref is None or ref[0] <= v.members or self._confirmed(c.name, v.members):
            return v
        return against_reference(v, *ref)


def scan(root: str | os.PathLike[str], *, verify_all: bool = True) -> list[CheckpointInfo]:
    """Every child of `root` that is a directory, newest first, each with its state.

    With verify_all=False, dirs are verified newest-first only until the newest complete,
    non-quarantined one; older ones come back with state "unverified" (foreign ones still "foreign").
    Raises CheckpointDirectoryError, before verifying anything, when the root is one level too high.
    """
    path, candidates = _list_root(root)
    judge = _Judge(path, candidates).shaped()
    infos: list[CheckpointInfo] = []
    found_newest = False
    for c in candidates:
        if not c.is_link and judge.shape(c).kind == FOREIGN_SHAPE:
            infos.append(_foreign(c, judge.shape(c).reason))
            continue
        if found_newest and not verify_all:
            infos.append(_info(c, None))
            continue
        verdict = judge.linked(c) if c.is_link else judge.verdict(c)
        if verdict is None and not c.is_link:
            continue  # gone
        info = _info(c, verdict)
        infos.append(info)
        found_newest = found_newest or (info.complete and not info.quarantined and not c.is_link)
    infos.sort(key=age_order, reverse=True)
    return with_holds(path, infos)


def newest_complete(root: str | os.PathLike[str]) -> CheckpointInfo | None:
    """The newest complete, non-quarantined checkpoint under `root`, or None.

    The hot path: candidates are ranked from names and stats alone, and verification stops at the
    first complete one (a nested one also looks at its nearest sibling whose DCP dirs are all complete).
    """
    path, candidates = _list_root(root)
    judge = _Judge(path, candidates)
    for c in candidates:
        if c.is_link or is_temporary(c.name) or is_quarantined(c.path):
            continue
        verdict = judge.verdict(c)
        if verdict is not None and verdict.complete:
            return _info(c, verdict)
    return None


def judge(path: str | os.PathLike[str], *, deep: bool = False) -> Verdict:
    """verify() one dir as a scan of its parent would: a nested folder is also held against its siblings."""
    directory = Path(os.path.abspath(path))
    verdict = verify(directory, deep=deep)
    if not (verdict.complete and verdict.members):
        return verdict
    try:
        parent, candidates = _list_root(directory.parent)
        this = next((c for c in candidates if c.name == directory.name), None)
        return verdict if this is None else (_Judge(parent, candidates).verdict(this) or verdict)
    except CheckpointError:
        return verdict  # the parent cannot be read or holds something odd: the dir alone is all we know


def check_root(root: str | os.PathLike[str]) -> None:
    """Raise CheckpointDirectoryError when `root` holds a directory of checkpoints (it is one level too high),
    CheckpointError when it cannot be read; verifies nothing (cheap enough to run before every launch)."""
    _Judge(*_list_root(root)).shaped()
