"""One job per checkpoint root: a claim next to the resolved root, taken at start and held while the job runs.

Where it lives, who may share it, when it is live or stale: docs/checkpoints.md, 'What the supervisor keeps next
to the root' ("The root claim"). Invariants while editing: docs/design.md, 'Notes for maintainers'.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from supervisor.checkpoints.lease import Here, Lease, lease_body, lease_state, read_leases, refresh_lease, write_lease
from supervisor.checkpoints.metadata.cache import cache_dir
from supervisor.checkpoints.sidecars import open_sidecar, resolved, sidecar_path, trusted_owners
from supervisor.checkpoints.slurmrun import SlurmRun
from supervisor.errors import ClaimedError, SidecarError
from supervisor.host import procs
from supervisor.host.boot import start_ticks
from supervisor.host.mounts import identity
from supervisor.layout import CLAIM_SUFFIX

__all__ = ["CLAIM_MAX_AGE_S", "Holder", "RootClaim", "SlurmRun", "holder_state", "conflicts", "claim_homes", "identity_home",
           "live_holders"]

CLAIM_MAX_AGE_S = 900.0  # a claim from another host not refreshed for this long (or 3 refresh periods) is stale
_LOCK_WAIT_S = 5.0
_CHECK_WAIT_S = 0.2
PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class Holder(Lease):
    """One supervisor's claim on the root, as read from its file: a lease and what it says about its job."""

    job: str | None = None  # the multi-node job's rendezvous; None: a single-node job (shares with nobody)
    config: str = "?"
    run_dir: str = "?"
    orphan: int | None = None  # its supervisor is gone, but this process of its job still runs here
    slurm: SlurmRun | None = None  # the Slurm job and run it was in, if any

    def describe(self) -> str:
        who = f"supervisor pid {self.pid} on {self.host}"
        if self.orphan is not None:
            who += f" (killed, but its job still runs: pid {self.orphan})"
        return f"{who}, config {self.config} (run dir {self.run_dir})"


def holder_state(h: Holder, *, here: Here, now: float, started: Callable[[int], int | None],
                 slurm: SlurmRun | None = None) -> str | None:
    """Why the claim `h` is stale, or None while it is live (pure; lease_state, and `slurm`: our Slurm run)."""
    if not here.knows(h) and slurm is not None and slurm.follows(h.slurm):
        assert h.slurm is not None
        return (f"it is from an earlier run of Slurm job {h.slurm.job_id} (restart {h.slurm.restart}; this is "
                f"{slurm.restart}), which Slurm ended before this one")
    return lease_state(h, here=here, now=now, started=started, max_age=max(CLAIM_MAX_AGE_S, 3 * h.refresh_s))


def conflicts(job: str | None, live: Sequence[Holder]) -> list[Holder]:
    """The live holders that are another job: any single-node holder, or another rendezvous (pure)."""
    return [h for h in live if job is None or h.job != job]


def _cache(root: PathLike) -> Path | None:
    """This user's cache dir, unless it lies inside the (resolved) root: nothing of ours goes there."""
    cache = cache_dir()
    if cache is None:
        return None
    real, base = os.path.realpath(cache), str(resolved(root))
    return None if real == base or real.startswith(base.rstrip("/") + "/") else cache


def claim_homes(root: PathLike) -> list[Path]:
    """Where claims on `root` may be: next to the resolved root, then this user's cache dir."""
    homes = [sidecar_path(root, CLAIM_SUFFIX)]
    cache = _cache(root)
    if cache is not None:
        homes.append(cache / "claims" / hashlib.sha256(os.fsencode(resolved(root))).hexdigest()[:32])
    return homes


def identity_home(root: PathLike) -> tuple[Path, tuple[int, int]] | None:
    """This user's folder of claims on the directory `root` is, whoever's path reached it: (folder, (st_dev,
    st_ino)) of the root. A bind mount (or a second mount of one share) gives one root two paths, hence two
    folders next to it; on this host both paths meet here. None without a cache dir or a root."""
    cache, ident = _cache(root), identity(root)
    if cache is None or ident is None:
        return None
    return cache / "claims" / f"id-{hashlib.sha256(f'{ident[0]}:{ident[1]}'.encode()).hexdigest()[:32]}", ident


def _open_home(root: PathLike, folder: Path, first: bool) -> bool:
    """Make and check one claim folder (`first`: the one next to the root). SidecarError / OSError."""
    if first:  # next to the root: ours, or the root owner's
        return open_sidecar(folder, trusted_owners(root), create=True)
    os.makedirs(folder.parent, mode=0o700, exist_ok=True)
    return open_sidecar(folder, {os.geteuid()}, create=True)


def _holder(lease: Lease, ident: tuple[int, int] | None = None) -> Holder | None:
    """The claim `lease`; with `ident` (a record in the identity home) only while the root it names is still
    that directory (not a root deleted since, whose inode number another directory now has)."""
    doc = lease.doc
    if ident is not None and not (isinstance(doc.get("root"), str) and identity(doc["root"]) == ident):
        return None
    job = doc.get("job")
    fields = {f.name: getattr(lease, f.name) for f in dataclasses.fields(Lease)}
    return Holder(**fields, job=job if isinstance(job, str) else None, config=str(doc.get("config", "?")),
                  run_dir=str(doc.get("run_dir", "?")), slurm=SlurmRun.from_doc(doc.get("slurm")))


def _read_all(folder: Path, now: float, ident: tuple[int, int] | None = None) -> list[Holder]:
    return [h for h in (_holder(lease, ident) for lease in read_leases(folder, now)) if h is not None]


def _readable(root: PathLike) -> list[tuple[Path, tuple[int, int] | None]]:
    """The claim folders of `root` that exist and are ours to believe, each with the root identity its records
    must name (the identity home's) or None."""
    homes: list[tuple[Path, tuple[int, int] | None]] = [(h, None) for h in claim_homes(root)]
    by_id = identity_home(root)
    if by_id is not None:
        homes.append(by_id)
    found = []
    for i, (folder, ident) in enumerate(homes):
        try:
            if open_sidecar(folder, trusted_owners(root) if i == 0 else {os.geteuid()}, create=False):
                found.append((folder, ident))
        except (SidecarError, OSError):
            continue
    return found


def _holders(root: PathLike, now: float) -> list[Holder]:
    """Every claim on `root` found in its folders; a supervisor's records in two folders count once."""
    seen: dict[tuple[str, int, int | None, int | None], Holder] = {}
    for folder, ident in _readable(root):
        for h in _read_all(folder, now, ident):
            seen.setdefault((h.host, h.pid, h.pidns, h.start), h)
    return list(seen.values())


def live_holders(root: PathLike) -> list[Holder]:
    """The live claims on `root` (read only: nothing is created, stale ones are left for `run` to take over)."""
    here, now, slurm = Here.now(), time.time(), SlurmRun.from_env(os.environ)
    return [h for h in _holders(root, now) if holder_state(h, here=here, now=now, started=start_ticks,
                                                          slurm=slurm) is None]


@contextlib.contextmanager
def _locked(folder: Path, wait: float = _LOCK_WAIT_S) -> Iterator[None]:
    """Serialize claim-takers on the folder's `.lock` (a few ms each); after `wait` seconds go on without it."""
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break  # a holder stopped mid-claim (SIGSTOP): the claim files themselves still decide
                time.sleep(0.02)
            except OSError:
                break  # no locks on this file system: the files decide
        yield
    finally:
        os.close(fd)


class RootClaim:
    """This supervisor's claim on its (resolved) checkpoint root."""

    def __init__(self, root: PathLike, *, job: str | None, config: PathLike, run_dir: PathLike,
                 refresh_s: float, slurm: SlurmRun | None = None) -> None:
        self.root, self.job, self.refresh_s, self.slurm = resolved(root), job, refresh_s, slurm
        self.config, self.run_dir = str(config), str(run_dir)
        self.here, self.pid = Here.now(), os.getpid()
        self.name = self.here.name(self.pid)
        self.path: Path | None = None  # our claim file, once taken
        self.id_path: Path | None = None  # its copy in the identity home (identity_home), when one could be made
        self.held = False

    def acquire(self) -> list[tuple[str, str]]:
        """Take the claim; returns what to warn about as (event, detail): stale claims taken over, a claim kept
        in the cache dir. ClaimedError naming a live holder of another job; OSError when no folder can hold it."""
        notes: list[tuple[str, str]] = []
        folder = None
        for i, home in enumerate(claim_homes(self.root)):
            try:
                _open_home(self.root, home, i == 0)
            except (SidecarError, OSError) as exc:
                if i == 0:
                    why = str(exc) if isinstance(exc, SidecarError) else f"{home}: {exc.strerror or exc}"
                    note = f"{why}; the claim is kept in this user's cache dir instead, where other hosts cannot see it"
                    notes.append(("root_claim_elsewhere", note))
                    continue
                raise
            folder = home
            break
        if folder is None:
            raise OSError(f"no folder can hold the claim on {self.root}")
        self.path = folder / self.name
        by_id = identity_home(self.root)
        if by_id is not None:
            with contextlib.suppress(SidecarError, OSError):
                _open_home(self.root, by_id[0], False)
                self.id_path = by_id[0] / self.name
        with contextlib.ExitStack() as held:
            # The identity home first, in every taker: two paths to one root are serialized there too.
            for f in [*([self.id_path.parent] if self.id_path else []), folder]:
                held.enter_context(_locked(f))
            others, stale = self._look()
            if others:
                raise ClaimedError(self._refusal(others))
            self._write()
        self.held = True
        return [*notes, *(("root_claim_taken_over", line) for line in stale)]

    def check(self) -> str | None:
        """Before a launch: None when the claim is still ours (rewritten if it vanished), else why not."""
        if self.path is None:
            return None
        try:
            _open_home(self.root, self.path.parent, self.path.parent == claim_homes(self.root)[0])
            with _locked(self.path.parent, wait=_CHECK_WAIT_S):  # on the event loop: never wait long
                others, _ = self._look()
                if others:
                    return self._refusal(others)
                self._write(missing_only=True)
        except (SidecarError, OSError):
            return None  # cannot look now (a blip on shared storage): the claim taken at start still stands
        return None

    def refresh(self) -> None:
        """Touch the claim so that supervisors on other hosts keep counting it, and write it again where it was
        removed (`rm -rf` of the folder: a second job must not find the root free); off the loop: shared storage."""
        if self.path is None or not self.held:
            return
        if not all(refresh_lease(p) for p in (self.path, self.id_path) if p is not None):
            self.check()  # made again (and looked at) as before a launch

    def release(self) -> None:
        if self.held and self.path is not None:
            self.held = False
            for path in (self.path, self.id_path):
                if path is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(path)

    def _look(self) -> tuple[list[Holder], list[str]]:
        """(live claims of other jobs, one line per stale claim removed), from every claim folder of the root.
        A holder's records in two folders (next to the root and in the identity home) are judged once."""
        now = time.time()
        live: dict[tuple[str, int, int | None, int | None], Holder] = {}
        stale: dict[tuple[str, int, int | None, int | None], str] = {}
        for folder, ident in _readable(self.root):
            for h in _read_all(folder, now, ident):
                key = (h.host, h.pid, h.pidns, h.start)
                if (h.pid == self.pid and self.here.knows(h)) or key in live:
                    continue  # ours (in any folder), or a holder already judged live
                if key not in stale:
                    why = holder_state(h, here=self.here, now=now, started=start_ticks, slurm=self.slurm)
                    orphan = self._orphan_job(h) if why is not None else None
                    if why is None or orphan is not None:  # an orphan: a killed supervisor's job trains on
                        live[key] = h if orphan is None else dataclasses.replace(h, orphan=orphan)
                        continue
                    stale[key] = f"{h.describe()}: {why}"
                with contextlib.suppress(OSError):
                    os.unlink(h.path)
        return conflicts(self.job, list(live.values())), list(stale.values())

    def _orphan_job(self, h: Holder) -> int | None:
        """A live process of the job of `h`, a claim of this host whose supervisor is gone (SIGKILL, OOM): its job
        runs on in its own session and still trains on the root. Our own run dir's is ours to stop (Core.begin)."""
        if not self.here.knows(h):
            return None
        if h.run_dir in ("", "?") or os.path.realpath(h.run_dir) == os.path.realpath(self.run_dir):
            return None
        try:
            return procs.job_of(Path(h.run_dir))
        except (psutil.Error, OSError):
            return None

    def _refusal(self, others: Sequence[Holder]) -> str:
        h = others[0]
        more = f" (and {len(others) - 1} more)" if len(others) > 1 else ""
        remedy = (f"run it again (fsdp-supervisor run -c {h.config}) to take over and stop its job, or kill pid "
                  f"{h.orphan}" if h.orphan is not None else f"stop that one first (fsdp-supervisor stop -c {h.config})")
        return (f"checkpoint root {self.root} is held by another job: {h.describe()}{more}. One job per checkpoint "
                f"root: {remedy}, or give this config its own [checkpoints] dir")

    def _write(self, *, missing_only: bool = False) -> None:
        """Write our claim (and its copy in the identity home, as far as it can be: a failure there is not one
        of the claim); with `missing_only` only where it was removed."""
        assert self.path is not None
        body = lease_body(self.pid, job=self.job, config=self.config, run_dir=self.run_dir, refresh_s=self.refresh_s,
                          root=str(self.root), slurm=self.slurm.doc() if self.slurm else None)
        if not (missing_only and os.path.lexists(self.path)):
            write_lease(self.path, body)
        if self.id_path is not None and not (missing_only and os.path.lexists(self.id_path)):
            with contextlib.suppress(SidecarError, OSError):
                _open_home(self.root, self.id_path.parent, False)
                write_lease(self.id_path, body)
