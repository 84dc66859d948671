"""A user's own training script, written after the PyTorch DCP tutorial (FSDP1, SHARDED_STATE_DICT).

It knows nothing of fsdp-supervisor: it saves plain DCP dirs `epoch_<E>/` into --ckpt-dir every
--save-every epochs, keeps the newest --keep of them if asked (the tutorial's own cleanup: `shutil.rmtree` of the
older ones, rank 0, after the save), and resumes with --resume-from PATH. No signal handling: SIGTERM ends it where
it is. One epoch is one optimizer step on a fixed batch per rank. Rank 0 prints `step=<E> loss=<repr>` per epoch
and `resumed step=<E> from=<path>`. Used to prove such scripts are supervisable with only `command` and
`resume_args` (tests/integration/test_supervisor_torchrun.py, and the tutorial row of tests/clients).
`--crash-at-epoch E` makes the first attempt (no --resume-from) fail there (`--hold FILE`: once FILE exists, so
that a test can do something to the checkpoints first); `--step-s` sleeps in every epoch. `--save-with-trainer`:
saves with `trainer.checkpoint.save_checkpoint` (`step_<N>/`, the manifest's checksums) but still loads with plain
`dcp.load`, which checks nothing (issue 34's outside attack).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType

from supervisor.contract import ENV_ATTEMPT


def rotate(ckpt_dir: Path, keep: int) -> None:
    """The tutorial's cleanup: keep the newest `keep` epoch dirs (by number), remove the rest."""
    numbered = sorted((int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := re.fullmatch(r"epoch_(\d+)", p.name)))
    for _, old in numbered[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--resume-from", type=Path, default=None)
    p.add_argument("--crash-at-epoch", type=int, default=-1)
    p.add_argument("--record", type=Path, default=None)
    p.add_argument("--keep", type=int, default=0, help="keep the newest K epoch dirs (0: all)")
    p.add_argument("--step-s", type=float, default=0.0)
    p.add_argument("--hold", type=Path, default=None, help="the crash waits until this file exists")
    p.add_argument("--save-with-trainer", action="store_true")
    a = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    model = FSDP(net, device_id=torch.device("cpu"), use_orig_params=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    start = 0
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        if a.resume_from is not None:
            state = {"model": model.state_dict(), "epoch": 0}
            dcp.load(state, checkpoint_id=str(a.resume_from))
            model.load_state_dict(state["model"])
            optim = load_sharded_optimizer_state_dict(model.state_dict(), "optimizer",
                                                      dcp.FileSystemReader(str(a.resume_from)))
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, optim["optimizer"]))
            start = state["epoch"] + 1
            if dist.get_rank() == 0:
                print(f"resumed step={state['epoch']} from={a.resume_from}", flush=True)
        for epoch in range(start, a.epochs):
            time.sleep(a.step_s)
            if epoch == a.crash_at_epoch and a.resume_from is None:
                while a.hold is not None and not a.hold.exists():
                    time.sleep(0.05)
                raise RuntimeError(f"simulated crash at epoch {epoch}")
            g = torch.Generator().manual_seed(epoch * 100 + dist.get_rank())
            x = torch.randn(32, 16, generator=g)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if dist.get_rank() == 0:
                print(f"step={epoch} loss={loss.item()!r}", flush=True)
            if epoch % a.save_every == 0:
                state = {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model, opt), "epoch": epoch}
                if a.save_with_trainer:
                    from trainer.checkpoint import save_checkpoint
                    save_checkpoint(a.ckpt_dir, epoch, state)
                else:
                    dcp.save(state, checkpoint_id=str(a.ckpt_dir / f"epoch_{epoch}"))
                if a.keep and dist.get_rank() == 0:
                    rotate(a.ckpt_dir, a.keep)
    if a.record is not None and dist.get_rank() == 0:
        with open(a.record, "a") as f:
            f.write(f"start={start} resume={a.resume_from} attempt={os.environ.get(ENV_ATTEMPT)}\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
