"""Hang recovery: SIGSTOP of rank 1 -> the first training step after the job came back (issue 25).

The same job two ways, interleaved: `supervisor` (`fsdp-supervisor run`, `[health] hang_timeout_s = 10` and
every other setting at its default: the stack dumps, SIGTERM, SIGKILL `hang_kill_grace_s` later) and
`torchrun` (bare torchrun `--max-restarts=1`, trainer `--resume auto`: no hang detection, so the other rank's
collective times out after the trainer's `--pg-timeout-s`, 30 s here for both, then torchrun's own 30 s SIGTERM
grace for the stopped rank). Bare torchrun takes over a minute a round: it runs `torchrun_repeats` rounds (1).
`beyond_timeout` is the supervisor's median minus `hang_timeout_s`: what the hang costs beyond the wait that
defines it. Measuring code and phases are bench/recovery.py's.

    python -m bench.hangs        # prints the result of run() as JSON
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from bench.common import median
from bench.recovery import HANG_PHASES, measure_once, steps_lost_errors

__all__ = ["run", "run_auto", "HANG_TIMEOUT_S", "PG_TIMEOUT_S"]

HANG_TIMEOUT_S = 10.0  # as in the side-by-side measurement
PG_TIMEOUT_S = 30  # the job's collective timeout, for both variants (the setup)


def run(repeats: int = 3, torchrun_repeats: int = 1, *, hang_timeout_s: float = HANG_TIMEOUT_S, kill_step: int = 12,
        model: dict[str, Any] | None = None, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """`hang_recovery_s` {median, beyond_timeout, torchrun, ...} and the supervised rounds' steps-lost errors."""
    job = {**(model or {}), "pg_timeout_s": PG_TIMEOUT_S}
    health = f"hang_timeout_s = {hang_timeout_s}"
    runs: dict[str, list[dict[str, Any]]] = {"supervisor": [], "torchrun": []}
    for r in range(max(repeats, torchrun_repeats)):
        order = ("supervisor", "torchrun") if r % 2 == 0 else ("torchrun", "supervisor")
        for v in order:
            if len(runs[v]) >= (repeats if v == "supervisor" else torchrun_repeats):
                continue
            variant = "supervisor" if v == "supervisor" else "torchrun_restart"
            runs[v].append(measure_once(variant, kill_step=kill_step, model=job, fault="stop", health=health))
            if progress:
                progress(f"hang recovery {v} #{len(runs[v])}: {runs[v][-1]['total']} s")
    sup = median(x["total"] for x in runs["supervisor"])
    out: dict[str, Any] = {
        "median": sup,
        "beyond_timeout": None if sup is None else round(sup - hang_timeout_s, 3),
        "torchrun": median(x["total"] for x in runs["torchrun"]),
        "hang_timeout_s": hang_timeout_s,
        "breakdown": {v: {ph: median(x["phases"].get(ph, 0.0) for x in runs[v]) for ph in HANG_PHASES}
                      for v in runs if runs[v]},
        "runs": runs,
        "repeats": repeats,
        "torchrun_repeats": torchrun_repeats,
    }
    return {"hang_recovery_s": out, "steps_lost_errors": steps_lost_errors(runs["supervisor"]),
            "hang_false_positives": [x["hang_false_positives"] for x in runs["supervisor"]]}


def run_auto(repeats: int = 3, *, kill_step: int = 12, model: dict[str, Any] | None = None,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """`hang_recovery_s.auto_beyond_threshold`: no [health] section (hang_timeout_s = "auto", hang_min_s and
    hang_factor at their defaults), rank 1 SIGSTOPped once status says the allowance; from the moment the threshold
    was reached (the job's last step by its own clock + that allowance) to the first step of the relaunched attempt.
    The job's collective timeout stays the trainer's default (120 s), beyond the allowance (60 s)."""
    runs = []
    for r in range(repeats):
        runs.append(measure_once("supervisor", kill_step=kill_step, model=model, fault="stop"))
        if progress:
            progress(f"hang recovery auto #{r + 1}: {runs[-1].get('beyond_threshold')} s beyond the "
                     f"{runs[-1].get('threshold_s')} s threshold")
    beyond = [x["beyond_threshold"] for x in runs if "beyond_threshold" in x]
    out = {"auto_beyond_threshold": median(beyond), "auto_threshold_s": median(x.get("threshold_s") for x in runs),
           "auto_beyond_threshold_all": beyond, "auto_runs": runs}
    return {"hang_recovery_s": out, "steps_lost_errors": steps_lost_errors(runs),
            "hang_false_positives": [x["hang_false_positives"] for x in runs]}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps(run(progress=lambda s: print(s, flush=True)), indent=2))
