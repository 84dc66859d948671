"""Warm workers: a rank handed to a warm worker sees exactly what a cold rank sees, resumes bit-exactly, and
anything that is not exactly a cold start (a per-rank environment, CUDA touched by an import) starts cold."""
from __future__ import annotations

import contextlib
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


FORGING = REPO / "tests" / "jobs" / "forging_trainer.py"
HANGS = "hang_timeout_s = 4\nsave_timeout_s = 8\nstack_dump_wait_s = 2\nhang_kill_grace_s = 1\n"


class TestHandoffChannel:
    @pytest.mark.parametrize("forge", ["huge", "rename", "side"])
    def test_a_forged_line_in_the_jobs_output_changes_nothing(self, tmp_path: Path, supervisors: Supervisors,
                                                             forge: str) -> None:
        """The job prints a warm agent's hand-off line (a 5,000-digit pid; or rank 1's own pid as rank 0) in every
        attempt: the SIGSTOPped rank 1 of the cold attempt 1 is still named rank 1 (no crash), and so is rank 1 of
        the warm attempt 2, named by the agent's side file (its /proc environment has no RANK). Or rank 1 appends that
        record to the side file itself: not read for the cold attempt 1, and after the agent's own for attempt 2."""
        pids = tmp_path / "pids"
        pids.mkdir()
        cmd = [*TORCHRUN, str(FORGING), "--checkpoint-dir", str(tmp_path / "ckpts"), "--steps", str(10**6),
               "--save-every", str(10**6), "--seed", "3"]
        cfg = _config(tmp_path, cmd, env={"FORGE": forge, "PIDS_OUT": str(pids)}, modules=[])
        cfg.write_text(cfg.read_text().replace("stop_timeout_s = 20\n", f"stop_timeout_s = 20\n{HANGS}"))
        p = supervisors.start(cfg)
        for attempt in (1, 2):
            wait_for(lambda a=attempt: _training(tmp_path, a) and (pids / f"attempt-{a}-rank-1").exists()
                     and (a == 2 or _warm_ready(tmp_path)), 180, f"attempt {attempt} training")
            if attempt == 2:
                side = (_run_dir(tmp_path) / "logs" / "attempt-0002.handoff").read_text().splitlines()
                assert len(side) == 2 + (forge == "side"), "attempt 2 did not run in warm workers"
                assert "RANK" not in psutil.Process(int((pids / "attempt-2-rank-1").read_text())).environ()
            victim = psutil.Process(int((pids / f"attempt-{attempt}-rank-1").read_text()))
            victim.suspend()
            try:
                wait_for(lambda a=attempt: _attempt(tmp_path) == a + 1, 120, f"attempt {attempt + 1} after the hang")
            finally:
                with contextlib.suppress(psutil.Error):
                    victim.resume()
            assert p.poll() is None, supervisors.print_logs()
            hang = json.loads((_run_dir(tmp_path) / "state.json").read_text())["last_hang"]
            assert hang["ranks"] == [{"rank": 1, "why": "stopped (SIGSTOP or SIGTSTP)"}], (attempt, hang)
        p.terminate()
        assert p.wait(timeout=60) == 0


def _training(tmp_path: Path, attempt: int) -> bool:
    """`attempt` beats `train` (hang detection is armed by a beat)."""
    try:
        st = json.loads((_run_dir(tmp_path) / "state.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(st.get("attempt") == attempt and st.get("phase") == "train")


def _attempt(tmp_path: Path) -> int | None:
    try:
        return json.loads((_run_dir(tmp_path) / "state.json").read_text()).get("attempt")
    except (OSError, ValueError):
        return None


TRAIN_PY = '''import json, os, sys, time
import helper  # from sys.path[0]: the script's own (resolved) directory


def version(name):
    try:
        return getattr(__import__(name), "VERSION", None)
    except ImportError:
        return None


out, attempt, rank = os.environ["PROBE_OUT"], os.environ["FSDP_SUPERVISOR_ATTEMPT"], os.environ["RANK"]
record = {n: version(n) for n in ("helper", "prewarmed", "tinypkg", "sitecustomize")}
with open(os.path.join(out, f"attempt-{attempt}-rank-{rank}.json"), "w") as f:
    json.dump(dict(record, pid=os.getpid()), f)
beat = os.environ.get("FSDP_SUPERVISOR_HEARTBEAT")
if beat and rank == "0":
    with open(beat + ".tmp", "w") as f:
        json.dump({"step": 1, "time": time.time(), "phase": "train", "loss": None}, f)
    os.replace(beat + ".tmp", beat)
if attempt != "1":
    sys.exit(0)
while not os.path.exists(os.path.join(out, "go")):
    time.sleep(0.05)
sys.exit(3)
'''


def _stale_job(tmp_path: Path) -> tuple[Path, Path]:
    """A venv of its own (torch through a .pth to ours) with `tinypkg` 1 installed by pip, a job directory whose
    train.py is a symlink to versions/v1/train.py, and lib/ (on PYTHONPATH) with `prewarmed` and a sitecustomize
    that every interpreter of the job loads at start-up. Its python, and the package's source (to install 2)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    ours = subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    site = next((venv / "lib").glob("python*/site-packages"))
    (site / "_outer.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    pkg = tmp_path / "pkg"
    (pkg / "tinypkg").mkdir(parents=True)
    (pkg / "pyproject.toml").write_text('[build-system]\nrequires = ["setuptools"]\nbuild-backend = '
                                        '"setuptools.build_meta"\n[project]\nname = "tinypkg"\nversion = "1"\n')
    (pkg / "tinypkg" / "__init__.py").write_text("VERSION = 1\n")
    python = venv / "bin" / "python"
    _pip_install(python, pkg)
    job = tmp_path / "job"
    for v in (1, 2):
        (job / "versions" / f"v{v}").mkdir(parents=True)
        (job / "versions" / f"v{v}" / "train.py").write_text(TRAIN_PY)
        (job / "versions" / f"v{v}" / "helper.py").write_text(f"VERSION = {v}\n")
    (job / "train.py").symlink_to("versions/v1/train.py")
    (job / "lib").mkdir()
    for name in ("prewarmed", "sitecustomize"):
        (job / "lib" / f"{name}.py").write_text("VERSION = 1\n")
    return python, pkg


def _pip_install(python: Path, pkg: Path) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", "--no-build-isolation", str(pkg)],
                   check=True, capture_output=True)


def _bump(path: Path) -> None:
    path.write_text(path.read_text().replace("VERSION = 1", "VERSION = 2"))  # the same size, the same inode


def _stale_lines(tmp_path: Path, attempt: int) -> list[tuple[int, str]]:
    log = (_run_dir(tmp_path) / "logs" / f"attempt-{attempt:04d}.log").read_text(errors="replace")
    return [(int(pid), json.loads(f)) for pid, f in re.findall(r"event=warm_workers_stale pid=(\d+) file=(\".*\")", log)]


class TestStaleGoesCold:
    @pytest.mark.parametrize("change", ["module", "symlink", "pip", "agent", "shadow"])
    def test_what_changed_on_disk_is_run_cold(self, tmp_path: Path, supervisors: Supervisors, change: str) -> None:
        """Between the warm workers' imports and attempt 2, what a cold start would run changes: an edited prewarmed
        module, `ln -sfn versions/v2/train.py train.py` (the script's directory, sys.path[0]), `pip install` of
        tinypkg 2 over 1, or a file the spare agent itself loaded (sitecustomize). Attempt 2's ranks run the new code
        (cold), and the attempt log says who went cold and which file was stale. Or a `tinypkg.py` added next to the
        script, which a cold rank imports instead of the package a warm worker already has."""
        python, pkg = _stale_job(tmp_path)
        job, out = tmp_path / "job", tmp_path / "probe"
        out.mkdir()
        cmd = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
               "train.py"]
        cfg = _config(tmp_path, cmd, env={"PYTHONPATH": str(job / "lib"), "PROBE_OUT": str(out)},
                      modules=["prewarmed", "tinypkg"], resume=False)
        cfg.write_text(cfg.read_text().replace(f"cwd = {json.dumps(str(REPO))}", f"cwd = {json.dumps(str(job))}"))
        p = supervisors.start(cfg)
        wait_for(lambda: len(list(out.glob("attempt-1-*"))) == 2 and _warm_ready(tmp_path), 180,
                 "attempt 1's ranks and an idle spare's warm workers")
        key, stale = {"module": ("prewarmed", "lib/prewarmed.py"), "symlink": ("helper", "train.py"),
                      "pip": ("tinypkg", "tinypkg/__init__.py"), "agent": ("sitecustomize", "lib/sitecustomize.py"),
                      "shadow": ("tinypkg", "versions/v1/tinypkg.py")}[change]
        if change == "symlink":
            (job / "train.py.new").symlink_to("versions/v2/train.py")
            os.replace(job / "train.py.new", job / "train.py")
        elif change == "shadow":  # a module added next to the script hides the one a warm worker imported
            (job / "versions" / "v1" / "tinypkg.py").write_text("VERSION = 2\n")
        elif change == "pip":
            _bump(pkg / "tinypkg" / "__init__.py")
            (pkg / "pyproject.toml").write_text((pkg / "pyproject.toml").read_text().replace('"1"', '"2"'))
            _pip_install(python, pkg)
        else:
            _bump(job / "lib" / f"{key}.py")
        (out / "go").touch()
        assert p.wait(timeout=180) == 0, supervisors.print_logs()
        first = [json.loads((out / f"attempt-1-rank-{r}.json").read_text()) for r in (0, 1)]
        second = [json.loads((out / f"attempt-2-rank-{r}.json").read_text()) for r in (0, 1)]
        assert [r[key] for r in first] == [1, 1] and [r[key] for r in second] == [2, 2], second
        lines = _stale_lines(tmp_path, 2)
        assert lines and all(f.endswith(stale) for _, f in lines), lines
        if change == "agent":  # the agent itself went cold (so no rank was handed to a warm worker)
            assert _handoffs(tmp_path, 2) == [] and len(lines) == 1
        else:  # each warm worker took its rank, found itself stale, and became the cold rank (same pid)
            assert sorted(pid for pid, _ in lines) == sorted(r["pid"] for r in second)
