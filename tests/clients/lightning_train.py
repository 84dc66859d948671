"""A user's PyTorch Lightning script: FSDP with sharded checkpoints, ModelCheckpoint every N steps.

Written the way Lightning's docs suggest and knowing nothing of fsdp-supervisor except its heartbeat
(an optional Callback, below): `Trainer(strategy=FSDPStrategy(state_dict_type="sharded"))`,
`ModelCheckpoint(dirpath=--ckpt-dir, every_n_train_steps=--save-every, save_top_k=--top-k, monitor=...,
save_last=..., save_on_exception=True)` and `trainer.fit(model, ckpt_path=--ckpt-path)`: "last" (the
default) resumes from Lightning's own `last.ckpt`, a path resumes from that checkpoint (the supervisor's pick,
`resume_args = ["--ckpt-path", "{checkpoint}"]`).

One epoch is --save-every steps (the dataset is cut to fit), so every save lands on an epoch boundary and a
resumed run sees the very batches an uninterrupted one does. Rank 0 prints `step=N loss=<repr>` per step and,
after a resume, `resumed step=N from=<path Lightning loaded>`. `--step-s` sleeps in every step (every rank):
a stand-in for a model whose steps take time, so that a test's kill lands between two saves.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy
from torch.utils.data import DataLoader, TensorDataset

BATCH, WORLD = 8, 2


class Tiny(pl.LightningModule):
    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        self.step_s = step_s

    def training_step(self, batch: Any, _index: int) -> torch.Tensor:
        x, y = batch
        time.sleep(self.step_s)
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=True, sync_dist=True)
        if self.global_rank == 0:
            print(f"step={self.global_step + 1} loss={loss.item()!r}", flush=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Heartbeat(Callback):
    """Rewrite the supervisor's heartbeat file ($FSDP_SUPERVISOR_HEARTBEAT) after every step (rank 0 only)."""

    def __init__(self) -> None:
        self.path = os.environ.get("FSDP_SUPERVISOR_HEARTBEAT")

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.path and trainer.is_global_zero:
            loss = float(outputs["loss"]) if isinstance(outputs, dict) else None
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                json.dump({"step": trainer.global_step, "time": time.time(), "phase": "train", "loss": loss}, f)
            os.replace(tmp, self.path)


class Hold(Callback):
    """Before training the step after each of `steps`, wait until `release-<step>` exists in `folder`: the test
    acts on a save (cuts it, kills a rank) while the job cannot move on to the next one, however loaded the
    machine (a job that trained on past the next save made the test's kill land too late)."""

    def __init__(self, steps: list[int], folder: str | None) -> None:
        self.steps, self.folder = set(steps), folder

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.folder and trainer.global_step in self.steps:
            release = os.path.join(self.folder, f"release-{trainer.global_step}")
            while not os.path.exists(release):
                time.sleep(0.05)


class Resumed(Callback):
    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.ckpt_path and trainer.is_global_zero:
            print(f"resumed step={trainer.global_step} from={trainer.ckpt_path}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--top-k", type=int, default=1)
    p.add_argument("--metric", default=None, help="a logged metric (train_loss) for save_top_k; default: none")
    p.add_argument("--save-last", default="true", choices=["true", "link", "false"])
    p.add_argument("--ckpt-path", default="last", help='"last" (Lightning picks), a path, or "none"')
    p.add_argument("--step-s", type=float, default=0.0)
    p.add_argument("--hold-at", type=int, action="append", default=[], help="wait after this step (and its save)")
    p.add_argument("--hold-dir", default=None, help="where the test puts release-<step> to end a --hold-at")
    a = p.parse_args()
    pl.seed_everything(0, verbose=False)
    n = a.save_every * BATCH * WORLD  # one epoch = --save-every steps on each rank
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=BATCH, shuffle=False)
    save_last = {"true": True, "link": "link", "false": False}[a.save_last]
    checkpoint = ModelCheckpoint(dirpath=a.ckpt_dir, every_n_train_steps=a.save_every, save_top_k=a.top_k,
                                 monitor=a.metric, save_last=save_last, save_on_exception=True)
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=FSDPStrategy(state_dict_type="sharded"),
                         max_steps=a.steps, callbacks=[checkpoint, Heartbeat(), Resumed(), Hold(a.hold_at, a.hold_dir)],
                         logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(Tiny(a.step_s), loader, ckpt_path=None if a.ckpt_path == "none" else a.ckpt_path)


if __name__ == "__main__":
    main()
