"""Where a checkpoint write's time goes: the reference trainer's state saved under several writer settings.

Runs under torchrun (2 ranks, like bench/ckpt_job.py) and times, in rounds that rotate their order, each
configuration in the same directory: `dd` (rank 0, `bs=4M conv=fsync`, the checkpoint's size), `raw`
(each rank writes its local tensors' bytes to one file and fsyncs it: the floor without serialization),
and DCP saves with `_Writer` variants (thread count, one file per rank or per item, fsync on/off, the
CRC32 switch), plus the benchmarked `Checkpointer.save` split into phases. Each time is the slowest rank's.
Prints a table (configuration -> GB/s, median of the rounds) and writes the samples as JSON to --out. A
diagnostic for docs/performance-scale.md, not part of `make bench`:

    torchrun --standalone --nproc-per-node=2 -m bench.write_profile --dir D --out R.json [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from bench.ckpt_job import Bench, warmed_trainer
from trainer import checkpoint as ck
from trainer.args import build_parser
from trainer.parallel import init_distributed, shutdown

_DD_BLOCK = 4 * 2**20


class _Phases(ck._Writer):
    """The trainer's writer, timing its phases (plan, write, finish) on this rank."""

    log: ClassVar[dict[str, float]] = {}  # one save at a time: the phases of the last one

    def prepare_local_plan(self, plan: Any) -> Any:
        _Phases.log["plan_start"] = time.perf_counter()
        return super().prepare_local_plan(plan)

    def write_data(self, plan: Any, planner: Any) -> Any:
        _Phases.log["write_start"] = time.perf_counter()
        try:
            return super().write_data(plan, planner)
        finally:
            _Phases.log["write_end"] = time.perf_counter()

    def finish(self, metadata: Any, results: Any) -> None:
        start = time.perf_counter()
        super().finish(metadata, results)
        _Phases.log["finish_s"] = time.perf_counter() - start


class Profile:
    def __init__(self, bench: Bench, root: Path) -> None:
        self.b, self.root = bench, root
        self.rank = bench.rank
        self.samples: dict[str, list[float]] = {}
        self.bytes = 0

    def _size(self, path: Path) -> int:
        box = [sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if self.rank == 0 else 0]
        dist.broadcast_object_list(box, src=0, group=self.b.group)
        return int(box[0])

    def _record(self, name: str, seconds: float, nbytes: int) -> None:
        self.samples.setdefault(name, []).append(nbytes / seconds / 1e9)

    def dcp_save(self, name: str, crc: bool = False, **writer: Any) -> None:
        path = self.root / name
        state = self.b.t.state()

        def save() -> None:
            w = ck._Writer(path, **writer) if not crc else dcp.FileSystemWriter(path, **writer)
            dcp.save(state, storage_writer=w, process_group=self.b.t.dist.ckpt)

        seconds = self.b._timed(save)
        self._record(name, seconds, self._size(path))
        self.b._clear(path)

    def checkpointer(self) -> None:
        """The benchmarked save (state dict, DCP, manifest, commit), with its phases."""
        saver = ck.Checkpointer(self.root / "ckpt", process_group=self.b.t.dist.ckpt, control_group=self.b.group)
        original = ck._Writer
        ck._Writer = _Phases  # type: ignore[misc]
        try:
            start = [0.0]

            def save() -> None:
                start[0] = time.perf_counter()
                saver.save(5000, self.b.t.state(), metrics={}, blocking=True)

            seconds = self.b._timed(save)
        finally:
            ck._Writer = original  # type: ignore[misc]
        end = time.perf_counter()
        log = _Phases.log
        phases = {"state_dict_and_plan": log["write_start"] - start[0],
                  "write_data": log["write_end"] - log["write_start"],
                  "after_write": end - log["write_end"]}
        for k, v in phases.items():
            self.samples.setdefault(f"phase:{k}", []).append(self.b._max(v))
        if self.rank == 0:
            self.samples.setdefault("phase:finish_metadata", []).append(log.get("finish_s", 0.0))
        self.bytes = self._size(self.root / "ckpt")
        self._record("checkpointer", seconds, self.bytes)
        self.b._clear(self.root / "ckpt")

    def raw(self) -> None:
        tensors = [t.contiguous() for t in self.b._local_tensors()]
        path = self.root / f"raw.{self.rank}"

        def write() -> None:
            with open(path, "wb") as f:
                for t in tensors:
                    f.write(memoryview(t.numpy()).cast("B"))
                f.flush()
                os.fsync(f.fileno())

        seconds = self.b._timed(write)
        total = torch.tensor([path.stat().st_size], dtype=torch.int64)
        dist.all_reduce(total, group=self.b.group)
        self._record("raw", seconds, int(total.item()))
        dist.barrier(group=self.b.group)
        path.unlink()

    def dd(self) -> None:
        path = self.root / "dd.bin"
        count = max(1, math.ceil(self.bytes / _DD_BLOCK))

        def run() -> None:
            if self.rank == 0:
                subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={_DD_BLOCK}", f"count={count}",
                                "conv=fsync"], check=True, capture_output=True)

        self._record("dd", self.b._timed(run), count * _DD_BLOCK)
        self.b._clear(path)


def configs(p: Profile) -> dict[str, Callable[[], None]]:
    return {
        "dd": p.dd,
        "raw": p.raw,
        "checkpointer": p.checkpointer,
        "dcp_t1_crc_off": lambda: p.dcp_save("dcp_t1_crc_off"),
        "dcp_t1_crc_on": lambda: p.dcp_save("dcp_t1_crc_on", crc=True),
        "dcp_t2": lambda: p.dcp_save("dcp_t2", thread_count=2),
        "dcp_per_item_files": lambda: p.dcp_save("dcp_per_item_files", single_file_per_rank=False),
        "dcp_no_fsync": lambda: p.dcp_save("dcp_no_fsync", sync_files=False),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.write_profile")
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", default="", help="comma-separated configurations (default: all)")
    a, trainer_flags = p.parse_known_args(argv)
    targs = build_parser().parse_args(["--checkpoint-dir", str(a.dir / "unused"), *trainer_flags])
    d = init_distributed(600)
    try:
        prof = Profile(Bench(warmed_trainer(targs, d), a.dir), a.dir)
        prof.checkpointer()  # warm-up (first save pays for imports and plan caches); also sizes dd
        prof.samples.clear()
        table = configs(prof)
        names = [n for n in table if not a.only or n in a.only.split(",")]
        for r in range(a.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                table[name]()
        if d.rank == 0:
            med = {k: round(statistics.median(v), 4) for k, v in prof.samples.items()}
            a.out.write_text(json.dumps({"median": med, "samples": prof.samples, "bytes": prof.bytes,
                                         "load_avg": os.getloadavg()}, indent=1))
            for k in sorted(med):
                unit = "s" if k.startswith("phase:") else "GB/s"
                print(f"{k:28s} {med[k]:8.4f} {unit}   spread {min(prof.samples[k]):.4f}..{max(prof.samples[k]):.4f}")
        return 0
    finally:
        shutil.rmtree(a.dir / "unused", ignore_errors=True)
        shutdown()


if __name__ == "__main__":
    sys.exit(main())
