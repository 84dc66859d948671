"""A user's Hugging Face `transformers.Trainer` script: torch FSDP, SHARDED_STATE_DICT, a tiny model from a config.

Written the way the transformers docs suggest and knowing nothing of fsdp-supervisor: a 2-layer Llama built
from `LlamaConfig` (no download), `TrainingArguments(fsdp="full_shard", fsdp_config={"state_dict_type":
"SHARDED_STATE_DICT"}, save_strategy="steps", save_steps=--save-every, save_total_limit=--total-limit)`,
checkpoints in `<output-dir>/checkpoint-<global_step>/`. Resume either way transformers offers:
`--resume_from_checkpoint PATH` (the supervisor's pick, `resume_args = ["--resume_from_checkpoint",
"{checkpoint}"]`) or `--resume-auto` (`trainer.train(resume_from_checkpoint=True)`: transformers picks the
highest-numbered `checkpoint-N` itself). `--jit-checkpoint`: transformers' own emergency save on SIGTERM
(`enable_jit_checkpoint=True`: `checkpoint-<step>/` at the step it reached). `--no-fsdp`: the Trainer's defaults
(DDP, the full state dict: `model.safetensors`, `optimizer.pt`, ... in each `checkpoint-N/`). On CPU ranks the
Trainer's resume then loads `optimizer.pt` with `map_location=args.device`, `cpu:0`, which torch 2.13 cannot restore
("don't know how to restore data location ... cpu:0"; on GPUs it is `cuda:N`): `cpu_locations()` lets torch read
`cpu:N` as `cpu`, a CPU-only shim like tests/clients/shims/accelerate_cpu.py.

Rank 0 prints `step=N loss=<repr>` per step (a TrainerCallback's `on_log`, logging every step) and, after a
resume, `resumed step=N from=<folder>`. `--step-s` sleeps in every step (every rank): a stand-in for a model
whose steps take time, so that a test's kill lands between two saves. `--hold-at N --hold-dir D`: before the step after
step N (and its save), wait until `D/release-N` exists (as tests/clients/lightning_train.py's).

The supervisor's one line: `callbacks=[hf_callback()]` (trainer/callbacks.py: the node's and every rank's heartbeat
with the logged loss, `logging_steps=1`). The Trainer resumes its data position from the checkpoint's `global_step`
only and offers no way to skip more: after a rollback (`FSDP_SUPERVISOR_SKIP_STEPS=N`) rank 0 prints `not skipping
N steps` and the Trainer trains on the same data again. Test-only: `FSDP_TEST_NAN_AT_STEP=N` turns the loss of step N
into NaN on the supervisor's first attempt only (`compute_loss`).
"""
from __future__ import annotations

import argparse
import atexit
import os
import sys
import time
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from trainer.callbacks import hf_callback

SEQ, VOCAB = 32, 128


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Fixed random token sequences: the labels are the inputs (causal LM)."""

    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Printer(TrainerCallback):
    def __init__(self, step_s: float, hold: list[int] | None = None, folder: str | None = None) -> None:
        self.step_s, self.hold, self.folder = step_s, set(hold or ()), folder

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        time.sleep(self.step_s)
        if self.folder and state.global_step in self.hold:
            while not os.path.exists(os.path.join(self.folder, f"release-{state.global_step}")):
                time.sleep(0.05)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if state.is_world_process_zero and logs and "loss" in logs:
            print(f"step={state.global_step} loss={logs['loss']!r}", flush=True)


class NaNAt(Trainer):
    """Test-only: the loss of step `nan_at` (1-based, as printed) is NaN; 0: the Trainer as it is."""

    nan_at = 0

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        out = super().compute_loss(model, inputs, *args, **kwargs)
        if self.state.global_step + 1 != self.nan_at:
            return out
        return (out[0] * float("nan"), *out[1:]) if isinstance(out, tuple) else out * float("nan")


def cpu_locations() -> None:
    """torch.load restores a storage tagged `cpu:N` as a CPU storage (see the module docstring)."""
    torch.serialization.register_package(
        11, lambda obj: None, lambda obj, location: obj if str(location).startswith("cpu:") else None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--total-limit", type=int, default=None)
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--resume-auto", action="store_true", help="trainer.train(resume_from_checkpoint=True)")
    p.add_argument("--jit-checkpoint", action="store_true", help="enable_jit_checkpoint: save on SIGTERM")
    p.add_argument("--step-s", type=float, default=0.0)
    p.add_argument("--hold-at", type=int, action="append", default=[], help="wait after this step (and its save)")
    p.add_argument("--hold-dir", default=None, help="where the test puts release-<step> to end a --hold-at")
    p.add_argument("--no-fsdp", action="store_true", help="no FSDP: the default full state dict layout")
    a = p.parse_args()
    if a.no_fsdp:
        cpu_locations()
    sharded = {} if a.no_fsdp else {"fsdp": "full_shard", "fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"}}
    args = TrainingArguments(
        output_dir=a.output_dir, max_steps=a.steps, per_device_train_batch_size=4, learning_rate=1e-3,
        logging_steps=1, save_strategy="steps", save_steps=a.save_every, save_total_limit=a.total_limit,
        use_cpu=True, seed=0, report_to=[], disable_tqdm=True, dataloader_num_workers=0,
        enable_jit_checkpoint=a.jit_checkpoint, **sharded)  # type: ignore[arg-type]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ)
    trainer = NaNAt(model=LlamaForCausalLM(config), args=args, train_dataset=Tokens(a.steps * 8),
                    callbacks=[Printer(a.step_s, a.hold_at, a.hold_dir), hf_callback()])
    if os.environ.get("FSDP_SUPERVISOR_ATTEMPT", "1") == "1":
        trainer.nan_at = int(os.environ.get("FSDP_TEST_NAN_AT_STEP") or 0)
    skip = int(os.environ.get("FSDP_SUPERVISOR_SKIP_STEPS") or 0)
    if skip and args.process_index == 0:
        print(f"not skipping {skip} steps", flush=True)
    resume: str | bool | None = a.resume_from_checkpoint
    if a.resume_auto and os.path.isdir(a.output_dir) and get_last_checkpoint(a.output_dir):
        resume = True  # transformers raises when there is none: a first run starts fresh
    if resume and args.process_index == 0:
        picked = resume if isinstance(resume, str) else get_last_checkpoint(a.output_dir)
        print(f"resuming from={picked}", flush=True)
    trainer.train(resume_from_checkpoint=resume)
    # Trained and saved: skip the interpreter's teardown, where gloo's (the Trainer leaves its process group alive)
    # aborted with SIGABRT in 3 of 4 make test-clients runs of 2026-12-06 (destroy_process_group hung DDP instead).
    atexit._run_exitfuncs()  # the library's last heartbeat write, as a normal exit would do it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
