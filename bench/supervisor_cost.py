"""What the supervisor itself costs: its RSS and CPU while a job runs, and its start-up import time.

`Sampler` watches the supervisor process (not its job) during the supervised throughput runs
(bench/throughput.py), so the figures come from the same minute of training that the throughput
comparison uses. `import_seconds` times fresh interpreters importing the CLI.

    python -m bench.supervisor_cost      # prints import_seconds() as JSON
"""
from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from bench.common import PY, REPO, median
from supervisor.prewarmer import is_spare_cmdline

__all__ = ["Sampler", "import_seconds", "spare_rss_mb"]


class Sampler:
    """CPU time and peak RSS of one process between `start()` and `stop()` (RSS sampled every 0.5 s)."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)
            except psutil.Error:
                return

    def start(self) -> Sampler:
        times = self.proc.cpu_times()
        self._cpu0, self._t0 = times.user + times.system, time.monotonic()
        self.peak_rss = self.proc.memory_info().rss
        self._thread.start()
        return self

    def stop(self) -> dict[str, float]:
        """{"cpu_s", "wall_s", "peak_rss_mb"} for the sampled window."""
        times = self.proc.cpu_times()
        wall = time.monotonic() - self._t0
        self._stop.set()
        self._thread.join()
        return {"cpu_s": times.user + times.system - self._cpu0, "wall_s": wall,
                "peak_rss_mb": self.peak_rss / 2**20}


def spare_rss_mb(supervisor_pid: int, run_dir: Path) -> float | None:
    """RSS of the supervisor's idle prewarm spare, if it has one (reported apart: it is not the supervisor)."""
    try:
        job_pid = json.loads((run_dir / "state.json").read_text()).get("job_pid")
    except (OSError, ValueError):
        job_pid = None
    try:
        for child in psutil.Process(supervisor_pid).children():
            if child.pid != job_pid and is_spare_cmdline(child.cmdline()):
                return round(child.memory_info().rss / 2**20, 1)
    except psutil.Error:
        pass
    return None


def _wall(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, cwd=REPO)
    return time.perf_counter() - start


def import_seconds(repeats: int = 5) -> dict[str, Any]:
    """Median wall time of fresh interpreters: bare, importing the CLI, importing what `run` needs, --version."""
    cases = {
        "python_startup_s": [PY, "-c", "pass"],
        "import_s": [PY, "-c", "import supervisor.commands"],
        "run_imports_s": [PY, "-c", "import supervisor.commands, supervisor.core, supervisor.loop, "
                          "supervisor.system, supervisor.metrics, supervisor.notify"],
        "version_s": [PY, "-m", "supervisor", "--version"],
    }
    samples: dict[str, list[float]] = {k: [] for k in cases}
    _wall(cases["import_s"])  # warm the page cache and __pycache__ once
    for _ in range(repeats):
        for key, argv in cases.items():  # interleaved
            samples[key].append(_wall(argv))
    return {k: median(v) for k, v in samples.items()}


if __name__ == "__main__":
    print(json.dumps(import_seconds(), indent=2))
