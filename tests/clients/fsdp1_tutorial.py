"""A user's script written after the PyTorch DCP-with-FSDP tutorial: FSDP1, SHARDED_STATE_DICT, `epoch_<E>/` dirs.

It knows nothing of fsdp-supervisor. It wraps the model in `FullyShardedDataParallel`, saves
`{"model", "optimizer", "epoch"}` with `dcp.save` into `--ckpt-dir/epoch_<E>` every --save-every epochs, keeps
the newest --keep of them (its own rotation: `shutil.rmtree` of the older ones, on rank 0, after the save), and
resumes with `--resume-from PATH`. No signal handling: SIGTERM ends it where it is, and the next run resumes from
its last periodic save. One epoch is one optimizer step on a fixed batch per rank. Rank 0 prints
`step=<E> loss=<repr>` per epoch and `resumed step=<E> from=<path>`; `--step-s` sleeps in every epoch.
"""
from __future__ import annotations

import argparse
import re
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType


def rotate(ckpt_dir: Path, keep: int) -> None:
    """The tutorial's cleanup: keep the newest `keep` epoch dirs (by number), remove the rest."""
    numbered = sorted((int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := re.fullmatch(r"epoch_(\d+)", p.name)))
    for _, old in numbered[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--keep", type=int, default=5)
    p.add_argument("--resume-from", type=Path, default=None)
    p.add_argument("--step-s", type=float, default=0.0)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model = FSDP(net, device_id=torch.device("cpu"), use_orig_params=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    start = 1
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        if a.resume_from is not None:
            state = {"model": model.state_dict(), "epoch": 0}
            dcp.load(state, checkpoint_id=str(a.resume_from))
            model.load_state_dict(state["model"])
            optim = load_sharded_optimizer_state_dict(model.state_dict(), "optimizer",
                                                      dcp.FileSystemReader(str(a.resume_from)))
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, optim["optimizer"]))
            start = state["epoch"] + 1
            if rank == 0:
                print(f"resumed step={state['epoch']} from={a.resume_from}", flush=True)
        for epoch in range(start, a.epochs + 1):
            time.sleep(a.step_s)
            g = torch.Generator().manual_seed(epoch * 100 + rank)
            x = torch.randn(32, 16, generator=g)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rank == 0:
                print(f"step={epoch} loss={loss.item()!r}", flush=True)
            if epoch % a.save_every == 0:
                state = {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model, opt), "epoch": epoch}
                dcp.save(state, checkpoint_id=str(a.ckpt_dir / f"epoch_{epoch}"))
                if rank == 0:
                    rotate(a.ckpt_dir, a.keep)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
