"""The prewarmed launcher: which commands it takes over, and that a prewarmed attempt behaves like a cold one."""
from __future__ import annotations

import json
import os
import signal
import stat
import sys
from pathlib import Path

import psutil
import pytest

from supervisor.prewarmer import SPARE_SCRIPT, Plan, is_spare_cmdline, plan
from tests.supervise import REPO, TAG_ENV, Supervisors, stop, supervisors, wait_for, write_config  # noqa: F401

JOB = REPO / "tests" / "jobs" / "attempt_job.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "--max-restarts=0"]
FAST = "\n[restart]\nbackoff_initial_s = 0.05\nbackoff_max_s = 0.2\n[health]\nstop_timeout_s = 20\n"


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


class TestPlan:
    def test_module_form(self, tmp_path: Path) -> None:
        """`python -m torch.distributed.run ARGS` is prewarmed with the same python and the same ARGS."""
        got = plan([sys.executable, "-m", "torch.distributed.run", "--standalone", "train.py", "--lr", "1"],
                   cwd=tmp_path, env=dict(os.environ))
        assert got == Plan(sys.executable, None, ("--standalone", "train.py", "--lr", "1"))

    def test_console_script_found_on_the_jobs_path(self, tmp_path: Path) -> None:
        """`torchrun` resolves through the job's PATH; its shebang names the interpreter to prewarm."""
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        script = _script(bin_dir / "torchrun", f"#!{sys.executable}\nimport sys\nfrom torch.distributed.run import main\n")
        got = plan(["torchrun", "--nnodes=1", "x.py"], cwd=tmp_path, env={"PATH": str(bin_dir)})
        assert got == Plan(sys.executable, str(script), ("--nnodes=1", "x.py"))

    @pytest.mark.parametrize(
        "argv",
        [
            [sys.executable, "train.py"],
            [sys.executable, "-u", "-m", "torch.distributed.run", "x.py"],  # interpreter flags: not reproduced
            ["torchrun", "x.py"],  # the wrapper below is no pip console script
            ["no-such-torchrun-here", "x.py"],
            [],
        ],
    )
    def test_anything_else_goes_cold(self, tmp_path: Path, argv: list[str]) -> None:
        """Commands that are not exactly a torchrun start get no plan (the cold path runs them)."""
        _script(tmp_path / "torchrun", "#!/bin/sh\nexec python3 -m torch.distributed.run \"$@\"\n")
        assert plan(argv, cwd=tmp_path, env={"PATH": str(tmp_path)}) is None

    def test_spare_cmdline_is_recognised(self) -> None:
        """A spare's argv (kept after it became a job) is recognised; a job's own argv is not."""
        assert is_spare_cmdline([sys.executable, str(SPARE_SCRIPT), "123"])
        assert not is_spare_cmdline([sys.executable, "-m", "torch.distributed.run", "x.py"])


# ---- real processes ------------------------------------------------------------------------------------------


def _events(tmp_path: Path, name: str) -> list[dict]:
    lines = (tmp_path / ".fsdp-supervisor" / "supervisor.log").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == name]


def _marks(marker: Path) -> list[dict]:
    return [json.loads(line) for line in marker.read_text().splitlines()] if marker.exists() else []


def _ready_spares(tmp_path: Path) -> int:
    log = tmp_path / ".fsdp-supervisor" / "logs" / "prewarm.log"
    return log.read_text().count("event=prewarm_ready") if log.exists() else 0


def _live_spares(tag: str) -> list[int]:
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and is_spare_cmdline(p.cmdline()) and p.environ().get(TAG_ENV) == tag:
                found.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _config(tmp_path: Path, fail_attempts: str) -> tuple[Path, Path, Path]:
    marker, trap = tmp_path / "marks", tmp_path / "trap"
    argv = [*TORCHRUN, str(JOB), "--marker", str(marker), "--trap", str(trap), "--fail-attempts", fail_attempts]
    return write_config(tmp_path, argv, FAST), marker, trap


@pytest.mark.integration
class TestPrewarmedLaunch:
    def test_prewarmed_attempts_match_cold_ones_and_forward_sigterm(self, tmp_path: Path,
                                                                      supervisors: Supervisors) -> None:
        """Attempt 1 (cold) and 2 (prewarmed) fail alike; attempt 3 (prewarmed) gets SIGTERM; no spare is left."""
        cfg, marker, trap = _config(tmp_path, "1,2")
        p = supervisors.start(cfg)
        wait_for(lambda: len(_marks(marker)) == 3, 180, "attempt 3's worker")
        handoffs = [e["pid"] for e in _events(tmp_path, "prewarm_handoff")]
        started = {e["attempt"]: e["pid"] for e in _events(tmp_path, "job_started")}
        assert handoffs == [started[2], started[3]] and started[1] not in handoffs
        exits = {e["attempt"]: (e["code"], e["signal"], e["reason"], e["detail"]) for e in _events(tmp_path, "job_exited")}
        assert exits[1] == exits[2] == (1, None, "crash", "rank 0: exitcode 5")
        # The per-attempt environment reached the workers through the spare; the agent leads its own session.
        assert [m["attempt"] for m in _marks(marker)] == [1, 2, 3]
        agent = started[3]
        assert _marks(marker)[2]["ppid"] == agent and os.getsid(agent) == agent and os.getpgid(agent) == agent
        rc, out = stop(p, signal.SIGTERM)
        assert rc == 0, out[-3000:]
        assert trap.read_text() == str(int(signal.SIGTERM))
        assert json.loads((tmp_path / ".fsdp-supervisor" / "state.json").read_text())["state"] == "stopped"
        assert _live_spares(supervisors.tag) == []

    def test_spare_dies_with_supervisor_and_prewarmed_orphan_is_stopped(self, tmp_path: Path,
                                                                         supervisors: Supervisors) -> None:
        """SIGKILLed supervisor: its idle spare dies too; the next `run` stops the prewarmed orphan job first."""
        cfg, marker, trap = _config(tmp_path, "1")
        first = supervisors.start(cfg)
        wait_for(lambda: len(_marks(marker)) == 2 and _ready_spares(tmp_path) == 2, 180, "a prewarmed attempt 2")
        orphan = _marks(marker)[1]["ppid"]
        supervisors.track(orphan)
        spares = _live_spares(supervisors.tag)
        assert orphan in spares and len(spares) == 2  # the job (a former spare) and the idle one
        first.kill()
        first.wait()
        wait_for(lambda: _live_spares(supervisors.tag) == [orphan], 30, "the idle spare to die with its supervisor")
        second = supervisors.start(cfg)
        wait_for(lambda: len(_marks(marker)) == 3, 180, "attempt 3")
        assert trap.read_text() == str(int(signal.SIGTERM)), "the orphaned job was not stopped before relaunch"
        assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE
        assert stop(second)[0] == 0
