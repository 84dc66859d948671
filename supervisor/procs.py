"""Process plumbing: subreaper, spawning a job in its own session, reaping, and making sure nothing survives.

Only the real `System` (supervisor/system.py) calls these; the core never touches processes directly.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import psutil

from supervisor.spares import is_spare_cmdline

__all__ = [
    "set_child_subreaper",
    "spawn",
    "descendants",
    "kill_descendants",
    "signal_children",
    "find_job",
    "stop_orphan",
    "reap_any",
]

_PR_SET_CHILD_SUBREAPER = 36


def set_child_subreaper() -> bool:
    """Adopt orphaned descendants (Linux prctl) so nothing the job forks can escape our reaping."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def spawn(argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start the job in a new session (its own process group), stdout+stderr appended to `log_path`.

    No shell: argv is passed as a list. The log file is inherited by the job, so its output survives a
    supervisor that is killed, and the job never dies of a broken pipe.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab", buffering=0) as log:
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
    out = []
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


def kill_descendants(sig: int = signal.SIGKILL, exclude: Collection[int] = ()) -> list[tuple[int, str]]:
    """Signal every live descendant but `exclude` (the idle prewarm spare); returns (pid, name) signalled."""
    hit = []
    for p in descendants(exclude):
        try:
            name = p.name()
            p.send_signal(sig)
            hit.append((p.pid, name))
        except psutil.Error:
            continue
    return hit


def signal_children(pid: int, sig: int) -> list[int]:
    """Send `sig` to the direct children of `pid` (torchrun's workers), not to the agent itself."""
    try:
        kids = psutil.Process(pid).children()
    except psutil.Error:
        return []
    sent = []
    for k in kids:
        try:
            k.send_signal(sig)
            sent.append(k.pid)
        except psutil.Error:
            continue
    return sent


def find_job(pid: int | None, create_time: float | None, cmdline: Sequence[str] | None) -> psutil.Process | None:
    """The live process that is exactly the recorded job (same pid, start time and argv), else None."""
    if not pid or create_time is None:
        return None
    try:
        p = psutil.Process(pid)
        if abs(p.create_time() - create_time) > 0.05:
            return None
        # A prewarmed job keeps its spare's argv (trainer/spare.py); the start time already pins it.
        if cmdline is not None and p.cmdline() != list(cmdline) and not is_spare_cmdline(p.cmdline()):
            return None
        return p
    except psutil.Error:
        return None


def stop_orphan(proc: psutil.Process, timeout: float) -> list[int]:
    """Gracefully stop a job we did not start (SIGTERM, wait, then SIGKILL its group and tree)."""
    try:
        tree = [proc, *proc.children(recursive=True)]
        pgid = os.getpgid(proc.pid)
    except (psutil.Error, ProcessLookupError):
        return []
    try:
        proc.terminate()
    except psutil.Error:
        pass
    _, alive = psutil.wait_procs([proc], timeout=timeout)
    for p in [*alive, *tree]:
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    psutil.wait_procs(tree, timeout=5)
    return [p.pid for p in tree]
