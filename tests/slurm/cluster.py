"""A real Slurm cluster on this host for the tests (deploy/slurm/local-cluster.sh), and the jobs submitted to it.

`Cluster` brings up munged, slurmctld and two slurmd (emulated nodes n1, n2) under one directory and stops exactly
those daemons again. `SlurmJob` is one submission of the sbatch script under test: its Slurm state (`scontrol show
job`), its run dirs and checkpoints, and the waits the scenarios need.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.helpers import REPO, TAG_ENV, wait_for

__all__ = ["CLUSTER_SCRIPT", "SBATCH", "Cluster", "SlurmJob", "unavailable"]

CLUSTER_SCRIPT = REPO / "deploy" / "slurm" / "local-cluster.sh"
# The script under test; FSDP_TEST_SLURM_SBATCH points the scenarios at another one (e.g. an older version).
SBATCH = Path(os.environ.get("FSDP_TEST_SLURM_SBATCH") or REPO / "deploy" / "slurm" / "fsdp-supervisor.sbatch")
SUPERVISOR = Path(sys.executable).parent / "fsdp-supervisor"
FORGOTTEN = "FORGOTTEN"
FINAL_STATES = {FORGOTTEN, "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                "BOOT_FAIL"}
_FIELD = re.compile(r"(\w+)=(\S*)")


def unavailable() -> str | None:
    """Why this machine cannot run the cluster (one line), or None: root, and Debian's slurm-wlm and munge."""
    if os.geteuid() != 0:
        return "needs root (slurmd starts the jobs, munged runs as root): run `make test-slurm` as root"
    r = subprocess.run(["bash", str(CLUSTER_SCRIPT), "install"], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return f"slurm-wlm and munge cannot be installed here: {last}"
    return None


class Cluster:
    """The daemons of deploy/slurm/local-cluster.sh under `root`; `down()` stops exactly them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def up(self) -> None:
        self._script("up", timeout=180)

    def down(self) -> None:
        self._script("down", timeout=300)

    def _script(self, cmd: str, timeout: float) -> None:
        r = subprocess.run(["bash", str(CLUSTER_SCRIPT), cmd, str(self.root)], capture_output=True, text=True,
                           timeout=timeout)
        assert r.returncode == 0, f"local-cluster.sh {cmd}: {r.stderr}\n{self.logs()}"

    def logs(self, lines: int = 30) -> str:
        out = []
        for log in sorted((self.root / "log").glob("*.log")):
            out.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)

    def run(self, *argv: str, timeout: float = 60) -> str:
        """A Slurm command (`scontrol ...`) against this cluster; its stdout. Fails the test on an error."""
        r = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, f"{' '.join(argv)}: {r.stderr.strip()}"
        return r.stdout

    def submit(self, workdir: Path, tag: str, *sbatch_args: str, **env: str) -> SlurmJob:
        """sbatch the script under test from `workdir` (checkpoints and run dirs below it); every process of the
        job inherits `tag` (tests.helpers.TAG_ENV), so that none may outlive the scenario."""
        workdir.mkdir(parents=True, exist_ok=True)
        job_env = {**self.env, TAG_ENV: tag, "SUPERVISOR": str(SUPERVISOR), "CKPT_DIR": str(workdir / "ckpts"),
                   "RUN_ROOT": str(workdir / "run"), "OMP_NUM_THREADS": "1", **env}
        r = subprocess.run(["sbatch", "--parsable", "--output", str(workdir / "slurm-%j.out"), *sbatch_args, str(SBATCH)],
                           env=job_env, cwd=workdir, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"sbatch: {r.stderr.strip()}"
        return SlurmJob(self, int(r.stdout.strip().split(";")[0]), workdir)


class SlurmJob:
    def __init__(self, cluster: Cluster, job_id: int, workdir: Path) -> None:
        self.cluster, self.id, self.workdir = cluster, job_id, workdir
        self.ckpts, self.run_root = workdir / "ckpts", workdir / "run"

    # ---- Slurm's view -------------------------------------------------------------------------------------------
    def show(self) -> dict[str, str]:
        """`scontrol show job -o` as a dict (JobState, Reason, Restarts, ExitCode, RunTime, TimeLimit, ...); a job
        Slurm has forgotten (MinJobAge, 300 s after its end) is JobState=FORGOTTEN."""
        r = subprocess.run(["scontrol", "show", "job", "-o", str(self.id)], env=self.cluster.env, capture_output=True,
                           text=True, timeout=60)
        if r.returncode != 0 and "Invalid job id" in r.stderr:
            return {"JobState": FORGOTTEN}
        assert r.returncode == 0, f"scontrol show job {self.id}: {r.stderr.strip()}"
        return dict(_FIELD.findall(r.stdout))

    def state(self) -> str:
        return self.show().get("JobState", "")

    def ended(self) -> bool:
        """Final, and done completing (JobState says COMPLETING until every step and its processes are gone)."""
        return self.state() in FINAL_STATES

    def pending(self) -> bool:
        return self.state() == "PENDING"

    def squeue_state(self) -> str:
        """squeue's compact state: R, PD, CG (completing), or '' once the job has left the queue."""
        return self.cluster.run("squeue", "-h", "-j", str(self.id), "-o", "%t").strip()

    def wait(self, predicate: Any, timeout: float, what: str) -> Any:
        return wait_for(predicate, timeout, f"job {self.id}: {what}\n{self.output()[-3000:]}", interval=0.5)

    def wait_ended(self, timeout: float = 300) -> dict[str, str]:
        self.wait(self.ended, timeout, "the end")
        return self.show()

    def release(self, time_limit_min: int | None = None) -> None:
        """Start a requeued job now (Slurm holds one for about two minutes otherwise), with a new time limit."""
        self.wait(lambda: self.squeue_state() == "PD", 120, "the requeue to complete")
        limit = [f"TimeLimit={time_limit_min}"] if time_limit_min else []
        self.cluster.run("scontrol", "update", f"JobId={self.id}", "StartTime=now", *limit)

    def near_time_limit(self, left_s: tuple[int, int] = (90, 150)) -> None:
        """Set the time limit (whole minutes) so that between left_s[0] and left_s[1] seconds remain: the script's
        pre-timeout signal is then due, and Slurm sends it at its next look (every 30 s)."""
        elapsed = _seconds(self.show()["RunTime"])
        minutes = (elapsed + left_s[1]) // 60
        assert left_s[0] < minutes * 60 - elapsed <= left_s[1], (elapsed, minutes)
        self.cluster.run("scontrol", "update", f"JobId={self.id}", f"TimeLimit={minutes}")

    # ---- the run's files ----------------------------------------------------------------------------------------
    def output(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.workdir.glob("slurm-*.out")))

    def node_state(self, node: int = 0) -> dict[str, Any]:
        try:
            return json.loads((self.run_root / f"node-{node}" / "state.json").read_text())  # type: ignore[no-any-return]
        except (OSError, ValueError):
            return {}

    def job_logs(self, node: int = 0) -> str:
        logs = sorted((self.run_root / f"node-{node}" / "logs").glob("*.log"))
        return "".join(p.read_text(errors="replace") for p in logs)

    def supervisor_log(self, node: int = 0) -> str:
        try:
            return (self.run_root / f"node-{node}" / "supervisor.log").read_text(errors="replace")
        except OSError:
            return ""

    def checkpoint(self, step: int) -> Path:
        return self.ckpts / f"step_{step:08d}"

    def resumed_steps(self, node: int = 0) -> list[int]:
        """Steps rank 0 resumed from, in order (the trainer's `event=resuming` lines)."""
        return [int(s) for s in re.findall(r"event=resuming rank=0 .*? step=(\d+)", self.job_logs(node))]

    def training(self, past_step: int) -> bool:
        """The job is training beyond `past_step` (node 0's heartbeat)."""
        st = self.node_state()
        return st.get("state") == "running" and isinstance(st.get("step"), int) and st["step"] > past_step


def _seconds(runtime: str) -> int:
    """Slurm's [D-]HH:MM:SS as seconds."""
    days, _, hms = runtime.rpartition("-")
    h, m, s = (int(x) for x in hms.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


def settle(seconds: float) -> None:
    """Let Slurm act (or not): a requeue that must not happen has this long to show."""
    time.sleep(seconds)
