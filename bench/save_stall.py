"""Checkpoint cost of the reference trainer: training stall (sync vs async vs a memcpy), write speed vs `dd`.

Runs bench/ckpt_job.py under torchrun (2 ranks) at a model size whose state (parameters plus AdamW's two
moments) is a few hundred MB, and reduces its samples to medians:
- `save_stall_s`: `{sync, async, memcpy_floor, async_over_sync, async_over_memcpy}` plus, not gated,
  `memcpy_clone` (the copy with fresh allocations), `async_first_save` (the first async save, which also
  allocates the staging buffers), `async_write` (save call to commit) and `async_background_extra` (how
  much longer the training steps during the background write took than undisturbed ones);
- `write_gbps_small`: `{checkpoint, dd_fsync, ratio, ratio_spread, rounds}`: bytes of a sync checkpoint /
  its save time, against `dd if=/dev/zero bs=4M conv=fsync` of the same size in the same directory; each
  round is one save and one dd back to back (alternating which goes first), `ratio` is the median of the
  rounds' ratios and `ratio_spread` their range. At this size (~300 MB) a save's fixed cost weighs in;
  the gated `write_gbps` is bench/checkpoint_io.py's, at >= 1 GB;
- `dcp_vs_torch_save`: DCP's sharded sync save vs gathering a full state dict on rank 0 and `torch.save`;
- `supervisor_verify_s`: the supervisor's CPU per new checkpoint of this size (`verify()`: mostly parsing
  `.metadata` with its allowlisting pure-Python unpickler), cold metadata cache.

    python -m bench.save_stall        # prints the result of run() as JSON
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from bench.common import Tagged, job_env, median, scratch, torchrun_argv

__all__ = ["run", "MODEL"]

# ~25 M parameters: 100 MB of weights + 200 MB of AdamW moments, a few hundred MB of state over 2 ranks.
MODEL = {"d_model": 512, "n_layers": 8, "n_heads": 8, "seq_len": 32, "batch_size": 2}
TIMEOUT = 900.0


def _flags(model: dict[str, Any]) -> list[str]:
    return [x for k, v in model.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def reduce(raw: dict[str, Any]) -> dict[str, Any]:
    """Medians and ratios from the job's samples (seconds, GB/s)."""
    s = raw["samples"]
    stall = {"sync": median(s["sync"], 4), "async": median(s["async"], 4), "memcpy_floor": median(s["memcpy"], 4)}
    stall["async_over_sync"] = _ratio(stall["async"], stall["sync"])
    stall["async_over_memcpy"] = _ratio(stall["async"], stall["memcpy_floor"])
    # The first async save also allocates the stager's buffers (later saves reuse them): shown apart.
    stall.update(memcpy_clone=median(s["clone"], 4), async_first_save=round(s["async"][0], 4),
                 async_write=median(s["async_write"], 4), async_background_extra=median(s["async_extra"], 4))
    rounds = raw["write_rounds"]
    ratios = [r["ratio"] for r in rounds]
    write = {"checkpoint": median(s["checkpoint_gbps"], 3), "dd_fsync": median(s["dd_gbps"], 3),
             "ratio": median(ratios), "ratio_spread": [min(ratios), max(ratios)] if ratios else None,
             "rounds": rounds, "bytes": raw["checkpoint_bytes"]}
    full = median(s["full"], 4)
    dcp = {"dcp_sharded_save_s": stall["sync"], "full_state_dict_torch_save_s": full,
           "torch_save_over_dcp": _ratio(full, stall["sync"])}
    model = {"params": raw["params"], "state_mb": round(raw["state_bytes"] / 2**20, 1),
             "checkpoint_mb": round((raw["checkpoint_bytes"] or 0) / 2**20, 1), "step_s": round(raw["step_s"], 4)}
    return {"save_stall_s": stall, "write_gbps_small": write, "dcp_vs_torch_save": dcp, "model": model,
            "repeats": raw["repeats"], "save_samples": s}


def verify_seconds(path: Path, repeats: int = 3) -> float | None:
    """What the supervisor spends on each new checkpoint: `verify()` with its metadata cache cleared."""
    from supervisor.checkpoints import verify
    from supervisor.checkpoints.metadata import reader as metadata
    times = []
    for _ in range(repeats):
        metadata._cache.clear()
        start = time.perf_counter()
        assert verify(path).state == "complete", path
        times.append(time.perf_counter() - start)
    return median(times, 4)


def run(repeats: int = 3, model: dict[str, Any] | None = None, data_dir: Path | None = None) -> dict[str, Any]:
    """Run the checkpoint job once (all kinds interleaved inside it) and reduce its samples."""
    root = Path(data_dir) if data_dir else scratch("ckpt")
    out = root / "result.json"
    flags = _flags({**MODEL, **(model or {})})
    argv = [*torchrun_argv(), "-m", "bench.ckpt_job", "--dir", str(root), "--out", str(out),
            "--repeats", str(repeats), *flags]
    try:
        with Tagged() as tagged:
            p = tagged.start(argv, log=root / "job.log", env=job_env())
            rc = p.wait(TIMEOUT)
            if rc != 0 or not out.exists():
                tail = (root / "job.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"checkpoint benchmark job failed (exit {rc}):\n{tail}")
            result = reduce(json.loads(out.read_text()))
        result["model"]["flags"] = " ".join(flags)
        result["supervisor_verify_s"] = verify_seconds(next((root / "sync").glob("step_*")))
        return result
    finally:
        if data_dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps(run(), indent=2))
