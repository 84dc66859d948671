"""Test entry for torchrun workers: runs `python -m trainer` in-process and records its exit code.

torchrun does not report worker exit codes when it is itself signalled, so tests run this script instead
of `-m trainer`; it writes `$TRAINER_RC_DIR/rank_<RANK>` with the code before the process exits.
"""
from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path


def _record(code: object) -> None:
    rc_dir = os.environ.get("TRAINER_RC_DIR")
    if rc_dir:
        rc = code if isinstance(code, int) else (0 if code is None else 1)
        Path(rc_dir, f"rank_{os.environ.get('RANK', '0')}").write_text(str(rc))


if __name__ == "__main__":
    sys.argv[0] = "trainer"
    try:
        runpy.run_module("trainer", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        _record(exc.code)
        raise
    except BaseException:
        _record(1)
        raise
    _record(0)
