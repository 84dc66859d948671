"""The spare torchrun agent: a process that has already imported torch and waits to become the next job.

A supervisor relaunch would otherwise pay a fresh interpreter start plus `import torch` (2-3 s here) that
torchrun's in-agent restart does not. The supervisor (supervisor/host/spares.py) starts this file with the
job's own interpreter, in a session of its own and with the job's environment; it imports
`torch.distributed.run` and then blocks reading its stdin. To launch, the supervisor writes one JSON object
(`script`, `args`, `env`, `cwd`, `argv`, `log_path`, `handoff`) and closes the pipe; the spare then takes the job's
environment, directory and output and calls torchrun's `main` in-process, so from here on it *is* the
torchrun agent: same pid semantics (it leads its own session), same exit codes, same signal handling.
If a file it runs from changed since it loaded it (the interpreter, a module's file, a mapped library: `pip install
-U torch`), it execs the job's cold `argv` instead (`event=warm_workers_stale`, with the first such file); each warm
worker checks itself the same way, and its script's directory, at its own hand-off.

Two things differ on purpose:
- A spare started next to a running job waits with its import until that job trains (its heartbeat
  says `train`), or 60 s, or a hand-off arrives, and then imports at idle priority (nice 19, on a helper
  thread): it must not slow the start or the restart it is meant to speed up.
- When torchrun returns, the spare runs the interpreter's exit steps that have effects (non-daemon
  threads, atexit handlers, flushing stdio) and then `os._exit`s with the status Python would have used:
  an interpreter that imported torch otherwise spends about a second tearing itself down before its
  parent learns that the job failed.

Until the hand-off it dies with the supervisor (PR_SET_PDEATHSIG; EOF on stdin means "not needed"). At the
hand-off it takes torchrun's name, so that `ps` and `pgrep -f torchrun` show the job where people look for it: its
command line becomes `torchrun ARGS...` (written over its own argv in memory, as setproctitle does, cut to the
length of the spare's own command line). Its comm becomes torch's `pt_elastic` as a cold agent's does.

With warm workers on (the supervisor's OPTIONS argument, `[job] prewarm_workers`), the spare also starts one
warm worker per local rank once its own import is done (trainer/warm_pool.py, trainer/warm.py), and hands
torchrun's first round of ranks to them.

Run as a plain file (`python .../trainer/spare.py PARENT_PID OPTIONS`), standard library only until the
import it exists for: the job's interpreter need not have this package installed. The supervisor itself
never imports this module.
"""
from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

__all__ = ["main", "run_then_exit"]

_IMPORT_AFTER_S = 60.0


def _sibling(name: str) -> Any:
    """Load `trainer/<name>.py` by path (this file runs by path; its directory is never put on sys.path)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_fsdp_supervisor_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


_WARM = _sibling("warm")
_pdeathsig = _WARM.pdeathsig  # not Linux: the EOF on stdin still ends an unneeded spare
_set_title = _WARM.set_title


def _wait_for_training(timeout: float) -> None:
    """Hold the import back until the job started with us trains, a hand-off arrives, or `timeout` passes.

    "Trains" is the job's heartbeat saying phase `train` (its workers are past their own imports and the
    checkpoint load, which a concurrent import would slow down, even at nice 19: measured +1.5 s on a
    restart here). A job without a heartbeat, or an interpreter without this package (so without the
    contract's reader), just waits out `timeout`.
    """
    beat: str | None
    try:  # stdlib only: cheap
        from supervisor.contract import ENV_HEARTBEAT, parse_heartbeat
        from supervisor.host.regularfile import open_regular  # a FIFO under the heartbeat's name must not block us
    except ImportError:
        beat = None  # no reader for it: the names above stay unbound and unused
    else:
        beat = os.environ.get(ENV_HEARTBEAT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([sys.stdin], [], [], 0.25)[0]:
            return
        if not beat:
            continue
        try:
            with open(open_regular(beat), "rb") as fh:
                parsed = parse_heartbeat(fh.read(1 << 16))[0]
        except OSError:
            continue
        if parsed is not None and parsed.phase == "train":
            return


def _import_torchrun_at_idle_priority() -> Any:
    """`import torch.distributed.run` on a helper thread at nice 19, so it only takes CPU the job leaves idle.

    Niceness is per thread on Linux: the main thread, which later runs torchrun and forks the workers,
    keeps its own. If the job fails before the import is done, its workers are gone and the CPU is free,
    so the import finishes at full speed then.
    """
    box: dict[str, Any] = {}

    def work() -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            import torch.distributed.run

            box["module"] = torch.distributed.run
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
            box["error"] = exc

    thread = threading.Thread(target=work, name="prewarm-import")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["module"]


def _take_over(spec: dict[str, Any], module_file: str) -> None:
    """Become the job: its directory, environment and output; no tie to the supervisor's life any more."""
    os.chdir(spec["cwd"])
    os.environ.clear()
    os.environ.update(spec["env"])
    out = os.open(spec["log_path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), (out, 1), (out, 2)):
        os.dup2(fd, target)
    os.close(out)
    os.close(null)
    # Like a cold start, the job outlives a killed supervisor; the next supervisor stops it as an orphan.
    _pdeathsig(0)
    # What a cold start would see: `torchrun` (a console script) or `python -m torch.distributed.run`.
    script = spec["script"]
    sys.argv = [script or module_file, *spec["args"]]
    sys.path.insert(0, os.path.dirname(script) if script else os.getcwd())
    _set_title(" ".join(["torchrun", *spec["args"]]))


def _exit_status(exc: SystemExit) -> int:
    """The process status CPython gives an uncaught SystemExit."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def run_then_exit(fn: Callable[[], object]) -> NoReturn:
    """Run `fn` as a script's body; exit with CPython's status, minus the slow interpreter teardown."""
    interrupted = False
    try:
        fn()
        status = 0  # the console script does `sys.exit(main())` and torchrun's main returns None
    except SystemExit as exc:
        status = _exit_status(exc)
    except KeyboardInterrupt:
        traceback.print_exc()
        status, interrupted = 1, True
    except BaseException:  # noqa: BLE001 - an uncaught exception: traceback on stderr, status 1
        sys.excepthook(*sys.exc_info())
        status = 1
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_Finalize does first: join non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    if interrupted:  # CPython re-raises an uncaught SIGINT so the parent sees "killed by SIGINT"
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _warm_pool(options: dict[str, Any]) -> Any:
    """Start the warm workers `options` ask for (trainer/warm_pool.py); the pool, or None."""
    if not options.get("workers"):
        return None
    pools = _sibling("warm_pool")
    plan = pools.plan_workers(options.get("args", []), env=os.environ, cwd=os.getcwd())
    if isinstance(plan, str):
        _say(f"event=warm_workers_off pid={os.getpid()} reason={json.dumps(plan)}")
        return None
    pool = pools.WarmPool(plan, os.getcwd(), list(options.get("modules", [])), frozenset(options.get("volatile", [])),
                          _say)
    pool.start()
    return pool


def _wait_for_handoff(pool: Any) -> None:
    """Block until the supervisor writes the launch (or closes the pipe); meanwhile note which workers are ready."""
    while True:
        waiting = pool.sockets() if pool is not None else []
        readable, _, _ = select.select([sys.stdin, *waiting], [], [])
        if sys.stdin in readable:
            return
        pool.collect()


def main() -> int:
    parent = int(sys.argv[1])
    options: dict[str, Any] = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    _pdeathsig(signal.SIGKILL)
    if os.getppid() != parent:  # the supervisor died before the line above took effect
        return 0
    del sys.path[0]  # this file's directory holds trainer modules (log.py, loop.py, ...): never shadow anything with them
    _wait_for_training(_IMPORT_AFTER_S)
    started = time.monotonic()
    try:
        torchrun = _import_torchrun_at_idle_priority()
    except Exception:  # noqa: BLE001 - a broken install: fail as the job would, in its own log
        return _fail_as_the_job(traceback.format_exc())
    _say(f"event=prewarm_ready pid={os.getpid()} import_s={time.monotonic() - started:.3f}")
    # A spare handed its launch at once (the first attempt) gets no warm workers: too late to help, and they
    # would compete with the job's own start. It also imported just now what a cold start would: nothing to check.
    waited = not select.select([sys.stdin], [], [], 0)[0]
    pool = _warm_pool(options) if waited else None
    loaded = _WARM.loaded_files() if waited else []
    _wait_for_handoff(pool)
    data = sys.stdin.buffer.read()
    if not data:
        return 0
    spec = json.loads(data)
    stale = _WARM.first_change(loaded)
    _take_over(spec, torchrun.__file__)
    if stale is not None:  # a file we run from changed since we loaded it (pip install, an edit): start cold instead
        if pool is not None:
            pool.release()
        _say(f"event=warm_workers_stale pid={os.getpid()} file={json.dumps(stale)}")
        _WARM.go_cold(spec["argv"], spec["env"])
    if pool is not None:
        problem = pool.install(spec.get("handoff"))
        if problem is not None:
            _say(f"event=warm_workers_off pid={os.getpid()} reason={json.dumps(problem)}")
            pool.release()
    run_then_exit(torchrun.main)


def _fail_as_the_job(failure: str) -> int:
    """The import failed: become the job anyway and fail as a cold start would, its traceback in the job's log.

    Otherwise every prewarmed attempt ends with exit 1 and an empty attempt log, and the cause (say, a CUDA
    library torch cannot load) sits only in prewarm.log, where `job_exited` and `logs --job` never look.
    """
    sys.stderr.write(failure)  # prewarm.log: also when no hand-off comes
    sys.stderr.flush()
    data = sys.stdin.buffer.read()
    if not data:
        return 1
    _take_over(json.loads(data), "torch/distributed/run.py")  # never runs: only the job's output is wanted
    sys.stderr.write(failure)
    sys.stderr.flush()
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
