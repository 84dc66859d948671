"""The supervisor's event loop while a large checkpoint is being verified: stalls, signal and exit latency.

The loop never blocks on store work (docs/design.md): a signal or a job exit is handled within half a second
whatever is being verified. One repeat is one real `fsdp-supervisor run` of a torch-free fake job (tests/jobs/fakejob.py)
with the loop probe on (bench/loopprobe.py: a 10 ms tick that records how late it ran), in which a
copy of a large checkpoint (its `.metadata` and sparse shards) is renamed into the checkpoint root twice:
1. while the first copy is being verified, the job is SIGKILLed: `job_exit_reaped_s` is kill -> the exit
   recorded in state.json (`last_exit.at`, written when the loop reaps it) and `job_exited_log_s` is
   kill -> the `job_exited` log line, which by design waits for the pass (it reports what the attempt
   committed); the supervisor then restarts the job;
2. while the second copy is being verified, the supervisor gets SIGTERM:
   `signal_latency_during_verify_s` is SIGTERM -> the job's SIGTERM trap file (its mtime).
"While being verified" is checked, not assumed: the action is taken `act_s` (default ACT_INTO_PASS_S)
after the pass began (seen from outside as the supervisor's extra `store-pass` thread) and counts only if
the pass's `checkpoint_committed` line comes after it. `loop_stall_ms_max` is the largest tick lateness
during the passes (pass seen -> `checkpoint_committed`); `idle_stall_ms_max` is the same over IDLE_S with nothing
to verify just before, i.e. what the machine itself does to the loop. Figures are medians over repeats;
`worst` keeps the largest.

The checkpoint is the synthetic Llama-3 70B FSDP2 one of bench/synthetic.py (`SIZE`: 256 ranks, ~100 MB
of `.metadata`; `QUICK_SIZE`: 8 ranks, ~3.6 MB), generated once per run in a subprocess (it needs torch).

    python -m bench.loop_stall        # prints the result of run() as JSON
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

from bench.common import PY, REPO, Tagged, median, scratch, wait_until
from bench.loopprobe import PROBE_ENV
from supervisor.layout import METADATA_NAME, step_dir_name

__all__ = ["run", "build_template", "SIZE", "QUICK_SIZE"]

SIZE: dict[str, Any] = {"model": "70b", "ranks": 256}  # issue 12's size: ~100 MB of .metadata, seconds of verifying
QUICK_SIZE: dict[str, Any] = {"model": "70b", "ranks": 8, "act_s": 0.05}  # ~3.6 MB: a few tenths of a second
FAKEJOB = REPO / "tests" / "jobs" / "fakejob.py"
ACT_INTO_PASS_S = 0.2  # the pass is parsing `.metadata` by then (the default of `act_s`)
IDLE_S = 1.0
TIMEOUT = 180.0


def build_template(size: dict[str, Any], out: Path) -> Path:
    """The checkpoint every drop copies: bench/synthetic.py's 70B-class one (`model`, `ranks`)."""
    subprocess.run([PY, "-m", "bench.synthetic", "--model", str(size["model"]), "--ranks", str(size["ranks"]),
                    str(out)], check=True, capture_output=True, cwd=REPO, timeout=600)
    return out


def _clone(template: Path, dest: Path) -> None:
    """A copy with a fresh `.metadata` inode (no cached verdict applies) and sparse shards of the same sizes."""
    dest.mkdir(parents=True)
    for f in template.iterdir():
        if f.name == METADATA_NAME:
            shutil.copyfile(f, dest / f.name)
        else:
            with open(dest / f.name, "wb") as out:
                out.truncate(f.stat().st_size)


def _log_events(run_dir: Path) -> list[dict[str, Any]]:
    try:
        lines = (run_dir / "supervisor.log").read_text().splitlines()
    except OSError:
        return []
    return [json.loads(line) for line in lines if line.startswith("{")]


def _wall(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["ts"].replace("Z", "+00:00")).timestamp()


def _nth(events: list[dict[str, Any]], name: str, n: int) -> dict[str, Any] | None:
    hits = [e for e in events if e.get("event") == name]
    return hits[n - 1] if len(hits) >= n else None


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


class _Run:
    """One supervisor with the probe on, its fake job, and the checkpoints dropped into its root."""

    def __init__(self, root: Path, tagged: Tagged, template: Path, act_s: float) -> None:
        self.root, self.template, self.act_s = root, template, act_s
        self.ckpts, self.run_dir, self.staging = root / "ckpts", root / ".fsdp-supervisor", root / "staging"
        self.trap, self.marker, self.probe = root / "trapped", root / "launched", root / "probe.json"
        for d in (self.ckpts, self.staging):
            d.mkdir(parents=True)
        command = [PY, str(FAKEJOB), "--steps", "100000", "--step-s", "0.05", "--trap-term", str(self.trap),
                   "--marker", str(self.marker)]
        config = root / "job.toml"
        config.write_text(
            f"[job]\ncommand = {json.dumps(command)}\nresume_args = [\"--resume\", \"{{checkpoint}}\"]\n"
            f"cwd = {json.dumps(str(REPO))}\n\n[checkpoints]\ndir = {json.dumps(str(self.ckpts))}\n"
            # The 70B-shaped checkpoint is 789 GB of sparse shards: reading them (seal, resume check) would take the
            # whole run; this benchmark measures the loop while .metadata is parsed, not the byte check.
            "integrity = false\n\n"
            "[restart]\nbackoff_initial_s = 0.05\n")
        env = {**os.environ, PROBE_ENV: str(self.probe), "PYTHONPATH": str(REPO)}
        self.proc = tagged.start([PY, "-m", "bench.loopprobe", "run", "-c", str(config)], log=root / "supervisor.out",
                                 env=env, cwd=root)
        self.offset = time.time() - time.monotonic()  # wall = monotonic + offset (log lines are wall clock)

    def wait_job(self, attempt: int) -> int:
        """Pid of attempt `attempt` once its signal handlers are installed (fakejob marks after them)."""
        def ready() -> int | None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"supervisor exited early ({self.proc.returncode}): "
                                   + (self.root / "supervisor.out").read_text(errors="replace")[-2000:])
            try:
                lines = [ln for ln in self.marker.read_text().splitlines(keepends=True) if ln.endswith("\n")]
            except OSError:
                return None
            return int(json.loads(lines[attempt - 1])["pid"]) if len(lines) >= attempt else None
        return int(wait_until(ready, TIMEOUT, f"attempt {attempt} of the fake job"))

    def threads(self) -> int:
        return psutil.Process(self.proc.pid).num_threads()

    def drop(self, step: int) -> int:
        """Clone the template beside the root and rename it in; returns the supervisor's thread count before."""
        staged = self.staging / step_dir_name(step)
        _clone(self.template, staged)
        idle = self.threads()  # no pass runs now: the launch pass is over, the periodic one is minutes away
        os.rename(staged, self.ckpts / staged.name)
        return idle

    def committed(self, n: int) -> dict[str, Any] | None:
        return _nth(_log_events(self.run_dir), "checkpoint_committed", n)

    def act_while_verifying(self, n: int, idle_threads: int) -> tuple[bool, float]:
        """Wait until the pass has run `act_s`: (still running, i.e. nothing committed yet; its start)."""
        wait_until(lambda: self.threads() > idle_threads or self.committed(n), TIMEOUT, "the housekeeping pass",
                   interval=0.005)
        began = time.monotonic()
        time.sleep(self.act_s)
        return self.committed(n) is None and self.threads() > idle_threads, began

    def lateness(self, start: float, end: float) -> list[float]:
        doc = json.loads(self.probe.read_text())
        return [late for t, late in doc["samples"] if start <= t <= end]


def measure_once(template: Path, act_s: float = ACT_INTO_PASS_S) -> dict[str, Any]:
    """One supervisor run: an idle window, a job exit during the first verification, a SIGTERM during the second."""
    root = scratch("loop")
    try:
        with Tagged() as tagged:
            r = _Run(root, tagged, template, act_s)
            job = r.wait_job(1)
            time.sleep(0.3)  # let the launch pass and the first heartbeats settle
            idle = (time.monotonic(), time.monotonic() + IDLE_S)
            time.sleep(IDLE_S)
            # 1. the job dies while checkpoint 1 is verified
            exit_during, pass1 = r.act_while_verifying(1, r.drop(1))
            killed_wall = time.time()
            os.kill(job, signal.SIGKILL)
            r.wait_job(2)  # reaped, judged after the pass, restarted
            events = _log_events(r.run_dir)
            state = json.loads((r.run_dir / "state.json").read_text())
            reaped = state["last_exit"]["at"] if state.get("last_exit") else None
            exited, commit1 = _nth(events, "job_exited", 1), r.committed(1)
            assert exited is not None and commit1 is not None, events
            # 2. the supervisor is told to stop while checkpoint 2 is verified
            time.sleep(0.3)
            signal_during, pass2 = r.act_while_verifying(2, r.drop(2))
            sent_wall = time.time()
            os.kill(r.proc.pid, signal.SIGTERM)
            wait_until(r.trap.exists, TIMEOUT, "the job's SIGTERM trap file")
            trapped_wall = r.trap.stat().st_mtime_ns / 1e9
            rc = r.proc.wait(TIMEOUT)
            commit2 = r.committed(2)
            assert rc == 0 and commit2 is not None, (rc, _log_events(r.run_dir))
        end1, end2 = _wall(commit1) - r.offset, _wall(commit2) - r.offset
        busy = r.lateness(pass1, end1) + r.lateness(pass2, end2)
        quiet = r.lateness(*idle)
        return {
            "signal_latency_s": round(trapped_wall - sent_wall, 4),
            "signal_during_verify": signal_during and trapped_wall < _wall(commit2),
            "job_exit_reaped_s": None if reaped is None else round(reaped - killed_wall, 4),
            "job_exited_log_s": round(_wall(exited) - killed_wall, 4),
            "exit_during_verify": exit_during and (reaped or 0) < _wall(commit1),
            "loop_stall_ms_max": round(1000 * max(busy, default=0.0), 1),
            "loop_stall_ms_p99": round(1000 * _quantile(busy, 0.99), 1),
            "idle_stall_ms_max": round(1000 * max(quiet, default=0.0), 1),
            "ticks": len(busy),
            "verify_s": [round(end1 - pass1, 2), round(end2 - pass2, 2)],  # pass thread seen -> committed
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(repeats: int = 3, size: dict[str, Any] | None = None) -> dict[str, Any]:
    """Build the checkpoint once, measure `repeats` supervisor runs; the figures of issue 12 and the samples."""
    size = dict(size or SIZE)
    work = scratch("loop-template")
    try:
        start = time.monotonic()
        template = build_template(size, work / "template")
        built_s = time.monotonic() - start
        runs = [measure_once(template, size.get("act_s", ACT_INTO_PASS_S)) for _ in range(repeats)]
        metadata_mb = (template / METADATA_NAME).stat().st_size / 1e6
    finally:
        shutil.rmtree(work, ignore_errors=True)
    signal_ok = [r["signal_latency_s"] for r in runs if r["signal_during_verify"]]
    exits = [r for r in runs if r["exit_during_verify"]]
    detail = {
        **size, "metadata_mb": round(metadata_mb, 2), "build_s": round(built_s, 1),
        "verify_s": median(v for r in runs for v in r["verify_s"]),
        "job_exit_reaped_s": median(r["job_exit_reaped_s"] for r in exits),
        "job_exited_log_s": median(r["job_exited_log_s"] for r in exits),
        "loop_stall_ms_p99": median(r["loop_stall_ms_p99"] for r in runs),
        "idle_stall_ms_max": median((r["idle_stall_ms_max"] for r in runs), 1),
        "worst": {"loop_stall_ms_max": max(r["loop_stall_ms_max"] for r in runs),
                  "signal_latency_s": max(signal_ok, default=None)},
        "repeats": repeats, "runs": runs,
    }
    return {"loop_stall_ms_max": median((r["loop_stall_ms_max"] for r in runs), 1),
            "signal_latency_during_verify_s": median(signal_ok, 4) if signal_ok else None, "loop": detail}


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
