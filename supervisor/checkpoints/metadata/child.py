"""Parse a large `.metadata` in a child process, so that the daemon's event loop never waits for the GIL.

Why: docs/performance-scale.md, 'The loop'. Only `run` turns this on (`isolate`). Any outcome but one JSON line is
None and the caller parses in-process. Invariants: docs/design.md, 'Notes for maintainers'.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, BinaryIO

import supervisor
from supervisor.checkpoints.metadata import cache as metadata_cache

__all__ = ["isolate", "running_pids", "parse_in_child", "timeout_s"]

# A hung child holds up the pass, and a launch waits for the pass: the wait is sized to the file. The parse
# runs at ~40 MB/s (391 MB in 10 s, docs/performance.md); 1 MiB/s plus a floor for the interpreter's
# start is 40x slower than that, and a timed-out child only costs a parse here.
_TIMEOUT_FLOOR_S = 30.0
_TIMEOUT_BYTES_PER_S = 1 << 20
_TIMEOUT_MAX_S = 900.0
_MAX_ANSWER_BYTES = 1 << 24
_ROOT = str(Path(supervisor.__file__).resolve().parent.parent)  # the directory our `supervisor` package is in
_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); "
         "from supervisor.checkpoints.metadata.child import main; sys.exit(main(int(sys.argv[2]), int(sys.argv[3])))")

_min_bytes: int | None = None  # None: off
_lock = threading.Lock()
_running: set[int] = set()


def isolate(min_bytes: int | None) -> None:
    """Parse files of at least `min_bytes` in a child from now on (None: never)."""
    global _min_bytes
    _min_bytes = min_bytes


def running_pids() -> frozenset[int]:
    """Children parsing right now: never to be killed as a finished job's survivors."""
    with _lock:
        return frozenset(_running)


def timeout_s(size: int) -> float:
    """How long a child may take over a file of `size` bytes before the parse happens here instead."""
    return min(_TIMEOUT_MAX_S, _TIMEOUT_FLOOR_S + size / _TIMEOUT_BYTES_PER_S)


def parse_in_child(f: BinaryIO, size: int) -> dict[str, Any] | None:
    """{"summary": ...} or {"error": ...} from a child (checked as a cache entry's), or None when not isolating or
    the child gave no such answer."""
    if _min_bytes is None or size < _min_bytes:
        return None
    try:
        f.seek(0)
        proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOT, _ROOT, str(size), str(os.getpid())], stdin=f,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
    except (OSError, ValueError, TypeError):  # no or odd sys.executable: parse here
        f.seek(0)
        return None
    with _lock:
        _running.add(proc.pid)
    try:
        out, _ = proc.communicate(timeout=timeout_s(size))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None
    finally:
        with _lock:
            _running.discard(proc.pid)
        f.seek(0)  # the child moved the shared offset: a parse here starts at the beginning
    # The exit status may be lost (the daemon's loop reaps every child): the answer line alone counts.
    try:
        return metadata_cache.valid_result(json.loads(out[:_MAX_ANSWER_BYTES]))
    except (ValueError, RecursionError):
        return None


def _die_with(parent: int) -> bool:
    """Be killed when the thread that started us ends (the supervisor exited mid-pass); False: it is gone."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL (Linux)
    if os.getppid() == parent:
        return True
    try:  # a wrapper for sys.executable that forks sits in between: is the supervisor still there?
        os.kill(parent, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass
    return True


def main(size: int, parent: int) -> int:
    """The child: parse the first `size` bytes of stdin, print the answer (disk-cache format)."""
    if not _die_with(parent):
        return 1
    from supervisor.checkpoints.metadata import reader as metadata

    try:
        answer: dict[str, Any] = {"summary": metadata._summary_json(metadata._parse(sys.stdin.buffer, size))}
    except metadata.MetadataError as exc:
        answer = {"error": metadata._error_json(exc)}
    sys.stdout.write(json.dumps(answer) + "\n")
    return 0
