"""The prewarmed launcher: which commands it takes over, and that a prewarmed attempt behaves like a cold one."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from supervisor.host.spares import SPARE_SCRIPT, is_spare_cmdline
from tests.supervise import REPO, TAG_ENV, Supervisors, launches, stop, supervisors, wait_for  # noqa: F401

JOB = REPO / "tests" / "jobs" / "attempt_job.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "--max-restarts=0"]
FAST = "\n[restart]\nbackoff_initial_s = 0.05\nbackoff_max_s = 0.2\n[health]\nstop_timeout_s = 20\n"


class TestSpareExit:
    @pytest.mark.parametrize("body", [
        "pass",
        "raise SystemExit(3)",
        "raise SystemExit('bye')",
        "raise ValueError('boom')",
        "raise KeyboardInterrupt",
    ])
    def test_exit_status_and_output_match_cpython(self, body: str) -> None:
        """run_then_exit ends a process with CPython's status, stderr and atexit output, minus the teardown."""
        head = ("import atexit, sys\natexit.register(lambda: print('atexit ran', flush=True))\n"
                f"def job():\n    {body}\n")
        plain = subprocess.run([sys.executable, "-c", head + "job()\n"], capture_output=True, text=True,
                               cwd=REPO, timeout=60)
        fast = subprocess.run([sys.executable, "-c", head + "from trainer.spare import run_then_exit\n"
                               "run_then_exit(job)\n"], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert fast.returncode == plain.returncode
        assert fast.stdout == plain.stdout == "atexit ran\n"
        assert fast.stderr.splitlines()[-1:] == plain.stderr.splitlines()[-1:]


    def test_a_torch_that_fails_to_import_fails_the_job_in_its_own_log(self, tmp_path: Path) -> None:
        """A broken install: the handed-off spare exits 1 with the import's traceback in the attempt log, as cold."""
        (tmp_path / "torch").mkdir()
        (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('this torch is broken')\n")
        log = tmp_path / "attempt-0001.log"
        env = {**os.environ, "PYTHONPATH": str(tmp_path)}
        env.pop("FSDP_SUPERVISOR_HEARTBEAT", None)
        spec = {"script": None, "args": [], "env": env, "cwd": str(tmp_path), "log_path": str(log)}
        r = subprocess.run([sys.executable, str(SPARE_SCRIPT), str(os.getpid())], input=json.dumps(spec).encode(),
                           capture_output=True, env=env, cwd=tmp_path, timeout=60)
        assert r.returncode == 1 and b"ImportError: this torch is broken" in r.stderr  # prewarm.log has it too
        assert log.read_text().splitlines()[-1] == "ImportError: this torch is broken"


# ---- real processes ------------------------------------------------------------------------------------------


def _events(tmp_path: Path, name: str) -> list[dict]:
    lines = (tmp_path / ".fsdp-supervisor" / "supervisor.log").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == name]




def _live_spares(tag: str) -> list[int]:
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            cmdline = p.cmdline()
            took_a_job = cmdline[:1] == ["torchrun"]  # a spare running a job is titled as torchrun
            if (p.status() != psutil.STATUS_ZOMBIE and (is_spare_cmdline(cmdline) or took_a_job)
                    and p.environ().get(TAG_ENV) == tag):
                found.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _config(tmp_path: Path, fail_attempts: str, prewarm: bool = True) -> tuple[Path, Path, Path]:
    marker, trap = tmp_path / "marks", tmp_path / "trap"
    argv = [*TORCHRUN, str(JOB), "--marker", str(marker), "--trap", str(trap), "--fail-attempts", fail_attempts]
    cfg = tmp_path / "job.toml"
    cfg.write_text(f"[job]\ncommand = {json.dumps(argv)}\nprewarm = {str(prewarm).lower()}\n"
                   f"env = {{ OMP_NUM_THREADS = \"1\" }}\n\n[checkpoints]\ndir = \"ckpts\"\n{FAST}")
    return cfg, marker, trap


class TestPrewarmedLaunch:
    @pytest.mark.parametrize("prewarm", [False, True])
    def test_same_exit_reports_and_sigterm_forwarding_as_cold(self, tmp_path: Path, supervisors: Supervisors,
                                                              prewarm: bool) -> None:
        """Cold or prewarmed: a failed attempt reads the same, the next gets SIGTERM, and no spare is left."""
        cfg, marker, trap = _config(tmp_path, "1", prewarm)
        p = supervisors.start(cfg)
        wait_for(lambda: len(launches(marker)) == 2, 180, "attempt 2's worker")
        started = {e["attempt"]: e["pid"] for e in _events(tmp_path, "job_started")}
        handoffs = [e["pid"] for e in _events(tmp_path, "prewarm_handoff")]
        assert handoffs == ([started[1], started[2]] if prewarm else [])
        exited = _events(tmp_path, "job_exited")[0]
        assert (exited["code"], exited["signal"], exited["reason"], exited["detail"]) == (
            1, None, "crash", "rank 0: exitcode 5")
        # The per-attempt environment reached the workers through the spare; the agent leads its own session.
        assert [m["attempt"] for m in launches(marker)] == [1, 2]
        agent = started[2]
        assert launches(marker)[1]["ppid"] == agent and os.getsid(agent) == agent and os.getpgid(agent) == agent
        if prewarm:  # the spare running the job looks like torchrun in ps; its hand-off line says so
            cmdline = psutil.Process(agent).cmdline()
            assert " ".join(cmdline).startswith("torchrun --standalone --nproc-per-node=1"), cmdline
            assert all("torchrun" in e["note"] for e in _events(tmp_path, "prewarm_handoff"))
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
        wait_for(lambda: len(launches(marker)) == 2 and len(_live_spares(supervisors.tag)) == 2, 180,
                 "attempt 2 and an idle spare")
        orphan = launches(marker)[1]["ppid"]
        supervisors.track(orphan)
        assert orphan in _live_spares(supervisors.tag)  # the job (a former spare) and the idle one
        first.kill()
        first.wait()
        wait_for(lambda: _live_spares(supervisors.tag) == [orphan], 30, "the idle spare to die with its supervisor")
        second = supervisors.start(cfg)
        wait_for(lambda: len(launches(marker)) == 3, 180, "attempt 3")
        assert trap.read_text() == str(int(signal.SIGTERM)), "the orphaned job was not stopped before relaunch"
        assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE
        assert stop(second)[0] == 0
