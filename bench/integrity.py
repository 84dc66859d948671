"""What checksums cost (issue 34): a save with them over the same save without, and the supervisor's read of a
checkpoint against its checksums over a cold sequential `dd` of the same files.

- `integrity.write_overhead`: (median save time with checksums) / (median without) - 1, one process, the trainer's
  `save_checkpoint` of the same state dict, the two alternating round by round (without: the trainer's writer with
  DCP's plain file system, `trainer.checksums` left out).
- `integrity.verify_ratio`: (dd's time) / (`supervisor.checkpoints.seals.check`'s time), both cold (each file's
  pages dropped with posix_fadvise after an fsync), rounds alternating which goes first; the median ratio.

    python -m bench.integrity        # prints the result of run() as JSON
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.common import median, scratch

__all__ = ["run"]


def _drop(directory: Path) -> None:
    for p in directory.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def run(mb: int = 512, repeats: int = 5) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.filesystem import FileSystem

    from supervisor.checkpoints.manifest import read_manifest
    from supervisor.checkpoints.seals import check
    from trainer import checkpoint as ckpt

    torch.manual_seed(0)
    state = {"model": {f"w{i}": torch.randn(mb * (1 << 20) // 4 // 16) for i in range(16)}}
    root = scratch("integrity")
    hashing = ckpt.HashingFileSystem, ckpt.checked_results, ckpt.collect
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        shutil.rmtree(ckpt.save_checkpoint(root / "warm", 0, state))  # first-save costs (allocation, imports)
        for r in range(repeats):
            for on in (r % 2 == 0, r % 2 != 0):
                if not on:  # the same writer without the hashing file system
                    ckpt.HashingFileSystem = FileSystem  # type: ignore[misc,assignment]
                    ckpt.checked_results = lambda res, fs, d: res  # type: ignore[assignment]
                    ckpt.collect = lambda res, fs, d: None  # type: ignore[assignment]
                try:
                    started = time.perf_counter()
                    path = ckpt.save_checkpoint(root / str(on), r + 1, state)
                    times[on].append(time.perf_counter() - started)
                finally:
                    ckpt.HashingFileSystem, ckpt.checked_results, ckpt.collect = hashing  # type: ignore[misc]
                shutil.rmtree(path)
        path = ckpt.save_checkpoint(root / "v", 1, state)
        manifest = read_manifest(path)
        assert manifest is not None and manifest.checksums
        names = sorted(manifest.checksums)
        ratios, ours, dd = [], [], []
        for r in range(repeats):
            for first in ((True, False) if r % 2 == 0 else (False, True)):
                _drop(path)
                started = time.perf_counter()
                if first:
                    assert check(root / "v", path, manifest.checksums) is None
                else:
                    for n in names:
                        subprocess.run(["dd", f"if={path / n}", "of=/dev/null", "bs=4M"], check=True,
                                       capture_output=True)
                (ours if first else dd).append(time.perf_counter() - started)
            ratios.append(dd[-1] / ours[-1])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    on, off = median(times[True], 4), median(times[False], 4)
    return {"write_overhead": round(on / off - 1, 4) if on and off else None, "save_s": {"checksums": on, "plain": off},
            "verify_ratio": median(ratios), "verify_s": median(ours, 4), "dd_s": median(dd, 4), "mb": mb,
            "repeats": repeats}


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
