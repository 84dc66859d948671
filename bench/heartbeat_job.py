"""The torch side of bench/heartbeat.py: the reference trainer's own step and heartbeat, in alternating blocks.

Every rank builds `trainer.loop.Trainer` at the model size given and trains short blocks of `--block` steps,
each step followed by the trainer's own heartbeat call, alternating block by block (the order rotating every
round, so that both sides share the machine's moment: this box's load swings step times by 2x) between
- `rank0`: the node's heartbeat file only, written by rank 0 (what the trainer did before every rank beat), and
- `every`: the node's file plus every rank's own file (`FSDP_SUPERVISOR_HEARTBEAT_DIR`), as the trainer does now.
A block ends with an all-reduce of the ranks' CPU time, so its time holds every rank's beats (a rank's beat
after the last step would otherwise delay the next block). Rank 0 writes the blocks as JSON to --out.

    torchrun --standalone --nproc-per-node=2 -m bench.heartbeat_job --dir D --out R.json [trainer model flags]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from supervisor.contract import rank_heartbeat_name
from trainer.args import build_parser
from trainer.heartbeat import Heartbeat, RankBeat
from trainer.loop import Trainer
from trainer.parallel import init_distributed, shutdown
from trainer.stopping import GracefulStop

VARIANTS = ("rank0", "every")


def block(trainer: Trainer, node: Heartbeat, own: RankBeat | None, steps: int) -> tuple[float, float]:
    """(rank 0's wall seconds, every rank's CPU seconds) for `steps` steps and their beats, up to an all-reduce every
    rank reaches after its last beat. CPU time is what a loaded machine disturbs least (waits cost none of it).

    One node heartbeat serves both variants (its once-a-second atomic rewrite lands in either alike); `own` is
    what `Heartbeat(..., rank_path=...)` adds on every rank, called as the trainer's heartbeat calls it."""
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        loss = trainer.train_step()
        node.beat(trainer.progress.step, "train", loss)
        if own is not None:
            own.beat(trainer.progress.step, "train", time.time(), trainer.step_timer.seconds())
    used = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
    dist.all_reduce(used, group=trainer.dist.control)
    return time.perf_counter() - start, float(used.item())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.heartbeat_job")
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--block", type=int, default=4)
    a, trainer_flags = p.parse_known_args(argv)
    targs = build_parser().parse_args(["--checkpoint-dir", str(a.dir / "unused"), *trainer_flags])
    d = init_distributed(600)
    try:
        trainer = Trainer(targs, d, GracefulStop(), Heartbeat(None))
        trainer.build()
        node = Heartbeat(a.dir / "heartbeat.json" if d.rank == 0 else None)
        own = RankBeat(a.dir / rank_heartbeat_name(d.rank))
        block(trainer, node, own, 10)  # warm-up: allocator, first collectives, the rank file opened
        blocks: list[dict[str, float | str | int]] = []
        for r in range(a.rounds):
            for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
                wall, cpu = block(trainer, node, own if v == "every" else None, a.block)
                blocks.append({"round": r, "variant": v, "seconds": wall, "cpu_s": cpu})
        if d.rank == 0:
            a.out.write_text(json.dumps({"blocks": blocks, "steps_per_block": a.block, "pid": os.getpid()}))
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
