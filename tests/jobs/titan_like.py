"""A torch-free, seconds-fast reproduction of what torchtitan 0.3.0 does on disk, for supervisor tests.

Same folder names, same files, same write order and the same resume rule as the real
`torchtitan.components.checkpointer.dcp.CheckpointManager` (CheckpointManager below), with R ranks
emulated in one process and real-format DCP `.metadata` from `tests/jobs/dcp_files.py` (a pickle
torch itself loads; shards are zeros). tests/clients/layouts.py holds the layout the real program wrote
in the real-client tier; tests/clients/test_client_reproductions.py checks this script against it.

Flags keep torchtitan's spelling where torchtitan has one (`--dump_folder`, `--checkpoint.load_step`, ...).
Extra: `--ranks`, `--step-s` (seconds per step), `--die-at-save STEP --die-after FILE` (SIGKILL itself
right after FILE, relative to the checkpoint dir, is written during the save of STEP: what a kill mid-save
leaves), `--die-at-step STEP` (SIGKILL itself after step STEP, before its save: a crash mid-training),
`--die-attempt N` (those two only in the launch whose FSDP_SUPERVISOR_ATTEMPT is N), `--marker PATH` (one
JSON line per launch: attempt, what it loaded, first step, argv).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

from dcp_files import dcp_metadata_bytes
from marks import append_mark  # tests/jobs/marks.py: this script's directory is on sys.path

# flattened torchtitan state (ModelWrapper keys + optimizer/lr_scheduler/dataloader/train_state), sizes tiny
TENSORS = {"tok_embeddings.weight": 64, "layers.0.attention.wqkv.weight": 48, "norm.weight": 8,
           "optimizer.state.tok_embeddings.weight.exp_avg": 64}


class CheckpointException(Exception):
    """Named as torch.distributed.checkpoint.api.CheckpointException, which `dcp.load` raises on a missing
    `.metadata` or a short shard (each rank's cause inside: FileNotFoundError, EOFError)."""


class CheckpointManager:
    """torchtitan.components.checkpointer.dcp.CheckpointManager, reduced to what touches the disk."""

    def __init__(self, folder: Path, ranks: int, keep_latest_k: int, die: tuple[int, str] | None) -> None:
        self.folder, self.ranks, self.keep_latest_k, self.die = folder, ranks, keep_latest_k, die
        self.metadata, self.shard_sizes = dcp_metadata_bytes(TENSORS, shards=ranks)

    def find_load_step(self) -> int:
        """_find_load_step: the highest `step-(\\d+)` (re.search, not a full match) holding `.metadata`."""
        if not self.folder.is_dir():
            return -1
        steps = []
        for name in os.listdir(self.folder):
            m = re.search(r"step-(\d+)", name)
            if m and ((self.folder / name / ".metadata").is_file()
                      or (self.folder / name / "model.safetensors.index.json").is_file()):
                steps.append(int(m.group(1)))
        return max(steps) if steps else -1

    def load(self, step: int = -1) -> int | None:
        """_load: --checkpoint.load_step N, else the newest by find_load_step; returns the loaded step."""
        has_folder = self.folder.exists()
        load_step = (self.find_load_step() if step == -1 else step) if has_folder else -1
        if step != -1 and not has_folder:
            raise FileNotFoundError(f"--checkpoint.load_step={step} not found because "
                                    f"checkpoint.folder {self.folder} does not exist")
        if load_step == -1:
            print("No checkpoint was provided, this is a fresh start.", flush=True)
            return None
        checkpoint_id = self.folder / f"step-{load_step}"
        if not checkpoint_id.is_dir():
            raise FileNotFoundError(f"--checkpoint.load_step={load_step} not found at {checkpoint_id}")
        print(f"Loading the checkpoint from {checkpoint_id}.", flush=True)
        self._dcp_load(checkpoint_id)
        return load_step

    def _dcp_load(self, path: Path) -> None:
        """dcp.load: reads `.metadata`, then every shard it names; a missing or short one fails the load."""
        if not (path / ".metadata").is_file():
            raise CheckpointException(f"CheckpointException ranks:dict_keys([0])\nFileNotFoundError: "
                                      f"[Errno 2] No such file or directory: '{path / '.metadata'}'")
        for name, size in self.shard_sizes.items():
            shard = path / name
            if not shard.is_file() or shard.stat().st_size < size:
                raise CheckpointException(f"CheckpointException ranks:dict_keys([0, 1])\nEOFError ({shard})")

    def save(self, step: int) -> None:
        """dcp.save into `step-N` (FileSystemWriter), then _purge_stale_checkpoints on rank 0."""
        ckpt = self.folder / f"step-{step}"
        ckpt.mkdir(parents=True, exist_ok=True)  # set_up_storage_writer: every rank, exist_ok (re-saves overwrite)
        for name, size in self.shard_sizes.items():  # each rank writes its `__<rank>_0.distcp` in place
            with open(ckpt / name, "wb") as f:
                f.truncate(size)
            self._maybe_die(step, name)
        tmp = ckpt / ".metadata.tmp"  # FileSystemWriter.finish, coordinator only, after all ranks wrote
        tmp.write_bytes(self.metadata)
        self._maybe_die(step, ".metadata.tmp")
        (ckpt / ".metadata").unlink(missing_ok=True)  # an older save's `.metadata` is removed first
        os.rename(tmp, ckpt / ".metadata")
        self._maybe_die(step, ".metadata")
        self._purge()

    def _purge(self) -> None:
        """_purge_stale_checkpoints: every `step-(\\d+)` name counts, complete or not; the real one deletes in a
        background thread (shutil.rmtree, ignore_errors), done inline here."""
        if self.keep_latest_k <= 0 or not self.folder.is_dir():
            return
        found = sorted((int(m.group(1)), self.folder / name) for name in os.listdir(self.folder)
                       if (m := re.search(r"step-(\d+)", name)))
        for _, path in found[: -self.keep_latest_k]:
            shutil.rmtree(path, ignore_errors=True)

    def _maybe_die(self, step: int, written: str) -> None:
        if self.die == (step, written):
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dump_folder", type=Path, required=True)
    p.add_argument("--checkpoint.folder", dest="folder", default="checkpoint")
    p.add_argument("--checkpoint.interval", dest="interval", type=int, default=5)
    p.add_argument("--checkpoint.keep_latest_k", dest="keep_latest_k", type=int, default=10)
    p.add_argument("--checkpoint.load_step", dest="load_step", type=int, default=-1)
    p.add_argument("--training.steps", dest="steps", type=int, default=20)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--step-s", type=float, default=0.01)
    p.add_argument("--die-at-save", type=int, default=None)
    p.add_argument("--die-after", default=None)
    p.add_argument("--die-at-step", type=int, default=None)
    p.add_argument("--die-attempt", default=None, help="die only in this launch (FSDP_SUPERVISOR_ATTEMPT)")
    p.add_argument("--marker", default=None)
    a = p.parse_args()  # a bad value exits 2, as tyro does for `--checkpoint.load_step {step}`
    if a.keep_latest_k == 1:
        raise ValueError("We need to maintain at least 2 checkpoint replicas, "
                         "as the last one may be in the process of being saved.")
    dying = a.die_attempt is None or os.environ.get("FSDP_SUPERVISOR_ATTEMPT") == a.die_attempt
    die = (a.die_at_save, a.die_after) if dying and a.die_at_save is not None else None
    manager = CheckpointManager(a.dump_folder / a.folder, a.ranks, a.keep_latest_k, die)
    loaded = manager.load(a.load_step)  # Trainer.train: checkpointer.load(step=config.checkpoint.load_step)
    start = loaded or 0
    if a.marker:
        append_mark(a.marker, {"attempt": os.environ.get("FSDP_SUPERVISOR_ATTEMPT"), "pid": os.getpid(),
                               "loaded": None if loaded is None else f"step-{loaded}", "start": start + 1,
                               "argv": sys.argv[1:]})
    for step in range(start + 1, a.steps + 1):
        time.sleep(a.step_s)
        print(f"step: {step}  loss: {1.0 / step:.5f}", flush=True)
        if dying and step == a.die_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if step % a.interval == 0 or step == a.steps:  # _should_save; the last step always saves
            manager.save(step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
