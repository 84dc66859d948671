"""The torch side of `local_tier.load_speedup`: a cold load of the same >= 1 GB checkpoint from each tier.

Runs under torchrun with bench/checkpoint_io_job.py's state (a transformer-shaped sharded state of `--gb`) and
its `IoBench`: the checkpoint is written once into the durable root (`--dir`) and once into the node-local tier
(`--local-dir`, e.g. /dev/shm), both with the trainer's writer; then `--rounds` rounds each load it through the
trainer's `load_checkpoint` from both, back to back, the order alternating, each after the same eviction
(`drop_caches`, then the settle; a tmpfs keeps its pages: that is the tier's point). The first load of each side
is checked against the saved values. Each time is the slowest rank's; rank 0 writes JSON to --out.

    torchrun --standalone --nproc-per-node=2 -m bench.local_tier_job --dir D --local-dir L --out R.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from bench.checkpoint_io_job import CACHE_METHODS, SETTLE_S, IoBench
from trainer.checkpoint import _Writer
from trainer.parallel import shutdown


def _load_from(bench: IoBench, path: Path, check: bool) -> float:
    bench.path = path  # IoBench.load (and its eviction) read the checkpoint at bench.path
    return bench.load(check)


def run(bench: IoBench, local: Path, rounds: int) -> dict[str, Any]:
    durable = bench.path
    nbytes = bench.save()
    dist.barrier(group=bench.group)
    dcp.save(bench.source, storage_writer=_Writer(local), process_group=bench.d.ckpt)
    dist.barrier(group=bench.group)
    samples: dict[str, list[float]] = {"durable_s": [], "local_s": []}
    for r in range(rounds):
        order = [("durable_s", durable), ("local_s", local)]
        for key, path in order if r % 2 == 0 else order[::-1]:
            samples[key].append(_load_from(bench, path, check=r < 2))
    return {"samples": samples, "bytes": nbytes, "cache": bench.cache, "world_size": bench.d.world_size}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.local_tier_job")
    p.add_argument("--dir", type=Path, required=True, help="the durable root's side (a disk)")
    p.add_argument("--local-dir", type=Path, required=True, help="the node-local tier's side (e.g. /dev/shm/...)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--gb", type=float, default=1.2, help="checkpoint size (GB, 1e9 bytes)")
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--cache", choices=("auto", *CACHE_METHODS), default="auto")
    p.add_argument("--settle-s", type=float, default=SETTLE_S)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    bench = IoBench(a.dir, a.gb, a.d_model, a.cache, a.settle_s)
    try:
        result = run(bench, a.local_dir / "ckpt", a.rounds)
        if bench.rank == 0:
            a.out.write_text(json.dumps(result))
        return 0
    finally:
        shutdown()


if __name__ == "__main__":
    sys.exit(main())
