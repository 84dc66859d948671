"""How fast the supervisor finds the newest complete checkpoint among many (issue 3: 1,000 x 16 shards < 200 ms).

The root holds `n` trainer-style checkpoints (`step_<N>`, 16 sparse shard files, a real DCP-format
`.metadata` written by supervisor.checkpoints.testing, a manifest). Each timing clears the store's
in-process metadata cache first, so every repetition parses `.metadata` from disk as a fresh supervisor
would (the OS page cache stays warm, as it would on a live node).

    python -m bench.discovery        # prints the result of run() as JSON
"""
from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor.checkpoints import metadata, newest_complete, scan
from supervisor.checkpoints.testing import dcp_metadata_bytes, write_checkpoint

__all__ = ["build_root", "run"]

# A small model's worth of metadata: 8 tensors, each sharded over every rank.
_TENSORS = {f"layers.{i}.weight": 4096 for i in range(8)}


def build_root(root: Path, n: int, shards: int) -> None:
    """Write `n` complete checkpoints, steps 100..100*n, cloning one metadata pickle."""
    prebuilt = dcp_metadata_bytes(_TENSORS, shards=shards)
    for i in range(1, n + 1):
        write_checkpoint(root, 100 * i, shards=shards, prebuilt=prebuilt, metrics={"loss": 1.0 / i})


def _median_ms(fn: Callable[[], Any], repeats: int, cold: bool = True) -> float:
    times = []
    for _ in range(repeats):
        if cold:
            metadata._cache.clear()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(times), 2)


def _parse_ms_per_mb(repeats: int) -> float:
    data, _ = dcp_metadata_bytes({f"layers.{i}.weight": 4096 for i in range(128)}, shards=16)
    ms = _median_ms(lambda: metadata.parse_metadata(data), repeats)
    return round(ms / (len(data) / 2**20), 1)


def run(n: int = 1000, shards: int = 16, repeats: int = 7) -> dict[str, Any]:
    """Median milliseconds for newest_complete (and friends) over `n` checkpoints of `shards` shards."""
    root = Path(tempfile.mkdtemp(prefix="bench-discovery-"))
    try:
        start = time.perf_counter()
        build_root(root, n, shards)
        build_s = time.perf_counter() - start
        newest = newest_complete(root)
        assert newest is not None and newest.step == 100 * n, newest
        result: dict[str, Any] = {f"n{n}": _median_ms(lambda: newest_complete(root), repeats)}
        for i in range(n, n - 10, -1):  # the 10 newest lose a shard: 11 dirs verified before a hit
            (root / f"step_{100 * i:08d}" / f"__{shards - 1}_0.distcp").unlink()
        result[f"n{n}_newest10_torn"] = _median_ms(lambda: newest_complete(root), repeats)
        result[f"scan{n}_cached"] = _median_ms(lambda: scan(root), repeats, cold=False)
        result[f"scan{n}_cold"] = _median_ms(lambda: scan(root), 1)
        result["parse_ms_per_mb"] = _parse_ms_per_mb(3)
        result.update(shards=shards, metadata_bytes=len(dcp_metadata_bytes(_TENSORS, shards=shards)[0]),
                      repeats=repeats, build_s=round(build_s, 1))
        return result
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
