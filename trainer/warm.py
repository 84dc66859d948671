"""A warm worker: an interpreter that has imported torch (and the job's listed modules) and waits to become a rank.

A cold rank pays a fresh interpreter, `import torch` and the job's heavy imports (about 2-3 s here, two ranks on
two cores) before its process group exists. The spare torchrun agent (trainer/spare.py, through
trainer/warm_pool.py) starts one of these per local rank while the running job trains, with the environment a
cold rank would get minus torchrun's per-rank variables, in the job's directory, as `python -u warm.py ...`
(`-u` is what torchrun gives every worker). It imports and then waits on a socket. At the hand-off the agent
sends the rank's exact argv, environment and directory, and its stdin/stdout/stderr as file descriptors; the
worker takes them over and runs the module (`runpy`, as `python -m` does) or the script (as `python script.py`
does) in a fresh `__main__`. The agent gets the very `Popen` it started, so torchrun watches, signals and reaps
a real child of its own, in a session of its own, like every worker it starts. If what it loaded changed on disk
since (`loaded_files`), or the script now resolves to another directory, it execs the rank's cold command instead.

What makes this safe on a GPU node: nothing before the hand-off touches an accelerator. `import torch` does not
initialise CUDA; after the listed imports the worker checks `torch.cuda.is_initialized()` and
`torch.distributed.is_initialized()` and declines (the rank then starts cold) if either is true, so
`CUDA_VISIBLE_DEVICES`, `LOCAL_RANK` and the NCCL settings are read by the rank itself, after it took its
environment over. A library thread pool created at import (OpenBLAS's, sized by `OMP_NUM_THREADS`) is created
with exactly the environment a cold rank would have: any difference but torchrun's per-rank variables sends the
rank down the cold path (warm_pool.stable_env). The import runs on the main thread at the worker's own
priority, so no thread it creates inherits another.

Standard library only until the import it exists for, and run by path: the supervisor never imports it.
"""
from __future__ import annotations

import builtins
import contextlib
import ctypes
import importlib
import json
import os
import runpy
import signal
import socket
import stat
import sys
import time
import types
from typing import Any, NoReturn

__all__ = ["main", "pdeathsig", "set_title", "loaded_files", "first_change", "shadowed", "go_cold", "READY", "UNUSABLE",
           "MAX_SPEC_BYTES"]

_PR_SET_PDEATHSIG = 1
READY = b"ready"
UNUSABLE = b"unusable"
MAX_SPEC_BYTES = 1 << 20  # argv and environment of one rank; a SOCK_SEQPACKET message holds them whole


def pdeathsig(sig: int) -> None:
    """Ask the kernel to send `sig` when the thread that started us ends (0: never)."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: EOF on the socket still ends an unneeded worker
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def set_title(title: str) -> None:
    """Show as `title` in ps (/proc/self/cmdline); anything that fails leaves the old one (it is cosmetic)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: stat's fields 48 and 49
    except (OSError, ValueError, IndexError):
        return
    # The title, a NUL, and padding that is not NUL: the kernel then shows the argv area up to that first NUL
    # (setproctitle's convention), with no trailing empty arguments. Python keeps its own copy of argv.
    room = end - start
    if room < 2:
        return
    text = title.encode("utf-8", "replace")[:room - 2] + b"\0"
    ctypes.memmove(start, text + b" " * (room - len(text)), room)


Stamp = tuple[str, int, int, int]  # path, size, mtime_ns, inode
_OURS = ("__main__", "_fsdp_supervisor_")  # warm.py as a script, and what spare.py loads by path


def _stamp(path: str) -> Stamp | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (path, st.st_size, st.st_mtime_ns, st.st_ino) if stat.S_ISREG(st.st_mode) else None


def loaded_files() -> list[Stamp]:
    """What this interpreter runs from disk: itself, the files its modules came from and every file it maps (libpython,
    extension modules, torch's libraries), each as (path, size, mtime_ns, inode), in the order they were loaded.

    Left out, safely: modules without a file of their own (built in, frozen: the interpreter's), names that are not
    absolute paths (torch.ops is a namespace object), and our own spare/warm code, which the job never runs. Nothing
    is left out to save time: one stat per file, about 2,000 files with torch and the default prewarm_modules (5-35 ms,
    by load), against the seconds of imports a cold start would repeat."""
    modules = [m for n, m in list(sys.modules.items()) if not n.startswith(_OURS)]
    paths = [sys.executable, *(getattr(m, "__file__", None) for m in modules)]
    try:
        with open("/proc/self/maps") as maps:
            mapped = [line.split(None, 5) for line in maps]
    except OSError:
        mapped = []
    paths += [fields[5].rstrip("\n") for fields in mapped if len(fields) == 6]  # "... (deleted)": no such file
    seen: dict[str, Stamp] = {}
    for path in paths:
        if isinstance(path, str) and os.path.isabs(path) and path not in seen and (stamp := _stamp(path)):
            seen[path] = stamp
    return list(seen.values())


def first_change(files: list[Stamp]) -> str | None:
    """The first of `files` that is no longer what was loaded (edited, replaced, gone), or None: a cold start would
    run what is on disk now."""
    return next((f[0] for f in files if _stamp(f[0]) != f), None)


def shadowed() -> str | None:
    """The file a cold start would import instead of a top-level module loaded here, or None: one added since ahead of
    it on sys.path (`tinypkg.py` next to the script shadows the site-packages `tinypkg` imported before)."""
    importlib.invalidate_caches()  # the finders' cached directory listings
    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        if "." in name or spec is None or spec.name != name or not spec.has_location or name.startswith(_OURS):
            continue
        found = next((s for s in (_find(f, name) for f in sys.meta_path) if s is not None), None)
        if found is not None and found.origin != spec.origin:
            return str(found.origin)
    return None


def _find(finder: Any, name: str) -> Any:
    try:
        return finder.find_spec(name, None)
    except Exception:  # noqa: BLE001 - a third-party finder's own trouble: as if it found nothing
        return None


def go_cold(argv: list[str], env: dict[str, str]) -> NoReturn:
    """Become `argv` by exec in this very process (same pid, session, streams, directory): what a cold start runs."""
    for name in ("SIGPIPE", "SIGXFZ", "SIGXFSZ"):  # what subprocess restores before its exec (Python ignores them)
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:  # what a cold start would meet too: say it where its output goes
        os.write(2, f"{argv[0]}: {exc}\n".encode())
        os._exit(127)


def _import(modules: list[str]) -> str | None:
    """Import torch and `modules`; why this interpreter cannot be a rank, or None."""
    try:
        import torch

        for name in modules:
            importlib.import_module(name)
    except BaseException as exc:  # noqa: BLE001 - any failure: the rank starts cold and meets it there
        return f"import failed: {type(exc).__name__}: {exc}"
    if torch.cuda.is_initialized():
        return "CUDA was initialised by an import: the rank must choose its device itself"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "a process group exists before the hand-off"
    return None


def _receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """The hand-off: the rank's spec and its stdin/stdout/stderr, or None when the agent no longer needs us."""
    try:
        data, fds, _flags, _addr = socket.recv_fds(sock, MAX_SPEC_BYTES, 3)
    except OSError:
        return None
    if not data:
        return None
    return json.loads(data), fds


def _fresh_main() -> types.ModuleType:
    """A `__main__` like the one a new interpreter has, so nothing of this file is in the rank's globals."""
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __annotations__={})
    sys.modules["__main__"] = main
    return main


def _become(spec: dict[str, Any], fds: list[int]) -> None:
    """Take the rank's streams, directory and environment; no tie to the agent's life any more (like a cold rank)."""
    for fd, target in zip(fds, (0, 1, 2)):
        if fd != target:
            os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    os.chdir(spec["cwd"])
    os.environ.clear()
    os.environ.update(spec["env"])
    pdeathsig(0)
    # `ps`, `pgrep -f` and py-spy find the rank by the command a cold rank has (cut to our own argv's length).
    set_title(" ".join([spec["argv0"], *spec["argv"]]))
    sys.orig_argv = [spec["argv0"], *spec["argv"]]  # what a script re-executing itself (os.execv) must find


def _run_script(path: str, main: types.ModuleType) -> None:
    """What `python script.py` does: absolute `__file__`, a source loader, the code compiled without our flags."""
    from importlib.machinery import SourceFileLoader

    absolute = os.path.abspath(path)
    main.__dict__.update(__file__=absolute, __cached__=None, __loader__=SourceFileLoader("__main__", absolute))
    with open(absolute, "rb") as fh:
        code = compile(fh.read(), absolute, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def run_rank(argv: list[str]) -> None:
    """Run the rank's `[-u, -m, module, args...]` or `[-u, script, args...]` as the interpreter would."""
    main = _fresh_main()
    if argv[1] == "-m":
        sys.argv = ["-m", *argv[3:]]  # runpy replaces argv[0] with the module's file, as `python -m` does
        runpy._run_module_as_main(argv[2], alter_argv=True)  # type: ignore[attr-defined]  # what `-m` calls
    else:
        sys.argv = argv[1:]
        _run_script(argv[1], main)


def main() -> int:
    fd, parent, path0 = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    modules: list[str] = json.loads(sys.argv[4])
    pdeathsig(signal.SIGKILL)  # until the hand-off we die with the spare agent
    sock = socket.socket(fileno=fd)
    if os.getppid() != parent:  # the agent died before the line above took effect
        return 0
    safe_path = getattr(sys.flags, "safe_path", False)  # -P / PYTHONSAFEPATH: a cold rank gets no sys.path[0] either
    if not safe_path:
        sys.path[0] = path0  # the rank's own (its directory for -m, its script's for a script), never ours
    started = time.monotonic()
    problem = _import(modules)
    loaded = loaded_files()
    try:
        sock.send(UNUSABLE + b" " + problem.encode() if problem else READY + f" {time.monotonic() - started:.3f}".encode())
    except OSError:
        return 0
    if problem:
        return 0
    received = _receive(sock)
    sock.close()
    if received is None:
        return 0
    spec, fds = received
    _become(spec, fds)
    stale = first_change(loaded) or shadowed() or (None if safe_path else _script_moved(spec["argv"], path0))
    if stale is not None:
        print(f"event=warm_workers_stale pid={os.getpid()} file={json.dumps(stale)}", file=sys.stderr, flush=True)
        go_cold([spec["argv0"], *spec["argv"]], spec["env"])
    run_rank(spec["argv"])
    return 0


def _script_moved(argv: list[str], path0: str) -> str | None:
    """A script whose directory (its resolved path's, a cold rank's sys.path[0]) is no longer `path0`, the one this
    worker put first on its path (a symlink re-pointed: `ln -sfn v2/train.py train.py`); None for -m (the directory
    is checked by the agent) and when it is still the same."""
    if argv[1] == "-m" or os.path.dirname(os.path.realpath(argv[1])) == path0:
        return None
    return argv[1]


if __name__ == "__main__":
    sys.exit(main())
