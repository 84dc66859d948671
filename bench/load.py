"""Load speed: a >= 1 GB DCP checkpoint loaded through the trainer's loader, cold, against `dd` reading it.

Runs bench/load_job.py under torchrun with 2 ranks, like the save benchmark: each rank loads its own
shards into preallocated tensors, as a resuming FSDP job does, and the time is the slowest rank's. The
baseline is `dd if=FILE of=/dev/null bs=4M` over the same files, one after the other (the disk's
sequential read speed). Both start cold (how: `load_gbps.cache`). Reduced to
`load_gbps = {checkpoint, dd, ratio, cache, rounds: [{checkpoint, dd, ratio}, ...]}` where `ratio` is
the median of the per-round ratios (load and dd alternate within a round).

    python -m bench.load        # prints the result of run() as JSON
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from bench.common import PY, Tagged, job_env, median, scratch, torchrun_argv

__all__ = ["run", "reduce", "GB"]

GB = 1.2  # the checkpoint's size: >= 1 GB, so that fixed costs (plans, process groups) do not dominate
TIMEOUT = 900.0


def reduce(raw: dict[str, Any]) -> dict[str, Any]:
    """Medians, the median per-round ratio, and the facts a reader needs (bytes, files, cache method)."""
    s = raw["samples"]
    return {
        "checkpoint": median(s["load_gbps"]), "dd": median(s["dd_gbps"]),
        "ratio": median(r["ratio"] for r in raw["rounds"]), "cache": raw["cache"], "rounds": raw["rounds"],
        "load_s": median(s["load_s"], 4), "dd_s": median(s["dd_s"], 4), "bytes": raw["bytes"],
        "files": raw["files"], "tensors_per_rank": raw["tensors_per_rank"], "ranks": raw["world_size"],
    }


def run(repeats: int = 3, gb: float = GB, d_model: int = 1024, cache: str = "auto", ranks: int = 2,
        data_dir: Path | None = None) -> dict[str, Any]:
    """Run the load job once (rounds inside it) and reduce its samples to `{"load_gbps": {...}}`.

    `ranks=1` runs the job as one plain process (no torchrun agent: a smoke run starts faster)."""
    root = Path(data_dir) if data_dir else scratch("load")
    out = root / "result.json"
    launcher = torchrun_argv(ranks) if ranks > 1 else [PY]
    argv = [*launcher, "-m", "bench.load_job", "--dir", str(root), "--out", str(out), "--rounds",
            str(repeats), "--gb", str(gb), "--d-model", str(d_model), "--cache", cache]
    try:
        with Tagged() as tagged:
            p = tagged.start(argv, log=root / "job.log", env=job_env())
            rc = p.wait(TIMEOUT)
            if rc != 0 or not out.exists():
                tail = (root / "job.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"load benchmark job failed (exit {rc}):\n{tail}")
            return {"load_gbps": reduce(json.loads(out.read_text()))}
    finally:
        if data_dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps(run(), indent=2))
