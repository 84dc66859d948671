"""The torch side of the checkpoint I/O benchmark: saves and cold loads of a >= 1 GB checkpoint vs `dd`.

Runs under torchrun. Every rank builds a transformer-shaped sharded state (per layer: attention and MLP
weights, a norm, and AdamW's two moments for each, as DTensors sharded on dim 0 over all ranks, the
layout FSDP2 saves), then runs `--rounds` write rounds and twice as many load rounds; within a round the
two sides run back to back and which goes first alternates, so that a change of disk speed hits both
sides of a round alike, and an even count weighs both orders equally (one uncounted load round comes
first; SETTLE_S says why the order mattered here):
- write: the trainer's `Checkpointer.save(blocking=True)` (DCP write, fsync, manifest, atomic rename)
  against rank 0's `dd if=/dev/zero bs=4M conv=fsync` of the same size into the same directory;
- load: the trainer's `load_checkpoint` (DCP) into preallocated tensors of the same layout (the first
  load is checked against the saved values) against rank 0's `dd if=FILE of=/dev/null bs=4M` over every
  file of the checkpoint, one after the other. Both start cold (`--cache`): `drop_caches` (sync, then
  `echo 3 > /proc/sys/vm/drop_caches`; needs root), else `fadvise` (fsync, then
  `posix_fadvise(POSIX_FADV_DONTNEED)` on every file: evicts clean pages of files we can open), else
  `warm`; `auto` takes the first that works; then SETTLE_S (`--settle-s`) of quiet.
Each time is the slowest rank's. Rank 0 writes JSON to --out. `--profile` compares loader and writer
variants instead (docs/performance-scale.md); `--local-dir` compares loads from the durable root's disk and
from a node-local tier (bench/local_tier.py).

    torchrun --standalone --nproc-per-node=2 -m bench.checkpoint_io_job --dir D --out R.json [--gb 1.2]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from trainer.checkpoint import Checkpointer, _Writer, load_checkpoint
from trainer.parallel import init_distributed, shutdown

_DD_BLOCK = 4 * 2**20
# After evicting, wait until the memory the drop freed is settled. This VM's balloon has free page
# reporting: ~2 s after guest pages are freed the host takes them back, and a read into such pages runs at
# about half the speed of one into pages the host still backs. Cold `dd` of the same 1.2 GB, 8 times
# each: 0.2 s after the drop alternated 2.0 / 1.2 GB/s, 1 s after 1.0-1.6, 4 s after 0.73-1.0.
SETTLE_S = 4.0
CACHE_METHODS = ("drop_caches", "fadvise", "warm")


def layer_shapes(d_model: int) -> dict[str, tuple[int, ...]]:
    """One transformer block's parameters (fp32): q, k, v, o, the MLP's up and down projections, a norm."""
    return {"attn.wq": (d_model, d_model), "attn.wk": (d_model, d_model), "attn.wv": (d_model, d_model),
            "attn.wo": (d_model, d_model), "mlp.up": (4 * d_model, d_model), "mlp.down": (4 * d_model, d_model),
            "norm": (d_model,)}


def layers_for(gb: float, d_model: int) -> int:
    per_layer = 3 * 4 * sum(torch.Size(s).numel() for s in layer_shapes(d_model).values())  # param + 2 moments
    return max(1, round(gb * 1e9 / per_layer + 0.49))


def build_state(layers: int, d_model: int, mesh: Any, fill: bool) -> dict[str, Any]:
    """{"model": {fqn: DTensor}, "optim": {"state": {fqn: {"exp_avg", "exp_avg_sq"}}}}, sharded on dim 0.

    `fill`: random values (what is saved); else zeros (what a load reads into). Zeros, not `torch.empty`: a
    resuming job loads into memory it has touched (initialized parameters; moments made by a zero step),
    and untouched pages would charge the first load ~150k page faults per rank (0.7 s against 0.25 s warm)."""
    world, rank = mesh.size(), mesh.get_local_rank()

    def shard(shape: tuple[int, ...]) -> DTensor:
        rows = -(-shape[0] // world)
        local_rows = max(0, min(rows, shape[0] - rank * rows))
        local = torch.rand((local_rows, *shape[1:])) if fill else torch.zeros((local_rows, *shape[1:]))
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())

    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for i in range(layers):
        for name, shape in layer_shapes(d_model).items():
            fqn = f"layers.{i}.{name}"
            model[fqn] = shard(shape)
            optim[fqn] = {"exp_avg": shard(shape), "exp_avg_sq": shard(shape)}
    return {"model": model, "optim": {"state": optim}}


def _leaves(state: Any) -> list[torch.Tensor]:
    if isinstance(state, DTensor):
        return [state.to_local()]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _leaves(v)]
    return []


def make_cold(files: list[Path], method: str) -> str:
    """Evict the checkpoint's pages from the page cache; returns the method that worked."""
    if method in ("auto", "drop_caches"):
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "drop_caches"
        except OSError:
            if method == "drop_caches":
                raise
    if method in ("auto", "fadvise") and hasattr(os, "posix_fadvise"):
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"
    return "warm"


class IoBench:
    def __init__(self, root: Path, gb: float, d_model: int, cache: str, settle_s: float = SETTLE_S) -> None:
        self.d = init_distributed(600)
        self.rank, self.group = self.d.rank, self.d.control
        self.mesh = init_device_mesh("cpu", (self.d.world_size,))
        self.root, self.path = root, root / "ckpt"
        self.saver = Checkpointer(root / "saves", process_group=self.d.ckpt, control_group=self.group)
        self.layers = layers_for(gb, d_model)
        self.source = build_state(self.layers, d_model, self.mesh, fill=True)
        self.target = build_state(self.layers, d_model, self.mesh, fill=False)
        self.cache_wanted, self.cache, self.settle_s = cache, "warm", settle_s
        self.samples: dict[str, list[float]] = {k: [] for k in ("save_gbps", "dd_fsync_gbps", "save_s", "dd_fsync_s",
                                                                  "load_gbps", "dd_gbps", "load_s", "dd_s")}
        self.write_rounds: list[dict[str, float]] = []
        self.load_rounds: list[dict[str, float]] = []

    def _max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    def files(self) -> list[Path]:
        return sorted(p for p in self.path.iterdir() if p.is_file())

    def save(self) -> int:
        """The checkpoint the loads read (plain DCP through the trainer's writer)."""
        dist.barrier(group=self.group)
        import torch.distributed.checkpoint as dcp

        dcp.save(self.source, storage_writer=_Writer(self.path), process_group=self.d.ckpt)
        dist.barrier(group=self.group)
        return sum(p.stat().st_size for p in self.files())

    def _remove(self, path: Path) -> None:
        dist.barrier(group=self.group)
        if self.rank == 0:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        dist.barrier(group=self.group)

    def checkpointer_save(self, step: int) -> tuple[float, int]:
        dist.barrier(group=self.group)
        start = time.perf_counter()
        result = self.saver.save(step, self.source, blocking=True)
        seconds = self._max(time.perf_counter() - start)
        box = [sum(f.stat().st_size for f in result.final.iterdir()) if self.rank == 0 else 0]
        dist.broadcast_object_list(box, src=0, group=self.group)
        self._remove(self.root / "saves" / result.final.name)
        return seconds, int(box[0])

    def dd_fsync(self, nbytes: int) -> tuple[float, int]:
        path, count = self.root / "dd.bin", max(1, -(-nbytes // _DD_BLOCK))
        dist.barrier(group=self.group)
        start = time.perf_counter()
        if self.rank == 0:
            subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={_DD_BLOCK}", f"count={count}", "conv=fsync"],
                           check=True, capture_output=True)
        seconds = self._max(time.perf_counter() - start)
        self._remove(path)
        return seconds, count * _DD_BLOCK

    def cold(self) -> None:
        box = [self.cache]
        if self.rank == 0:
            box = [make_cold(self.files(), self.cache_wanted)]
            if box[0] != "warm":
                time.sleep(self.settle_s)
        dist.broadcast_object_list(box, src=0, group=self.group)
        self.cache = box[0]
        dist.barrier(group=self.group)

    def dd(self) -> tuple[float, int]:
        self.cold()
        start = time.perf_counter()
        if self.rank == 0:
            for path in self.files():
                subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={_DD_BLOCK}"], check=True,
                               capture_output=True)
        return self._max(time.perf_counter() - start), sum(p.stat().st_size for p in self.files())

    def load(self, check: bool) -> float:
        self.cold()
        start = time.perf_counter()
        load_checkpoint(self.path, self.target, process_group=self.d.ckpt)
        seconds = self._max(time.perf_counter() - start)
        if check:
            for got, want in zip(_leaves(self.target), _leaves(self.source)):
                if not torch.equal(got, want):
                    raise AssertionError("the loaded checkpoint differs from the saved one")
        return seconds

    def variant(self, name: str) -> float:
        """A loader configuration for the profile (docs/performance-scale.md): seconds, slowest rank."""
        import torch.distributed.checkpoint as dcp

        from trainer.reader import CheckpointReader

        self.cold()
        start = time.perf_counter()
        if name == "raw_read":  # this rank's own file into its (touched) buffer: the floor without parsing
            with open(self.path / f"__{self.rank}_0.distcp", "rb", buffering=0) as f:
                view, done = memoryview(self._raw), 0
                while done < len(view):
                    done += f.readinto(view[done:done + _DD_BLOCK]) or len(view)
        elif name == "dd_parallel":  # every rank dd's its own file at the same time (the ranks' access pattern)
            subprocess.run(["dd", f"if={self.path / f'__{self.rank}_0.distcp'}", "of=/dev/null", f"bs={_DD_BLOCK}"],
                           check=True, capture_output=True)
        elif name == "dcp_default":
            dcp.load(self.target, checkpoint_id=self.path, process_group=self.d.ckpt)
        else:  # "direct_<threads>": the trainer's reader
            reader = CheckpointReader(self.path, threads=int(name.split("_")[1].rstrip("ab")))
            dcp.load(self.target, checkpoint_id=self.path, storage_reader=reader, process_group=self.d.ckpt)
        return self._max(time.perf_counter() - start)

    def save_variant(self, name: str) -> tuple[float, int]:
        """A DCP save (no commit) for the profile: `save_trainer` (the trainer's writer), `save_crc` (DCP's
        own, with the CRC32), `save_t<N>` (N writer threads), `save_nofsync` (the page cache's speed)."""
        import torch.distributed.checkpoint as dcp

        path = self.root / "variant"
        options: dict[str, Any] = {"save_nofsync": {"sync_files": False}}.get(name, {})
        if name[len("save_t"):].isdigit():
            options = {"thread_count": int(name[len("save_t"):])}
        writer = dcp.FileSystemWriter(path) if name == "save_crc" else _Writer(path, **options)
        dist.barrier(group=self.group)
        start = time.perf_counter()
        dcp.save(self.source, storage_writer=writer, process_group=self.d.ckpt)
        seconds = self._max(time.perf_counter() - start)
        size = sum(p.stat().st_size for p in path.iterdir())
        self._remove(path)
        return seconds, size

    def profile(self, rounds: int, names: list[str]) -> dict[str, Any]:
        nbytes = self.save()
        self._raw = bytearray(os.path.getsize(self.path / f"__{self.rank}_0.distcp"))  # touched: zero-filled
        out: dict[str, list[float]] = {}
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                if name == "dd":
                    seconds, size = self.dd()
                elif name == "dd_fsync":
                    seconds, size = self.dd_fsync(nbytes)
                elif name == "checkpointer":
                    seconds, size = self.checkpointer_save(2000 + r)
                elif name.startswith("save_"):
                    seconds, size = self.save_variant(name)
                else:
                    seconds, size = self.variant(name), nbytes
                out.setdefault(name, []).append(size / seconds / 1e9)
        return {"profile_gbps": out, "bytes": nbytes, "cache": self.cache}

    def _record(self, kind: str, rounds: list[dict[str, float]], ours: tuple[float, int], dd: tuple[float, int],
                dd_key: str) -> None:
        ours_gbps, dd_gbps = ours[1] / ours[0] / 1e9, dd[1] / dd[0] / 1e9
        rounds.append({"checkpoint": round(ours_gbps, 4), dd_key: round(dd_gbps, 4),
                       "ratio": round(ours_gbps / dd_gbps, 4)})
        for key, value in ((f"{kind}_gbps", ours_gbps), (f"{dd_key}_gbps", dd_gbps), (f"{kind}_s", ours[0]),
                           (f"{dd_key}_s", dd[0])):
            self.samples[key].append(value)

    def tiers(self, local: Path, rounds: int) -> dict[str, Any]:
        """`--local-dir`: cold loads of the same checkpoint from the durable root's side (`--dir`) and from the node-
        local tier (bench/local_tier.py's `load_speedup`), back to back, the order alternating, each after the same
        eviction (a tmpfs keeps its pages: that is the tier's point); the first two rounds are checked."""
        durable, nbytes = self.path, self.save()
        dist.barrier(group=self.group)
        dcp.save(self.source, storage_writer=_Writer(local), process_group=self.d.ckpt)
        dist.barrier(group=self.group)
        samples: dict[str, list[float]] = {"durable_s": [], "local_s": []}
        for r in range(rounds):
            order = [("durable_s", durable), ("local_s", local)]
            for key, path in order if r % 2 == 0 else order[::-1]:
                self.path = path  # load() and its eviction read the checkpoint at self.path
                samples[key].append(self.load(check=r < 2))
        self.path = durable
        return {"samples": samples, "bytes": nbytes, "cache": self.cache, "world_size": self.d.world_size}

    def run(self, rounds: int) -> dict[str, Any]:
        nbytes = self.save()
        save_bytes = nbytes
        for r in range(rounds):  # writes: the first round saves first (the dd needs the size)
            if r % 2 == 0:
                ours = self.checkpointer_save(1000 + r)
                save_bytes = ours[1]
                dd = self.dd_fsync(save_bytes)
            else:
                dd = self.dd_fsync(save_bytes)
                ours = self.checkpointer_save(1000 + r)
            self._record("save", self.write_rounds, ours, dd, "dd_fsync")
        # Loads: twice the write rounds. An even count, so that either order is half the rounds; and more of
        # them, because cold reads here spread more than writes (per-round ratios 0.76-2.03 within one run).
        # First one round that is not counted: right after the write rounds, cold reads ran at twice their
        # later speed (memory the writes freed that the host had not taken back yet; see SETTLE_S).
        self.dd()
        self.load(check=False)
        for r in range(2 * rounds):
            if r % 2 == 0:
                dd = self.dd()
                ours = (self.load(check=r == 0), nbytes)
            else:
                ours = (self.load(check=r == 0), nbytes)
                dd = self.dd()
            self._record("load", self.load_rounds, ours, dd, "dd")
        return {"samples": self.samples, "write_rounds": self.write_rounds, "load_rounds": self.load_rounds,
                "bytes": nbytes, "save_bytes": save_bytes, "cache": self.cache, "files": len(self.files()),
                "layers": self.layers, "world_size": self.d.world_size,
                "tensors_per_rank": len(_leaves(self.source))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.checkpoint_io_job")
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--gb", type=float, default=1.2, help="checkpoint size (GB, 1e9 bytes)")
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cache", choices=("auto", *CACHE_METHODS), default="auto")
    p.add_argument("--settle-s", type=float, default=SETTLE_S, help="quiet after each eviction (see SETTLE_S)")
    p.add_argument("--local-dir", type=Path, default=None,
                   help="compare cold loads from --dir and from this node-local tier instead (bench/local_tier.py)")
    p.add_argument("--profile", default="", help="comma-separated loader configurations to compare instead "
                   "(loads: dd, dd_parallel, raw_read, dcp_default, direct_<threads>; saves: dd_fsync, "
                   "checkpointer, save_trainer, save_crc, save_t<threads>, save_nofsync)")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    bench = IoBench(a.dir, a.gb, a.d_model, a.cache, a.settle_s)
    try:
        if a.local_dir is not None:
            result = bench.tiers(a.local_dir / "ckpt", a.rounds)
        else:
            result = bench.profile(a.rounds, a.profile.split(",")) if a.profile else bench.run(a.rounds)
        if bench.rank == 0:
            a.out.write_text(json.dumps(result))
        return 0
    finally:
        shutdown()


if __name__ == "__main__":
    sys.exit(main())
