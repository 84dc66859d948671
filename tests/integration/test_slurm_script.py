"""deploy/slurm/fsdp-supervisor.sbatch's own decisions, with stand-ins for srun, scontrol and the supervisor.

Fast, and in `make test`: which config each node gets, and what the script does on each signal and each exit of
the supervisors (requeue or not, a `stop` on every node or not). tests/slurm/ runs the same script on a real
cluster (`make test-slurm`): what Slurm really sends, and the emergency checkpoint that follows.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.helpers import TAG_ENV, assert_no_orphans, wait_for
from tests.unit.test_multinode import SBATCH

# srun: runs the command once per node (SLURM_NODEID), options ignored, exits with the highest status; the main step
# (no --overlap) leaves FAKE_DIR/main-step as it starts.
_FAKE_SRUN = """#!/bin/bash
[[ " $* " == *" --overlap "* ]] || touch "$FAKE_DIR/main-step"
while [[ $1 == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do SLURM_NODEID=$i "$@" & pids+=($!); done
rc=0
for p in "${pids[@]}"; do wait "$p"; s=$?; (( s > rc )) && rc=$s; done
exit $rc
"""
# scontrol: two hosts whose NodeAddr differs from their names (the first thing the script asks; FAKE_DIR/hostnames
# says it was asked, FAKE_HOSTNAMES_DELAY delays the answer); the job's state from FAKE_JOB_STATE/REASON
# (what the batch shell asks on a SIGTERM); requeues recorded.
_FAKE_SCONTROL = """#!/bin/bash
case "$1 $2" in
    "show hostnames") touch "$FAKE_DIR/hostnames"; sleep "${FAKE_HOSTNAMES_DELAY:-0}"; printf 'node-a\\nnode-b\\n' ;;
    "show node") printf 'NodeName=%s Arch=x86_64\\n   NodeAddr=10.9.8.7 NodeHostName=%s Version=22.05.8\\n' "$3" "$3" ;;
    "show job") printf 'JobId=%s\n   JobState=%s Reason=%s\n' "$3" "${FAKE_JOB_STATE:-RUNNING}" "${FAKE_JOB_REASON:-None}" ;;
    requeue*) echo "$@" >> "$FAKE_DIR/requeued" ;;
    *) exit 1 ;;
esac
"""
# fsdp-supervisor: `run` validates the generated config with the real loader, records it, then exits with
# FAKE_EXIT_<node>, or for "wait" is up after FAKE_UP_AFTER seconds, waits for SIGTERM (its pid in
# FAKE_DIR/pid-<node>) and exits 0 as a graceful stop does (with FAKE_HOLD: once FAKE_DIR/release exists, a save
# still going on), or without one after FAKE_WAIT_MAX seconds, as a run that finished, or for "killed" starts a job
# in a session of its own (the run token in its environment and in run_dir/job.token, its pid in
# FAKE_DIR/job-<node>) and dies by SIGKILL, as a supervisor the OOM killer took; `stop` records itself and
# SIGTERMs that node's `run` (none up yet: says so, exit 0); `status` exits 0 while that node's `run` is up, else 3.
_FAKE_SUPERVISOR = """#!{python}
import json, os, signal, sys, time
from pathlib import Path
from supervisor.config import load_config
fake, node = Path(os.environ["FAKE_DIR"]), os.environ["SLURM_NODEID"]
assert sys.argv[2] == "-c" and sys.argv[3].endswith(f"node-{{node}}.toml"), sys.argv
def up():
    try:
        os.kill(int((fake / f"pid-{{node}}").read_text()), 0)
        return True
    except (OSError, ValueError):
        return False
if sys.argv[1] == "status":
    sys.exit(0 if up() else 3)
if sys.argv[1] == "stop" and not up():
    print("no supervisor is running")  # as the real one: exit 0
    sys.exit(0)
if sys.argv[1] == "stop":
    (fake / f"stop-{{node}}").write_text("1")
    os.kill(int((fake / f"pid-{{node}}").read_text()), signal.SIGTERM)
    sys.exit(0)
cfg = load_config(sys.argv[3])
record = {{"node": node, "prune": cfg.checkpoints.prune, "command": cfg.job.command,
          "resume_args": cfg.job.resume_args, "env": cfg.job.env, "run_dir": str(cfg.run_dir),
          "ckpts": str(cfg.checkpoints.dir), "stop_timeout_s": cfg.health.stop_timeout_s}}
mode = os.environ["FAKE_EXIT_" + node]
if mode == "killed":
    import subprocess
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    (cfg.run_dir / "job.token").write_text("tok" + node)
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True,
                           env={{**os.environ, "FSDP_SUPERVISOR_RUN_TOKEN": "tok" + node}},
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    (fake / f"job-{{node}}").write_text(str(job.pid))
    os.kill(os.getpid(), signal.SIGKILL)
def stopped(*_):
    (fake / f"term-{{node}}").write_text("1")
    while os.environ.get("FAKE_HOLD") and not (fake / "release").exists():
        time.sleep(0.05)
    sys.exit(0)
if mode == "wait":
    time.sleep(float(os.environ.get("FAKE_UP_AFTER", "0")))
    signal.signal(signal.SIGTERM, stopped)
    (fake / f"pid-{{node}}").write_text(str(os.getpid()))
(fake / f"node-{{node}}.json").write_text(json.dumps(record))
deadline = time.monotonic() + float(os.environ.get("FAKE_WAIT_MAX", "600"))
while mode == "wait" and time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(0 if mode == "wait" else int(mode))
"""


@pytest.fixture
def slurm_tag() -> Iterator[str]:
    """A tag for the fake Slurm processes; none may outlive the test."""
    tag = uuid.uuid4().hex
    yield tag
    assert_no_orphans(tag)


def fake_slurm(tmp_path: Path, exits: tuple[str, str], tag: str, **extra: str) -> tuple[list[str], dict[str, str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", _FAKE_SRUN), ("scontrol", _FAKE_SCONTROL),
                       ("fsdp-supervisor", _FAKE_SUPERVISOR.format(python=sys.executable))):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)  # the sbatch uses the python next to fsdp-supervisor
    env = {k: v for k, v in os.environ.items() if k != "RDZV_PORT"}
    env.update({"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_DIR": str(tmp_path),
                "SUPERVISOR": str(bin_dir / "fsdp-supervisor"), "CKPT_DIR": str(tmp_path / "ckpts"),
                "RUN_ROOT": str(tmp_path / "run"), "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2",
                "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_RESTART_COUNT": "0",
                "FAKE_EXIT_0": exits[0], "FAKE_EXIT_1": exits[1], TAG_ENV: tag, **extra})
    return ["bash", str(SBATCH)], env


def requeues(tmp_path: Path) -> list[list[str]]:
    try:
        return [line.split() for line in (tmp_path / "requeued").read_text().splitlines()]
    except FileNotFoundError:
        return []


def configs(tmp_path: Path) -> list[dict]:
    return [json.loads((tmp_path / f"node-{n}.json").read_text()) for n in (0, 1)]


def signalled(tmp_path: Path, sig: int, tag: str, *, slurm_too: bool = False, again: int | None = None,
              early: str | None = None, **extra: str) -> tuple[int, str]:
    """Run the script with both supervisors waiting; send `sig` to the batch shell (and, with `slurm_too`, SIGTERM
    to every supervisor as Slurm does to every process of a job it ends); its exit status and stderr. `again`: a
    second signal to the batch shell once it has logged its answer to the first, while both supervisors are still
    saving (they finish once it is sent). `early`: send `sig` as soon as FAKE_DIR/<early> appears (`main-step`: the
    main step has started; `hostnames`: the script has just begun), before the supervisors are up."""
    if again is not None:
        extra["FAKE_HOLD"] = "1"
    argv, env = fake_slurm(tmp_path, ("wait", "wait"), tag, **extra)
    err_path = tmp_path / "stderr"
    with err_path.open("w") as err_file:
        p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err_file, start_new_session=True)
    try:
        if early:
            wait_for(lambda: (tmp_path / early).exists(), 60, early)
        else:
            wait_for(lambda: all((tmp_path / f"pid-{n}").exists() for n in (0, 1)), 60, "both supervisors")
        p.send_signal(sig)
        if slurm_too:
            for n in (0, 1):
                os.kill(int((tmp_path / f"pid-{n}").read_text()), signal.SIGTERM)
        if again is not None:
            wait_for(lambda: "fsdp-supervisor.sbatch:" in err_path.read_text(), 60, "the script's answer")
            wait_for(lambda: all((tmp_path / f"term-{n}").exists() for n in (0, 1)), 60, "both supervisors stopping")
            p.send_signal(again)
            time.sleep(0.2)  # the shell takes it in its wait for srun (were it later, the test could only pass)
            (tmp_path / "release").write_text("1")
        p.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):  # what a dead batch shell left: Slurm would kill it too
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    return p.returncode, err_path.read_text()

class TestNodeConfigs:
    def test_bash_syntax(self) -> None:
        """The sbatch script parses (bash -n)."""
        r = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr

    @pytest.mark.parametrize("how", ["sh", "bash outside Slurm"])
    def test_run_the_wrong_way_says_so_in_one_line(self, tmp_path: Path, slurm_tag: str, how: str) -> None:
        """`sh fsdp-supervisor.sbatch` (dash has no pipefail), or bash outside a Slurm job: exit 2, one line."""
        argv, env = fake_slurm(tmp_path, ("0", "0"), slurm_tag)
        if how == "sh":
            argv[0] = "sh"
        else:
            env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("fsdp-supervisor.sbatch: "), r.stderr
        assert ("bash" if how == "sh" else "sbatch") in lines[0] and not (tmp_path / "run").exists()

    def test_each_node_gets_a_valid_config(self, tmp_path: Path, slurm_tag: str) -> None:
        """Same c10d endpoint (the head node's NodeAddr, a port from the job id) and id (the job's), node 0 hosts the
        store and is the one pruner, an own run dir per node."""
        argv, env = fake_slurm(tmp_path, ("0", "0"), slurm_tag)
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        nodes = configs(tmp_path)
        assert [n["prune"] for n in nodes] == [True, False]
        assert all(n["resume_args"] == [] and n["ckpts"] == str(tmp_path / "ckpts") for n in nodes)
        assert all(n["env"].get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1" for n in nodes)
        assert nodes[0]["run_dir"] != nodes[1]["run_dir"]
        for n, host in zip(nodes, ("1", "0"), strict=True):
            cmd = n["command"]
            assert "--rdzv-endpoint=10.9.8.7:24242" in cmd and "--rdzv-backend=c10d" in cmd  # 20000 + 4242 % 10000
            assert f"--rdzv-conf=is_host={host}" in cmd and "--rdzv-id=fsdp-4242" in cmd
            assert cmd[cmd.index("--resume") + 1] == "auto"
        assert not requeues(tmp_path)

    def test_port_and_host_can_be_set(self, tmp_path: Path, slurm_tag: str) -> None:
        """RDZV_PORT and RDZV_HOST override the derived endpoint."""
        argv, env = fake_slurm(tmp_path, ("0", "0"), slurm_tag, RDZV_PORT="29577", RDZV_HOST="head.example")
        assert subprocess.run(argv, env=env, capture_output=True, timeout=60).returncode == 0
        assert all("--rdzv-endpoint=head.example:29577" in n["command"] for n in configs(tmp_path))


class TestExits:
    @pytest.mark.parametrize("code", ["2", "3"])
    def test_config_error_and_gave_up_are_not_requeued(self, tmp_path: Path, slurm_tag: str, code: str) -> None:
        """A supervisor exiting 2 (bad config) or 3 (gave up) fails the job with that code, no requeue."""
        argv, env = fake_slurm(tmp_path, ("0", code), slurm_tag)
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == int(code) and not requeues(tmp_path), r.stderr

    def test_other_failure_is_requeued(self, tmp_path: Path, slurm_tag: str) -> None:
        """A supervisor failing any other way (here exit 1) requeues the job."""
        argv, env = fake_slurm(tmp_path, ("1", "0"), slurm_tag)
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert requeues(tmp_path) == [["requeue", "4242"]], r.stderr

    def test_a_killed_supervisors_job_does_not_outlive_it(self, tmp_path: Path, slurm_tag: str) -> None:
        """A supervisor SIGKILLed (the OOM killer, kill -9) leaves its job running in a session of its own, which
        Slurm's proctrack/linuxproc no longer counts as the step's: the node's wrapper kills it (found by the run
        token in its environment), then the job is requeued as for any failure. (The fixture: no process left.)"""
        argv, env = fake_slurm(tmp_path, ("killed", "0"), slurm_tag)
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert requeues(tmp_path) == [["requeue", "4242"]], r.stderr
        job = int((tmp_path / "job-0").read_text())
        assert not psutil.pid_exists(job) or psutil.Process(job).status() == psutil.STATUS_ZOMBIE, r.stderr

    def test_requeues_are_bounded(self, tmp_path: Path, slurm_tag: str) -> None:
        """After MAX_REQUEUES requeues a failure ends the job with the failure's code."""
        argv, env = fake_slurm(tmp_path, ("1", "0"), slurm_tag, SLURM_RESTART_COUNT="20", MAX_REQUEUES="20")
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and not requeues(tmp_path), r.stderr


class TestSignals:
    def test_time_limit_warning_stops_every_supervisor_and_requeues(self, tmp_path: Path, slurm_tag: str) -> None:
        """USR1 (--signal=B:USR1@...) to the batch shell: a `stop` on every node, then one requeue."""
        rc, err = signalled(tmp_path, signal.SIGUSR1, slurm_tag)
        assert rc == 0, err
        assert all((tmp_path / f"stop-{n}").exists() and (tmp_path / f"term-{n}").exists() for n in (0, 1))
        assert requeues(tmp_path) == [["requeue", "4242"]]

    def test_term_to_the_batch_shell_stops_for_good(self, tmp_path: Path, slurm_tag: str) -> None:
        """SIGTERM to the batch shell alone, the job still RUNNING (`scancel --batch --signal=TERM`): a `stop` on
        every node, no requeue."""
        rc, err = signalled(tmp_path, signal.SIGTERM, slurm_tag)
        assert rc == 0, err
        assert all((tmp_path / f"stop-{n}").exists() for n in (0, 1)) and not requeues(tmp_path)

    def test_slurm_ending_the_job_is_left_to_slurm(self, tmp_path: Path, slurm_tag: str) -> None:
        """scancel, scontrol requeue, preemption: Slurm signals every process; the script neither sends a `stop`
        (the supervisors have their SIGTERM) nor requeues (a cancel stays one; Slurm requeues a requeue itself)."""
        rc, err = signalled(tmp_path, signal.SIGTERM, slurm_tag, slurm_too=True, FAKE_JOB_STATE="COMPLETING")
        assert rc == 0, err
        assert not any((tmp_path / f"stop-{n}").exists() for n in (0, 1)) and not requeues(tmp_path)

    def test_time_limit_reached_without_warning_requeues(self, tmp_path: Path, slurm_tag: str) -> None:
        """The time limit itself (the warning came too late, or never): Slurm stops everything; the script requeues."""
        rc, err = signalled(tmp_path, signal.SIGTERM, slurm_tag, slurm_too=True, FAKE_JOB_STATE="COMPLETING",
                            FAKE_JOB_REASON="TimeLimit")
        assert rc == 0, err
        assert requeues(tmp_path) == [["requeue", "4242"]]


class TestSignalsDuringStartUp:
    """A time limit shorter than --signal's lead: Slurm sends the warning at its first look (within 30 s of the
    start), possibly before the supervisors are up, when a `stop` finds none to ask."""

    def test_warning_before_the_supervisors_are_up_still_stops_them(self, tmp_path: Path, slurm_tag: str) -> None:
        """USR1 while both supervisors are still starting: each is asked once it is up, then one requeue."""
        rc, err = signalled(tmp_path, signal.SIGUSR1, slurm_tag, early="main-step", FAKE_UP_AFTER="3",
                            FAKE_WAIT_MAX="20")
        assert rc == 0, err
        assert all((tmp_path / f"term-{n}").exists() for n in (0, 1)), f"a supervisor never got its stop: {err}"
        assert requeues(tmp_path) == [["requeue", "4242"]]

    def test_stop_before_the_supervisors_are_up_still_stops_them(self, tmp_path: Path, slurm_tag: str) -> None:
        """`scancel --batch --signal=TERM` while both supervisors are still starting: each is stopped, no requeue."""
        rc, err = signalled(tmp_path, signal.SIGTERM, slurm_tag, early="main-step", FAKE_UP_AFTER="3",
                            FAKE_WAIT_MAX="20")
        assert rc == 0, err
        assert all((tmp_path / f"term-{n}").exists() for n in (0, 1)), f"a supervisor never got its stop: {err}"
        assert not requeues(tmp_path)

    def test_warning_before_the_handlers_exist_is_kept_for_them(self, tmp_path: Path, slurm_tag: str) -> None:
        """USR1 in the script's first moments (USR1's default action would end the shell: the job FAILED, exit 0:10):
        remembered, then answered as the time limit's warning."""
        rc, err = signalled(tmp_path, signal.SIGUSR1, slurm_tag, early="hostnames", FAKE_HOSTNAMES_DELAY="1",
                            FAKE_UP_AFTER="1", FAKE_WAIT_MAX="20")
        assert rc == 0, err
        assert all((tmp_path / f"term-{n}").exists() for n in (0, 1)), f"a supervisor never got its stop: {err}"
        assert requeues(tmp_path) == [["requeue", "4242"]]


class TestRepeatedSignals:
    """A second signal while the supervisors save (a second `scancel`, the time limit after its warning, Slurm's
    SIGTERM repeated): the batch shell keeps its first decision and lives to act on it. (A bare `return` in a
    trap returns the status of the command it interrupted, the `wait`'s 128+n, which `set -e` made fatal.)"""

    def test_warning_twice_requeues_once(self, tmp_path: Path, slurm_tag: str) -> None:
        """`scancel --batch --signal=USR1` twice: one stop, one requeue, exit 0."""
        rc, err = signalled(tmp_path, signal.SIGUSR1, slurm_tag, again=signal.SIGUSR1)
        assert rc == 0, err
        assert requeues(tmp_path) == [["requeue", "4242"]]

    def test_term_after_the_warning_still_requeues(self, tmp_path: Path, slurm_tag: str) -> None:
        """USR1, then SIGTERM to the batch shell alone while the stop runs: the time limit's path goes on."""
        rc, err = signalled(tmp_path, signal.SIGUSR1, slurm_tag, again=signal.SIGTERM)
        assert rc == 0, err
        assert requeues(tmp_path) == [["requeue", "4242"]]

    def test_slurm_term_twice_is_left_to_slurm(self, tmp_path: Path, slurm_tag: str) -> None:
        """Slurm's SIGTERM to every process, then again (a second scancel or requeue): no stop, no requeue, exit 0."""
        rc, err = signalled(tmp_path, signal.SIGTERM, slurm_tag, slurm_too=True, again=signal.SIGTERM,
                            FAKE_JOB_STATE="COMPLETING")
        assert rc == 0, err
        assert not any((tmp_path / f"stop-{n}").exists() for n in (0, 1)) and not requeues(tmp_path)
