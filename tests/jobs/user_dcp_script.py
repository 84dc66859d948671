"""A user's own training script, written after the PyTorch DCP tutorial (FSDP1, SHARDED_STATE_DICT).

It knows nothing of fsdp-supervisor: it saves plain DCP dirs `epoch_<E>/` into --ckpt-dir every
--save-every epochs and resumes with --resume-from PATH. Used to prove such scripts are supervisable with
only `command` and `resume_args`. `--crash-at-epoch E` makes the first attempt (no --resume-from) fail there.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType

from supervisor.contract import ENV_ATTEMPT


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--resume-from", type=Path, default=None)
    p.add_argument("--crash-at-epoch", type=int, default=-1)
    p.add_argument("--record", type=Path, required=True)
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
        for epoch in range(start, a.epochs):
            if epoch == a.crash_at_epoch and a.resume_from is None:
                raise RuntimeError(f"simulated crash at epoch {epoch}")
            g = torch.Generator().manual_seed(epoch * 100 + dist.get_rank())
            x = torch.randn(32, 16, generator=g)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if epoch % a.save_every == 0:
                state = {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model, opt), "epoch": epoch}
                dcp.save(state, checkpoint_id=str(a.ckpt_dir / f"epoch_{epoch}"))
    if dist.get_rank() == 0:
        with open(a.record, "a") as f:
            f.write(f"start={start} resume={a.resume_from} attempt={os.environ.get(ENV_ATTEMPT)}\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
