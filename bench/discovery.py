"""How fast the supervisor finds the newest complete checkpoint: among many, and when one is huge.

run(): the root holds `n` trainer-style checkpoints (`step_<N>`, 16 sparse shard files, a real DCP-format
`.metadata` written by tests.jobs.dcp_files, a manifest); issue 3: 1,000 x 16 shards < 200 ms.
run_large(): one synthetic Llama-3 70B FSDP2 + AdamW checkpoint saved by 64, 256 and 1024 ranks
(`bench.synthetic`, torch's real classes, 25-390 MB of `.metadata`), each generated once in a temp dir:
`newest_complete` on its root, our parse against torch's own `pickle.load` of the same file (in one
process, torch imported), and the parse's peak RSS in a fresh process.

Every timing starts cold: the in-process cache is cleared and the on-disk cache
($FSDP_SUPERVISOR_CACHE_DIR) is a new empty dir, so each repetition parses `.metadata` as a supervisor
meeting the checkpoint for the first time would (the OS page cache stays warm, as on a live node).

    python -m bench.discovery              # run() and run_large() as JSON (generating 70B x 1024 takes minutes)
    python -m bench.discovery --large-only
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from supervisor.checkpoints import newest_complete, scan
from supervisor.checkpoints.metadata import reader as metadata
from supervisor.checkpoints.metadata.cache import CACHE_ENV
from tests.jobs.dcp_files import dcp_metadata_bytes, write_checkpoint

__all__ = ["build_root", "run", "run_large", "LARGE_RANKS"]

LARGE_RANKS = (64, 256, 1024)
_REPO = Path(__file__).resolve().parent.parent

# A small model's worth of metadata: 8 tensors, each sharded over every rank.
_TENSORS = {f"layers.{i}.weight": 4096 for i in range(8)}


def build_root(root: Path, n: int, shards: int) -> None:
    """Write `n` complete checkpoints, steps 100..100*n, cloning one metadata pickle.

    Their `.metadata` is dated a minute back, as a supervisor meets checkpoints (a file written in the
    last seconds is parsed but not remembered, see metadata.RACY_NS). Only the mtime can be dated back: a
    measurement of remembered results waits out the ctime's window first (`_settle`).
    """
    prebuilt = dcp_metadata_bytes(_TENSORS, shards=shards)
    then = time.time_ns() - 60 * 10**9
    for i in range(1, n + 1):
        d = write_checkpoint(root, 100 * i, shards=shards, prebuilt=prebuilt, metrics={"loss": 1.0 / i})
        os.utime(d / ".metadata", ns=(then, then))


_private: list[Path] = []  # the base dir of the innermost _private_caches(), if any


@contextlib.contextmanager
def _private_caches() -> Iterator[None]:
    """Point the on-disk metadata cache at a temp dir for the duration (never the user's), then restore it."""
    before = os.environ.get(CACHE_ENV)
    _private.append(Path(tempfile.mkdtemp(prefix="bench-metadata-cache-")))
    os.environ[CACHE_ENV] = str(_private[-1])
    try:
        yield
    finally:
        shutil.rmtree(_private.pop(), ignore_errors=True)
        if before is None:
            os.environ.pop(CACHE_ENV, None)
        else:
            os.environ[CACHE_ENV] = before
        metadata._cache.clear()


def _settle(root: Path) -> None:
    """Sleep until every `.metadata` under `root` changed longer ago than RACY_NS (then it can be remembered)."""
    newest = max((p.stat().st_ctime_ns for p in root.glob("*/.metadata")), default=0)
    time.sleep(max(0, metadata.RACY_NS - (time.time_ns() - newest)) / 1e9)


def _median_ms(fn: Callable[[], Any], repeats: int, cold: bool = True) -> float:
    """Median wall milliseconds of `fn`; cold: every parsed `.metadata` forgotten first (memory and disk)."""
    times = []
    with _private_caches() if not _private else contextlib.nullcontext():
        for _ in range(repeats):
            if cold:
                metadata._cache.clear()
                os.environ[CACHE_ENV] = tempfile.mkdtemp(dir=_private[-1])
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
    with _private_caches():
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
            _settle(root)
            result[f"scan{n}_cached"] = _median_ms(lambda: scan(root), repeats, cold=False)
            result[f"scan{n}_cold"] = _median_ms(lambda: scan(root), 1)
            result["parse_ms_per_mb"] = _parse_ms_per_mb(3)
            result.update(shards=shards, metadata_bytes=len(dcp_metadata_bytes(_TENSORS, shards=shards)[0]),
                          repeats=repeats, build_s=round(build_s, 1))
            return result
        finally:
            shutil.rmtree(root, ignore_errors=True)


# ---- one huge checkpoint ------------------------------------------------------------------------------

_PEAK = r"""
import json, sys, time
from pathlib import Path
from supervisor.checkpoints.metadata import reader as metadata

def kib(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field + ":")).split()[1])

path = Path(sys.argv[1])
before = kib("VmHWM")
start = time.process_time()
meta = metadata.read_metadata(path, cached=False)
seconds = time.process_time() - start
print(json.dumps({"parse_cpu_s": seconds, "peak_growth_bytes": (kib("VmHWM") - before) * 1024,
                  "files": len(meta.storage)}))
"""

_VERSUS_TORCH = r"""
import gc, json, pickle, statistics, sys, time
from pathlib import Path
import torch, torch.distributed.checkpoint  # imported first: torch's load then costs only the load
from supervisor.checkpoints.metadata import reader as metadata

path, repeats = Path(sys.argv[1]), int(sys.argv[2])
times = {"ours_cpu": [], "torch_cpu": [], "ours_wall": [], "torch_wall": []}
for _ in range(repeats):  # interleaved, so both see the same machine load
    for who in ("ours", "torch"):
        with open(path, "rb") as f:
            cpu, wall = time.process_time(), time.perf_counter()
            got = metadata.read_metadata(path, cached=False) if who == "ours" else pickle.load(f)
            times[who + "_cpu"].append(time.process_time() - cpu)
            times[who + "_wall"].append(time.perf_counter() - wall)
        del got
        gc.collect()
print(json.dumps({k: statistics.median(v) for k, v in times.items()}))
"""


def _python(script: str, *args: str, timeout: float = 1800) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                       cwd=_REPO, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"benchmark subprocess failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def synthetic_root(base: Path, model: str, ranks: int) -> tuple[Path, dict[str, Any]]:
    """`base/<model>_r<ranks>/step_00000100`, written by bench.synthetic in a subprocess (it imports torch)."""
    root = base / f"{model}_r{ranks}"
    argv = ["-m", "bench.synthetic", "--model", model, "--ranks", str(ranks), str(root / "step_00000100")]
    start = time.perf_counter()
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=3600, cwd=_REPO)
    if r.returncode != 0:
        raise RuntimeError(f"bench.synthetic failed:\n{r.stderr[-3000:]}")
    info = json.loads(r.stdout)
    info["generate_s"] = round(time.perf_counter() - start, 1)
    return root, info


def run_large(model: str = "70b", ranks: Sequence[int] = LARGE_RANKS, repeats: int = 3,
              torch_ranks: int = 64) -> dict[str, Any]:
    """Cold newest_complete, parse cost, peak RSS and (at `torch_ranks`) the ratio to torch's load, per size."""
    base = Path(tempfile.mkdtemp(prefix="bench-synthetic-"))
    with _private_caches():
        discovery: dict[str, Any] = {}
        parse: dict[str, Any] = {}
        ratio = None
        try:
            for n in ranks:
                root, info = synthetic_root(base, model, n)
                key = f"llama{model}_r{n}"
                reps = repeats if n <= 256 else 1  # the 1024-rank parse alone takes ~10 s here
                found = newest_complete(root)
                assert found is not None and found.complete, found
                discovery[key] = _median_ms(lambda: newest_complete(root), reps)  # noqa: B023 - called before the next root
                path = root / "step_00000100" / ".metadata"
                peak = _python(_PEAK, str(path))
                size = info["metadata_bytes"]
                parse[key] = {"metadata_mb": round(size / 1e6, 1), "chunks": info["chunks"],
                              "generate_s": info["generate_s"], "parse_cpu_s": round(peak["parse_cpu_s"], 3),
                              "parse_cpu_ms_per_mb": round(peak["parse_cpu_s"] * 1e9 / size, 1),
                              "peak_rss_x": round(peak["peak_growth_bytes"] / size, 2)}
                if n == torch_ranks:
                    vs = {k: round(v, 3) for k, v in _python(_VERSUS_TORCH, str(path), str(repeats)).items()}
                    parse[key]["versus_torch"] = vs
                    ratio = round(vs["ours_cpu"] / vs["torch_cpu"], 3)
                    parse[key]["wall_ratio"] = round(vs["ours_wall"] / vs["torch_wall"], 3)
                    parse["peak_rss_x"] = parse[key]["peak_rss_x"]
                shutil.rmtree(root, ignore_errors=True)
            per_mb = [parse[f"llama{model}_r{n}"]["parse_cpu_ms_per_mb"] for n in ranks]
            parse["linearity"] = round(max(per_mb) / min(per_mb), 2)  # 1.0: cost exactly proportional to size
            discovery["llama_note"] = ("newest_complete on a root holding one synthetic Llama-3 checkpoint, cold cache "
                                       "(in-process and on-disk caches empty each repetition): the parse is included")
            parse["note"] = ("CPU seconds (process_time) of read_metadata(cached=False); parse_vs_torch_ratio: ours / "
                             "torch's pickle.load of the same file, interleaved in one process with torch imported")
            return {"discovery_ms": discovery, "parse_vs_torch_ratio": ratio, "metadata_parse": parse}
        finally:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    large = run_large()
    print(json.dumps(large if "--large-only" in sys.argv[1:] else {**run(), **large}, indent=2))
