"""The node-local checkpoint tier: what its saves cost while training, what it saves on a failure, how fast it loads.

- `throughput_ratio`: tokens/s of bare torchrun training with local saves every K steps (async, into /dev/shm) /
  the same without: bench/throughput.py's job, over the same steps K/2 .. K/2 + 2K in both (a window in steps, not
  seconds, so that it holds two saves and their aftermath however loaded the machine is), runs interleaved,
  the median of the rounds' own ratios. `cpu_per_step_ratio` gives the same comparison in the workers' CPU
  seconds per step (less sensitive to other load on the machine).
- `steps_lost_median`: recovery rounds of bench/recovery.py (same job, same kill) under the supervisor with
  `[checkpoints] local_dir` on /dev/shm, the durable root saving every DURABLE_EVERY steps and the local tier every
  K; lost = the last step trained before the kill - the step resumed (the job's own log, as bench/recovery.py
  reads it). Also the recovery's total, its phases and
  which tier each round resumed from.
- `load_speedup`: a cold load of the same 1.2 GB checkpoint from the durable root (a disk, `FSDP_BENCH_DIR`) /
  from the local tier, through the trainer's `load_checkpoint` (bench/checkpoint_io_job.py `--local-dir`), median
  of per-round ratios.

    python -m bench.local_tier        # prints the result of run() as JSON
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from bench import recovery
from bench.common import Tagged, job_env, median, scratch, torchrun_argv, train_lines, trainer_argv, wait_until
from bench.throughput import LOG_EVERY, MODEL, SAVE_EVERY, _tokens_per_s

__all__ = ["run", "K", "DURABLE_EVERY", "TIER_BASE"]

# Local saves every K steps: the K reported with the figures (steps_lost_median's goal). One save costs a fixed
# ~0.2 s of CPU per rank here (DCP serialises each of the throughput model's 238 tensors on its own), about 3 of
# its 0.1 s steps: K = 200 keeps that near 1.5% (a job with second-long steps gets the same cost at K of a few).
K = 200
DURABLE_EVERY = 2000  # the durable root's --save-every in the recovery rounds: rarely, as it would be with a tier
TIER_BASE = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())  # a tmpfs where there is one
TIMEOUT = 180.0


def _tier_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"bench-{prefix}-", dir=TIER_BASE))


def _workers_cpu(agent: psutil.Process) -> float:
    total = 0.0
    for p in agent.children(recursive=True):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


def _training_once(local: bool, *, k: int, saves: int, model: dict[str, Any]) -> dict[str, Any]:
    """One bare torchrun run: tokens/s and CPU seconds per step over steps k/2 .. k/2 + saves*k (the same steps with
    or without local saves: with them, exactly `saves` saves fall inside, each with k/2 steps of its aftermath)."""
    root, tier = scratch("tier-train"), _tier_dir("tier-train")
    extra = {"local_save_every": k, "local_checkpoint_dir": tier} if local else {}
    first, last = k // 2, k // 2 + saves * k
    try:
        with Tagged() as tagged:
            cmd = torchrun_argv() + trainer_argv(root / "ckpts", steps=10**6, save_every=SAVE_EVERY, log_every=LOG_EVERY,
                                                 async_save=True, **model, **extra)
            log = root / "job.log"
            agent = psutil.Process(tagged.start(cmd, log=log, env=job_env()).pid)

            def reached(step: int) -> float | None:
                text = log.read_text(errors="replace") if log.exists() else ""
                if agent.status() == psutil.STATUS_ZOMBIE:
                    raise RuntimeError(f"the training job exited early:\n{text[-3000:]}")
                lines = train_lines(text)
                return _workers_cpu(agent) if lines and lines[-1][0] >= step else None

            cpu0 = wait_until(lambda: reached(first), TIMEOUT + first, f"step {first}", interval=0.05)
            cpu1 = wait_until(lambda: reached(last), TIMEOUT + 2 * last, f"step {last}", interval=0.05)
            text = log.read_text(errors="replace")
            window = [(s, t) for s, t in train_lines(text) if first <= s <= last]
            tokens = _tokens_per_s(window, 2 * model["batch_size"] * model["seq_len"])
            saved = [int(m) for m in re.findall(rf"event=checkpoint_saved rank=0 step=(\d+) path={re.escape(str(tier))}",
                                                text)]
            steps = window[-1][0] - window[0][0]
            return {"tokens_per_s": tokens, "cpu_per_step": round((cpu1 - cpu0) / steps, 5) if steps else None,
                    "steps": steps, "local_saves": sum(first < s <= last for s in saved)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(tier, ignore_errors=True)


def throughput(repeats: int, *, k: int = K, saves: int = 2, model: dict[str, Any] | None = None,
               progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """`throughput_ratio` and `cpu_per_step_ratio` (medians of interleaved rounds' own ratios), local saves every `k`."""
    model = {**MODEL, **(model or {})}
    runs: dict[str, list[dict[str, Any]]] = {"local": [], "off": []}
    for r in range(repeats):
        for variant in (("local", "off") if r % 2 == 0 else ("off", "local")):
            runs[variant].append(_training_once(variant == "local", k=k, saves=saves, model=model))
            if progress:
                progress(f"local tier throughput {variant} #{r + 1}: {runs[variant][-1]['tokens_per_s']:.0f} tokens/s")
    pairs = list(zip(runs["local"], runs["off"]))  # each round's two runs ran back to back: the same machine load
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in pairs if a["tokens_per_s"] and b["tokens_per_s"]]
    cpu = [b["cpu_per_step"] / a["cpu_per_step"] for a, b in pairs if a["cpu_per_step"] and b["cpu_per_step"]]
    return {"throughput_ratio": median(ratios, 4), "cpu_per_step_ratio": median(cpu, 4),
            "round_ratios": [round(x, 3) for x in ratios],
            "tokens_per_s": {v: median(x["tokens_per_s"] for x in runs[v]) for v in runs},
            "local_saves_in_window": [x["local_saves"] for x in runs["local"]], "throughput_runs": runs}


def recovery_rounds(repeats: int, *, k: int = K, model: dict[str, Any] | None = None, seed: int = 0,
                    progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Recovery under the supervisor with the tier on, killed at a drawn step: steps lost and where it resumed."""
    draw = random.Random(seed)
    rounds = []
    for r in range(repeats):
        tier = _tier_dir("tier-recovery")
        try:
            kill = draw.randrange(2 * k, 3 * k)  # any point between two local saves, once the first ones exist
            out = recovery.measure_once("supervisor", kill_step=kill, model=model, local=tier,
                                        flags={"save_every": DURABLE_EVERY, "local_save_every": k})
        finally:
            shutil.rmtree(tier, ignore_errors=True)
        out["resumed_tier"] = "local" if out["resumed_from"] and out["resumed_from"].startswith(str(tier)) else "durable"
        out["kill_step"] = kill
        rounds.append(out)
        if progress:
            progress(f"local tier recovery #{r + 1}: {out['total']} s, lost {out['steps_lost']['true']} steps "
                     f"(resumed from the {out['resumed_tier']} tier)")
    return {"steps_lost_median": median(x["steps_lost"]["true"] for x in rounds),
            "recovery_s": median(x["total"] for x in rounds),
            "breakdown": {ph: median(x["phases"][ph] for x in rounds) for ph in recovery.PHASES},
            "recovery_runs": rounds}


def load_speedup(repeats: int, *, gb: float = 1.2, d_model: int = 1024, ranks: int = 2) -> dict[str, Any]:
    """Cold load from the durable root / from the local tier (bench/checkpoint_io_job.py), median per-round ratio."""
    from bench.common import PY

    root, tier = scratch("tier-load"), _tier_dir("tier-load")
    out = root / "result.json"
    launcher = torchrun_argv(ranks) if ranks > 1 else [PY]
    argv = [*launcher, "-m", "bench.checkpoint_io_job", "--dir", str(root), "--local-dir", str(tier), "--out", str(out),
            "--rounds", str(repeats), "--gb", str(gb), "--d-model", str(d_model)]
    try:
        with Tagged() as tagged:
            rc = tagged.start(argv, log=root / "job.log", env=job_env()).wait(900)
            if rc != 0 or not out.exists():
                tail = (root / "job.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"local tier load benchmark failed (exit {rc}):\n{tail}")
        raw = json.loads(out.read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(tier, ignore_errors=True)
    s = raw["samples"]
    ratios = [d / loc for d, loc in zip(s["durable_s"], s["local_s"])]
    return {"load_speedup": median(ratios), "load_s": {"durable": median(s["durable_s"]), "local": median(s["local_s"])},
            "load_rounds": [round(x, 3) for x in ratios], "load_bytes": raw["bytes"], "load_cache": raw["cache"],
            "tier_dir": str(TIER_BASE)}


def run(repeats: int = 3, *, quick: bool = False, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Everything under `local_tier` in bench-results.json (`quick`: tiny sizes, a smoke run, not figures)."""
    k = 5 if quick else K
    tiny = {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 16, "batch_size": 2} if quick else None
    result: dict[str, Any] = {"k": k, "durable_every": DURABLE_EVERY}
    result.update(throughput(repeats, k=k, model=tiny, progress=progress))
    result.update(recovery_rounds(repeats, k=k, model=tiny, progress=progress))
    result.update(load_speedup(repeats + 1, gb=0.02 if quick else 1.2, d_model=128 if quick else 1024))
    return result


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps(run(progress=lambda s: print(s, flush=True)), indent=2))
