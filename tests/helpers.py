"""Shared helpers for trainer tests: real torchrun jobs that never outlive a test, and weight comparison.

`Launcher` starts every process in a new session and tags its environment; `close()` kills every process
it has seen (torchrun starts its workers in sessions of their own, so killing the agent's group is not
enough) and then asserts that no process carrying the tag is left.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import psutil
import pytest

__all__ = [
    "REPO", "TORCHRUN", "TAG_ENV", "free_port", "Job", "Launcher", "torchrun", "module_torchrun", "assert_no_orphans",
    "wait_for", "logged_steps", "returns_despite_fifo", "compare_checkpoints", "suspended",
]

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).parent / "torchrun"
RC_ENTRY = REPO / "tests" / "trainer_rc.py"
HOOKED_ENTRY = REPO / "tests" / "jobs" / "hooked_trainer.py"  # RC_ENTRY with the test hooks (its docstring)
TAG_ENV = "FSDP_TEST_TAG"


def free_port() -> int:
    """A TCP port that was free a moment ago (for launchers that need one; torchrun --standalone picks its own)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.02) -> object:
    """Poll `predicate` until it returns something truthy; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@contextlib.contextmanager
def suspended(proc: subprocess.Popen[bytes] | subprocess.Popen[str] | psutil.Process) -> Iterator[None]:
    """SIGSTOP `proc` (Ctrl+Z) for the block, SIGCONT after whatever happened in it: no test leaves it stopped."""
    proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGCONT)


def returns_despite_fifo(fifo: Path, call: Callable[[], object], timeout: float = 5) -> object:
    """Run `call` on a thread and fail if it is still blocked after `timeout` (in an open() or read of `fifo`).

    Whatever happens, the thread is released before this returns: a writer opening the FIFO ends a reader's
    blocked open(), and its close ends the read with EOF.
    """
    box: dict[str, object] = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", call()), daemon=True)
    thread.start()
    thread.join(timeout)
    blocked = thread.is_alive()
    while thread.is_alive():
        with contextlib.suppress(OSError):  # no reader waiting yet
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(0.1)
    assert not blocked, f"blocked on the FIFO {fifo}"
    return box.get("result")


def logged_steps(text: str) -> list[int]:
    """Steps of the rank-0 `event=train` progress lines in a trainer log."""
    return [int(m) for m in re.findall(r"event=train rank=0 step=(\d+)", text)]


class Job:
    """One launched command (a torchrun agent or a single trainer process) and what it spawned."""

    def __init__(self, proc: subprocess.Popen, log: Path, rc_dir: Path) -> None:
        self.proc, self.log, self.rc_dir = proc, log, rc_dir
        self.seen: dict[int, float] = {}  # pid -> create_time, so that a reused pid is never killed

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def workers(self) -> list[psutil.Process]:
        """The live descendants of the launched process (torchrun's workers); remembers them for cleanup."""
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                self.seen[child.pid] = child.create_time()
        return children

    def worker_of_rank(self, rank: int, timeout: float = 60) -> psutil.Process:
        """The worker process whose environment says RANK=<rank>."""
        def find() -> psutil.Process | None:
            for w in self.workers():
                try:
                    if w.environ().get("RANK") == str(rank) and w.environ().get("LOCAL_RANK") is not None:
                        return w
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
            return None

        return wait_for(find, timeout, f"the worker of rank {rank}")  # type: ignore[return-value]

    def wait(self, timeout: float) -> int:
        """Exit code of the launched process; fails the test (after cleanup by the fixture) on timeout."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"job did not exit within {timeout:.0f}s; log tail:\n{self.text()[-3000:]}") from None

    def rank_exit_codes(self) -> dict[int, int]:
        """Exit codes the workers recorded through tests/trainer_rc.py."""
        return {int(p.name.split("_")[1]): int(p.read_text()) for p in self.rc_dir.glob("rank_*")}

    def kill(self) -> None:
        """SIGKILL everything this job started, including workers in their own sessions."""
        self.workers()
        for pid, created in self.seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created:
                    p.kill()
            except psutil.NoSuchProcess:
                pass
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


class Launcher:
    """Starts trainer jobs for one test (or one module) and guarantees none of them survives it."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.tag = uuid.uuid4().hex
        self.jobs: list[Job] = []

    def _env(self, extra: dict[str, str] | None, rc_dir: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TRAINER_RC_DIR=str(rc_dir), **{TAG_ENV: self.tag})
        env.update(extra or {})
        return env

    def _start(self, argv: Sequence[str], env: dict[str, str] | None, name: str) -> Job:
        index = len(self.jobs)
        log = self.workdir / f"{name}-{index}.log"
        rc_dir = self.workdir / f"{name}-{index}.rc"
        rc_dir.mkdir(parents=True)
        with open(log, "wb") as out:
            proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                    env=self._env(env, rc_dir), start_new_session=True)
        job = Job(proc, log, rc_dir)
        self.jobs.append(job)
        return job

    def torchrun(self, args: Sequence[str], *, nproc: int = 2, env: dict[str, str] | None = None,
                 hooked: bool = False) -> Job:
        """`torchrun --standalone --nproc-per-node=N trainer ARGS` (no restarts: the tests relaunch); `hooked`:
        through tests/jobs/hooked_trainer.py, whose hooks `env` sets."""
        argv = [str(TORCHRUN), "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0",
                str(HOOKED_ENTRY if hooked else RC_ENTRY), *map(str, args)]
        return self._start(argv, env, "torchrun")

    def single(self, args: Sequence[str], *, env: dict[str, str] | None = None, hooked: bool = False) -> Job:
        """`python -m trainer ARGS` as one process (a world of one, no torchrun); `hooked`: as in `torchrun`."""
        entry = [str(HOOKED_ENTRY)] if hooked else ["-m", "trainer"]
        return self._start([sys.executable, *entry, *map(str, args)], env, "single")

    def run(self, args: Sequence[str], *, timeout: float = 180, nproc: int | None = 2,
            env: dict[str, str] | None = None) -> Job:
        """Start a job (torchrun with `nproc` ranks, or a single process when None) and wait for it."""
        job = self.single(args, env=env) if nproc is None else self.torchrun(args, nproc=nproc, env=env)
        job.wait(timeout)
        return job

    def close(self) -> None:
        for job in self.jobs:
            job.kill()
        assert_no_orphans(self.tag)


_COMPARE = """
import sys, torch
from trainer.export import main
ref_ckpt, ref_out, got_ckpt, got_out = sys.argv[1:5]
assert main([ref_ckpt, ref_out]) == 0 and main([got_ckpt, got_out]) == 0
a, b = torch.load(ref_out, weights_only=True), torch.load(got_out, weights_only=True)
diff = [k for k in a if k not in b or a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
print(f"compared {len(a)} tensors; keys equal: {a.keys() == b.keys()}; differing: {diff}")
sys.exit(0 if a.keys() == b.keys() and not diff else 1)
"""


def compare_checkpoints(ref: Path, got: Path, workdir: Path) -> subprocess.CompletedProcess[str]:
    """Export two trainer checkpoints to .pt files (in `workdir`) and compare every tensor bit for bit, in a
    subprocess (the supervisor's tests never import torch); exit 0 when equal, its output says what differs."""
    return subprocess.run([sys.executable, "-c", _COMPARE, str(ref), str(workdir / "ref.pt"), str(got),
                           str(workdir / "got.pt")], capture_output=True, text=True, timeout=120, cwd=REPO)


def assert_no_orphans(tag: str) -> None:
    """Fail if any live process carries the launcher's tag in its environment."""
    left = []
    for p in psutil.process_iter(["pid", "name"]):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(TAG_ENV) == tag:
                left.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for p in left:  # do not leak them into the next test either
        p.kill()
    assert not left, f"orphan processes left behind: {[(p.pid, p.info['name']) for p in left]}"


@pytest.fixture
def torchrun(tmp_path: Path) -> Iterator[Launcher]:
    """A Launcher for one test; everything it started is killed (and checked gone) at teardown."""
    launcher = Launcher(tmp_path / "jobs")
    launcher.workdir.mkdir()
    try:
        yield launcher
    finally:
        launcher.close()


@pytest.fixture(scope="module")
def module_torchrun(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    """A Launcher shared by one test module (for expensive reference runs); cleaned up like `torchrun`."""
    launcher = Launcher(tmp_path_factory.mktemp("jobs"))
    try:
        yield launcher
    finally:
        launcher.close()
