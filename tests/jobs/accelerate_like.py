"""A torch-free, seconds-fast reproduction of what Accelerate 1.16.0 does on disk (FSDP, SHARDED_STATE_DICT).

The user script is tests/clients/accelerate_train.py; this reproduces it together with the Accelerate code
it calls: folder names, nested DCP dirs, the extra files, their write order, `total_limit` cleanup and
`load_state()`'s own choice of folder. R ranks are emulated in one process; the nested DCP dirs get a
real-format `.metadata` from `tests/jobs/dcp_files.py` (a pickle torch itself loads; shards are
zeros); the `.bin`/`.pkl` files hold JSON, as nobody but this script may read them. tests/clients/layouts.py
holds the layout the real program wrote; tests/clients/test_client_reproductions.py checks this against it.

Flags are the user script's. Extra: `--ranks`, `--step-s`, `--die-at-save STEP --die-after FILE` (SIGKILL
itself right after FILE, relative to checkpoint_<i>, is written during the save of STEP), `--die-at-step
STEP` (SIGKILL itself after step STEP, before its save: a crash mid-training), `--die-attempt N` (those two
only in the launch whose FSDP_SUPERVISOR_ATTEMPT is N), `--marker PATH` (one JSON line per launch: attempt,
folder loaded, first step, argv).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

from dcp_files import dcp_metadata_bytes
from marks import append_mark  # tests/jobs/marks.py: this script's directory is on sys.path

MODEL_DIR, OPTIM_DIR = "pytorch_model_fsdp_0", "optimizer_0"  # FSDP_MODEL_NAME_<i>, OPTIMIZER_NAME_<i>
SIDECAR = "trainer_state.json"
TENSORS = {"0.weight": 64, "0.bias": 8, "2.weight": 8}


class CheckpointException(Exception):
    """Named as torch.distributed.checkpoint.api.CheckpointException, which `dcp.load` raises on a missing
    `.metadata` or a short shard (each rank's cause inside: FileNotFoundError, EOFError)."""


def _trailing_number(folder: str) -> int:
    """Accelerator.save_state/load_state `_inner`: the first digit run of the last path component; a name
    without digits (`.trash`, `logs`) raises IndexError, as in Accelerate."""
    return list(map(int, re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", folder)))[0]


class Accelerator:
    """The parts of accelerate.Accelerator (+ utils.fsdp_utils, checkpointing) that touch the disk."""

    def __init__(self, project_dir: Path, ranks: int, total_limit: int | None, die: tuple[int, str] | None) -> None:
        self.root = project_dir / "checkpoints"  # automatic_checkpoint_naming
        self.ranks, self.total_limit, self.die = ranks, total_limit, die
        self.iteration = 0  # ProjectConfiguration.iteration
        self.metadata, self.shard_sizes = dcp_metadata_bytes(TENSORS, shards=ranks)

    # ---- save_state ---------------------------------------------------------------------------------------
    def save_state(self, step: int) -> Path:
        os.makedirs(self.root, exist_ok=True)
        folders = [os.path.join(self.root, f) for f in os.listdir(self.root)]  # every entry, not only checkpoints
        if self.total_limit is not None and len(folders) + 1 > self.total_limit:  # main process
            folders.sort(key=_trailing_number)
            for folder in folders[: len(folders) + 1 - self.total_limit]:
                shutil.rmtree(folder)  # before the new save: while it runs, total_limit - 1 remain
        out = self.root / f"checkpoint_{self.iteration}"
        if out.exists():
            raise ValueError(f"Checkpoint directory {out} ({self.iteration}) already exists. Please manually "
                             "override `self.save_iteration` with what iteration to start with.")
        out.mkdir(parents=True)  # after wait_for_everyone, on every rank (exist_ok)
        self._dcp_save(out, MODEL_DIR, step)  # save_fsdp_model: DCP into pytorch_model_fsdp_0/
        self._dcp_save(out, OPTIM_DIR, step)  # save_fsdp_optimizer: DCP into optimizer_0/
        self._write(out, "scheduler.bin", {"last_epoch": step}, step)  # save_accelerator_state, main process
        for rank in range(self.ranks):  # every rank: its RNG states and Accelerator.step
            self._write(out, f"random_states_{rank}.pkl", {"step": 0}, step)
        self._write(out, "custom_checkpoint_0.pkl", {"step": step}, step)  # save_custom_state, main process
        self.iteration += 1
        return out

    def _dcp_save(self, out: Path, sub: str, step: int) -> None:
        d = out / sub
        d.mkdir(exist_ok=True)
        for name, size in self.shard_sizes.items():
            with open(d / name, "wb") as f:
                f.truncate(size)
            self._maybe_die(step, f"{sub}/{name}")
        (d / ".metadata.tmp").write_bytes(self.metadata)  # FileSystemWriter.finish: tmp, then rename
        os.rename(d / ".metadata.tmp", d / ".metadata")
        self._maybe_die(step, f"{sub}/.metadata")

    def _write(self, out: Path, name: str, body: dict[str, int], step: int) -> None:
        (out / name).write_text(json.dumps(body))
        self._maybe_die(step, name)

    def _maybe_die(self, step: int, written: str) -> None:
        if self.die == (step, written):
            os.kill(os.getpid(), signal.SIGKILL)

    # ---- load_state ---------------------------------------------------------------------------------------
    def load_state(self, input_dir: str | None = None) -> tuple[Path, int]:
        """Returns (folder loaded, step restored from the custom state)."""
        if input_dir is not None:
            path = Path(os.path.expanduser(input_dir))
            if not path.is_dir():
                raise ValueError(f"Tried to find {path} but folder does not exist")
        else:  # automatic naming: the last entry by trailing number, complete or not
            folders = [os.path.join(self.root, f) for f in os.listdir(self.root)]
            folders.sort(key=_trailing_number)
            path = Path(folders[-1])
        print(f"Loading states from {path}", flush=True)
        self._dcp_load(path / MODEL_DIR)  # load_fsdp_model
        self._dcp_load(path / OPTIM_DIR)  # load_fsdp_optimizer
        json.loads((path / "scheduler.bin").read_text())  # load(): FileNotFoundError when missing
        # random_states_<rank>.pkl: read inside `try/except Exception` ("Could not load random states")
        customs = [f for f in os.listdir(path) if re.search(r"^custom_checkpoint_\d+\.pkl$", f)]
        if len(customs) != 1:
            raise RuntimeError(f"Number of custom checkpoints in folder {path} does not match the number of "
                               f"registered objects:\n\tFound checkpoints: {len(customs)}\n\tRegistered objects: 1")
        return path, json.loads((path / "custom_checkpoint_0.pkl").read_text())["step"]

    def _dcp_load(self, d: Path) -> None:
        if not (d / ".metadata").is_file():
            raise CheckpointException(f"CheckpointException ranks:dict_keys([0])\nFileNotFoundError: "
                                      f"[Errno 2] No such file or directory: '{d / '.metadata'}'")
        for name, size in self.shard_sizes.items():
            if not (d / name).is_file() or (d / name).stat().st_size < size:
                raise CheckpointException(f"CheckpointException ranks:dict_keys([0, 1])\nEOFError ({d / name})")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--project-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--total-limit", type=int, default=None)
    p.add_argument("--resume-from", default=None)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--step-s", type=float, default=0.01)
    p.add_argument("--die-at-save", type=int, default=None)
    p.add_argument("--die-after", default=None)
    p.add_argument("--die-at-step", type=int, default=None)
    p.add_argument("--die-attempt", default=None, help="die only in this launch (FSDP_SUPERVISOR_ATTEMPT)")
    p.add_argument("--marker", default=None)
    a = p.parse_args()
    dying = a.die_attempt is None or os.environ.get("FSDP_SUPERVISOR_ATTEMPT") == a.die_attempt
    die = (a.die_at_save, a.die_after) if dying and a.die_at_save is not None else None
    acc = Accelerator(a.project_dir, a.ranks, a.total_limit, die)
    loaded, start = None, 0
    if a.resume_from or (acc.root.is_dir() and os.listdir(acc.root)):  # as tests/clients/accelerate_train.py
        loaded, start = acc.load_state(a.resume_from)
        acc.iteration = max(int(m.group(1)) for n in os.listdir(acc.root) if (m := re.search(r"(\d+)$", n))) + 1
    if a.marker:
        append_mark(a.marker, {"attempt": os.environ.get("FSDP_SUPERVISOR_ATTEMPT"), "pid": os.getpid(),
                               "loaded": loaded.name if loaded else None, "start": start + 1, "argv": sys.argv[1:]})
    for step in range(start + 1, a.steps + 1):
        time.sleep(a.step_s)
        print(f"step={step} loss={1.0 / step!r}", flush=True)
        if dying and step == a.die_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if step % a.save_every == 0:
            out = acc.save_state(step)
            (out / SIDECAR).write_text(json.dumps({"global_step": step}))  # the user script, main process
    return 0


if __name__ == "__main__":
    sys.exit(main())
