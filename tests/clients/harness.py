"""Run a client job under `fsdp-supervisor run` and look at what happened.

The job is a real third-party trainer under torchrun (the `make test-clients` tier) or one of its torch-free
reproductions in tests/jobs (tests/clients/test_client_reproductions.py, part of `make test`).

One `SupervisedClient` per run: it writes the job.toml, starts the real supervisor CLI (own session, the
test tag in its environment so tests/helpers.assert_no_orphans finds every leftover), and reads back what
the supervisor recorded (supervisor.log events, state.json, attempt logs, `checkpoints list --json`).
Waiting helpers fail with the supervisor's and the job's log tails, so a failing client test says what the
client printed, not only that a file never appeared.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from tests.helpers import TAG_ENV
from tests.supervise import REPO, Supervisors, cli, kill_tree

__all__ = ["CLIENTS", "TORCHRUN", "STEP_LINE", "NAN_AT_ENV", "RESTART_FAST", "SupervisedClient", "run_plain", "strip_ansi",
           "printed", "assert_losses_match", "NAN_AT", "SKIP_AFTER", "nan_rolled_back"]

CLIENTS = Path(__file__).resolve().parent
# `python -m torch.distributed.run` is `torchrun` of this interpreter's venv, whichever venv runs the tests.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0"]
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# What the test scripts print on rank 0 for every step (accelerate_train, lightning_train, hf_train, user_dcp_script)
STEP_LINE = re.compile(r"^step=(\d+) loss=(\S+)$", re.M)
# A warm worker's hand-off line in the attempt log: its pid and the rank it took
_WARM = re.compile(r"^event=warm_handoff pid=(\d+) local_rank=\S+ rank=(\d+)$", re.M)
# The test scripts' NaN: the loss of this step is NaN on the supervisor's first attempt (lightning_train, hf_train)
NAN_AT_ENV = "FSDP_TEST_NAN_AT_STEP"
NAN_AT, SKIP_AFTER = 13, 3  # the NaN three steps after the step-10 save; [divergence] skip_after_onset
# Quick relaunches, and room for a client's own save on SIGTERM
RESTART_FAST = "\n[restart]\nbackoff_initial_s = 0.5\nbackoff_max_s = 2\n\n[health]\nstop_timeout_s = 60\n"


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def printed(pattern: re.Pattern[str], log: str) -> dict[int, Any]:
    """step -> what a client printed for it (`pattern`: the step, then one or more values; the first line wins)."""
    out: dict[int, Any] = {}
    for m in pattern.finditer(log):
        values = m.groups()[1:]
        out.setdefault(int(m.group(1)), values[0] if len(values) == 1 else values)
    return out


def assert_losses_match(reference: Mapping[int, Any], log: str, attempt: int, pattern: re.Pattern[str]) -> None:
    """Every step attempt `attempt` printed prints what the uninterrupted run printed for it, exactly."""
    got = printed(pattern, log)
    assert got, f"attempt {attempt} printed no training step"
    diff = {s: (v, reference.get(s)) for s, v in got.items() if reference.get(s) != v}
    assert not diff, f"attempt {attempt}: steps whose loss differs from the uninterrupted run: {diff}"


def _toml(value: Any) -> str:
    return json.dumps(value)  # strings, lists and numbers: JSON spells them as TOML does


class SupervisedClient:
    """One supervised run of a client job in `workdir` (config, run dir, checkpoints all inside it)."""

    def __init__(self, sups: Supervisors, workdir: Path, *, command: Sequence[str], resume_args: Sequence[str],
                 checkpoint_dir: Path, env: dict[str, str] | None = None, extra_toml: str = "") -> None:
        self.sups, self.workdir, self.checkpoint_dir = sups, workdir, checkpoint_dir
        self.run_dir = workdir / ".fsdp-supervisor"
        self.config = workdir / "job.toml"
        job_env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
                   "HF_DATASETS_OFFLINE": "1", **(env or {})}
        self.config.write_text(
            "[job]\n"
            f"command = {_toml(list(command))}\n"
            f"resume_args = {_toml(list(resume_args))}\n"
            f"cwd = {_toml(str(REPO))}\n"
            "env = { " + ", ".join(f"{k} = {_toml(v)}" for k, v in job_env.items()) + " }\n\n"
            f"[checkpoints]\ndir = {_toml(str(checkpoint_dir))}\n" + extra_toml
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.console = workdir / "supervisor.observe.console"

    # ---- running ----------------------------------------------------------------------------------------------
    def start(self) -> SupervisedClient:
        with open(self.console, "ab") as out:  # a file, not a pipe: nobody drains a pipe during a long run
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "supervisor", "run", "-c", str(self.config)], cwd=REPO, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, TAG_ENV: self.sups.tag})
        self.sups.procs.append(self.proc)  # type: ignore[arg-type]  # cleanup kills its tree, waits, checks orphans
        return self

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the supervisor did not exit within {timeout:.0f}s\n{self.tails()}") from None

    def stop(self, timeout: float) -> int:
        """SIGTERM the supervisor (what systemd, Slurm or Ctrl+C do) and wait for its graceful stop; its exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.wait_exit(timeout)

    def wait_for(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        """Poll `predicate`; fail with the log tails on timeout or when the supervisor exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"the supervisor exited ({self.proc.returncode}) before {what}\n{self.tails()}")
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{self.tails()}")

    def kill_rank(self, rank: int) -> int:
        """SIGKILL the current attempt's worker of `rank` (found by its RANK env under the torchrun agent)."""
        def find() -> psutil.Process | None:
            pid = self.state().get("job_pid")
            if not pid:
                return None
            try:
                children = psutil.Process(pid).children(recursive=True)
            except psutil.NoSuchProcess:
                return None
            for child in children:
                try:
                    env = child.environ()
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                if env.get("RANK") == str(rank) and "LOCAL_RANK" in env:
                    return child
            # a warm worker (trainer/warm_pool.py) got its rank after its start: its environ does not say it
            logs = self.attempt_logs() if (self.run_dir / "logs").is_dir() else []
            warm = {int(p): int(r) for p, r in _WARM.findall(logs[-1])} if logs else {}
            return next((c for c in children if warm.get(c.pid) == rank), None)

        worker: psutil.Process = self.wait_for(find, 60, f"the worker of rank {rank}")
        worker.send_signal(signal.SIGKILL)
        return worker.pid

    # ---- what the supervisor recorded -------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        try:
            return json.loads((self.run_dir / "state.json").read_text())
        except (OSError, ValueError):
            return {}

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        """supervisor.log JSON events (whole lines only), optionally only those named `name`."""
        try:
            text = (self.run_dir / "supervisor.log").read_text()
        except FileNotFoundError:
            return []
        out = []
        for line in text.splitlines(keepends=True):
            if line.endswith("\n"):
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if name is None or event.get("event") == name:
                    out.append(event)
        return out

    def history(self, kind: str) -> list[dict[str, Any]]:
        """history.jsonl records of `kind` (the events the supervisor keeps for the report: diverged, rolled_back...)."""
        try:
            lines = (self.run_dir / "history.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return []
        return [r for r in map(json.loads, lines) if r.get("kind") == kind]

    def attempt_logs(self) -> list[str]:
        """The job output of each attempt, in order."""
        return [strip_ansi(p.read_text(errors="replace")) for p in sorted((self.run_dir / "logs").glob("attempt-*.log"))]

    def checkpoints_list(self) -> list[dict[str, Any]]:
        """`fsdp-supervisor checkpoints list --dir <root> --json`, oldest first."""
        done = cli("checkpoints", "list", "--dir", str(self.checkpoint_dir), "--json", timeout=120)
        assert done.returncode == 0, done.stderr
        return sorted(json.loads(done.stdout or "[]"), key=lambda c: (c["step"] is None, c["step"] or 0, c["name"]))

    def tails(self, chars: int = 4000) -> str:
        parts = []
        if self.console.exists():
            parts.append("--- supervisor console (tail) ---\n" + self.console.read_text(errors="replace")[-chars:])
        logs = self.attempt_logs() if (self.run_dir / "logs").is_dir() else []
        if logs:
            parts.append(f"--- attempt {len(logs)} log (tail) ---\n" + logs[-1][-chars:])
        return "\n".join(parts)


def nan_rolled_back(sups: Supervisors, workdir: Path, command: Sequence[str], checkpoint_dir: Path,
                    resume_flag: str) -> tuple[SupervisedClient, dict[str, Any], str]:
    """A client job whose loss turns NaN at NAN_AT (attempt 1 only), resumed with `[resume_flag, "{checkpoint}"]`:
    `diverged` (nan), the job stopped, `rolled_back` to a save from before the onset (step 5 or 10) with skip =
    onset - resume step + SKIP_AFTER, relaunched once with `resume_flag` naming that save; `completed`, exit 0.
    The job, the `rolled_back` record and the second attempt's log."""
    job = SupervisedClient(sups, workdir, command=command, resume_args=[resume_flag, "{checkpoint}"],
                           checkpoint_dir=checkpoint_dir, env={NAN_AT_ENV: str(NAN_AT)},
                           extra_toml=f"keep_last = 2\n\n[divergence]\nskip_after_onset = {SKIP_AFTER}\n" + RESTART_FAST)
    job.start()
    assert job.wait_exit(300) == 0 and job.state().get("state") == "completed", job.tails()
    [found] = job.history("diverged")
    assert found["why"] == "nan" and found["onset_step"] >= NAN_AT, found
    [back] = job.history("rolled_back")
    assert back["to_step"] in (5, 10), f"resumed a save from after the onset: {back}"
    assert back["skip"] == found["onset_step"] - back["to_step"] + SKIP_AFTER, back
    started = job.events("job_started")
    assert len(started) == 2 and started[1]["argv"][-2:] == [resume_flag, back["to_checkpoint"]], job.tails()
    first, second = job.attempt_logs()
    assert printed(STEP_LINE, first)[NAN_AT] == "nan"
    return job, back, second


def run_plain(command: Sequence[str], log: Path, tag: str, timeout: float) -> str:
    """Run `command` without the supervisor (the uninterrupted reference run); return its output.

    Same environment as a supervised job gets from SupervisedClient; on timeout everything it started is
    killed (tests/supervise.kill_tree) and the test fails with the output tail.
    """
    env = {**os.environ, TAG_ENV: tag, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(list(command), cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait(30)
        raise AssertionError(f"reference run timed out after {timeout:.0f}s:\n{log.read_text()[-4000:]}") from None
    text = strip_ansi(log.read_text(errors="replace"))
    assert code == 0, f"reference run exited {code}:\n{text[-4000:]}"
    return text
