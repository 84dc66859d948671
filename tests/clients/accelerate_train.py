"""A user's Accelerate training script: FSDP2 plugin, automatic checkpoint naming, own resume.

Written the way Accelerate's docs suggest and knowing nothing of fsdp-supervisor: `save_state()` every
--save-every steps into `<project-dir>/checkpoints/checkpoint_<i>` (ProjectConfiguration with
`automatic_checkpoint_naming=True, total_limit=...`), and on start `load_state()` when that folder holds
anything, or `load_state(--resume-from)` when given (the supervisor's pick). The step survives in a
registered custom state (`custom_checkpoint_0.pkl`, pickle) and, for readers that do not unpickle, in a
`trainer_state.json` sidecar `{"global_step": N}` written by the main process after `save_state()`
returns (the name and key transformers' Trainer uses for its checkpoints).
Rank 0 prints `resumed step=N from=<folder Accelerate loaded>` and one `step=N loss=<repr>` line per step.
`--step-s` (default 0) sleeps that long in every step, on every rank: a stand-in for a model whose steps take
time, so that a test's kill lands between two saves rather than anywhere in a run that lasts two seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin, ProjectConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset

SIDECAR = "trainer_state.json"


class TrainState:
    """The loop position, saved by Accelerate as custom state (`register_for_checkpointing`)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--project-dir", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--total-limit", type=int, default=None)
    p.add_argument("--resume-from", default=None, help="load this checkpoint instead of Accelerate's own pick")
    p.add_argument("--step-s", type=float, default=0.0, help="seconds to sleep in every step")
    a = p.parse_args()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    project = ProjectConfiguration(project_dir=a.project_dir, automatic_checkpoint_naming=True,
                                   total_limit=a.total_limit)
    acc = Accelerator(fsdp_plugin=plugin, cpu=True, project_config=project)
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    x = torch.randn(1024, 16, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    state = TrainState()
    acc.register_for_checkpointing(state)
    ckpt_root = os.path.join(a.project_dir, "checkpoints")
    loaded: list[str] = []  # Accelerate passes the folder it chose to its load-state pre-hooks
    acc.register_load_state_pre_hook(lambda _models, input_dir: loaded.append(input_dir))
    if a.resume_from or (os.path.isdir(ckpt_root) and os.listdir(ckpt_root)):
        acc.load_state(a.resume_from)  # None: Accelerate picks the folder itself, the last by trailing number
        newest = max(int(m.group(1)) for n in os.listdir(ckpt_root) if (m := re.search(r"(\d+)$", n)))
        acc.project_configuration.iteration = newest + 1  # save_state refuses an existing checkpoint_<i>
        if acc.is_main_process:
            print(f"resumed step={state.step} from={loaded[0]}", flush=True)
    start = state.step
    batches = iter(acc.skip_first_batches(loader, start) if start else loader)
    for step in range(start + 1, a.steps + 1):
        xb, yb = next(batches)
        time.sleep(a.step_s)
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        state.step = step
        if acc.is_main_process:
            print(f"step={step} loss={loss.item()!r}", flush=True)
        if step % a.save_every == 0:
            out = acc.save_state()
            if acc.is_main_process:
                with open(os.path.join(out, SIDECAR), "w") as f:
                    json.dump({"global_step": step}, f)
    acc.end_training()


if __name__ == "__main__":
    main()
