"""TEST-ONLY torchrun worker: writes what a rank sees of its own start, so a warm rank can be held against a cold one.

Run as a script (`torchrun ... tests/jobs/warm_probe.py OUT`) or a module (`torchrun ... -m tests.jobs.warm_probe
OUT`, cwd = the repo). Each rank writes `OUT/attempt-<A>-rank-<R>.json` at once: argv, sys.path[0], directory,
environment, its `__main__`'s globals, its standard streams, session, priority, parent-death signal, threads,
whether CUDA was initialised, which of our modules were already imported, signal dispositions and masks, umask,
rlimits, sys.orig_argv and open descriptors. Then it beats `train` (so the supervisor's idle spare starts its warm
workers), and on attempt 1 waits for `OUT/go` and exits 3; on any other attempt it exits 0.
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
import time

_SEEN_MODULES = sorted(m for m in sys.modules if m.startswith(("tests", "trainer", "marks")))  # before our own
_MAIN = dict(globals())
_PR_GET_PDEATHSIG = 2


def _describe(value: object) -> str:
    if isinstance(value, str) or value is None:
        return repr(value)
    if type(value).__name__ == "ModuleSpec":
        return f"ModuleSpec({value.name}, {value.origin})"  # type: ignore[attr-defined]
    return type(value).__name__


def _pdeathsig() -> int:
    sig = ctypes.c_int(-1)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_GET_PDEATHSIG, ctypes.byref(sig), 0, 0, 0)
    return sig.value


def _cmdline() -> list[str]:
    """What ps shows for us, read as psutil reads it: NUL-separated argv, or (a retitled process, setproctitle's
    way) one line of words."""
    with open("/proc/self/cmdline", "rb") as fh:
        raw = fh.read().decode()
    words = (raw[:-1] if raw.endswith("\0") else raw).split("\0")
    return words[0].split(" ") if len(words) == 1 else words


def record() -> dict[str, object]:
    import torch

    return {
        "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "env": dict(os.environ),
        "main": {k: _describe(v) for k, v in _MAIN.items() if k.startswith("__")},
        "streams": [os.readlink(f"/proc/self/fd/{fd}") for fd in (0, 1, 2)],
        "stdout_write_through": sys.stdout.write_through,  # type: ignore[attr-defined]
        "session_leader": os.getsid(0) == os.getpid(), "group_leader": os.getpgid(0) == os.getpid(),
        "nice": os.getpriority(os.PRIO_PROCESS, 0), "pdeathsig": _pdeathsig(),
        "threads": len(os.listdir("/proc/self/task")), "flags": list(sys.flags),
        "cuda_initialized": torch.cuda.is_initialized(), "our_modules_before_main": _SEEN_MODULES,
        "listed_imported": "tests.jobs.marks" in sys.modules or "marks" in sys.modules, "pid": os.getpid(),
        "cmdline": _cmdline(), **_extra(),
    }


def _extra() -> dict[str, object]:
    """What the interpreter and the kernel hold for us beyond the above: signals, umask, limits, argv as started."""
    import faulthandler
    import resource
    import signal

    with open("/proc/self/status") as fh:
        status = dict(line.split(":\t", 1) for line in fh.read().splitlines() if ":\t" in line)
    mask = os.umask(0)
    os.umask(mask)
    return {
        "signal_masks": {k: status[k].strip() for k in ("SigBlk", "SigIgn", "SigCgt")}, "umask": mask,
        "handlers": {s.name: str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1,
                                                                signal.SIGPIPE, signal.SIGHUP)},
        "rlimits": [resource.getrlimit(getattr(resource, n)) for n in sorted(dir(resource)) if n.startswith("RLIMIT_")],
        "orig_argv": sys.orig_argv, "warnoptions": sys.warnoptions, "faulthandler": faulthandler.is_enabled(),
        "stdio": [sys.stdout.encoding, sys.stdout.line_buffering, sys.stderr.line_buffering],
        "fds": sorted(os.listdir("/proc/self/fd")), "excepthook": str(sys.excepthook),
    }


def main() -> int:
    out = sys.argv[1]
    attempt, rank = os.environ.get("FSDP_SUPERVISOR_ATTEMPT", "0"), os.environ.get("RANK", "0")
    with open(os.path.join(out, f"attempt-{attempt}-rank-{rank}.json"), "w") as fh:
        json.dump(record(), fh)
    beat = os.environ.get("FSDP_SUPERVISOR_HEARTBEAT")
    if beat and rank == "0":
        with open(beat + ".tmp", "w") as fh:
            json.dump({"step": 1, "time": time.time(), "phase": "train", "loss": None}, fh)
        os.replace(beat + ".tmp", beat)
    if attempt != "1":
        return 0
    while not os.path.exists(os.path.join(out, "go")):
        time.sleep(0.05)
    return 3


if __name__ == "__main__":
    sys.exit(main())
