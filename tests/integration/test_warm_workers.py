"""Warm workers: a rank handed to a warm worker sees exactly what a cold rank sees, resumes bit-exactly, and
anything that is not exactly a cold start (a per-rank environment, CUDA touched by an import) starts cold."""
from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from supervisor.config import DEFAULT_PREWARM_MODULES
from supervisor.host.spares import is_spare_cmdline
from tests.helpers import Launcher, logged_steps, module_torchrun  # noqa: F401
from tests.integration.test_trainer_runs import (
    BASE,
    JOB_TIMEOUT,
    assert_same_rng_and_progress,
    assert_same_weights,
    complete_steps,
)
from tests.jobs.hooked_trainer import HOLD_TRAIN_STEP_ENV, HOLD_TRAIN_UNTIL_ENV
from tests.supervise import REPO, Supervisors, supervisors, wait_for  # noqa: F401
from trainer.warm_pool import WARM_SCRIPT

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0"]
PROBE = REPO / "tests" / "jobs" / "warm_probe.py"
HOOKED = REPO / "tests" / "jobs" / "hooked_trainer.py"
FAST = "[restart]\nbackoff_initial_s = 0.05\nbackoff_max_s = 0.2\n[health]\nstop_timeout_s = 20\n"


def _config(tmp_path: Path, command: list[str], *, env: dict[str, str] | None = None, modules: list[str] | None = None,
            resume: bool = True) -> Path:
    job_env = {"OMP_NUM_THREADS": "1", **(env or {})}
    table = ", ".join(f"{k} = {json.dumps(v)}" for k, v in job_env.items())
    extra = "" if modules is None else f"prewarm_modules = {json.dumps(modules)}\n"
    extra += "" if resume else "resume_args = []\n"
    cfg = tmp_path / "job.toml"
    cfg.write_text(f"[job]\ncommand = {json.dumps(command)}\ncwd = {json.dumps(str(REPO))}\n"
                   f"env = {{ {table} }}\n{extra}\n"
                   f"[checkpoints]\ndir = {json.dumps(str(tmp_path / 'ckpts'))}\n{FAST}")
    return cfg


def _run_dir(tmp_path: Path) -> Path:
    return tmp_path / ".fsdp-supervisor"


def _warm_ready(tmp_path: Path) -> bool:
    """An idle spare's warm workers are all ready (only idle spares start them)."""
    return re.search(r"event=warm_workers_ready pid=\d+ workers=(\d+) of=\1 ", _prewarm_log(tmp_path)) is not None


def _handoffs(tmp_path: Path, attempt: int) -> list[str]:
    log = _run_dir(tmp_path) / "logs" / f"attempt-{attempt:04d}.log"
    return re.findall(r"event=warm_handoff .*", log.read_text(errors="replace")) if log.exists() else []


def _state(tmp_path: Path) -> str | None:
    try:
        return json.loads((_run_dir(tmp_path) / "state.json").read_text()).get("state")
    except (OSError, ValueError):
        return None


class TestExactlyACold:
    @pytest.mark.parametrize("entry", ["script", "module"])
    def test_a_warm_rank_sees_what_a_cold_one_saw(self, tmp_path: Path, supervisors: Supervisors, entry: str) -> None:
        """Attempt 1 (cold ranks) and attempt 2 (warm ranks) record the same argv, sys.path[0], directory, environment
        (but per-attempt values), `__main__`, streams, session, priority, parent-death signal and threads; no CUDA,
        and none of our modules imported before `__main__` but the listed one."""
        out = tmp_path / "probe"
        out.mkdir()
        # The listed module is one the rank itself could import: from its own sys.path[0].
        target, listed = ([str(PROBE)], "marks") if entry == "script" else (["-m", "tests.jobs.warm_probe"],
                                                                          "tests.jobs.marks")
        cfg = _config(tmp_path, [*TORCHRUN, *target, str(out)], modules=[*DEFAULT_PREWARM_MODULES, listed],
                      resume=False)
        p = supervisors.start(cfg)
        wait_for(lambda: len(list(out.glob("attempt-1-*"))) == 2 and _warm_ready(tmp_path), 180,
                 "attempt 1's ranks and an idle spare's warm workers")
        (out / "go").touch()
        assert p.wait(timeout=180) == 0, supervisors.print_logs()
        assert len(_handoffs(tmp_path, 2)) == 2, "attempt 2 did not run in warm workers"
        for rank in (0, 1):
            cold, warm = (json.loads((out / f"attempt-{a}-rank-{rank}.json").read_text()) for a in (1, 2))
            assert warm["listed_imported"] and not cold["listed_imported"]
            assert warm["pid"] in {int(m) for m in re.findall(r"pid=(\d+)", "\n".join(_handoffs(tmp_path, 2)))}
            assert not warm["cuda_initialized"] and warm["pdeathsig"] == 0 and warm["session_leader"]
            assert _comparable(warm) == _comparable(cold), f"rank {rank}"


def _comparable(rec: dict) -> dict:
    """A probe record without what differs between any two attempts, cold or warm."""
    per_attempt = ("FSDP_SUPERVISOR_ATTEMPT", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_RUN_ID")
    rec = dict(rec, env={k: v for k, v in rec["env"].items() if k not in per_attempt})
    rec["streams"] = [re.sub(r"attempt-\d+", "attempt-N", s) for s in rec["streams"]]
    rec["our_modules_before_main"] = [m for m in rec["our_modules_before_main"] if not m.endswith("marks")]
    for key in ("listed_imported", "pid"):
        del rec[key]
    return rec


@pytest.fixture(scope="module")
def reference(module_torchrun: Launcher, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted run: the yardstick of the resumed one."""
    root = tmp_path_factory.mktemp("reference") / "ckpts"
    job = module_torchrun.run([*BASE, "--checkpoint-dir", root], timeout=JOB_TIMEOUT)
    assert job.proc.returncode == 0, job.text()[-3000:]
    return root


class TestWarmResume:
    def test_a_warm_handoff_resumes_bit_exactly(self, tmp_path: Path, supervisors: Supervisors,
                                                reference: Path) -> None:
        """Rank 1 SIGKILLed at a random step once warm workers are ready: the warm attempt 2 ends, and saves every
        common step, with the uninterrupted run's weights, RNG and progress."""
        held = random.choice([s for s in range(5, 20) if s % 4])  # a training step, not a save: phase `train`
        go = tmp_path / "go"
        root = tmp_path / "ckpts"
        cfg = _config(tmp_path, [*TORCHRUN, str(HOOKED), *map(str, BASE), "--checkpoint-dir", str(root)],
                      env={HOLD_TRAIN_STEP_ENV: str(held), HOLD_TRAIN_UNTIL_ENV: str(go)})
        p = supervisors.start(cfg)
        log = _run_dir(tmp_path) / "logs" / "attempt-0001.log"
        wait_for(lambda: log.exists() and held in logged_steps(log.read_text()) and _warm_ready(tmp_path), 180,
                 f"step {held} held and warm workers ready")
        victim = next(w for w in _job_workers(tmp_path) if w.environ().get("RANK") == "1")
        victim.kill()
        go.with_name(f"go.{held}").touch()
        assert p.wait(timeout=JOB_TIMEOUT) == 0, supervisors.print_logs()
        assert len(_handoffs(tmp_path, 2)) == 2, f"held={held}: attempt 2 did not run in warm workers"
        ours, theirs = complete_steps(root), complete_steps(reference)
        assert max(ours) == max(theirs) and set(ours) <= set(theirs), f"held={held}"
        for step in ours:
            assert_same_weights(ours[step], theirs[step], f"held={held} step={step}")
        assert_same_rng_and_progress(ours[max(ours)], theirs[max(theirs)], f"held={held}")


def _job_workers(tmp_path: Path) -> list[psutil.Process]:
    job = json.loads((_run_dir(tmp_path) / "state.json").read_text())["job_pid"]
    return psutil.Process(job).children()


class TestColdWhenNotExact:
    def test_a_per_rank_environment_starts_cold(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """torchrun's --virtual-local-rank gives each rank its own CUDA_VISIBLE_DEVICES: not what the warm workers
        were started with, so both ranks of attempt 2 start cold (and the run still completes)."""
        out = tmp_path / "probe"
        out.mkdir()
        command = [*TORCHRUN, "--virtual-local-rank", str(PROBE), str(out)]
        cfg = _config(tmp_path, command, env={"CUDA_VISIBLE_DEVICES": "0,1"}, resume=False)
        p = supervisors.start(cfg)
        wait_for(lambda: len(list(out.glob("attempt-1-*"))) == 2 and _warm_ready(tmp_path), 180,
                 "attempt 1's ranks and an idle spare's warm workers")
        (out / "go").touch()
        assert p.wait(timeout=180) == 0, supervisors.print_logs()
        assert _handoffs(tmp_path, 2) == []
        warm = json.loads((out / "attempt-2-rank-1.json").read_text())
        assert warm["env"]["CUDA_VISIBLE_DEVICES"] == "1" and warm["argv"][0] == str(PROBE)

    def test_prewarm_workers_off_keeps_only_the_spare_agent(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """`[job] prewarm_workers = false`: the idle spare is told so, starts no warm worker, attempt 2 starts cold."""
        out = tmp_path / "probe"
        out.mkdir()
        cfg = _config(tmp_path, [*TORCHRUN, str(PROBE), str(out)], resume=False)
        cfg.write_text(cfg.read_text().replace("[checkpoints]", "prewarm_workers = false\n\n[checkpoints]"))
        p = supervisors.start(cfg)

        def idle_spare() -> psutil.Process | None:
            job = json.loads((_run_dir(tmp_path) / "state.json").read_text()).get("job_pid")
            idle = [c for c in psutil.Process(p.pid).children() if is_spare_cmdline(c.cmdline()) and c.pid != job]
            return idle[0] if idle and f"prewarm_ready pid={idle[0].pid} " in _prewarm_log(tmp_path) else None

        wait_for(lambda: len(list(out.glob("attempt-1-*"))) == 2, 180, "attempt 1's ranks")
        spare = wait_for(idle_spare, 180, "a ready idle spare")
        assert json.loads(spare.cmdline()[3])["workers"] is False  # type: ignore[union-attr]
        (out / "go").touch()
        assert p.wait(timeout=180) == 0
        assert "warm_workers" not in _prewarm_log(tmp_path) and _handoffs(tmp_path, 2) == []


def _prewarm_log(tmp_path: Path) -> str:
    try:
        return (_run_dir(tmp_path) / "logs" / "prewarm.log").read_text()
    except OSError:
        return ""


class TestGpuSafety:
    def test_a_worker_that_finds_cuda_initialised_declines(self, tmp_path: Path) -> None:
        """An import that initialised CUDA (simulated: torch.cuda.is_initialized says so) makes the worker answer
        `unusable` and exit: the rank would otherwise inherit a device context chosen before its environment."""
        fake = tmp_path / "cuda_touching.py"
        fake.write_text("import torch.cuda\ntorch.cuda.is_initialized = lambda: True\n")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        with theirs:
            proc = subprocess.Popen([sys.executable, "-u", WARM_SCRIPT, str(theirs.fileno()), str(os.getpid()),
                                     str(tmp_path), json.dumps(["cuda_touching"])],
                                    pass_fds=(theirs.fileno(),), env=env, cwd=tmp_path)
        with ours:
            ours.settimeout(120)
            answer = ours.recv(4096)
        assert proc.wait(timeout=60) == 0
        assert answer.startswith(b"unusable") and b"CUDA" in answer

    def test_an_idle_worker_has_not_initialised_cuda(self, tmp_path: Path) -> None:
        """With torch and the default modules imported, the worker answers `ready`: nothing touched CUDA."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            proc = subprocess.Popen([sys.executable, "-u", WARM_SCRIPT, str(theirs.fileno()), str(os.getpid()),
                                     str(tmp_path), json.dumps(list(DEFAULT_PREWARM_MODULES))],
                                    pass_fds=(theirs.fileno(),), cwd=tmp_path)
        with ours:
            ours.settimeout(120)
            assert ours.recv(4096).startswith(b"ready")
        # EOF on the socket: the agent no longer needs it; it exits quietly
        assert proc.wait(timeout=60) == 0
