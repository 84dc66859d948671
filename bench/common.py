"""What every benchmark shares: the machine's facts, process groups that never outlive a run, log polling.

Benchmarks run real `torchrun` jobs of the reference trainer on this machine. Every process they start
carries a tag in its environment, so `Tagged.close()` finds and kills all of them (torchrun starts its
workers in sessions of their own; the supervisor's jobs lead their own sessions too).
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

__all__ = [
    "REPO", "PY", "TAG_ENV", "BENCH_DIR_ENV", "median", "machine", "scratch", "Tagged", "torchrun_argv",
    "trainer_argv", "wait_until", "train_lines", "job_env", "count_events",
]

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
TAG_ENV = "FSDP_BENCH_TAG"
BENCH_DIR_ENV = "FSDP_BENCH_DIR"  # where checkpoints and dd files go (default: the system temp dir)
_TRAIN = re.compile(r"event=train rank=0 step=(\d+) loss=\S+ tokens_per_s=(\d+)")


def median(values: Iterable[float], digits: int = 3) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), digits) if vals else None


def scratch(prefix: str) -> Path:
    """A fresh directory under $FSDP_BENCH_DIR (or the temp dir); the caller removes it."""
    base = os.environ.get(BENCH_DIR_ENV) or None
    if base:
        Path(base).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"bench-{prefix}-", dir=base))


def _mount_of(path: Path) -> tuple[str, str, str]:
    """(device, mount point, filesystem type) of the longest mount prefix of `path`."""
    best = ("?", "/", "?")
    real = str(path.resolve())
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if (real == mp or real.startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best[1]):
            best = (part.device, mp, part.fstype)
    return best


def _disk_model(device: str) -> dict[str, Any]:
    name = Path(device).name
    base = Path("/sys/class/block") / name
    parent = base.resolve().parent if (base / "partition").exists() else base.resolve()

    def read(rel: str) -> str | None:
        try:
            return (parent / rel).read_text().strip()
        except OSError:
            return None

    rot = read("queue/rotational")
    return {"model": read("device/model"), "rotational": None if rot is None else rot == "1"}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def machine(data_dir: Path) -> dict[str, Any]:
    """Facts a reader needs to judge the numbers (no torch import: its version comes from metadata)."""
    device, mountpoint, fstype = _mount_of(data_dir)
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    return {
        "cores": os.cpu_count(), "cpu": _cpu_model(), "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(), "torch": torch_version, "platform": platform.platform(),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "disk": {"dir": str(data_dir), "device": device, "mountpoint": mountpoint, "filesystem": fstype,
                 "free_gb": round(shutil.disk_usage(data_dir).free / 2**30, 1), **_disk_model(device)},
    }


def job_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of every benchmarked job: one thread per rank, unbuffered logs, no stray torchrun vars."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR")}
    pythonpath = [str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(pythonpath))
    # torchrun's own restart needs it (pytorch/pytorch#135712: the shared store keeps the previous round's
    # keys); the supervisor sets the same for its jobs, so every variant runs with it.
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    env.update(extra or {})
    return env


def torchrun_argv(nproc: int = 2, max_restarts: int = 0) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}"]


def trainer_argv(ckpt_dir: Path, **flags: Any) -> list[str]:
    """`-m trainer --checkpoint-dir DIR --flag value ...` (True flags become bare switches)."""
    argv = ["-m", "trainer", "--checkpoint-dir", str(ckpt_dir)]
    for key, value in flags.items():
        opt = "--" + key.replace("_", "-")
        if value is True:
            argv.append(opt)
        elif value is not False and value is not None:
            argv += [opt, str(value)]
    return argv


def count_events(run_dir: Path, name: str) -> int:
    """How many `name` events a supervisor logged in `run_dir` (its supervisor.log)."""
    try:
        lines = (run_dir / "supervisor.log").read_text(errors="replace").splitlines()
    except OSError:
        return 0
    found = 0
    for line in lines:
        try:
            found += json.loads(line).get("event") == name
        except (ValueError, AttributeError):
            continue  # a line cut short by a kill
    return found


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"benchmark gave up after {timeout:.0f}s waiting for {what}")


def train_lines(text: str) -> list[tuple[int, int]]:
    """(step, tokens_per_s) of every rank-0 progress line of the trainer."""
    return [(int(s), int(t)) for s, t in _TRAIN.findall(text)]


class Tagged:
    """Starts processes in new sessions with a tag in their environment; `close()` kills every tagged one."""

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, argv: Sequence[str], *, log: Path, env: Mapping[str, str], cwd: Path = REPO) -> subprocess.Popen[bytes]:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            p = subprocess.Popen(list(argv), cwd=cwd, env={**env, TAG_ENV: self.tag}, stdin=subprocess.DEVNULL,
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    def tagged(self) -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter(["pid"]):
            try:
                if p.pid != os.getpid() and p.environ().get(TAG_ENV) == self.tag:
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def close(self) -> None:
        for _ in range(3):  # a dying agent may still spawn; sweep until nothing tagged is left
            left = self.tagged()
            for p in left:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            psutil.wait_procs(left, timeout=10)
            for p in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=10)
            if not left:
                break

    def __enter__(self) -> Tagged:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
