"""Two nodes on one machine: two supervisors, torchrun's c10d rendezvous, one shared checkpoint dir.

Also the Kubernetes example shipped for multi-node runs (the Slurm script: test_slurm_script.py and tests/slurm/).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from tests.helpers import TORCHRUN as HELPER_TORCHRUN
from tests.helpers import Launcher, compare_checkpoints, free_port, torchrun  # noqa: F401  (fixture)
from tests.supervise import REPO, Supervisors, supervisors, wait_for  # noqa: F401

TORCHRUN = str(HELPER_TORCHRUN)
STEPS = 24
KILL_AFTER = 8  # SIGKILL once this step's checkpoint exists: a resume point, and most of the run still ahead
# Tiny and short, but long enough that the kill lands mid-run; --seed makes both runs the same run.
TRAINER_ARGS = ["--steps", str(STEPS), "--save-every", "4", "--seed", "7", "--d-model", "32", "--n-layers", "1",
                "--n-heads", "2", "--seq-len", "32", "--batch-size", "4", "--log-every", "10"]


def node_config(tmp_path: Path, node: int, endpoint: str, rdzv_id: str, ckpts: Path) -> Path:
    """Node `node`'s job.toml: torchrun on c10d, --resume auto (rank 0 decides), only node 0 prunes."""
    command = [TORCHRUN, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
               f"--rdzv-id={rdzv_id}", "--max-restarts=3", "-m", "trainer", "--checkpoint-dir", str(ckpts),
               "--resume", "auto", *TRAINER_ARGS]
    # torchrun's default shared rendezvous store leaves restarted workers hanging in init_process_group.
    env = '{ OMP_NUM_THREADS = "1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE = "1" }'
    path = tmp_path / f"node{node}.toml"
    path.write_text(
        f"[job]\ncommand = {json.dumps(command)}\nresume_args = []\nenv = {env}\n\n"
        f"[checkpoints]\ndir = {json.dumps(str(ckpts))}\nprune = {'true' if node == 0 else 'false'}\nkeep_last = 3\n\n"
        f"[restart]\nbackoff_initial_s = 0.5\nbackoff_max_s = 2\n\n[health]\nstop_timeout_s = 30\n\n"
        f"[supervisor]\nrun_dir = \"run{node}\"\n"
    )
    return path


def job_state(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def worker_of(run_dir: Path) -> psutil.Process | None:
    """The trainer process under this node's torchrun agent, once it runs."""
    pid = job_state(run_dir).get("job_pid")
    try:
        kids = psutil.Process(pid).children(recursive=True) if pid else []
    except psutil.Error:
        return None
    return next((k for k in kids if "trainer" in " ".join(k.cmdline())), None)


class TestTwoNodes:
    def test_worker_killed_on_node_1_both_recover_bit_identical(self, tmp_path: Path, supervisors: Supervisors,
                                                                 torchrun: Launcher) -> None:
        """SIGKILL node 1's worker mid-run: both sides recover and exit 0; weights equal a 2-rank single-node run."""
        ref_ckpts = tmp_path / "ref-ckpts"
        ref = torchrun.torchrun(["--checkpoint-dir", ref_ckpts, *TRAINER_ARGS])  # concurrently: the same 2-rank run
        ckpts = tmp_path / "ckpts"
        endpoint, rdzv_id = f"127.0.0.1:{free_port()}", f"test-{os.getpid()}-{tmp_path.name}"
        nodes = [supervisors.start(node_config(tmp_path, n, endpoint, rdzv_id, ckpts)) for n in (0, 1)]

        wait_for(lambda: (ckpts / f"step_{KILL_AFTER:08d}").is_dir(), 120, f"step {KILL_AFTER} checkpoint")
        victim = wait_for(lambda: worker_of(tmp_path / "run1"), 30, "node 1's worker")
        assert not (ckpts / f"step_{STEPS:08d}").exists(), "the run finished before the kill: make it longer"
        victim.send_signal(signal.SIGKILL)

        outs = [p.communicate(timeout=180)[0] for p in nodes]
        assert [p.returncode for p in nodes] == [0, 0], outs
        assert ref.wait(120) == 0, ref.text()[-3000:]
        job_logs = "".join(f.read_text() for n in (0, 1) for f in (tmp_path / f"run{n}" / "logs").glob("attempt-*.log"))
        assert "event=resuming" in job_logs, "no rank resumed from a checkpoint after the kill"
        assert all(job_state(tmp_path / f"run{n}")["state"] == "completed" for n in (0, 1))
        # Each node's local rank 0 beats into its own supervisor: both know the final step (hang detection on both).
        assert [job_state(tmp_path / f"run{n}")["step"] for n in (0, 1)] == [STEPS, STEPS]
        sup_logs = [(tmp_path / f"run{n}" / "supervisor.log").read_text() for n in (0, 1)]
        assert "retention_deleted" in sup_logs[0] and "retention_deleted" not in sup_logs[1]

        cmp = compare_checkpoints(ref_ckpts / f"step_{STEPS:08d}", ckpts / f"step_{STEPS:08d}", tmp_path)
        assert cmp.returncode == 0, cmp.stdout + cmp.stderr
K8S_JOB = REPO / "deploy" / "k8s" / "job.yaml"

class TestKubernetesExample:
    def test_manifests_parse_and_cover_the_emergency_save(self) -> None:
        """job.yaml parses; the grace period covers stop_timeout_s; exit 3 fails the Job; the script parses."""
        yaml = pytest.importorskip("yaml", reason="PyYAML not installed (pip install -e '.[dev]')")
        docs = {d["kind"]: d for d in yaml.safe_load_all(K8S_JOB.read_text())}
        assert set(docs) == {"PersistentVolumeClaim", "Service", "ConfigMap", "Job"}
        spec = docs["Job"]["spec"]
        script = docs["ConfigMap"]["data"]["start.sh"]
        stop_timeout = int(script.split("stop_timeout_s = ")[1].split()[0])
        assert spec["template"]["spec"]["terminationGracePeriodSeconds"] >= stop_timeout + 30
        rule = spec["podFailurePolicy"]["rules"][0]
        assert rule["action"] == "FailJob" and rule["onExitCodes"]["values"] == [3]
        claim = spec["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
        assert claim == docs["PersistentVolumeClaim"]["metadata"]["name"]
        r = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        assert 'TORCH_DISABLE_SHARE_RDZV_TCP_STORE = "1"' in script and 'resume_args = []' in script
