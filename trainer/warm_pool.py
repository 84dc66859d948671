"""The spare agent's warm workers: start them, and let torchrun's own launch hand each rank to one (job side).

Loaded by path by trainer/spare.py (the job's interpreter need not have this package installed). While the spare
waits, `WarmPool.start` launches one warm worker (trainer/warm.py) per local rank that torchrun's arguments
promise. At the hand-off the spare becomes torchrun and `install` hooks the one call where torchrun starts a
worker binary: `SubprocessHandler._popen(args, env)`, after torchrun has computed the rank's argv and
environment and opened its output files. For a rank whose command is exactly what a warm worker was prepared
for (the same interpreter, `-u`, the same `-m module` or script, the same directory, and the same environment
but for torchrun's per-rank variables), the hook sends that argv, environment and the rank's stdin/stdout/stderr
to a ready worker and returns the worker's own `Popen`; for any other rank it calls torchrun's original. So a
wrapper (`numactl` from `--numa-binding`), `--no-python`, `--run-path`, `PYTHON_EXEC` or a changed environment
all start cold, rank by rank. Only the first round of workers is warm: the hook releases what it did not use
once torchrun has started them (an in-agent restart, `--max-restarts`, starts cold).
"""
from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["WorkerPlan", "WarmPool", "plan_workers", "stable_env", "PER_RANK_ENV", "WARM_SCRIPT"]

WARM_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm.py")
# What torchrun's LocalElasticAgent sets for each worker (besides TORCHELASTIC_*): read by torch.distributed and
# the job after the hand-off, never by `import torch`. CUDA_VISIBLE_DEVICES is not here on purpose: a worker
# whose value differs (torchrun's --virtual-local-rank) starts cold.
PER_RANK_ENV = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
})
_PER_RANK_PREFIX = "TORCHELASTIC_"
_READY, _UNUSABLE = b"ready", b"unusable"  # trainer/warm.py's two answers


def stable_env(env: Mapping[str, str], volatile: Collection[str]) -> dict[str, str]:
    """`env` without torchrun's per-rank variables and the supervisor's per-attempt ones: what must match exactly."""
    return {k: v for k, v in env.items()
            if k not in PER_RANK_ENV and k not in volatile and not k.startswith(_PER_RANK_PREFIX)}


@dataclass(frozen=True)
class WorkerPlan:
    """What torchrun will start for each local rank, predicted from its arguments (checked again at hand-off)."""

    interpreter: str  # argv[0] of every worker: PYTHON_EXEC or the agent's own interpreter
    prefix: tuple[str, ...]  # ("-u", "-m", module) or ("-u", script): the argv that must follow it
    path0: str  # the rank's sys.path[0]: the directory for -m, the script's (symlinks resolved) for a script
    count: int  # nproc-per-node
    env: dict[str, str]  # the agent's environment once torchrun set it up (OMP_NUM_THREADS)


def plan_workers(torchrun_args: Sequence[str], *, env: Mapping[str, str], cwd: str) -> WorkerPlan | str:
    """The warm workers for a launch of `torchrun torchrun_args`, or why there can be none.

    Uses torchrun's own parser, as its `config_from_args` does, without that function's side effects (it creates
    a log directory and sets OMP_NUM_THREADS in the agent).
    """
    from torch.distributed import run as torchrun

    try:
        args = torchrun.parse_args(list(torchrun_args))
        count = torchrun.determine_local_world_size(args.nproc_per_node)
    except (SystemExit, Exception) as exc:  # noqa: BLE001 - torchrun itself will say what is wrong, cold
        return f"torchrun's arguments do not parse here: {exc}"
    if args.run_path or args.no_python:
        return "--run-path and --no-python do not start `python -u` workers"
    script = args.training_script
    prefix: tuple[str, ...]
    if args.module:
        prefix, path0 = ("-u", "-m", script), cwd
    else:
        path = os.path.join(cwd, script)
        if not (script.endswith(".py") and os.path.isfile(path)):
            return f"{script}: only a plain .py script or a -m module is run warm"
        prefix, path0 = ("-u", script), os.path.dirname(os.path.realpath(path))
    agent_env = dict(env)
    if "OMP_NUM_THREADS" not in agent_env and count > 1:  # torchrun's own default, set in its agent
        agent_env["OMP_NUM_THREADS"] = "1"
    return WorkerPlan(agent_env.get("PYTHON_EXEC", sys.executable), prefix, path0, count, agent_env)


def _start_ticks(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (/proc/PID/stat field 22, as supervisor/host/boot reads it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class _Worker:
    proc: subprocess.Popen[bytes]
    sock: socket.socket
    state: str = "importing"  # -> ready | unusable | used | gone
    detail: str = ""


@dataclass
class WarmPool:
    """The spare's warm workers, from their start until torchrun's first round of workers took what it could."""

    plan: WorkerPlan
    cwd: str
    modules: list[str]
    volatile: frozenset[str]
    say: Callable[[str], None]  # one `key=value` line on the agent's stderr (prewarm.log, later the attempt log)
    workers: list[_Worker] = field(default_factory=list)
    started: float = 0.0
    released: bool = False
    handoff: str | None = None  # the supervisor's side file for hand-offs (`install`), never the job's output

    def start(self) -> None:
        """Launch one warm worker per local rank (from the main thread: their parent-death signal follows it)."""
        self.started = time.monotonic()
        for _ in range(self.plan.count):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                proc = subprocess.Popen(
                    [self.plan.interpreter, "-u", WARM_SCRIPT, str(theirs.fileno()), str(os.getpid()),
                     self.plan.path0, json.dumps(self.modules)],
                    cwd=self.cwd, env=self.plan.env, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                    start_new_session=True)  # like torchrun's workers; stdout/stderr: ours (prewarm.log)
            except OSError as exc:
                self.say(f"event=warm_worker_unavailable error={json.dumps(str(exc))}")
                ours.close()
                return
            finally:
                theirs.close()
            self.workers.append(_Worker(proc, ours))

    def sockets(self) -> list[socket.socket]:
        return [w.sock for w in self.workers if w.state == "importing"]

    def collect(self, timeout: float = 0.0) -> None:
        """Read the answers of workers that finished importing (without blocking past `timeout`)."""
        waiting = self.sockets()
        if not waiting:
            return
        readable, _, _ = select.select(waiting, [], [], timeout)
        for w in self.workers:
            if w.sock in readable:
                self._answer(w)
        if not self.sockets() and self.workers:
            ready = sum(w.state == "ready" for w in self.workers)
            self.say(f"event=warm_workers_ready pid={os.getpid()} workers={ready} of={len(self.workers)} "
                     f"seconds={time.monotonic() - self.started:.3f}")

    def _answer(self, w: _Worker) -> None:
        try:
            msg = w.sock.recv(4096)
        except OSError:
            msg = b""
        if msg.startswith(_READY):
            w.state = "ready"
            return
        w.state, w.detail = "unusable", msg[len(_UNUSABLE):].strip().decode(errors="replace") or "exited"
        self.say(f"event=warm_worker_unusable pid={w.proc.pid} reason={json.dumps(w.detail)}")
        self._end(w)

    def take(self, args: Sequence[str], env: Mapping[str, str],
             streams: tuple[int, int, int]) -> subprocess.Popen[bytes] | None:
        """A ready warm worker now running `args` with `env` and `streams`, or None (start this rank cold)."""
        if self.released or not self._matches(args, env):
            return None
        self.collect()
        w = next((w for w in self.workers if w.state == "ready"), None)
        if w is None:
            return None
        spec = json.dumps({"argv0": args[0], "argv": list(args[1:]), "env": dict(env), "cwd": os.getcwd()}).encode()
        self._record(w.proc.pid, env.get("RANK", ""))  # before the worker can run any of the job's code
        try:
            socket.send_fds(w.sock, [spec], list(streams))
        except OSError as exc:
            self.say(f"event=warm_handoff_failed pid={w.proc.pid} error={json.dumps(str(exc))}")
            self._end(w)
            return None
        w.state = "used"
        w.sock.close()
        self.say(f"event=warm_handoff pid={w.proc.pid} local_rank={env.get('LOCAL_RANK')} rank={env.get('RANK')}")
        return w.proc

    def _record(self, pid: int, rank: str) -> None:
        """Tell the supervisor which pid runs `rank` (its environment shows none): a line in the side file it named,
        with the worker's start time, so that neither a line the job prints nor a reused pid can name a rank."""
        if self.handoff is None or not rank.isdecimal():
            return
        line = json.dumps({"pid": pid, "start": _start_ticks(pid), "rank": int(rank)}).encode() + b"\n"
        try:
            fd = os.open(self.handoff, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         0o600)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except OSError as exc:
            self.say(f"event=warm_handoff_unrecorded pid={pid} error={json.dumps(str(exc))}")

    def _matches(self, args: Sequence[str], env: Mapping[str, str]) -> bool:
        p = self.plan
        return (len(args) >= 1 + len(p.prefix) and args[0] == p.interpreter
                and tuple(args[1:1 + len(p.prefix)]) == p.prefix
                and os.path.realpath(os.getcwd()) == os.path.realpath(self.cwd)
                and stable_env(env, self.volatile) == stable_env(p.env, self.volatile))

    def release(self) -> None:
        """torchrun started its workers: the warm ones it did not take go (their memory is the job's now)."""
        self.released = True
        for w in self.workers:
            if w.state != "used":
                self._end(w)

    def _end(self, w: _Worker) -> None:
        if w.state != "unusable":
            w.state = "gone"
        try:
            w.sock.close()
            w.proc.kill()
            w.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass

    def install(self, handoff: str | None = None) -> str | None:
        """Hook torchrun's worker start (this process is about to become the agent); why not, or None.

        `handoff`: the file where each hand-off is recorded for the supervisor (`_record`)."""
        self.handoff = handoff
        try:
            from torch.distributed.elastic.multiprocessing import api
            from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler as sh
        except ImportError as exc:
            return f"torchrun's worker start is not where this torch keeps it: {exc}"
        handler: Any = sh.SubprocessHandler  # Any: we replace two of torch's methods, which mypy rightly dislikes
        context: Any = api.SubprocessContext
        if not (callable(getattr(handler, "_popen", None)) and callable(getattr(context, "_start", None))):
            return "torchrun's SubprocessHandler._popen / SubprocessContext._start are gone in this torch"
        original_popen, original_start = handler._popen, context._start
        pool = self

        def _popen(self: Any, args: tuple[str, ...], env: dict[str, str]) -> Any:
            out, err = getattr(self, "_stdout", None), getattr(self, "_stderr", None)
            streams = (0, out.fileno() if out else 1, err.fileno() if err else 2)
            warm = pool.take(args, env, streams)
            return warm if warm is not None else original_popen(self, args, env)

        def _start(self: Any) -> None:
            try:
                original_start(self)
            finally:
                pool.release()

        handler._popen = _popen
        context._start = _start
        return None
