"""Run the real `fsdp-supervisor` CLI in tests, and make sure nothing it started outlives the test."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.helpers import REPO, TAG_ENV, assert_no_orphans, wait_for  # noqa: F401  (re-exported)

FAKEJOB = REPO / "tests" / "jobs" / "fakejob.py"


def cli(*args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    """Run `python -m supervisor ARGS` to completion."""
    return subprocess.run([sys.executable, "-m", "supervisor", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, **kw)


def write_config(tmp_path: Path, command: list[str], extra: str = "", name: str = "job.toml") -> Path:
    """A job.toml with fast restarts for tests; `extra` is appended TOML (sections may repeat only once)."""
    path = tmp_path / name
    path.write_text(
        f"[job]\ncommand = {json.dumps(command)}\nresume_args = [\"--resume\", \"{{checkpoint}}\"]\n"
        f"env = {{ OMP_NUM_THREADS = \"1\" }}\n\n[checkpoints]\ndir = \"ckpts\"\n" + extra
    )
    return path


def launches(marker: Path) -> list[dict]:
    """The lines fakejob's --marker holds so far, one per launch (only whole lines: a job may be writing)."""
    try:
        text = marker.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


def kill_tree(pid: int) -> None:
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        return
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=10)


class Supervisors:
    """Starts supervisors (own session) and kills them and every process they or their jobs started."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.extra_pids: set[int] = set()
        self.tag = uuid.uuid4().hex  # inherited by every descendant: how leftovers are found
        self.configs: list[Path] = []

    def start(self, config: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        p = subprocess.Popen([sys.executable, "-m", "supervisor", "run", "-c", str(config), *args], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                             env={**os.environ, TAG_ENV: self.tag, **(env or {})})
        self.procs.append(p)
        self.configs.append(config)
        return p

    def print_logs(self, lines: int = 40) -> None:
        """The tail of each started supervisor's event log: a failing test shows what the daemon decided."""
        for log in sorted({log for c in self.configs for log in c.parent.glob("*/supervisor.log")}):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            print(f"--- {log} (last {len(tail)} lines)", *tail, sep="\n")

    def track(self, pid: int) -> None:
        self.extra_pids.add(pid)

    def cleanup(self) -> None:
        for p in self.procs:
            kill_tree(p.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
            if p.stdout:
                p.stdout.close()
        for pid in self.extra_pids:
            kill_tree(pid)


@pytest.fixture
def supervisors(request: pytest.FixtureRequest) -> Iterator[Supervisors]:
    s = Supervisors()
    try:
        yield s
    finally:
        s.cleanup()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            s.print_logs()
        assert_no_orphans(s.tag)


def stop(p: subprocess.Popen[str], sig: int = signal.SIGTERM, timeout: float = 60) -> tuple[int, str]:
    p.send_signal(sig)
    out, _ = p.communicate(timeout=timeout)
    return p.returncode, out
