"""Write real DCP checkpoints with the installed torch and record which pickle globals their metadata uses.

Not a test module: tests of `supervisor.checkpoints` call `run_writer`, which runs this file as a
script (plainly, or under `torchrun --standalone --nproc-per-node=2`), so the test process itself
never imports torch (torch is imported only inside the script's functions).

    python tests/checkpoints_dcp_writer.py single OUT   # dcp.save and dcp.async_save, no process group
    torchrun ... tests/checkpoints_dcp_writer.py fsdp OUT  # FSDP2 step_<N> and FSDP1 SHARDED epoch_<N>

Each mode writes checkpoints under OUT and, on rank 0, `OUT/<mode>-globals.json`: every
(module, name) that `pickle` asked `find_class` for while loading each `.metadata`.
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()


def run_writer(mode: str, out: Path, timeout: float = 180) -> dict[str, Any]:
    """Run this script in `mode` ("single" or "fsdp") in its own session; return its globals record."""
    if mode == "single":
        cmd = [sys.executable, str(HERE), mode, str(out)]
    else:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        cmd = [*torchrun, str(HERE), mode, str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"writer {mode} failed ({proc.returncode}):\n{output.decode(errors='replace')[-4000:]}")
    return json.loads((out / f"{mode}-globals.json").read_text())


class _RecordingUnpickler(pickle.Unpickler):
    """The real unpickler, noting each global it resolves: the ground truth for the store's allowlist."""

    def __init__(self, file, seen: set[tuple[str, str]]) -> None:
        super().__init__(file)
        self._seen = seen

    def find_class(self, module: str, name: str):
        self._seen.add((module, name))
        return super().find_class(module, name)


def record_globals(dirs: list[Path], out: Path) -> None:
    seen: set[tuple[str, str]] = set()
    for d in dirs:
        with open(d / ".metadata", "rb") as f:
            _RecordingUnpickler(f, seen).load()
    import torch

    # Every dtype as pickle names it (its canonical name): the allowlist must cover all of them.
    dtypes = sorted({str(v).removeprefix("torch.") for v in vars(torch).values() if isinstance(v, torch.dtype)})
    out.write_text(json.dumps({"dirs": [str(d) for d in dirs], "globals": sorted(seen), "dtypes": dtypes}))


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _state(model) -> dict:
    import torch

    # Several dtypes and a non-tensor object, so the metadata has bytes entries and more than one dtype.
    return {
        "model": model.state_dict(),
        "extra": {
            "half": torch.ones(3, dtype=torch.float16),
            "bf16": torch.ones(2, 2, dtype=torch.bfloat16),
            "ids": torch.arange(5, dtype=torch.int64),
            "flags": torch.tensor([True, False]),
            "step": 7,
            "name": "tiny",
        },
    }


def write_single(out: Path) -> list[Path]:
    import torch.distributed.checkpoint as dcp

    model = _model()
    a, b = out / "step_00000010", out / "step_00000020"
    dcp.save(_state(model), checkpoint_id=a)
    dcp.async_save(_state(model), checkpoint_id=b).result()
    return [a, b]


def _train_step(model, opt, device) -> None:
    import torch

    x = torch.randn(4, 8, device=device)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()


def write_fsdp(out: Path) -> list[Path]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType, fully_shard

    device = torch.device("cuda", dist.get_rank()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    model2 = _model().to(device)
    for layer in model2:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model2)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    _train_step(model2, opt2, device)
    msd, osd = get_state_dict(model2, opt2)
    step_dir = out / "step_00000003"
    dcp.save({"model": msd, "optimizer": osd, "step": 3}, checkpoint_id=step_dir)

    # The seed tutorial's layout: FSDP1, SHARDED_STATE_DICT, {"model", "optimizer", "epoch"} in epoch_<E>.
    # An explicit device_id: FSDP1 refuses CPU-only hosts unless told the device (gloo runs).
    model1 = FSDP(_model().to(device), device_id=device)
    opt1 = torch.optim.AdamW(model1.parameters(), lr=1e-3)
    _train_step(model1, opt1, device)
    with FSDP.state_dict_type(model1, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model1.state_dict(), "optimizer": FSDP.optim_state_dict(model1, opt1), "epoch": 2}
    epoch_dir = out / "epoch_2"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(epoch_dir))
    return [step_dir, epoch_dir]


def main(mode: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if mode == "single":
        record_globals(write_single(out), out / "single-globals.json")
        return
    import torch
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    try:
        dirs = write_fsdp(out)
        dist.barrier()
        if dist.get_rank() == 0:
            record_globals(dirs, out / "fsdp-globals.json")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], Path(sys.argv[2]))
