"""What checksums cost (issue 34): a save with them over the same save without, and the supervisor's read of a
checkpoint against its checksums over a cold sequential `dd` of the same files.

Both are built to hold on a loaded machine (2 cores shared with other work): each figure is the median of
per-round ratios, the two sides of a round back to back and their order alternating from round to round, so
that a burst of other load moves a round's two sides together instead of one side of the comparison.

- `integrity.write_overhead`: per round, (save time with checksums) / (the same save without); the rounds taken
  two by two (one of each order: their geometric mean cancels what the order itself costs), the median of those,
  minus 1: one process, the trainer's `save_checkpoint` of the same state dict (without: the trainer's writer with
  DCP's plain file system, `trainer.checksums` left out); before each save the cache dropped as below and
  SETTLE_S of quiet, so that neither side pays for the other's writeback or freed pages. Context, not gated:
  `write_overhead_min` (the fastest save of each side: the least disturbed), `save_cpu_s` (this process's CPU
  over the save, every thread: what the hashing adds however loaded the machine).
- `integrity.verify_ratio`: median over `repeats` rounds of (dd's time) / (`supervisor.checkpoints.seals.check`'s
  time), both cold: before each read the page cache is dropped (`sync; echo 3 > /proc/sys/vm/drop_caches` as
  root, else each file's pages with posix_fadvise) and SETTLE_S of quiet follows (bench/checkpoint_io_job.py:
  this VM's host takes freed pages back, and reads into them run slower meanwhile).

    python -m bench.integrity        # prints the result of run() as JSON
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from typing import Any

from bench.common import median, scratch

__all__ = ["run"]


def run(mb: int = 512, repeats: int = 5, pairs: int = 8, settle_s: float | None = None) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.filesystem import FileSystem

    from bench.checkpoint_io_job import SETTLE_S, make_cold
    from supervisor.checkpoints.manifest import read_manifest
    from supervisor.checkpoints.seals import check
    from trainer import checkpoint as ckpt

    settle = SETTLE_S if settle_s is None else settle_s
    torch.manual_seed(0)
    state = {"model": {f"w{i}": torch.randn(mb * (1 << 20) // 4 // 16) for i in range(16)}}
    root = scratch("integrity")
    hashing = ckpt.HashingFileSystem, ckpt.checked_results, ckpt.collect
    times: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}  # this process's CPU (every thread) during the save
    write_ratios: list[float] = []
    cache = "warm"
    try:
        shutil.rmtree(ckpt.save_checkpoint(root / "warm", 0, state))  # first-save costs (allocation, imports)
        for r in range(pairs):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                if not on:  # the same writer without the hashing file system
                    ckpt.HashingFileSystem = FileSystem  # type: ignore[misc,assignment]
                    ckpt.checked_results = lambda res, fs, d: res  # type: ignore[assignment]
                    ckpt.collect = lambda res, fs, d: None  # type: ignore[assignment]
                try:
                    make_cold([], "auto")  # sync, and the last save's pages gone before the quiet, not during the save
                    time.sleep(settle)
                    started, used = time.perf_counter(), time.process_time()
                    path = ckpt.save_checkpoint(root / str(on), r + 1, state)
                    times[on].append(time.perf_counter() - started)
                    cpu[on].append(time.process_time() - used)
                finally:
                    ckpt.HashingFileSystem, ckpt.checked_results, ckpt.collect = hashing  # type: ignore[misc]
                shutil.rmtree(path)
            write_ratios.append(times[True][-1] / times[False][-1])
        path = ckpt.save_checkpoint(root / "v", 1, state)
        manifest = read_manifest(path)
        assert manifest is not None and manifest.checksums
        names = sorted(manifest.checksums)
        files = [path / n for n in names]
        ratios, ours, dd = [], [], []
        for r in range(repeats):
            for first in ((True, False) if r % 2 == 0 else (False, True)):
                cache = make_cold(files, "auto")
                time.sleep(settle)
                started = time.perf_counter()
                if first:
                    assert check(root / "v", path, manifest.checksums) is None
                else:
                    for f in files:
                        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=4M"], check=True, capture_output=True)
                (ours if first else dd).append(time.perf_counter() - started)
            ratios.append(dd[-1] / ours[-1])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # Each order's rounds alone swing both ways (the second save of a round was the slower one on this VM): the
    # figure is the median over the rounds taken two by two, one of each order (their geometric mean).
    balanced = [(a * b) ** 0.5 for a, b in zip(write_ratios[::2], write_ratios[1::2])] or write_ratios
    overhead = median(balanced, 4)
    return {"write_overhead": round(overhead - 1, 4) if overhead else None,
            "write_ratios": [round(x, 3) for x in write_ratios], "write_ratios_balanced": [round(x, 3) for x in balanced],
            "write_overhead_min": round(min(times[True]) / min(times[False]) - 1, 4) if pairs else None,
            "save_cpu_s": {"checksums": median(cpu[True], 4), "plain": median(cpu[False], 4)},
            "save_s": {"checksums": median(times[True], 4), "plain": median(times[False], 4)},
            "verify_ratio": median(ratios), "verify_ratios": [round(x, 3) for x in ratios],
            "verify_s": median(ours, 4), "dd_s": median(dd, 4), "cache": cache, "settle_s": settle, "mb": mb,
            "repeats": repeats, "pairs": pairs, "load_avg": [round(x, 2) for x in os.getloadavg()]}


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
