"""A user's PyTorch Lightning script: FSDP with sharded checkpoints, ModelCheckpoint every N steps.

Written the way Lightning's docs suggest and knowing nothing of fsdp-supervisor but its one-line callback
(`lightning_callback()`: the node's and every rank's heartbeat, with the loss) and its rollback's skip:
`Trainer(strategy=FSDPStrategy(state_dict_type="sharded"))`,
`ModelCheckpoint(dirpath=--ckpt-dir, every_n_train_steps=--save-every, save_top_k=--top-k, monitor=...,
save_last=..., save_on_exception=True)` and `trainer.fit(model, ckpt_path=--ckpt-path)`: "last" (the
default) resumes from Lightning's own `last.ckpt`, a path resumes from that checkpoint (the supervisor's pick,
`resume_args = ["--ckpt-path", "{checkpoint}"]`).

One epoch is --save-every steps (the dataset is cut to fit), so every save lands on an epoch boundary and a
resumed run sees the very batches an uninterrupted one does. Rank 0 prints `step=N loss=<repr>` per step and,
after a resume, `resumed step=N from=<path Lightning loaded>`. `--step-s` sleeps in every step (every rank):
a stand-in for a model whose steps take time, so that a test's kill lands between two saves.

After a rollback of a divergence the supervisor sets `FSDP_SUPERVISOR_SKIP_STEPS=N`: for the N steps after the loaded
one `training_step` does not look at its batch (it returns a zero loss marked `"skipped"`, which the heartbeat callback
does not report) and `optimizer_step` makes no update (returning None is refused in distributed training). The steps
still count, and the step counter is what Lightning resumes its data position from: later saves hold the skip. Rank 0
prints `skipped step=N` for each.
Test-only: `FSDP_TEST_NAN_AT_STEP=N` turns the loss of step N into NaN on the supervisor's first attempt only.
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from trainer.callbacks import lightning_callback

BATCH, WORLD = 8, 2


class Tiny(pl.LightningModule):
    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        self.step_s = step_s
        self.skip_to = 0  # the steps up to this one are skipped (a rollback's FSDP_SUPERVISOR_SKIP_STEPS)
        first = os.environ.get("FSDP_SUPERVISOR_ATTEMPT", "1") == "1"
        self.nan_at = int(os.environ.get("FSDP_TEST_NAN_AT_STEP") or 0) if first else 0

    def on_train_start(self) -> None:
        self.skip_to = self.global_step + int(os.environ.get("FSDP_SUPERVISOR_SKIP_STEPS") or 0)

    def training_step(self, batch: Any, _index: int) -> Any:
        if self.global_step < self.skip_to:  # the batch is not looked at; `optimizer_step` below makes no update
            if self.global_rank == 0:
                print(f"skipped step={self.global_step + 1}", flush=True)
            return {"loss": sum(p.sum() for p in self.parameters()) * 0.0, "skipped": True}
        x, y = batch
        time.sleep(self.step_s)
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.global_step + 1 == self.nan_at:
            loss = loss * float("nan")
        self.log("train_loss", loss, on_step=True, sync_dist=True)
        if self.global_rank == 0:
            print(f"step={self.global_step + 1} loss={loss.item()!r}", flush=True)
        return loss

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if self.global_step < self.skip_to:
            optimizer_closure()  # Lightning wants its closure run (training_step, a zero backward); no update
        else:
            optimizer.step(closure=optimizer_closure)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


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
                         max_steps=a.steps, logger=False,
                         callbacks=[checkpoint, lightning_callback(), Resumed(), Hold(a.hold_at, a.hold_dir)],
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(Tiny(a.step_s), loader, ckpt_path=None if a.ckpt_path == "none" else a.ckpt_path)


if __name__ == "__main__":
    main()
