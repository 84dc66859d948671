"""What the supervisor itself costs: its RSS and CPU while a job runs, and its start-up import time.

`Sampler` watches the supervisor process (not its job) during the supervised throughput runs
(bench/throughput.py), so the figures come from the same minute of training that the throughput
comparison uses. `import_seconds` times fresh interpreters importing what `run` needs.

    python -m bench.supervisor_cost      # prints import_seconds() as JSON
"""
from __future__ import annotations

import compileall
import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from bench.common import PY, REPO, median
from supervisor.host.spares import is_spare_cmdline

__all__ = ["Sampler", "wakeups", "import_seconds", "idle_spare", "idle_spare_ready", "spare_rss_mb", "warm_workers_memory",
           "RUN_IMPORTS"]


def wakeups(pid: int) -> tuple[int, int]:
    """(the main thread's, all threads') voluntary context switches so far: each is one time the thread slept and was
    woken. The supervisor's main thread is its event loop: its count is its waits in `select` and for the GIL (the
    exact wake-ups of the loop need `strace`: docs/operations.md, Heartbeats); the others' add the file watcher's
    threads (inotify) and off-loop work."""
    main = total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "status").read_text()
        except OSError:
            continue  # a thread that ended meanwhile
        n = int(text.split("voluntary_ctxt_switches:", 1)[1].split()[0])
        total += n
        main += n if task.name == str(pid) else 0
    return main, total


class Sampler:
    """CPU time, peak RSS (sampled every 0.5 s) and context switches of one process between `start()` and `stop()`."""

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
        self._wakeups0 = wakeups(self.proc.pid)
        self.peak_rss = self.proc.memory_info().rss
        self._thread.start()
        return self

    def stop(self) -> dict[str, float]:
        """{"cpu_s", "wall_s", "peak_rss_mb", "loop_switches_per_s", "switches_per_s"} for the sampled window."""
        times = self.proc.cpu_times()
        (loop0, all0), (loop1, all1) = self._wakeups0, wakeups(self.proc.pid)
        wall = time.monotonic() - self._t0
        self._stop.set()
        self._thread.join()
        return {"cpu_s": times.user + times.system - self._cpu0, "wall_s": wall,
                "peak_rss_mb": self.peak_rss / 2**20, "loop_switches_per_s": (loop1 - loop0) / wall,
                "switches_per_s": (all1 - all0) / wall}


def idle_spare(supervisor_pid: int, run_dir: Path) -> psutil.Process | None:
    """The supervisor's idle prewarm spare (a spare-script child that is not the running job), if any."""
    try:
        job_pid = json.loads((run_dir / "state.json").read_text()).get("job_pid")
    except (OSError, ValueError):
        job_pid = None
    try:
        for child in psutil.Process(supervisor_pid).children():
            if child.pid != job_pid and is_spare_cmdline(child.cmdline()):
                return child
    except psutil.Error:
        pass
    return None


def _warm_workers_on(spare: psutil.Process) -> bool:
    """Whether the supervisor asked this spare for warm workers (its OPTIONS argument, supervisor/host/spares.py)."""
    try:
        options = json.loads(spare.cmdline()[3])
    except (psutil.Error, IndexError, ValueError):
        return False
    return bool(options.get("workers"))


def idle_spare_ready(supervisor_pid: int, run_dir: Path) -> bool:
    """Whether the idle spare has imported torch and, when it keeps warm workers, those have answered too: its own
    lines (the job's former spare wrote some too)."""
    spare = idle_spare(supervisor_pid, run_dir)
    try:
        ready = (run_dir / "logs" / "prewarm.log").read_text()
    except OSError:
        return False
    if spare is None or f"event=prewarm_ready pid={spare.pid} " not in ready:
        return False
    return not _warm_workers_on(spare) or f"event=warm_workers_ready pid={spare.pid} " in ready


def spare_rss_mb(supervisor_pid: int, run_dir: Path) -> float | None:
    """RSS of the supervisor's idle prewarm spare, if it has one (reported apart: it is not the supervisor)."""
    spare = idle_spare(supervisor_pid, run_dir)
    try:
        return round(spare.memory_info().rss / 2**20, 1) if spare is not None else None
    except psutil.Error:
        return None


def warm_workers_memory(supervisor_pid: int, run_dir: Path) -> dict[str, Any] | None:
    """Memory of the idle spare's warm workers (its children): RSS and USS (the pages only they hold), in MB."""
    spare = idle_spare(supervisor_pid, run_dir)
    try:
        workers = spare.children() if spare is not None else []
        mem = [w.memory_full_info() for w in workers]
    except psutil.Error:
        return None
    if not mem:
        return None
    rss, uss = [m.rss / 2**20 for m in mem], [m.uss / 2**20 for m in mem]
    return {"idle_rss_mb": round(sum(rss), 1), "idle_uss_mb": round(sum(uss), 1), "workers": len(mem),
            "per_worker_rss_mb": round(max(rss), 1)}


# What `fsdp-supervisor run` imports before it loads the config: the CLI with every command group
# registered, then `cmd_run`'s own imports. tests/integration/test_bench.py checks a real `run` imports nothing else.
RUN_IMPORTS = (
    "from supervisor.cli import app as cli\n"
    "cli.build_parser()\n"
    "import supervisor.daemon.preflight, supervisor.host.procs, supervisor.daemon.core, supervisor.daemon.loop, "
    "supervisor.observe.metrics, supervisor.observe.notify, supervisor.daemon.system, "
    "supervisor.checkpoints.metadata.child, supervisor.daemon.run\n"
)
# The third-party floor under it: the same libraries, one pydantic model, none of our code.
LIBRARY_FLOOR = (
    "import argparse, json, logging.handlers, tomllib, psutil, structlog, watchdog.observers\n"
    "from pydantic import BaseModel\n"
    "class M(BaseModel):\n    x: int = 1\n"
)
_READY = "\nimport os, sys\nsys.stdout.write('ready\\n'); sys.stdout.flush(); os._exit(0)\n"


def _until_ready(code: str) -> float:
    """Seconds from spawning a fresh interpreter until `code` has run (its exit and teardown not counted)."""
    start = time.perf_counter()
    with subprocess.Popen([PY, "-c", code + _READY], stdout=subprocess.PIPE, cwd=REPO) as proc:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        took = time.perf_counter() - start
        if proc.wait() != 0 or line.strip() != b"ready":
            raise RuntimeError(f"import timing child failed: {code!r}")
    return took


def _wall(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, cwd=REPO)
    return time.perf_counter() - start


def import_seconds(repeats: int = 5) -> dict[str, Any]:
    """Medians over fresh interpreters, interleaved.

    `import_s` is the supervisor's start-up import: spawn -> everything `run` imports is imported. The
    rest give it context: `python_startup_s` (bare interpreter), `library_floor_s` (the third-party
    imports alone), `status_imports_s` (what `status`/`logs`/`stop` load), and `version_s`, the whole
    `python -m supervisor --version` process including interpreter teardown.
    """
    ready = {
        "python_startup_s": "pass",
        "library_floor_s": LIBRARY_FLOOR,
        "status_imports_s": "import supervisor.cli.commands",
        "import_s": RUN_IMPORTS,
    }
    samples: dict[str, list[float]] = {k: [] for k in (*ready, "version_s")}
    # An installed package has its bytecode compiled (pip does it); a source tree under
    # PYTHONDONTWRITEBYTECODE would recompile every edited module in every sample.
    compileall.compile_dir(REPO / "supervisor", quiet=1)
    _until_ready(RUN_IMPORTS)  # warm the page cache once
    for _ in range(repeats):
        for key, code in ready.items():  # interleaved
            samples[key].append(_until_ready(code))
        samples["version_s"].append(_wall([PY, "-m", "supervisor", "--version"]))
    return {k: median(v) for k, v in samples.items()}


if __name__ == "__main__":
    print(json.dumps(import_seconds(), indent=2))
