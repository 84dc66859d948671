"""The spare torchrun agent: a process that has already imported torch and waits to become the next job.

A supervisor relaunch would otherwise pay a fresh interpreter start plus `import torch` (2-3 s here) that
torchrun's in-agent restart does not. The supervisor (supervisor/prewarmer.py) starts this file with the
job's own interpreter, in a session of its own and with the job's environment; it imports
`torch.distributed.run` and then blocks reading its stdin. To launch, the supervisor writes one JSON object
(`script`, `args`, `env`, `cwd`, `log_path`) and closes the pipe; the spare then takes the job's
environment, directory and output and calls torchrun's `main` in-process, so from here on it *is* the
torchrun agent: same pid semantics (it leads its own session), same exit codes, same signal handling.

Until then it dies with the supervisor (PR_SET_PDEATHSIG, and EOF on stdin means "not needed").

Run as a plain file (`python .../supervisor/prewarm.py PARENT_PID`), standard library only until the
import it exists for: the job's interpreter need not have this package installed. The supervisor itself
never imports this module.
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
import time

__all__ = ["main"]

_PR_SET_PDEATHSIG = 1
_SIGKILL = 9


def _pdeathsig(sig: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the EOF on stdin still ends an unneeded spare


def _take_over(spec: dict, module_file: str) -> None:
    """Become the job: its directory, environment and output; no tie to the supervisor's life any more."""
    os.chdir(spec["cwd"])
    os.environ.clear()
    os.environ.update(spec["env"])
    out = os.open(spec["log_path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
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


def main() -> int:
    parent = int(sys.argv[1])
    _pdeathsig(_SIGKILL)
    if os.getppid() != parent:  # the supervisor died before the line above took effect
        return 0
    del sys.path[0]  # this file's directory holds supervisor modules; never shadow anything with them
    started = time.monotonic()
    import torch.distributed.run as torchrun

    print(f"event=prewarm_ready pid={os.getpid()} import_s={time.monotonic() - started:.3f}",
          file=sys.stderr, flush=True)
    data = sys.stdin.buffer.read()
    if not data:
        return 0
    _take_over(json.loads(data), torchrun.__file__)
    # The console script does `sys.exit(main())`: a failure propagates as an exception (exit 1, traceback).
    return torchrun.main()


if __name__ == "__main__":
    sys.exit(main())
