"""Two nodes on one machine: two supervisors, torchrun's c10d rendezvous, one shared checkpoint dir.

Also the scheduler examples shipped for multi-node runs (Slurm sbatch, Kubernetes Job).
"""
from __future__ import annotations

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

from tests.helpers import TAG_ENV, Launcher, assert_no_orphans, free_port, torchrun  # noqa: F401  (fixture)
from tests.helpers import TORCHRUN as HELPER_TORCHRUN
from tests.supervise import REPO, Supervisors, supervisors, wait_for  # noqa: F401
from tests.unit.test_multinode import SBATCH

TORCHRUN = str(HELPER_TORCHRUN)
STEPS = 24
KILL_AFTER = 8  # SIGKILL once this step's checkpoint exists: a resume point, and most of the run still ahead
# Tiny and short, but long enough that the kill lands mid-run; --seed makes both runs the same run.
TRAINER_ARGS = ["--steps", str(STEPS), "--save-every", "4", "--seed", "7", "--d-model", "32", "--n-layers", "1",
                "--n-heads", "2", "--seq-len", "32", "--batch-size", "4", "--log-every", "10"]

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

        cmp = subprocess.run([sys.executable, "-c", _COMPARE, str(ref_ckpts / f"step_{STEPS:08d}"),
                              str(tmp_path / "ref.pt"), str(ckpts / f"step_{STEPS:08d}"), str(tmp_path / "got.pt")],
                             capture_output=True, text=True, timeout=120, cwd=REPO)
        assert cmp.returncode == 0, cmp.stdout + cmp.stderr
K8S_JOB = REPO / "deploy" / "k8s" / "job.yaml"

# Stand-ins for Slurm's commands: srun runs the command once per node (SLURM_NODEID) and forwards SIGTERM,
# exiting with the highest status like srun; scontrol lists two hosts and records requeues.
_FAKE_SRUN = """#!/bin/bash
while [[ $1 == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do SLURM_NODEID=$i "$@" & pids+=($!); done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
rc=0
for p in "${pids[@]}"; do
    wait "$p"; s=$?
    if (( s > 128 )); then wait "$p"; s=$?; fi
    (( s > rc )) && rc=$s
done
exit $rc
"""
_FAKE_SCONTROL = """#!/bin/bash
case "$1 $2" in
    "show hostnames") printf 'node-a\\nnode-b\\n' ;;
    requeue*) echo "$@" >> "$FAKE_DIR/requeued" ;;
    *) exit 1 ;;
esac
"""
# Stands in for fsdp-supervisor: validates the generated config with the real loader, records it, then
# exits with FAKE_EXIT_<node> or, when that is "wait", waits for SIGTERM and exits 0 like a graceful stop.
_FAKE_SUPERVISOR = """#!{python}
import json, os, signal, sys, time
from pathlib import Path
from supervisor.config import load_config
assert sys.argv[1:3] == ["run", "-c"], sys.argv
cfg = load_config(sys.argv[3])
node = os.environ["SLURM_NODEID"]
record = {{"node": node, "prune": cfg.checkpoints.prune, "command": cfg.job.command,
          "resume_args": cfg.job.resume_args, "env": cfg.job.env, "run_dir": str(cfg.run_dir),
          "ckpts": str(cfg.checkpoints.dir)}}
fake = Path(os.environ["FAKE_DIR"])
mode = os.environ["FAKE_EXIT_" + node]
if mode == "wait":
    signal.signal(signal.SIGTERM, lambda *_: ((fake / f"term-{{node}}").write_text("1"), sys.exit(0)))
(fake / f"node-{{node}}.json").write_text(json.dumps(record))
while mode == "wait":
    time.sleep(0.05)
sys.exit(int(mode))
"""


@pytest.fixture
def slurm_tag() -> Iterator[str]:
    """A tag for the fake Slurm processes; none may outlive the test."""
    tag = uuid.uuid4().hex
    yield tag
    assert_no_orphans(tag)


def fake_slurm(tmp_path: Path, exits: tuple[str, str], tag: str) -> tuple[list[str], dict[str, str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", _FAKE_SRUN), ("scontrol", _FAKE_SCONTROL),
                       ("fsdp-supervisor", _FAKE_SUPERVISOR.format(python=sys.executable))):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)  # the sbatch uses the python next to fsdp-supervisor
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_DIR": str(tmp_path),
           "SUPERVISOR": str(bin_dir / "fsdp-supervisor"), "CKPT_DIR": str(tmp_path / "ckpts"),
           "RUN_ROOT": str(tmp_path / "run"), "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_RESTART_COUNT": "0", "RDZV_PORT": "29577",
           "FAKE_EXIT_0": exits[0], "FAKE_EXIT_1": exits[1], TAG_ENV: tag}
    return ["bash", str(SBATCH)], env


class TestSlurmScript:
    def test_bash_syntax(self) -> None:
        """The sbatch script parses (bash -n)."""
        r = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr

    def test_node_configs(self, tmp_path: Path, slurm_tag: str) -> None:
        """Each node gets a valid config: same c10d endpoint on the first host, own run dir, only node 0 prunes."""
        argv, env = fake_slurm(tmp_path, ("0", "0"), slurm_tag)
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        nodes = [json.loads((tmp_path / f"node-{n}.json").read_text()) for n in (0, 1)]
        assert [n["prune"] for n in nodes] == [True, False]
        assert all(n["resume_args"] == [] and n["ckpts"] == str(tmp_path / "ckpts") for n in nodes)
        assert all(n["env"].get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1" for n in nodes)
        assert nodes[0]["run_dir"] != nodes[1]["run_dir"]
        for n in nodes:
            assert "--rdzv-endpoint=node-a:29577" in n["command"] and "--rdzv-backend=c10d" in n["command"]
            assert n["command"][n["command"].index("--resume") + 1] == "auto"
        assert nodes[0]["command"] == nodes[1]["command"]
        assert not (tmp_path / "requeued").exists()

    def test_gave_up_is_not_requeued(self, tmp_path: Path, slurm_tag: str) -> None:
        """A supervisor exiting 3 makes the batch script exit 3 without requeueing."""
        argv, env = fake_slurm(tmp_path, ("0", "3"), slurm_tag)
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 3 and not (tmp_path / "requeued").exists(), r.stderr

    def test_other_failure_is_requeued(self, tmp_path: Path, slurm_tag: str) -> None:
        """A supervisor dying any other way (here exit 1) requeues the job."""
        argv, env = fake_slurm(tmp_path, ("1", "0"), slurm_tag)
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert (tmp_path / "requeued").read_text().split() == ["requeue", "4242"], r.stderr

    def test_time_limit_signal_stops_supervisors_and_requeues(self, tmp_path: Path, slurm_tag: str) -> None:
        """SIGTERM to the batch shell reaches every supervisor; after their graceful exit 0 the job is requeued."""
        argv, env = fake_slurm(tmp_path, ("wait", "wait"), slurm_tag)
        p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
        try:
            wait_for(lambda: all((tmp_path / f"node-{n}.json").exists() for n in (0, 1)), 60, "both supervisors")
            p.send_signal(signal.SIGTERM)
            _, err = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        assert p.returncode == 0, err
        assert all((tmp_path / f"term-{n}").exists() for n in (0, 1))
        assert (tmp_path / "requeued").read_text().split() == ["requeue", "4242"]


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
