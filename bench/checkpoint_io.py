"""Checkpoint I/O at disk speed: saves and cold loads of a >= 1 GB checkpoint against `dd` on the same disk.

Runs bench/checkpoint_io_job.py under torchrun with 2 ranks, like the save benchmark: each rank saves and
loads its own shards (the time is the slowest rank's), the save through the trainer's `Checkpointer`
(fsync, manifest, atomic rename), the load through the trainer's `load_checkpoint` into preallocated
tensors, as a resuming FSDP job does. Baselines: `dd if=/dev/zero bs=4M conv=fsync` of the same size
into the same directory, and `dd if=FILE of=/dev/null bs=4M` over the checkpoint's files one after the
other, cold like the load (how: `load_gbps.cache`). Each round runs one side right after the other
(alternating which goes first; twice as many load rounds as write rounds, an even count); `ratio` is
the median of the rounds' own ratios:
- `write_gbps = {checkpoint, dd_fsync, ratio, ratio_spread, rounds: [{checkpoint, dd_fsync, ratio}, ...]}`
- `load_gbps = {checkpoint, dd, ratio, ratio_spread, cache, rounds: [{checkpoint, dd, ratio}, ...]}`
The size is >= 1 GB so that what is measured is moving bytes: a save also has a fixed cost (state dict,
plans exchanged between ranks, `.metadata`, commit: ~0.2 s on 2 cores) that dominates small checkpoints;
save_stall's `write_gbps_small` shows it at the reference trainer's 300 MB.

    python -m bench.checkpoint_io        # prints the result of run() as JSON
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


def _side(rounds: list[dict[str, float]], ours: list[float], dd: list[float], dd_key: str) -> dict[str, Any]:
    ratios = [r["ratio"] for r in rounds]
    return {"checkpoint": median(ours), dd_key: median(dd), "ratio": median(ratios),
            "ratio_spread": [min(ratios), max(ratios)] if ratios else None, "rounds": rounds}


def reduce(raw: dict[str, Any]) -> dict[str, Any]:
    """`write_gbps` and `load_gbps`: medians, the median per-round ratio and its spread, the rounds, facts."""
    s = raw["samples"]
    facts = {"files": raw["files"], "tensors_per_rank": raw["tensors_per_rank"], "ranks": raw["world_size"]}
    write = {**_side(raw["write_rounds"], s["save_gbps"], s["dd_fsync_gbps"], "dd_fsync"),
             "save_s": median(s["save_s"], 4), "dd_fsync_s": median(s["dd_fsync_s"], 4), "bytes": raw["save_bytes"],
             **facts}
    load = {**_side(raw["load_rounds"], s["load_gbps"], s["dd_gbps"], "dd"), "cache": raw["cache"],
            "load_s": median(s["load_s"], 4), "dd_s": median(s["dd_s"], 4), "bytes": raw["bytes"], **facts}
    return {"write_gbps": write, "load_gbps": load}


def run(repeats: int = 3, gb: float = GB, d_model: int = 1024, cache: str = "auto", ranks: int = 2,
        data_dir: Path | None = None, settle_s: float | None = None) -> dict[str, Any]:
    """Run the I/O job once (rounds inside it) and reduce its samples to `{"write_gbps", "load_gbps"}`.

    `ranks=1` runs the job as one plain process (no torchrun agent: a smoke run starts faster); `settle_s`:
    the quiet after each eviction (default: bench/checkpoint_io_job.py's SETTLE_S)."""
    root = Path(data_dir) if data_dir else scratch("io")
    out = root / "result.json"
    launcher = torchrun_argv(ranks) if ranks > 1 else [PY]
    argv = [*launcher, "-m", "bench.checkpoint_io_job", "--dir", str(root), "--out", str(out), "--rounds",
            str(repeats), "--gb", str(gb), "--d-model", str(d_model), "--cache", cache]
    if settle_s is not None:
        argv += ["--settle-s", str(settle_s)]
    try:
        with Tagged() as tagged:
            p = tagged.start(argv, log=root / "job.log", env=job_env())
            rc = p.wait(TIMEOUT)
            if rc != 0 or not out.exists():
                tail = (root / "job.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"checkpoint I/O benchmark job failed (exit {rc}):\n{tail}")
            return reduce(json.loads(out.read_text()))
    finally:
        if data_dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps(run(), indent=2))
