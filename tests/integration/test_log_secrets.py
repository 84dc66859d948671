"""Issue 35 item 7: a secret never reaches supervisor.log, on any path that logs a traceback (`supervisor_failed`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.supervise import REPO, write_config

TOKEN, KEY = "hf_tOkEn_9f8e7d6c5b", "sk-aPiKeY-0a1b2c3d4e"
# The supervisor's own CLI with one handler broken: the launch (its frame holds the job's argv and environment) or
# the job's exit (the exception's message quotes the job's command line).
BROKEN = """
import sys
import supervisor.daemon.core as core
import supervisor.host.procs as procs
from supervisor.cli.app import main

def spawn(argv, **kw):
    raise RuntimeError("spawn is broken")

def on_job_exit(self, pid, returncode):
    raise RuntimeError(f"cannot judge the exit of {self.status.job_cmdline}")

where = sys.argv.pop(1)
if where == "launch":
    procs.spawn = spawn
else:
    core.Core.on_job_exit = on_job_exit
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("where", ["launch", "exit"])
def test_supervisor_failed_logs_no_secret(tmp_path: Path, where: str) -> None:
    """A `[job] env` token and an `--api-key` value: neither is in supervisor.log (nor on the console) after a failure
    whose traceback is logged; the traceback itself is (its frames, without their locals)."""
    config = write_config(tmp_path, [sys.executable, "-c", "pass", "--api-key", KEY])
    config.write_text(config.read_text().replace('OMP_NUM_THREADS = "1"', f'OMP_NUM_THREADS = "1", HF_TOKEN = "{TOKEN}"'))
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/"), "PYTHONPATH": str(REPO)}  # few: all shown
    p = subprocess.run([sys.executable, "-c", BROKEN, where, "run", "-c", str(config)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    log = (tmp_path / ".fsdp-supervisor" / "supervisor.log").read_text()
    failed = [json.loads(line) for line in log.splitlines() if '"supervisor_failed"' in line]
    assert p.returncode == 1 and len(failed) == 1, p.stdout + p.stderr + log
    assert failed[0]["exception"][0]["frames"] and all("locals" not in f for f in failed[0]["exception"][0]["frames"])
    assert TOKEN not in log + p.stdout + p.stderr and KEY not in log + p.stdout + p.stderr, log


def test_the_jobs_own_traceback_quoting_a_secret(tmp_path: Path) -> None:
    """A job whose exception quotes its `[job] env` token and its `--api-key`: the exit's detail and last lines are
    masked in history.jsonl, state.json and `status` (text and --json), as in supervisor.log; the attempt's own log
    keeps every byte the job wrote (they reached history, state and status verbatim)."""
    crash = "import os, sys; raise RuntimeError('boom ' + os.environ['HF_TOKEN'] + ' ' + sys.argv[2])"
    config = write_config(tmp_path, [sys.executable, "-c", crash, "--api-key", KEY], "[restart]\nmax_restarts = 0\n")
    config.write_text(config.read_text().replace('OMP_NUM_THREADS = "1"', f'OMP_NUM_THREADS = "1", HF_TOKEN = "{TOKEN}"'))
    cli = [sys.executable, "-m", "supervisor"]
    run = subprocess.run([*cli, "run", "-c", str(config)], cwd=REPO, capture_output=True, text=True, timeout=120)
    status = [subprocess.run([*cli, "status", *extra, "-c", str(config)], cwd=REPO, capture_output=True, text=True,
                             timeout=60).stdout for extra in ([], ["--json"])]
    run_dir = tmp_path / ".fsdp-supervisor"
    history, state = (run_dir / "history.jsonl").read_text(), (run_dir / "state.json").read_text()
    assert run.returncode == 3 and "boom ***" in history and "boom ***" in status[0], run.stderr + history
    for text in (history, state, *status, (run_dir / "supervisor.log").read_text(), run.stdout + run.stderr):
        assert TOKEN not in text and KEY not in text, text
    assert TOKEN in (run_dir / "logs" / "attempt-0001.log").read_text()
