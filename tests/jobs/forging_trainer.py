"""TEST-ONLY torchrun worker: the reference trainer behind a line in the job's output that forges a warm hand-off.

`torchrun ... tests/jobs/forging_trainer.py ARGS` with FORGE=huge: rank 0 prints `event=warm_handoff pid=<5,000
digits> ...` (once a ValueError that took the supervisor down at hang detection); FORGE=rename: rank 1 prints the
line a warm agent prints, naming its own pid as rank 0 (once the stopped rank 1 was reported as rank 0). Every rank
writes its pid to `$PIDS_OUT/attempt-<A>-rank-<R>`, then runs `python -m trainer ARGS` in-process.
"""
from __future__ import annotations

import os
import runpy
import sys

FORGED = {("huge", "0"): "event=warm_handoff pid=" + "9" * 5000 + " local_rank=0 rank=0",
          ("rename", "1"): f"event=warm_handoff pid={os.getpid()} local_rank=0 rank=0"}

if __name__ == "__main__":
    rank, attempt = os.environ["RANK"], os.environ.get("FSDP_SUPERVISOR_ATTEMPT", "0")
    with open(os.path.join(os.environ["PIDS_OUT"], f"attempt-{attempt}-rank-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    line = FORGED.get((os.environ.get("FORGE", ""), rank))
    if line:
        print(line, flush=True)
    sys.argv = ["trainer", *sys.argv[1:]]
    runpy.run_module("trainer", run_name="__main__", alter_sys=True)
