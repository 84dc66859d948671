"""Keep one spare torchrun agent warm and hand the next launch to it (the supervisor side; torch-free).

Why and how: docs/design.md, 'Warm workers' (`[job] prewarm`, `prewarm_workers`). Anything we cannot reproduce
exactly (another interpreter, a changed environment, a wrapper script) takes the ordinary cold path. The warm
workers are the spare's children: they count as the spare here (`spare_pids`).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from supervisor.contract import ENV_ATTEMPT, ENV_ERROR_FILE, ENV_SKIP_STEPS
from supervisor.host import joblog
from supervisor.host.boot import start_ticks
from supervisor.host.log import Log
from supervisor.host.regularfile import open_regular

__all__ = ["Plan", "Prewarmer", "plan", "is_spare_cmdline", "handed_ranks", "SPARE_SCRIPT", "PREWARM_LOG", "VOLATILE_ENV",
           "HANDOFF_NOTE"]

# Job-side code (it becomes the torchrun agent, torch and all), so it lives with the trainer; the supervisor
# only runs it by path and never imports it (find_spec imports the `trainer` package, which imports nothing).
_SPARE_SPEC = importlib.util.find_spec("trainer.spare")
if _SPARE_SPEC is None or _SPARE_SPEC.origin is None:  # the two packages ship together: a broken install
    raise ImportError("trainer.spare is not installed beside supervisor")
SPARE_SCRIPT = Path(_SPARE_SPEC.origin)
PREWARM_LOG = "prewarm.log"  # the spares' own output before they become a job (import errors, readiness)
# Set per attempt by the core and read by torchrun only at run time, so a spare started with the previous
# attempt's values is still exactly the next job once the hand-off replaces its environment.
VOLATILE_ENV = frozenset({ENV_ATTEMPT, ENV_ERROR_FILE, ENV_SKIP_STEPS})  # the skip: a rollback is warm too
_MODULE = "torch.distributed.run"
_CONSOLE_MARK = b"from torch.distributed.run import main"
_HANDOFF_MAX = 1 << 16  # bytes of a side file read: an agent writes one short line per local rank
HANDOFF_NOTE = "a torchrun agent started ahead, torch already imported, runs this attempt (ps: torchrun ...)"
_MAX_SPEC_BYTES = 60_000  # stays below a pipe's buffer: the hand-off never blocks the event loop


@dataclass(frozen=True)
class Plan:
    """How a cold start of this command would run torchrun, so the spare can do the very same."""

    interpreter: str  # argv[0] of the spare: the job's python, found the way exec would find it
    script: str | None  # the `torchrun` console script, or None for `python -m torch.distributed.run`
    args: tuple[str, ...]  # torchrun's own arguments


def _which(prog: str, cwd: Path, env: Mapping[str, str]) -> str | None:
    if os.sep in prog:
        path = Path(prog) if os.path.isabs(prog) else cwd / prog
        return str(path) if os.access(path, os.X_OK) else None
    return shutil.which(prog, path=env.get("PATH", os.defpath))


def _console_interpreter(script: str) -> str | None:
    """The interpreter of a pip-generated `torchrun` script (`#!/abs/python`, no arguments), else None."""
    try:
        with open(script, "rb") as fh:
            head = fh.read(4096)
    except OSError:
        return None
    first = head.split(b"\n", 1)[0]
    if not first.startswith(b"#!") or _CONSOLE_MARK not in head:
        return None
    interp = first[2:].strip().decode(errors="replace")
    if not os.path.isabs(interp) or " " in interp or not os.access(interp, os.X_OK):
        return None
    return interp


def plan(argv: Sequence[str], *, cwd: Path, env: Mapping[str, str]) -> Plan | None:
    """The prewarm plan for `argv`, or None when it is not a torchrun launch we can reproduce exactly."""
    if not argv:
        return None
    name = os.path.basename(argv[0])
    if name == "torchrun":
        script = _which(argv[0], cwd, env)
        interp = _console_interpreter(script) if script else None
        return Plan(interp, script, tuple(argv[1:])) if interp and script else None
    if name.startswith("python") and list(argv[1:3]) == ["-m", _MODULE]:
        # Spawned by the same name with the same PATH, the spare gets the same sys.executable.
        return Plan(argv[0], None, tuple(argv[3:])) if _which(argv[0], cwd, env) else None
    return None


def is_spare_cmdline(cmdline: Sequence[str]) -> bool:
    """Whether a process's argv is one of our idle spares (one running a job shows as `torchrun ARGS...`)."""
    return len(cmdline) >= 3 and cmdline[1] == str(SPARE_SCRIPT)


def _identity(p: Plan, cwd: Path, env: Mapping[str, str]) -> tuple[object, ...]:
    stable = tuple(sorted((k, v) for k, v in env.items() if k not in VOLATILE_ENV))
    return p.interpreter, p.script, str(cwd), stable


@dataclass
class _Spare:
    proc: subprocess.Popen[bytes]
    identity: tuple[object, ...]
    started: float


def handed_ranks(job_log: Path, launched: float = float("inf")) -> dict[int, int]:
    """pid -> rank of the warm workers an agent handed its ranks to, from its side file `attempt-NNNN.handoff` (never
    from the job's output, which the job fills as it likes): one JSON line per rank, `{"pid", "start", "rank"}`,
    counted only while that pid still has the start time (clock ticks since boot) the agent wrote beside it, and that
    time is before `launched` (a warm worker waited for the launch; a rank started cold, by torchrun, came after).

    A warm rank took its environment over in-process: /proc/PID/environ still shows the one it was started with,
    without torchrun's RANK, so the job's workers are named by this file instead. The first line for a pid, and for a
    rank, wins: the agent writes each before that worker runs any of the job's code, which may append to the file."""
    try:
        with open(open_regular(job_log.with_suffix(joblog.HANDOFF_SUFFIX), follow_symlinks=False, mine=True), "rb") as f:
            lines = f.read(_HANDOFF_MAX).splitlines()
    except OSError:
        return {}
    out: dict[int, int] = {}
    for line in lines:
        try:
            rec = json.loads(line)
            pid, start, rank = rec["pid"], rec["start"], rec["rank"]
        except (ValueError, KeyError, TypeError, RecursionError):  # a cut line, an int past Python's digit limit
            continue
        if (all(type(v) is int and 0 <= v < 1 << 62 for v in (pid, start, rank)) and pid not in out
                and rank not in out.values() and start < launched and start_ticks(pid) == start):
            out[pid] = rank
    return out


class Prewarmer:
    """Owns at most one idle spare (and its warm workers); `RealSystem` asks it first on every launch."""

    def __init__(self, log: Log, *, workers: bool = False, modules: Sequence[str] = ()) -> None:
        self.log = log  # the daemon's structlog logger (host/ knows nothing of how logs are rendered)
        self.workers, self.modules = workers, list(modules)
        self._spare: _Spare | None = None

    def launch(self, argv: Sequence[str], *, cwd: Path, env: Mapping[str, str],
               log_path: Path) -> subprocess.Popen[bytes] | None:
        """Hand this launch to a spare (the idle one, else a fresh one); its Popen, or None to launch cold.

        A fresh spare starts as fast as a cold torchrun (same interpreter, same import) and, like every
        spare, exits without the interpreter's slow teardown, so the next failure is seen sooner.
        """
        spare, self._spare = self._spare, None
        p = plan(argv, cwd=cwd, env=env)
        if p is None:
            if spare is not None:
                self._discard(spare, "the command no longer runs torchrun")
            return None
        if spare is not None and (spare.identity != _identity(p, cwd, env) or spare.proc.poll() is not None):
            self._discard(spare, "command, directory or environment changed, or the spare exited")
            spare = None
        spare = spare or self._start(p, cwd=cwd, env=env, log_dir=log_path.parent)
        if spare is None:
            return None
        spec = json.dumps({"script": p.script, "args": list(p.args), "env": dict(env), "cwd": str(cwd), "argv": list(argv),
                           "log_path": str(log_path), "handoff": str(log_path.with_suffix(joblog.HANDOFF_SUFFIX))}).encode()
        if len(spec) > _MAX_SPEC_BYTES:
            self._discard(spare, "environment too large for the hand-off pipe")
            return None
        log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            assert spare.proc.stdin is not None
            fd = spare.proc.stdin.fileno()
            os.set_blocking(fd, False)
            if os.write(fd, spec) != len(spec):
                raise BlockingIOError("short write")
            spare.proc.stdin.close()
        except OSError as exc:
            self._discard(spare, f"hand-off failed: {exc}")
            return None
        self.log.info("prewarm_handoff", pid=spare.proc.pid, spare_age_s=round(time.monotonic() - spare.started, 3),
                      note=HANDOFF_NOTE)
        return spare.proc

    def refill(self, argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], log_dir: Path) -> None:
        """Start a spare for the next launch of `argv`; a no-op unless it runs torchrun."""
        if self._spare is not None:
            return
        p = plan(argv, cwd=cwd, env=env)
        if p is not None:
            self._spare = self._start(p, cwd=cwd, env=env, log_dir=log_dir)

    def _start(self, p: Plan, *, cwd: Path, env: Mapping[str, str], log_dir: Path) -> _Spare | None:
        log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            with open(joblog.open_log(log_dir / PREWARM_LOG), "ab", buffering=0) as out:
                proc = subprocess.Popen(
                    [p.interpreter, str(SPARE_SCRIPT), str(os.getpid()), self._options(p)], cwd=cwd, env=dict(env),
                    stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True, close_fds=True,  # its own session, like a cold job
                )
        except OSError as exc:
            self.log.warning("prewarm_unavailable", error=str(exc))
            return None
        return _Spare(proc, _identity(p, cwd, env), time.monotonic())

    def _options(self, p: Plan) -> str:
        """What the spare needs to start its warm workers: torchrun's arguments predict them (trainer/warm_pool.py)."""
        return json.dumps({"workers": self.workers, "modules": self.modules, "volatile": sorted(VOLATILE_ENV),
                           "args": list(p.args)})

    def spare_pids(self) -> set[int]:
        """The idle spare and its warm workers (if any): never survivors to sweep after an attempt."""
        if self._spare is None:
            return set()
        pid = self._spare.proc.pid
        try:
            return {pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))}
        except psutil.Error:
            return {pid}

    def forget(self, pid: int, returncode: int) -> None:
        """The event loop reaped `pid`; if it was the idle spare, the next launch goes cold."""
        if self._spare is not None and self._spare.proc.pid == pid:
            self.log.warning("prewarm_spare_exited", pid=pid, code=returncode, log=PREWARM_LOG)
            self._spare.proc.returncode = returncode  # reaped already: Popen must never wait on it again
            self._spare = None

    def close(self) -> None:
        """Kill and reap the idle spare (the supervisor is exiting)."""
        spare, self._spare = self._spare, None
        if spare is not None:
            _kill(spare.proc)

    def _discard(self, spare: _Spare, reason: str) -> None:
        self.log.info("prewarm_discarded", pid=spare.proc.pid, reason=reason)
        _kill(spare.proc)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill a spare and its warm workers (they would follow it by their parent-death signal; this is sooner)."""
    try:
        workers = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        workers = []
    for w in workers:
        with contextlib.suppress(psutil.Error):
            w.kill()
    try:
        proc.kill()
        proc.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        pass
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
