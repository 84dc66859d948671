"""A shortened soak: the supervisor's memory, fds and threads over hundreds of quick crashes (issue 37, item 4).

`fsdp-supervisor run` supervises a job that starts, beats, saves a checkpoint (progress: every attempt is a
healthy one, relaunched at once), and exits 1 a moment later, with retention on (keep_last = 2) and the metrics
endpoint listening. After WARMUP attempts (imports, caches and the first compaction settle) the supervisor's RSS,
open fds and threads, and the latency of `fsdp-supervisor status` and of a metrics scrape are taken, again after
`attempts` more; `rss_growth_kb_per_100_attempts` is the RSS growth between the two, per 100 attempts.

    python -m bench.soak [attempts [warmup]]      # prints the JSON
"""
from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from bench.common import PY, REPO, job_env, scratch, wait_until

__all__ = ["run", "WARMUP"]

WARMUP = 50
_JOB = """import json, os, sys, time
from tests.jobs.dcp_files import write_checkpoint
n = int(os.environ["FSDP_SUPERVISOR_ATTEMPT"])
beat = os.environ["FSDP_SUPERVISOR_HEARTBEAT"]
def say(step, phase):
    with open(beat + ".tmp", "w") as f:
        json.dump({"step": step, "time": time.time(), "phase": phase, "loss": 1.0 / n}, f)
    os.replace(beat + ".tmp", beat)
say(10 * n, "train")
write_checkpoint(sys.argv[1], 10 * n)
say(10 * n + 1, "train")
time.sleep(0.2)
sys.exit(1)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _attempt(run_dir: Path) -> int:
    try:
        return int(json.loads((run_dir / "state.json").read_text()).get("attempt") or 0)
    except (OSError, ValueError):
        return 0


def _look(sup: psutil.Process, config: Path, port: int, run_dir: Path) -> dict[str, Any]:
    """The supervisor's footprint now, and how long `status` and a metrics scrape take."""
    t0 = time.monotonic()
    subprocess.run([PY, "-m", "supervisor", "status", "-c", str(config)], capture_output=True, check=False, cwd=REPO)
    t1 = time.monotonic()
    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    t2 = time.monotonic()
    return {"attempt": _attempt(run_dir), "rss_kb": sup.memory_info().rss // 1024, "fds": sup.num_fds(),
            "threads": sup.num_threads(), "status_s": round(t1 - t0, 3), "metrics_s": round(t2 - t1, 4)}


def run(attempts: int = 200, warmup: int = WARMUP) -> dict[str, Any]:
    root = scratch("soak")
    ckpts, config, port = root / "ckpts", root / "job.toml", _free_port()
    command = [PY, "-c", _JOB, str(ckpts)]
    config.write_text(
        f"[job]\ncommand = {json.dumps(command)}\ncwd = {json.dumps(str(REPO))}\n\n"
        f"[checkpoints]\ndir = {json.dumps(str(ckpts))}\nkeep_last = 2\nretention_interval_s = 5\n\n"
        "[restart]\nmax_restarts = 100000\n\n"
        f"[metrics]\nlisten = \"127.0.0.1:{port}\"\n")
    run_dir = root / ".fsdp-supervisor"
    proc = subprocess.Popen([PY, "-m", "supervisor", "run", "-c", str(config)], cwd=root, env=job_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        sup = psutil.Process(proc.pid)
        wait_until(lambda: _attempt(run_dir) >= warmup, 60 + 10 * warmup, "the warm-up attempts", interval=1.0)
        start = _look(sup, config, port, run_dir)
        wait_until(lambda: _attempt(run_dir) >= start["attempt"] + attempts, 60 + 10 * attempts, "the soak's attempts",
                   interval=1.0)
        end = _look(sup, config, port, run_dir)
        history = (run_dir / "history.jsonl").stat().st_size
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(root, ignore_errors=True)
    done = end["attempt"] - start["attempt"]
    growth = (end["rss_kb"] - start["rss_kb"]) * 100 / done
    return {"rss_growth_kb_per_100_attempts": round(growth, 1), "attempts": done, "start": start, "end": end,
            "history_bytes": history}


if __name__ == "__main__":
    print(json.dumps(run(*map(int, sys.argv[1:3])), indent=2))
