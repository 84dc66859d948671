"""TEST-ONLY torchrun worker: the reference trainer behind a line in the job's output that forges a warm hand-off.

`torchrun ... tests/jobs/forging_trainer.py ARGS` with FORGE=huge: rank 0 prints `event=warm_handoff pid=<5,000
digits> ...` (once a ValueError that took the supervisor down at hang detection); FORGE=rename: rank 1 prints the
line a warm agent prints, naming its own pid as rank 0 (once the stopped rank 1 was reported as rank 0); FORGE=side:
rank 1 appends that record (its pid, start ticks, rank 0) to the agent's side file `attempt-NNNN.handoff`. Every rank
writes its pid to `$PIDS_OUT/attempt-<A>-rank-<R>`, then runs `python -m trainer ARGS` in-process.
"""
from __future__ import annotations

import json
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
    if os.environ.get("FORGE") == "side" and rank == "1":
        with open(f"/proc/{os.getpid()}/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        side = os.path.join(os.environ["FSDP_SUPERVISOR_RUN_DIR"], "logs", f"attempt-{int(attempt):04d}.handoff")
        with open(side, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "start": ticks, "rank": 0}) + "\n")
    sys.argv = ["trainer", *sys.argv[1:]]
    runpy.run_module("trainer", run_name="__main__", alter_sys=True)
