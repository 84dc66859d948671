"""Training throughput under the supervisor vs under bare torchrun (interleaved), and the supervisor's own cost.

Runs come in pairs, one of each, back to back, the order alternating; `throughput_ratio` is the median of the
pairs' ratios (a pair shares the machine's load of its minute, which on a shared machine moves by several percent
between minutes), with their spread. Each run starts the reference trainer (2 ranks, a model with ~0.1 s steps)
and reads its rank-0 progress lines, which carry tokens/s measured by the trainer itself over each `--log-every`
interval. A run's throughput is all tokens of the intervals logged inside its window divided by their summed durations (so
slow intervals weigh what they cost). The window opens `warmup_s` after steady state: the first progress
line, and under the supervisor also its idle spare agent ready (it imports torch once, at nice 19, when
the job starts training; that one-off cost per launch is not steady-state throughput). During supervised
runs `supervisor_cost.Sampler` records the supervisor's CPU time, peak RSS and context switches over the same window.

    python -m bench.throughput        # prints the result of run() as JSON
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import PY, REPO, Tagged, job_env, median, scratch, torchrun_argv, train_lines, trainer_argv, wait_until
from bench.recovery import count_events
from bench.supervisor_cost import Sampler, idle_spare_ready, spare_rss_mb

__all__ = ["run", "measure_once", "spread", "MODEL"]

MODEL = {"d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 64, "batch_size": 4}
LOG_EVERY = 2  # many short intervals per window
# No checkpoint inside the windows: a commit costs the supervisor a `.metadata` parse (reported apart as
# save_stall's `supervisor_verify_s`), which would make a 12 s window's CPU figure a matter of luck.
SAVE_EVERY = 10**5
TIMEOUT = 180.0


def _tokens_per_s(lines: list[tuple[int, int]], tokens_per_step: int) -> float | None:
    tokens = seconds = 0.0
    prev = None
    for step, rate in lines:
        if prev is not None and step > prev and rate > 0:
            t = (step - prev) * tokens_per_step
            tokens, seconds = tokens + t, seconds + t / rate
        prev = step
    return tokens / seconds if seconds else None


def spread(ratios: list[float]) -> dict[str, float] | None:
    """How far the pairs' ratios lie apart: min, max, and the interquartile range (what resolving 1% needs small)."""
    if not ratios:
        return None
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
    return {"min": round(min(ratios), 4), "max": round(max(ratios), 4), "iqr": round(q[2] - q[0], 4)}


def _config(root: Path, command: list[str]) -> Path:
    path = root / "job.toml"
    path.write_text(f"[job]\ncommand = {json.dumps(command)}\ncwd = {json.dumps(str(REPO))}\n\n"
                    f"[checkpoints]\ndir = {json.dumps(str(root / 'ckpts'))}\n")
    return path


def measure_once(variant: str, *, window_s: float = 12.0, warmup_s: float = 4.0,
                 model: dict[str, Any] | None = None) -> dict[str, Any]:
    """One run of `variant` ("supervisor" or "bare"): tokens/s in the window (+ supervisor cost)."""
    model = {**MODEL, **(model or {})}
    root = scratch(f"throughput-{variant}")
    tagged = Tagged()
    try:
        cmd = torchrun_argv() + trainer_argv(root / "ckpts", steps=10**6, save_every=SAVE_EVERY, log_every=LOG_EVERY,
                                             **model)
        if variant == "supervisor":
            sup = tagged.start([PY, "-m", "supervisor", "run", "-c", str(_config(root, cmd))],
                               log=root / "supervisor.out", env=job_env(), cwd=root)
            log = root / ".fsdp-supervisor" / "logs" / "attempt-0001.log"
        else:
            sup, log = None, root / "job.log"
            tagged.start(cmd, log=log, env=job_env())

        def text() -> str:
            return log.read_text(errors="replace") if log.exists() else ""

        wait_until(lambda: train_lines(text()), TIMEOUT, f"{variant}: first progress line", interval=0.1)
        if sup is not None:  # steady state includes the next launch's spare, which imports once training runs
            wait_until(lambda: idle_spare_ready(sup.pid, root / ".fsdp-supervisor"), TIMEOUT,
                       "the idle spare to be ready", interval=0.2)
        time.sleep(warmup_s)
        first = len(train_lines(text()))
        sampler = Sampler(sup.pid).start() if sup else None
        time.sleep(window_s)
        cost = sampler.stop() if sampler else None
        lines = train_lines(text())[first - 1:]  # from the last line before the window: its interval ends inside
        tokens_per_step = 2 * model["batch_size"] * model["seq_len"]
        result: dict[str, Any] = {"tokens_per_s": _tokens_per_s(lines, tokens_per_step), "intervals": len(lines) - 1}
        if cost is not None:
            result.update(cost, spare_rss_mb=spare_rss_mb(sup.pid, root / ".fsdp-supervisor"),
                          hang_false_positives=count_events(root / ".fsdp-supervisor", "hang_detected"))
        return result
    finally:
        tagged.close()
        shutil.rmtree(root, ignore_errors=True)


def run(repeats: int = 5, window_s: float = 12.0, warmup_s: float = 4.0, model: dict[str, Any] | None = None,
        progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """`throughput_ratio` (the median of `repeats` interleaved pairs' ratios, and their spread) and the `supervisor`
    cost sampled in the same runs."""
    runs: dict[str, list[dict[str, Any]]] = {"supervisor": [], "bare": []}
    for r in range(repeats):
        for v in (("supervisor", "bare") if r % 2 == 0 else ("bare", "supervisor")):
            runs[v].append(measure_once(v, window_s=window_s, warmup_s=warmup_s, model=model))
            if progress:
                progress(f"throughput {v} #{r + 1}: {runs[v][-1]['tokens_per_s']:.0f} tokens/s")
    sup, bare = (median(x["tokens_per_s"] for x in runs[v]) for v in ("supervisor", "bare"))
    sampled = runs["supervisor"]
    cpu = sum(x["cpu_s"] for x in sampled)
    wall = sum(x["wall_s"] for x in sampled)
    # Each pair's supervised/bare ratio (its two runs were back to back, under the same minute's load).
    ratios = [s["tokens_per_s"] / b["tokens_per_s"]
              for s, b in zip(runs["supervisor"], runs["bare"]) if s["tokens_per_s"] and b["tokens_per_s"]]
    return {
        "throughput_ratio": median(ratios, 4) if ratios else None,
        "tokens_per_s": {"supervisor": sup, "bare": bare},
        "round_ratios": [round(r, 4) for r in ratios],
        "ratio_spread": spread(ratios),
        "hang_false_positives": [x["hang_false_positives"] for x in sampled],  # healthy runs: any hang is false
        "supervisor": {"rss_mb": round(max(x["peak_rss_mb"] for x in sampled), 1),
                       "idle_cpu_pct": round(100 * cpu / wall, 3) if wall else None,
                       "loop_switches_per_s": median(x["loop_switches_per_s"] for x in sampled),
                       "switches_per_s": median(x["switches_per_s"] for x in sampled),
                       "sampled_s": round(wall, 1),
                       "spare_rss_mb": median(x["spare_rss_mb"] for x in sampled)},
        "runs": runs, "repeats": repeats, "window_s": window_s,
    }


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps(run(progress=lambda s: print(s, flush=True)), indent=2))
