"""What every rank's own heartbeat costs the job: `heartbeat.per_rank_overhead` (issue 25).

Throughput with every rank beating / with rank 0 only, measured inside one torchrun job of the reference
trainer (bench/heartbeat_job.py) in short alternating blocks of steps, so that both sides share the process,
the model and the machine's moment: the ratio of each round's two blocks (rank0 time / every time), median
over the rounds. `per_rank_overhead_cpu` is the same ratio of the ranks' CPU time: what a loaded machine
disturbs least (its swings of the wall time do not move CPU time, and a beat costs CPU, never a wait). The
model is small (steps of a few tens of ms on CPU) so that a per-step cost would show. Also the cost of one
beat itself, in this process: `per_beat_us` (a rank's in-place write), `node_beat_us` (the node's atomic
rewrite, throttled to once a second in the trainer) and `per_step_fraction` (per_beat_us / the step time).

    python -m bench.heartbeat        # prints the result of run() as JSON
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import PY, Tagged, job_env, scratch, wait_until
from trainer.heartbeat import Heartbeat, RankBeat

__all__ = ["run", "MODEL", "beat_cost_us"]

MODEL = {"d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 32, "batch_size": 4}
TIMEOUT = 600.0


def beat_cost_us(folder: Path, n: int = 20000) -> dict[str, float]:
    """Microseconds per call: a rank's own beat (a new step each call, 10 us apart: nearly all held back by the throttle,
    as a fast job's are), one such write unthrottled, and the node's file (every call forced)."""
    per: dict[str, float] = {}
    for key, interval in (("per_beat_us", None), ("per_write_us", 0.0)):
        rank = RankBeat(folder / "rank-0.json", **({} if interval is None else {"step_interval_s": interval}))
        start = time.perf_counter()
        for step in range(n):
            rank.beat(step, "train", 1.0 + step * 1e-5, step_s=0.01)
        per[key] = round((time.perf_counter() - start) / n * 1e6, 2)
        rank.close()
    node = Heartbeat(folder / "heartbeat.json")
    start = time.perf_counter()
    for step in range(n // 20):
        node.beat(step, "train", 1.0, force=True)
    per_node = (time.perf_counter() - start) / (n // 20) * 1e6
    return {**per, "node_beat_us": round(per_node, 2)}


def _ratios(blocks: list[dict[str, Any]], key: str) -> list[float]:
    """Each round's rank0 / every ratio of `key` (seconds: rank0's throughput is the inverse)."""
    by_round: dict[int, dict[str, float]] = {}
    for b in blocks:
        by_round.setdefault(b["round"], {})[b["variant"]] = b[key]
    return [r["rank0"] / r["every"] for r in by_round.values() if r.get("every")]


def run(rounds: int = 60, block: int = 4, model: dict[str, Any] | None = None) -> dict[str, Any]:
    root = scratch("heartbeat")
    tagged = Tagged()
    try:
        out = root / "result.json"
        argv = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "bench.heartbeat_job",
                "--dir", str(root), "--out", str(out), "--rounds", str(rounds), "--block", str(block)]
        for key, value in {**MODEL, **(model or {})}.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        proc = tagged.start(argv, log=root / "job.log", env=job_env())
        wait_until(lambda: proc.poll() is not None, TIMEOUT, "the heartbeat job", interval=0.2)
        if proc.returncode != 0:
            raise RuntimeError(f"heartbeat job failed ({proc.returncode}): {(root / 'job.log').read_text()[-2000:]}")
        blocks = json.loads(out.read_text())["blocks"]
        ratios, cpu_ratios = _ratios(blocks, "seconds"), _ratios(blocks, "cpu_s")
        step_s = statistics.median(b["seconds"] for b in blocks) / block
        costs = beat_cost_us(root)
        return {"heartbeat": {
            "per_rank_overhead": round(statistics.median(ratios), 4) if ratios else None,
            "per_rank_overhead_cpu": round(statistics.median(cpu_ratios), 4) if cpu_ratios else None,
            "round_ratios_quartiles": [round(q, 4) for q in statistics.quantiles(ratios, n=4)] if len(ratios) > 1 else [],
            "step_s": round(step_s, 5),
            "per_step_fraction": round(costs["per_beat_us"] * 1e-6 / step_s, 6) if step_s else None,
            **costs, "rounds": rounds, "steps_per_block": block, "model": {**MODEL, **(model or {})},
        }}
    finally:
        tagged.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps(run(), indent=2))
