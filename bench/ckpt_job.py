"""The torch side of the checkpoint benchmarks: runs under torchrun, times saves of the reference trainer.

Every rank builds the reference trainer (`trainer.loop.Trainer`) at the model size given, trains two steps
so that AdamW's state exists, then repeats, in an order that rotates every round:
- `sync`: `Checkpointer.save(blocking=True)` (DCP write, fsync, manifest, atomic rename);
- `async`: the part of `Checkpointer.save()` with `--async-save` that blocks training (state dict, staging
  copy, hand-off to DCP's writer thread); training then continues until the write is done everywhere,
  and the extra time those steps took over the undisturbed step time is recorded too;
- `memcpy`: copying every local tensor of the same state once into preallocated buffers (and `clone`:
  the same with fresh allocations);
- `full`: the tutorial's "normal" save: a full state dict gathered on rank 0 (cpu offload), `torch.save`d
  there and fsynced;
- `dd`: rank 0 runs `dd if=/dev/zero bs=4M conv=fsync` of the checkpoint's size into the same directory,
  right before or after a `sync` save (alternating): each such pair is a write round, so that a change of
  disk speed (other tenants, the host) hits both sides of a round's ratio alike.
Each time is the slowest rank's. Rank 0 writes the results as JSON to --out. One last sync checkpoint
is left in `--dir/sync` for the runner, which times the supervisor's verification of it.

    torchrun --standalone --nproc-per-node=2 -m bench.ckpt_job --dir D --out R.json [trainer model flags]
"""
from __future__ import annotations

import argparse
import gc
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
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from trainer.args import build_parser
from trainer.checkpoint import Checkpointer
from trainer.heartbeat import Heartbeat
from trainer.loop import Trainer
from trainer.parallel import init_distributed, shutdown
from trainer.stopping import GracefulStop

KINDS = ("sync", "async", "memcpy", "full")  # "sync" is a write round: a sync save and a dd
_DD_BLOCK = 4 * 2**20


class Bench:
    def __init__(self, trainer: Trainer, root: Path) -> None:
        self.t, self.root = trainer, root
        self.rank = trainer.dist.rank
        self.group = trainer.dist.control
        self.sync_saver = Checkpointer(root / "sync", process_group=trainer.dist.ckpt, control_group=self.group)
        self.async_saver = Checkpointer(root / "async", process_group=trainer.dist.ckpt, control_group=self.group,
                                        async_save=True)
        self.step_s = self._step_time(5)
        self.bytes: int | None = None
        self.out: dict[str, list[float]] = {k: [] for k in
                                             ("sync", "async", "async_write", "async_extra", "memcpy", "clone",
                                              "full", "dd", "checkpoint_gbps", "dd_gbps")}
        self.rounds: list[dict[str, float]] = []  # write rounds: {checkpoint, dd_fsync, ratio} in GB/s

    # ---- helpers ---------------------------------------------------------------------------------------------
    def _max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    def _timed(self, fn: Callable[[], Any]) -> float:
        dist.barrier(group=self.group)
        start = time.perf_counter()
        fn()
        return self._max(time.perf_counter() - start)

    def _step_time(self, n: int) -> float:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            self.t.train_step()
            times.append(time.perf_counter() - start)
        return self._max(statistics.median(times))

    def _local_tensors(self) -> list[torch.Tensor]:
        state = self.t.state(rng=False)
        flat: list[torch.Tensor] = []

        def walk(x: Any) -> None:
            if isinstance(x, DTensor):
                flat.append(x.to_local())
            elif isinstance(x, torch.Tensor):
                flat.append(x)
            elif isinstance(x, dict):
                for v in x.values():
                    walk(v)
            elif isinstance(x, (list, tuple)):
                for v in x:
                    walk(v)

        walk(state["model"].state_dict())
        walk(state["optim"].state_dict())
        return flat

    def _clear(self, path: Path) -> None:
        dist.barrier(group=self.group)
        if self.rank == 0:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        dist.barrier(group=self.group)

    # ---- the measurements --------------------------------------------------------------------------------------
    def sync(self, step: int, keep: bool = False) -> None:
        result: list[Any] = []
        seconds = self._timed(lambda: result.append(
            self.sync_saver.save(step, self.t.state(), metrics={"loss": 0.0}, blocking=True)))
        if self.rank == 0:
            self.bytes = sum(f.stat().st_size for f in result[0].final.iterdir())
        box = [self.bytes]
        dist.broadcast_object_list(box, src=0, group=self.group)
        self.bytes = box[0]
        self.out["sync"].append(seconds)
        self.out["checkpoint_gbps"].append(self.bytes / seconds / 1e9)
        if not keep:
            self._clear(self.root / "sync")

    def async_(self, step: int) -> None:
        dist.barrier(group=self.group)
        start = time.perf_counter()
        pending = self.async_saver.save(step, self.t.state(), metrics={"loss": 0.0}, blocking=False)
        blocked = time.perf_counter() - start
        extra, steps = 0.0, 0
        while True:  # train on until the write is done on every rank (decided together: steps are collective)
            done = torch.tensor([1 if pending.future is not None and pending.future.done() else 0])
            dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self.group)
            if done.item() or steps >= 500:
                break
            s = time.perf_counter()
            self.t.train_step()
            extra += time.perf_counter() - s - self.step_s
            steps += 1
        self.async_saver.wait()
        written = time.perf_counter() - start
        self.out["async"].append(self._max(blocked))
        self.out["async_write"].append(self._max(written))
        self.out["async_extra"].append(self._max(extra))
        self._clear(self.root / "async")

    def memcpy(self) -> None:
        src = self._local_tensors()
        dst = [torch.empty_like(t) for t in src]
        self.out["memcpy"].append(self._timed(lambda: [d.copy_(s) for d, s in zip(dst, src)]))
        dst.clear()  # free the buffers before the clone pass allocates its own
        self.out["clone"].append(self._timed(lambda: [s.clone() for s in src]))

    def full(self) -> None:
        path = self.root / "full.pt"
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)

        def save() -> None:
            state = {"model": get_model_state_dict(self.t.model, options=opts),
                     "optim": get_optimizer_state_dict(self.t.model, self.t.optimizer, options=opts)}
            if self.rank == 0:
                with open(path, "wb") as fh:
                    torch.save(state, fh)
                    fh.flush()
                    os.fsync(fh.fileno())

        self.out["full"].append(self._timed(save))
        self._clear(path)

    def write_round(self, step: int, dd_first: bool) -> None:
        """A sync save and a dd of its size, in the order given (the first round must save first: sizes)."""
        if dd_first and self.bytes is not None:
            self.dd()
            self.sync(step)
        else:
            self.sync(step)
            self.dd()
        cp, dd = self.out["checkpoint_gbps"][-1], self.out["dd_gbps"][-1]
        self.rounds.append({"checkpoint": round(cp, 4), "dd_fsync": round(dd, 4), "ratio": round(cp / dd, 4)})

    def dd(self) -> None:
        assert self.bytes is not None, "sizes come from a sync save"
        path = self.root / "dd.bin"
        count = max(1, math.ceil(self.bytes / _DD_BLOCK))

        def run() -> None:
            if self.rank == 0:
                subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={_DD_BLOCK}", f"count={count}",
                                "conv=fsync"], check=True, capture_output=True)

        seconds = self._timed(run)
        self.out["dd"].append(seconds)
        self.out["dd_gbps"].append(count * _DD_BLOCK / seconds / 1e9)
        self._clear(path)


def warmed_trainer(targs: argparse.Namespace, d: Any) -> Trainer:
    """The reference trainer built and past two steps (optimizer state exists), its objects frozen out of the
    cyclic GC as trainer.loop.run does before training: what a save in steady state looks like."""
    trainer = Trainer(targs, d, GracefulStop(), Heartbeat(None))
    trainer.build()
    for _ in range(2):
        trainer.train_step()
    gc.freeze()
    return trainer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.ckpt_job")
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--repeats", type=int, default=3)
    a, trainer_flags = p.parse_known_args(argv)
    targs = build_parser().parse_args(["--checkpoint-dir", str(a.dir / "unused"), *trainer_flags])
    d = init_distributed(600)
    try:
        trainer = warmed_trainer(targs, d)
        bench = Bench(trainer, a.dir)
        step = 1000
        for r in range(a.repeats):
            for kind in KINDS[r % len(KINDS):] + KINDS[:r % len(KINDS)]:
                step += 1
                {"sync": lambda: bench.write_round(step, dd_first=r % 2 == 1),  # noqa: B023 - called right here
                 "async": lambda: bench.async_(step),  # noqa: B023 - called right here
                 "memcpy": bench.memcpy, "full": bench.full}[kind]()
        bench.sync(step + 1, keep=True)  # not a sample: left for the runner to time the supervisor's verify()
        bench.out["sync"].pop()
        bench.out["checkpoint_gbps"].pop()
        state_bytes = sum(t.numel() * t.element_size() for t in bench._local_tensors())
        total = torch.tensor([state_bytes], dtype=torch.int64)
        dist.all_reduce(total, group=d.control)
        if d.rank == 0:
            params = sum(t.numel() for t in trainer.model.parameters())  # DTensors: global sizes
            result = {"samples": bench.out, "write_rounds": bench.rounds, "checkpoint_bytes": bench.bytes,
                      "state_bytes": int(total.item()), "params": params, "step_s": bench.step_s,
                      "world_size": d.world_size, "repeats": a.repeats}
            a.out.write_text(json.dumps(result))
        return 0
    finally:
        shutdown()


if __name__ == "__main__":
    sys.exit(main())
