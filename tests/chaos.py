"""Seeded chaos driver: one supervised run of the reference trainer with several faults at random moments.

`ChaosRun` starts a real `fsdp-supervisor run` (2 CPU ranks under torchrun), waits for a moment drawn from a
seeded `random.Random`, injects a fault (see tests/chaos_faults.py), waits for the supervisor to relaunch, and
so on; a `Monitor` thread checks the run-wide invariants the whole time. `reference()` is the uninterrupted
run every chaos or disk-full run is compared with (cached per pytest session: one per trainer seed).

Seeds: `FSDP_CHAOS_SEED=N` replays one plan; unset, a fresh seed is drawn and printed. `FSDP_CHAOS_SOAK=K`
adds K more seeded runs (the soak; off in CI).
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from supervisor.checkpoints import newest_complete
from supervisor.checkpoints.naming import name_step
from supervisor.contract import HEARTBEAT_FILE, Beat, parse_heartbeat
from supervisor.errors import CheckpointError
from supervisor.host.spares import handed_ranks
from tests.helpers import TAG_ENV, Launcher, wait_for
from tests.supervise import Supervisors

__all__ = [
    "SEED_ENV", "SOAK_ENV", "STEPS", "SAVE_EVERY", "TRAIN_SEED", "TORCHRUN", "TIMEOUT", "CONFIG", "train_args", "job_config",
    "chaos_seeds", "Reference", "reference", "export_weights", "assert_same_weights", "RunDir", "Monitor", "ChaosRun",
]

SEED_ENV = "FSDP_CHAOS_SEED"
SOAK_ENV = "FSDP_CHAOS_SOAK"
# 50 steps: the faults' worst-case progress (an orphaned job trains on until the next supervisor stops it) is ~40.
STEPS, SAVE_EVERY, TRAIN_SEED = 50, 5, 3  # trainer seed fixed: one reference serves every chaos seed
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0"]
TIMEOUT = 300
CONFIG = """keep_last = 2
[restart]
backoff_initial_s = 0.2
backoff_max_s = 1
max_no_progress_restarts = 6
[health]
hang_timeout_s = 8
stack_dump_wait_s = 1
stop_timeout_s = 6
"""  # a chaos run's and a matrix cell's job.toml, after [checkpoints] dir


def train_args(root: str = "ckpts", steps: int = STEPS, save_every: int = SAVE_EVERY) -> list[str]:
    return ["-m", "trainer", "--checkpoint-dir", root, "--steps", str(steps), "--save-every", str(save_every),
            "--seed", str(TRAIN_SEED), "--log-every", "5"]


def job_config(base: Path, extra_toml: str, *, root: Path | None = None, command: list[str] | None = None,
               env: dict[str, str] | None = None, name: str = "job.toml") -> Path:
    """`base/<name>` running the reference trainer (or `command`) on `root` (default `base/ckpts`)."""
    root = root or base / "ckpts"
    command = command or TORCHRUN + train_args(str(root))
    env_toml = ", ".join(f"{k} = {json.dumps(v)}" for k, v in {"OMP_NUM_THREADS": "1", **(env or {})}.items())
    path = base / name
    path.write_text(f"[job]\ncommand = {json.dumps(command)}\nresume_args = [\"--resume\", \"{{checkpoint}}\"]\n"
                    f"env = {{ {env_toml} }}\n\n[checkpoints]\ndir = {json.dumps(str(root))}\n{extra_toml}")
    return path


def chaos_seeds() -> list[int]:
    """The fault-plan seeds of this session: FSDP_CHAOS_SEED (or a fresh one), plus FSDP_CHAOS_SOAK more."""
    first = int(os.environ[SEED_ENV]) if os.environ.get(SEED_ENV) else random.SystemRandom().randrange(2**31)
    extra = int(os.environ.get(SOAK_ENV) or 0)
    return [first] + [random.Random(first + i).randrange(2**31) for i in range(1, extra + 1)]


# ---- the uninterrupted reference ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Reference:
    weights: dict[str, Any]  # exported final weights
    ckpts: Path  # every checkpoint of the run (keep_last off): material for planted dirs


_REFERENCES: dict[tuple[int, int], Reference] = {}


def export_weights(ckpt: Path, out: Path) -> dict[str, Any]:
    """`python -m trainer.export` then torch.load(weights_only=True) (torch only in the test process)."""
    subprocess.run([sys.executable, "-m", "trainer.export", str(ckpt), str(out)], check=True, timeout=180,
                   capture_output=True)
    import torch

    return torch.load(out, weights_only=True)


def assert_same_weights(got: dict[str, Any], want: dict[str, Any], context: str = "") -> None:
    import torch

    assert got.keys() == want.keys(), context
    assert [k for k in got if not torch.equal(got[k], want[k])] == [], f"weights differ from the reference {context}"


def reference(basetemp: Path, steps: int = STEPS) -> Reference:
    """One plain torchrun run of `steps` steps (trainer seed TRAIN_SEED), computed once per session."""
    key = (steps, TRAIN_SEED)
    if key not in _REFERENCES:
        work = basetemp / f"chaos-reference-{steps}-{TRAIN_SEED}"
        work.mkdir()
        launcher = Launcher(work)
        try:
            job = launcher.run(train_args(str(work / "ckpts"), steps)[2:], timeout=TIMEOUT)  # no "-m trainer"
            assert job.proc.returncode == 0, job.text()[-3000:]
        finally:
            launcher.close()
        final = newest_complete(work / "ckpts")
        assert final is not None and final.step == steps
        _REFERENCES[key] = Reference(export_weights(final.path, work / "ref.pt"), work / "ckpts")
    return _REFERENCES[key]


# ---- one run's files and processes --------------------------------------------------------------------------
class RunDir:
    """The supervised run under `base`: checkpoint root, run dir, strict readers of state and heartbeat."""

    def __init__(self, base: Path, root: Path | None = None) -> None:
        self.base, self.root, self.run_dir = base, root or base / "ckpts", base / ".fsdp-supervisor"

    def state(self) -> dict[str, Any]:
        """state.json; {} before the first write. A file that does not parse fails the test: writes are atomic."""
        try:
            text = (self.run_dir / "state.json").read_text()
        except FileNotFoundError:
            return {}
        return json.loads(text)

    def beat(self) -> Beat | None:
        try:
            return parse_heartbeat((self.run_dir / HEARTBEAT_FILE).read_bytes())[0]
        except OSError:
            return None

    def log(self) -> str:
        path = self.run_dir / "supervisor.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def events(self, name: str) -> list[dict[str, Any]]:
        """The supervisor's log events called `name` (a line still being written is skipped)."""
        found = []
        for line in self.log().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == name:
                found.append(event)
        return found

    def newest_step(self) -> int:
        """Highest step among committed (non-temporary) dir names: what the trainer has committed so far."""
        steps = [name_step(p.name) for p in self.root.glob("step_*")] if self.root.is_dir() else []
        return max((s for s in steps if s is not None), default=0)

    def tmp_dirs(self) -> list[Path]:
        return sorted(self.root.glob(".tmp-step_*")) if self.root.is_dir() else []

    def job(self) -> psutil.Process | None:
        pid = self.state().get("job_pid")
        try:
            return psutil.Process(pid) if pid else None
        except psutil.Error:
            return None

    def worker(self, rank: int) -> psutil.Process | None:
        """The job's worker of `rank`: by RANK in its environment, or (a warm rank, whose /proc environment is the
        one it was started with) by the agent's hand-off side file."""
        agent = self.job()
        logs = sorted((self.run_dir / "logs").glob("attempt-*.log"))
        handed = handed_ranks(logs[-1]) if logs else {}
        try:
            for w in agent.children() if agent else []:
                if w.environ().get("RANK") == str(rank) or handed.get(w.pid) == rank:
                    return w
        except psutil.Error:
            return None
        return None

    def resumed_step(self) -> int:
        path = self.state().get("resumed_from")
        return (name_step(Path(path).name) or 0) if path else 0


# ---- invariants checked the whole time ----------------------------------------------------------------------
class Monitor(threading.Thread):
    """Samples every 0.1 s: at most one job of this test alive (never two jobs on one checkpoint dir),
    state.json always parses, and the newest complete checkpoint never goes backwards (except for the
    one a fault tears on purpose, through `tear`). `timeline` keeps (wall time, newest complete step) per
    sample: what the root held when an attempt was launched."""

    def __init__(self, dirs: RunDir, tag: str) -> None:
        super().__init__(daemon=True, name="chaos-monitor")
        self.dirs, self.tag = dirs, tag
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.violations: list[str] = []
        self.high: int | None = None  # newest complete step seen
        self.max_jobs = 0
        self.timeline: list[tuple[float, int | None]] = []
        self._envs: dict[tuple[int, float], dict[str, str] | None] = {}

    def tear(self, damage: Callable[[], None]) -> int | None:
        """Run `damage` (which tears the newest checkpoint on purpose) and lower the high-water mark to what is
        left, atomically with respect to sampling; returns the newest complete step afterwards."""
        with self.lock:
            damage()
            newest = newest_complete(self.dirs.root)
            self.high = newest.step if newest else None
            return self.high

    def _jobs(self) -> set[str]:
        """Identities of the live jobs of this test: a worker's torchrun run id (one per agent start), or the
        agent itself while it has no workers. A prewarmed spare that has not taken a job yet is no job."""
        jobs: set[str] = set()
        for p in psutil.process_iter():
            try:
                key = (p.pid, p.create_time())
                if key not in self._envs:  # an environment never changes: read it once per process
                    env = p.environ()
                    self._envs[key] = env if env.get(TAG_ENV) == self.tag else None
                env = self._envs[key]
                if env is None or p.status() == psutil.STATUS_ZOMBIE:
                    continue
                if "TORCHELASTIC_RUN_ID" in env and "RANK" in env:
                    jobs.add(env["TORCHELASTIC_RUN_ID"])
                elif "torch.distributed.run" in p.cmdline() and not p.children():
                    jobs.add(f"agent {p.pid}")
            except psutil.Error:
                continue
        return jobs

    def sample(self) -> None:
        jobs = self._jobs()
        self.max_jobs = max(self.max_jobs, len(jobs))
        if len(jobs) > 1:
            self.violations.append(f"two jobs on one checkpoint dir: {sorted(jobs)}")
        try:
            self.dirs.state()
        except ValueError as exc:
            self.violations.append(f"state.json did not parse: {exc}")
        with self.lock:
            seen_at = time.time()  # the look begins: it sees the root as it is at this time or later
            try:
                newest = newest_complete(self.dirs.root) if self.dirs.root.is_dir() else None
            except CheckpointError:
                return
            step = newest.step if newest else None
            if self.high is not None and (step is None or step < self.high):
                self.violations.append(f"newest complete checkpoint went back from step {self.high} to {step}")
            if step is not None and (self.high is None or step > self.high):
                self.high = step
            self.timeline.append((seen_at, step))

    def run(self) -> None:  # type: ignore[override]
        while not self.stopped.wait(0.1):
            self.sample()

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=10)


# ---- the driver -----------------------------------------------------------------------------------------------
class ChaosRun:
    """A supervised run plus what the faults need: the live supervisor, the seeded RNG, a record of events."""

    def __init__(self, base: Path, supervisors: Supervisors, seed: int, config: Path, root: Path | None = None) -> None:
        self.dirs = RunDir(base, root)
        self.supervisors, self.seed = supervisors, seed
        self.rng = random.Random(seed)
        self.config = config
        self.monitor = Monitor(self.dirs, supervisors.tag)
        self.proc: subprocess.Popen[str] | None = None
        self.output: list[str] = []
        self.notes: list[str] = []  # what each fault did, printed with the seed
        self.torn: set[str] = set()  # names of step dirs a fault tore on purpose (until the trainer re-saves them)

    def say(self, what: str) -> None:
        line = f"[chaos seed={self.seed} t={time.monotonic():.1f}] {what}"
        self.notes.append(line)
        print(line, flush=True)

    def start_supervisor(self) -> subprocess.Popen[str]:
        p = self.supervisors.start(self.config)
        # Drain its console output so a chatty run can never block on a full pipe.
        threading.Thread(target=lambda: self.output.append(p.stdout.read() if p.stdout else ""), daemon=True).start()
        self.proc = p
        return p

    def attempt(self) -> int:
        return int(self.dirs.state().get("attempt") or 0)

    def wait_running(self, attempt: int, timeout: float = TIMEOUT) -> dict[str, Any]:
        """Until attempt `attempt` (or later) is running; fails early if the supervisor exited."""
        def ready() -> dict[str, Any] | None:
            assert self.proc is not None and self.proc.poll() is None, \
                f"supervisor exited ({self.proc.returncode if self.proc else None}) before attempt {attempt}"
            st = self.dirs.state()
            return st if (st.get("attempt") or 0) >= attempt and st.get("state") == "running" else None

        return wait_for(ready, timeout, f"attempt {attempt} running")  # type: ignore[return-value]

    def wait_training(self, min_steps: int, *, past: int | None = None, timeout: float = TIMEOUT) -> int:
        """Until this attempt's heartbeat says train at >= `past` (default: the resume step) + `min_steps`."""
        attempt = self.attempt()
        floor = (self.dirs.resumed_step() if past is None else past) + min_steps

        def ready() -> int | None:
            self._still_attempt(attempt, "before the fault was injected")
            beat = self.dirs.beat()
            return beat.step if beat is not None and beat.phase == "train" and beat.step >= floor else None

        return int(wait_for(ready, timeout, f"training at step >= {floor}"))  # type: ignore[arg-type]

    def wait_commit(self, above: int, timeout: float = TIMEOUT) -> int:
        """Until a checkpoint with a step above `above` is committed; returns its step."""
        attempt = self.attempt()

        def ready() -> int | None:
            self._still_attempt(attempt, "while waiting for a commit")
            step = self.dirs.newest_step()
            return step if step > above else None

        return int(wait_for(ready, timeout, f"a commit above step {above}", interval=0.01))  # type: ignore[arg-type]

    def _still_attempt(self, attempt: int, when: str) -> None:
        st = self.dirs.state()
        assert st.get("attempt") == attempt and st.get("state") == "running", \
            f"attempt {attempt} ended {when} (state {st.get('state')}, step {st.get('step')}): out of steps?"

    def wait_relaunch(self, after: int, timeout: float = TIMEOUT) -> dict[str, Any]:
        return self.wait_running(after + 1, timeout)

    def strays(self) -> list[str]:
        """Live processes of this test that are neither the supervisor nor its descendants (should be none)."""
        assert self.proc is not None
        tagged = []
        for p in psutil.process_iter(["pid", "name"]):
            try:
                if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(TAG_ENV) == self.supervisors.tag:
                    tagged.append(p)
            except psutil.Error:
                continue
        # The tree after the scan: a process started meanwhile (a spare's new warm worker) is in it by now.
        try:
            mine = {self.proc.pid, *(p.pid for p in psutil.Process(self.proc.pid).children(recursive=True))}
        except psutil.Error:
            mine = set()
        return [f"{p.pid}:{p.info['name']}" for p in tagged if p.pid not in mine and p.is_running()]

    def finish(self, timeout: float = TIMEOUT) -> tuple[int, str]:
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"supervisor still running after {timeout}s; state: {self.dirs.state()}") from None
        time.sleep(0.2)  # let the drain thread collect the tail
        return rc, "".join(self.output)[-3000:]
