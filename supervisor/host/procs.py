"""Process plumbing: subreaper, spawning a job in its own session, reaping, and making sure nothing survives.

Only the real `System` (supervisor/daemon/system.py) calls these; the core never touches processes directly.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import psutil

from supervisor.contract import ENV_RUN_DIR, ENV_RUN_TOKEN
from supervisor.host import joblog

__all__ = [
    "set_child_subreaper",
    "spawn",
    "descendants",
    "named",
    "kill_descendants",
    "signal_catchers",
    "worker_states",
    "find_orphans",
    "job_of",
    "stop_processes",
    "reap_any",
    "LIBC",
]

_PR_SET_CHILD_SUBREAPER = 36
LIBC = ctypes.CDLL(None, use_errno=True)  # one handle for the process (one per call keeps ~110 bytes each)


def set_child_subreaper() -> bool:
    """Adopt orphaned descendants (Linux prctl) so nothing the job forks can escape our reaping."""
    try:
        rc: int = LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # ctypes: an untyped foreign call
        return rc == 0
    except (OSError, AttributeError):
        return False


def spawn(argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], log_path: Path | None) -> subprocess.Popen[bytes]:
    """Start the job in a new session (its own process group), stdout+stderr appended to `log_path`.

    No shell: argv is passed as a list. The log file is inherited by the job, so its output survives a
    supervisor that is killed, and the job never dies of a broken pipe. With `log_path` None (the run dir
    cannot take the file) the job writes to the supervisor's own stdout and stderr (the journal, the terminal).
    """
    if log_path is None:
        return subprocess.Popen(list(argv), cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL,
                                start_new_session=True, close_fds=True)
    log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(joblog.open_log(log_path), "ab", buffering=0) as log:
        return subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )


def reap_any() -> list[tuple[int, int]]:
    """waitpid(-1) without blocking until nothing is left: (pid, exit code or -signal) for each reaped child."""
    out: list[tuple[int, int]] = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return out
        if pid == 0:
            return out
        out.append((pid, os.waitstatus_to_exitcode(status)))


def descendants(exclude: Collection[int] = ()) -> list[psutil.Process]:
    """Every live descendant of this process (as a subreaper that includes re-parented orphans)."""
    try:
        return [p for p in psutil.Process().children(recursive=True)
                if p.pid not in exclude and p.status() != psutil.STATUS_ZOMBIE]
    except psutil.Error:
        return []


def named(found: Sequence[psutil.Process], sig: int | None = None) -> list[tuple[int, str]]:
    """(pid, name) of each process still there, after sending it `sig` if one is given."""
    out = []
    for p in found:
        try:
            name = p.name()
            if sig is not None:
                p.send_signal(sig)
            out.append((p.pid, name))
        except psutil.Error:
            continue
    return out


def kill_descendants(sig: int = signal.SIGKILL, exclude: Collection[int] = ()) -> list[tuple[int, str]]:
    """Signal every live descendant but `exclude` (the idle prewarm spare); returns (pid, name) signalled."""
    return named(descendants(exclude), sig)


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (the SigCgt mask in /proc/PID/status)."""
    with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/status", "rb") as f:
        for line in f.read(16384).splitlines():
            if line.startswith(b"SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def signal_catchers(pid: int, sig: int) -> list[int]:
    """Send `sig` to every process of the job (`pid` and its descendants) that has a handler for it.

    For SIGUSR1 (stack dumps: trainer/stackdump.py in torchrun's workers, a script's faulthandler, DataLoader
    workers, which inherit the handler) a process without a handler would die of it: torchrun's agent, a
    wrapper shell, a helper process. Those are left alone.
    """
    try:
        job = psutil.Process(pid)
        tree = [job, *job.children(recursive=True)]
    except psutil.Error:
        return []
    sent = []
    for p in tree:
        if not catches(p.pid, sig):
            continue
        try:
            p.send_signal(sig)
            sent.append(p.pid)
        except psutil.Error:
            continue
    return sent


def worker_states(pid: int, handed: Mapping[int, int] | None = None) -> dict[int, tuple[int, str]]:
    """torchrun's workers (the direct children of `pid`) by the `RANK` in their environment: (pid, psutil status).

    A warm worker's environment shows no RANK, or the one it inherited (it took the rank's over in-process):
    `handed` (pid -> rank, the agent's side file: spares.handed_ranks) names it first. A child with neither
    (not a torchrun worker, or gone) is left out.
    """
    try:
        kids = psutil.Process(pid).children()
    except psutil.Error:
        return {}
    out: dict[int, tuple[int, str]] = {}
    for k in kids:
        try:
            if handed and k.pid in handed:  # first: a warm rank's environment may hold a stale RANK of ours
                out[handed[k.pid]] = (k.pid, k.status())
                continue
            rank = k.environ().get("RANK", "")
            if rank.isdecimal() and len(rank) <= 7:
                out[int(rank)] = (k.pid, k.status())
        except psutil.Error:
            continue
    return out


def _ancestry() -> set[int]:
    """This process and its ancestors: never an orphan, whatever their environment says."""
    pids: set[int] = set()
    p: psutil.Process | None = psutil.Process()
    while p is not None:
        pids.add(p.pid)
        try:
            p = p.parent()
        except psutil.Error:
            break
    return pids


def _same_dir(a: str | None, b: Path) -> bool:
    return a is not None and os.path.realpath(a) == os.path.realpath(b)


def find_orphans(token: str, run_dir: Path) -> list[psutil.Process]:
    """Live processes of a job this run dir's supervisor started: its token and run dir in their environment.

    Every process of a job inherits both (the torchrun agent, its workers, a spare that became the job,
    anything they fork), whatever argv the kernel shows for it. Oldest first, so the job's agent comes before
    its workers.
    """
    return sorted(_started_from(run_dir, token, _ancestry()), key=_started)


def _started_from(run_dir: Path, token: str | None, skip: Collection[int]) -> list[psutil.Process]:
    """Live processes whose environment names `run_dir` (and `token`, unless None) as their supervisor's."""
    found = []
    for p in psutil.process_iter():
        if p.pid in skip:
            continue
        try:
            env = p.environ()
            if ((token is None or env.get(ENV_RUN_TOKEN) == token) and _same_dir(env.get(ENV_RUN_DIR), run_dir)
                    and p.status() != psutil.STATUS_ZOMBIE):
                found.append(p)
        except psutil.Error:  # gone, or another user's: not ours either way
            continue
    return found


def job_of(run_dir: Path) -> int | None:
    """The oldest live process of a job a supervisor of `run_dir` started (any token), or None: a job whose
    supervisor was killed still runs on its checkpoint root (checkpoints/claim.py)."""
    found = _started_from(run_dir, None, _ancestry())
    return min(found, key=_started).pid if found else None


def _children(p: psutil.Process) -> list[psutil.Process]:
    try:
        return p.children(recursive=True)
    except psutil.Error:
        return []


def _started(p: psutil.Process) -> float:
    try:
        return p.create_time()
    except psutil.Error:
        return 0.0


def stop_processes(found: Sequence[psutil.Process], timeout: float) -> list[int]:
    """Gracefully stop processes we did not start: SIGTERM the roots, wait, then SIGKILL all that is left.

    The roots (those whose parent is not among `found`: the torchrun agent, a detached grandchild) get
    SIGTERM, so torchrun forwards it once to its workers and they save, as on a normal stop; after `timeout`
    every process, its descendants and its process group are killed. psutil refuses to signal a pid that
    now belongs to another process (its start time differs), so nothing unrelated is hit.
    """
    pids = {p.pid for p in found}
    roots = []
    for p in found:
        try:
            if p.ppid() not in pids:
                roots.append(p)
        except psutil.Error:
            continue
    for p in roots:
        with contextlib.suppress(psutil.Error):
            p.terminate()
            p.resume()  # a stopped job (kill -STOP, a debugger) acts on SIGTERM only once continued
    psutil.wait_procs(roots, timeout=timeout)
    tree = {p.pid: p for p in found}
    for p in found:
        for child in _children(p):
            tree.setdefault(child.pid, child)
    own_group = os.getpgrp()
    for p in tree.values():
        with contextlib.suppress(psutil.Error):
            p.kill()
    for p in roots:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(p.pid) == p.pid != own_group:
                os.killpg(p.pid, signal.SIGKILL)
    psutil.wait_procs(list(tree.values()), timeout=5)
    return [p.pid for p in found]
