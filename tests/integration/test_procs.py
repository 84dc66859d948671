"""Orphan identity against real processes: found by the run dir's token, never by argv or a reused pid."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from supervisor.contract import ENV_RUN_DIR, ENV_RUN_TOKEN
from supervisor.host.procs import find_orphans, signal_catchers, stop_processes, worker_states
from tests.helpers import TAG_ENV, assert_no_orphans

TOKEN = "0123456789abcdef" * 2
# A sleeper that reports SIGTERM by writing a file (its argv says nothing about any job).
SLEEPER = ("import signal, sys, time\n"
           "signal.signal(signal.SIGTERM, lambda *_: (open(sys.argv[1], 'w').write('term'), sys.exit(0)))\n"
           "print('ready', flush=True)\n"
           "time.sleep(120)\n")


class Sleepers:
    def __init__(self, tag: str) -> None:
        self.tag, self.procs = tag, []  # type: ignore[var-annotated]

    def start(self, env: dict[str, str], trap: Path, *, ignore_term: bool = False) -> subprocess.Popen[str]:
        code = SLEEPER.replace("lambda *_: (open(sys.argv[1], 'w').write('term'), sys.exit(0))",
                               "signal.SIG_IGN") if ignore_term else SLEEPER
        p = subprocess.Popen([sys.executable, "-c", code, str(trap)], stdout=subprocess.PIPE, text=True,
                             start_new_session=True, env={**os.environ, TAG_ENV: self.tag, **env})
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        self.procs.append(p)
        return p


@pytest.fixture
def sleepers() -> Iterator[Sleepers]:
    s = Sleepers(os.urandom(8).hex())
    try:
        yield s
    finally:
        for p in s.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            if p.stdout:
                p.stdout.close()
        assert_no_orphans(s.tag)


class TestFindOrphans:
    def test_found_by_token_and_run_dir_only(self, tmp_path: Path, sleepers: Sleepers) -> None:
        """The token and this run dir: found; the same token under another run dir (a copy) or none: not."""
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        ours = sleepers.start({ENV_RUN_TOKEN: TOKEN, ENV_RUN_DIR: str(run_dir)}, tmp_path / "t1")
        copy = sleepers.start({ENV_RUN_TOKEN: TOKEN, ENV_RUN_DIR: str(tmp_path / "copy")}, tmp_path / "t2")
        other = sleepers.start({}, tmp_path / "t3")
        found = {p.pid for p in find_orphans(TOKEN, run_dir)}
        assert ours.pid in found and copy.pid not in found and other.pid not in found

    def test_stop_processes_terms_then_kills(self, tmp_path: Path, sleepers: Sleepers) -> None:
        """SIGTERM first (the job may save), SIGKILL for one that ignores it."""
        env = {ENV_RUN_TOKEN: TOKEN, ENV_RUN_DIR: str(tmp_path)}
        polite = sleepers.start(env, tmp_path / "polite")
        stubborn = sleepers.start(env, tmp_path / "stubborn", ignore_term=True)
        stopped = stop_processes(find_orphans(TOKEN, tmp_path), timeout=2)
        assert sorted(stopped) == sorted([polite.pid, stubborn.pid])
        assert (tmp_path / "polite").read_text() == "term" and not (tmp_path / "stubborn").exists()
        assert not psutil.pid_exists(stubborn.pid) or psutil.Process(stubborn.pid).status() == psutil.STATUS_ZOMBIE

    def test_a_stopped_orphan_is_continued_to_take_its_sigterm(self, tmp_path: Path, sleepers: Sleepers) -> None:
        """A job left SIGSTOPped (kill -STOP, a debugger) gets SIGCONT after SIGTERM: it saves, it is not killed."""
        env = {ENV_RUN_TOKEN: TOKEN, ENV_RUN_DIR: str(tmp_path)}
        frozen = sleepers.start(env, tmp_path / "frozen")
        os.kill(frozen.pid, signal.SIGSTOP)
        assert stop_processes(find_orphans(TOKEN, tmp_path), timeout=10) == [frozen.pid]
        assert (tmp_path / "frozen").read_text() == "term"


# A process tree: each level starts the next (`spec` lists, per level, whether it installs a SIGUSR1 handler, as the
# trainer's ranks do with faulthandler) and the top prints every level's pid once the deepest has started.
TREE = ("import faulthandler, signal, subprocess, sys, time\n"
        "spec, me = sys.argv[1], len(sys.argv) - 2\n"
        "if spec[me] == 'h':\n"
        "    faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
        "pids = [str(__import__('os').getpid())]\n"
        "if me + 1 < len(spec):\n"
        "    child = subprocess.Popen([sys.executable, *sys.argv, 'x'], stdout=subprocess.PIPE, text=True)\n"
        "    pids += child.stdout.readline().split()\n"
        "print(' '.join(pids), flush=True)\n"
        "time.sleep(120)\n")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class TestStackDumpSignal:
    """SIGUSR1 asks for stack dumps: it must reach the processes that dump, never one whose default action is to die."""

    @pytest.mark.parametrize(("spec", "wanted"), [
        ("-h-", [1]),   # torchrun: the agent has no handler, its rank dumps, the rank's helper (DataLoader) has none
        ("--h", [2]),   # a wrapper (bash -> torchrun -> rank): neither the wrapper nor the agent is signalled
        ("h-", [0]),    # a single-process script with a helper: the script itself dumps, its helper is spared
    ])
    def test_only_processes_that_handle_sigusr1_get_it(self, tmp_path: Path, sleepers: Sleepers, spec: str,
                                                       wanted: list[int]) -> None:
        """Each process of the tree that has no handler is still alive afterwards."""
        script = tmp_path / "tree.py"
        script.write_text(TREE)
        p = subprocess.Popen([sys.executable, str(script), spec], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True, start_new_session=True, env={**os.environ, TAG_ENV: sleepers.tag})
        sleepers.procs.append(p)  # type: ignore[arg-type]
        pids: list[int] = []
        try:
            assert p.stdout is not None
            pids = [int(x) for x in p.stdout.readline().split()]
            assert len(pids) == len(spec)
            assert signal_catchers(pids[0], signal.SIGUSR1) == [pids[i] for i in wanted]
            time.sleep(0.5)  # a process killed by the signal would be a zombie by now
            for pid in pids:
                assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        finally:
            os.killpg(p.pid, signal.SIGKILL)  # the whole tree: it leads its own session
            p.wait()
            deadline = time.monotonic() + 10  # SIGKILL lands asynchronously: the orphan check runs next
            while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
                time.sleep(0.05)


class TestWorkerStates:
    def test_a_warm_rank_is_named_by_its_handoff_not_its_environment(self) -> None:
        """A warm worker's /proc environment holds no RANK: the spare's hand-off names it; without it, nobody."""
        env = {k: v for k, v in os.environ.items() if k != "RANK"}
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
        try:
            assert child.pid not in {pid for pid, _ in worker_states(os.getpid()).values()}
            assert worker_states(os.getpid(), {child.pid: 1})[1][0] == child.pid
        finally:
            child.kill()
            child.wait()

    def test_the_handoff_beats_a_stale_rank_in_the_environment(self) -> None:
        """A supervisor run with RANK set passes it to the warm workers: the hand-off line still names each."""
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, "RANK": "0"})
        try:
            assert worker_states(os.getpid())[0][0] == child.pid
            assert {rank: pid for rank, (pid, _) in worker_states(os.getpid(), {child.pid: 1}).items()} == {1: child.pid}
        finally:
            child.kill()
            child.wait()
