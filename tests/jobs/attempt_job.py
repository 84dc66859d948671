"""A torch-free torchrun worker whose behaviour depends on FSDP_SUPERVISOR_ATTEMPT (prewarm tests).

Appends `{"attempt", "pid", "ppid", "resume"}` to --marker, then exits --exit-code on attempts listed in
--fail-attempts; any other attempt writes the signal number to --trap on SIGTERM and exits 0, or exits 0
after --sleep seconds.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from marks import append_mark  # tests/jobs/marks.py: this script's directory is on sys.path

from supervisor.contract import ENV_ATTEMPT


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--marker", required=True)
    p.add_argument("--trap", required=True)
    p.add_argument("--fail-attempts", default="1,2")
    p.add_argument("--exit-code", type=int, default=5)
    p.add_argument("--sleep", type=float, default=120.0)
    p.add_argument("--resume", default=None, help="what the supervisor's resume_args passed (recorded, not loaded)")
    a = p.parse_args()
    attempt = int(os.environ.get(ENV_ATTEMPT, "0"))

    def on_term(signum: int, _frame: object) -> None:
        Path(a.trap).write_text(str(signum))
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)  # before the marker: a test may signal us once it reads it
    append_mark(a.marker, {"attempt": attempt, "pid": os.getpid(), "ppid": os.getppid(), "resume": a.resume})
    if str(attempt) in a.fail_attempts.split(","):
        return a.exit_code
    deadline = time.monotonic() + a.sleep
    while time.monotonic() < deadline:
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
