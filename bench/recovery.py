"""Recovery time: SIGKILL (or SIGSTOP: a hang) of one worker of the reference trainer -> its first completed step
after resuming.

Three ways to bring the job back, interleaved and repeated:
- `supervisor`: `fsdp-supervisor run` with its defaults (torchrun `--max-restarts=0`; the supervisor
  relaunches with `--resume <newest complete>`, through its prewarmed spare agent);
- `torchrun_restart`: torchrun's own in-agent restart (`--max-restarts=1`, trainer `--resume auto`);
- `naive_loop`: `until torchrun ...; do sleep 1; done` with `--resume auto`.

The fault is injected once the job is in steady state: a checkpoint exists, training is past
`kill_step`, and (supervisor) its spare agent reported ready. The benchmark polls every 20 ms and
splits the time into phases: `teardown` (kill -> the surviving worker is gone), `relaunch` (-> new
worker processes exist: agent exit, supervisor decision, agent start or hand-off, agent rendezvous),
`worker_init` (-> rank 0's heartbeat after init_process_group: interpreter, `import torch`, process
group), `load` (-> the trainer's `loaded` line: resume choice, model build, DCP load) and `first_step`. With
`fault="stop"` (a hang, bench/hangs.py) the first phase is `detection` (-> the supervisor's `hang_detected`;
torchrun has none: its wait is in `teardown`).

Under the supervisor each round also checks its loss accounting: the steps lost it reports (state.json) against
the truth from the job's own log (`--log-every 1`: the last step rank 0 logged, minus the step it resumed from).

    python -m bench.recovery        # prints the result of run() as JSON
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

from bench.common import PY, REPO, Tagged, count_events, job_env, median, scratch, torchrun_argv, trainer_argv, wait_until
from bench.supervisor_cost import idle_spare_ready, warm_workers_memory
from supervisor.contract import ENV_HEARTBEAT, HEARTBEAT_FILE, RANK_HEARTBEAT_DIR, parse_heartbeat

__all__ = ["run", "measure_once", "steps_lost_errors", "warm_workers", "VARIANTS", "PHASES", "HANG_PHASES"]

VARIANTS = ("supervisor", "torchrun_restart", "naive_loop")
PHASES = ("teardown", "relaunch", "worker_init", "load", "first_step")
HANG_PHASES = ("detection", *PHASES)
SAVE_EVERY = 10
NAIVE_MAX_REPEATS = 3  # the naive loop is context, not a gated figure: fewer rounds keep make bench short
TIMEOUT = 180.0


class _Run:
    """One launched variant: where its job output and heartbeat are, and how to find its processes."""

    def __init__(self, variant: str, root: Path, tagged: Tagged, kill_step: int, model: dict[str, Any],
                 health: str = "", flags: dict[str, Any] | None = None, local: Path | None = None) -> None:
        self.variant, self.root, self.tagged, self.kill_step, self.health = variant, root, tagged, kill_step, health
        self.ckpts = root / "ckpts"
        self.local = local  # the supervisor's [checkpoints] local_dir (bench/local_tier.py), or None
        self.run_dir = root / ".fsdp-supervisor"
        self.heartbeat = (self.run_dir if variant == "supervisor" else root) / HEARTBEAT_FILE
        self.log = root / "job.log"
        flags = {"steps": 10**6, "save_every": SAVE_EVERY, "log_every": 1, **model, **(flags or {})}
        env = job_env({ENV_HEARTBEAT: str(self.heartbeat)})
        if variant == "supervisor":
            self.proc = tagged.start([PY, "-m", "supervisor", "run", "-c", str(self._config(flags))],
                                     log=root / "supervisor.out", env=env, cwd=root)
        elif variant == "torchrun_restart":
            argv = torchrun_argv(max_restarts=1) + trainer_argv(self.ckpts, resume="auto", **flags)
            self.proc = tagged.start(argv, log=self.log, env=env)
        else:
            cmd = shlex.join(torchrun_argv() + trainer_argv(self.ckpts, resume="auto", **flags))
            self.proc = tagged.start(["bash", "-c", f"until {cmd}; do sleep 1; done"], log=self.log, env=env)

    def _config(self, flags: dict[str, Any]) -> Path:
        command = torchrun_argv() + trainer_argv(self.ckpts, **flags)
        path = self.root / "job.toml"
        local = f"local_dir = {json.dumps(str(self.local))}\n" if self.local else ""
        path.write_text(f"[job]\ncommand = {json.dumps(command)}\ncwd = {json.dumps(str(REPO))}\n\n"
                        f"[checkpoints]\ndir = {json.dumps(str(self.ckpts))}\n{local}"
                        + (f"\n[health]\n{self.health}\n" if self.health else ""))
        return path

    def job_log(self, attempt: int) -> Path:
        return self.run_dir / "logs" / f"attempt-{attempt:04d}.log" if self.variant == "supervisor" else self.log

    def text(self, attempt: int = 1) -> str:
        try:
            return self.job_log(attempt).read_text(errors="replace")
        except OSError:
            return ""

    def workers(self) -> list[psutil.Process]:
        """Live trainer worker processes of this run (`python -u -m trainer ...` under torchrun)."""
        out = []
        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return out
        for p in procs:
            try:
                cmd = p.cmdline()
                if ("-u" in cmd and "trainer" in cmd and "torch.distributed.run" not in cmd
                        and p.status() != psutil.STATUS_ZOMBIE):
                    out.append(p)
            except psutil.Error:
                continue
        return out

    def steady(self) -> bool:
        steps = [int(s) for s in _steps(self.text())]
        saved = any(self.ckpts.glob("step_*")) or (self.local is not None and any(self.local.glob("step_*")))
        if not steps or steps[-1] < self.kill_step or not saved:
            return False
        if self.variant != "supervisor":
            return True
        # In a real run the idle spare is ready seconds after training starts, long before any fault.
        return idle_spare_ready(self.proc.pid, self.run_dir)


    def between_saves(self) -> bool:
        """The last step logged is a few steps past a save and a few before the next one."""
        steps = _steps(self.text())
        return bool(steps) and 2 <= int(steps[-1]) % SAVE_EVERY <= SAVE_EVERY // 2


def _steps(text: str) -> list[str]:
    return re.findall(r"event=train rank=0 step=(\d+)", text)


def _alive(procs: list[psutil.Process]) -> bool:
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                return True
        except psutil.Error:
            continue
    return False


_EVENTS = ("hang_detected", "hang_stopping", "job_killed", "job_exited", "backoff", "prewarm_handoff", "job_started")


def _allowance(run: _Run) -> float | None:
    """The hang allowance the supervisor says it applies now (`status`'s hang detection: "auto: after 60 s ...")."""
    try:
        said = json.loads((run.run_dir / "state.json").read_text()).get("hang_detection") or ""
    except (OSError, ValueError):
        return None
    found = re.search(r"after ([0-9.]+) s", said)
    return float(found[1]) if found else None


def _last_step_time(run: _Run) -> float | None:
    """The job's own time (wall clock) of the newest step any rank's heartbeat file holds."""
    times = []
    for path in (run.run_dir / RANK_HEARTBEAT_DIR).glob("rank-*.json"):
        try:
            beat, _ = parse_heartbeat(path.read_bytes())
        except OSError:
            continue
        if beat is not None and beat.time is not None:
            times.append(beat.time)
    return max(times, default=None)


def _supervisor_events(run: _Run, since_wall: float) -> dict[str, float]:
    """Seconds after the fault of the supervisor's own events (hang_detected ... job_started) for attempt 2."""
    out: dict[str, float] = {}
    try:
        lines = (run.run_dir / "supervisor.log").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        e = json.loads(line)
        if e.get("event") in _EVENTS and e["event"] not in out:
            at = datetime.fromisoformat(e["ts"].replace("Z", "+00:00")).timestamp()
            if at >= since_wall:
                out[e["event"]] = round(at - since_wall, 3)
    return out


def _steps_lost(run: _Run) -> dict[str, int | None]:
    """What the supervisor reported as the steps lost, and the truth from the job's own log (supervisor only)."""
    def reported() -> Any:
        try:
            return json.loads((run.run_dir / "state.json").read_text()).get("steps_lost")
        except (OSError, ValueError):
            return None

    lost = wait_until(reported, 10, "the steps lost in state.json", interval=0.05)  # a beat's write is held 0.5 s
    reached = [int(s) for s in _steps(run.text(1))]
    resumed = re.search(r"event=loaded .*?step=(\d+)", run.text(2))
    truth = reached[-1] - int(resumed[1]) if reached and resumed else None
    return {"reported": lost[-1], "true": truth, "error": None if truth is None else lost[-1] - truth}


def measure_once(variant: str, *, kill_step: int = 12, model: dict[str, Any] | None = None, fault: str = "kill",
                 health: str = "", flags: dict[str, Any] | None = None, local: Path | None = None) -> dict[str, Any]:
    """Launch `variant`, SIGKILL (fault="kill") or SIGSTOP (fault="stop") rank 1 in steady state, time the recovery;
    returns total and phase seconds (and, under the supervisor, its steps lost against the job's log and the idle
    warm workers' memory). `flags` add trainer flags; `local` gives the supervisor a node-local tier there."""
    root = scratch(f"recovery-{variant}")
    tagged = Tagged()
    try:
        run = _Run(variant, root, tagged, kill_step, model or {}, health, flags, local)
        wait_until(run.steady, TIMEOUT, f"{variant}: steady state", interval=0.1)
        if variant == "supervisor" and fault == "stop":  # "auto": armed once enough steps were seen (status says)
            wait_until(lambda: _allowance(run), TIMEOUT, f"{variant}: hang detection armed", interval=0.2)
        warm = warm_workers_memory(run.proc.pid, run.run_dir) if variant == "supervisor" else None
        if fault == "stop":  # a rank stopped inside a save gets save_timeout_s (30 min): stop it while training
            wait_until(run.between_saves, TIMEOUT, f"{variant}: a step between two saves", interval=0.01)
        allowance = _allowance(run) if variant == "supervisor" and fault == "stop" else None
        old = run.workers()
        victim = next(p for p in old if p.environ().get("RANK") == "1")
        run.heartbeat.unlink(missing_ok=True)
        attempt = 2 if variant == "supervisor" else 1
        offset = len(run.text(attempt)) if attempt == 1 else 0
        t0, t0_wall = time.monotonic(), time.time()
        victim.kill() if fault == "kill" else victim.suspend()
        marks: dict[str, float] = {}
        last_step: list[float] = []  # the job's last step before the hang, by its own clock (its ranks' beats)

        def poll() -> bool:
            t = time.monotonic() - t0
            if allowance is not None and "detection" not in marks and "teardown" not in marks:
                last_step[:] = [x for x in (_last_step_time(run),) if x is not None] or last_step
            if "teardown" not in marks and not _alive(old):
                marks["teardown"] = t
            if "relaunch" not in marks and any(p.pid not in {o.pid for o in old} for p in run.workers()):
                marks["relaunch"] = t
            if "worker_init" not in marks and run.heartbeat.exists():
                marks["worker_init"] = t
            after = run.text(attempt)[offset:]
            if "load" not in marks and "event=loaded" in after:
                marks["load"] = t
            if "load" in marks and _steps(after.split("event=loaded", 1)[1]):
                marks["first_step"] = t
                return True
            return False

        wait_until(poll, TIMEOUT, f"{variant}: first step after resume")
        events = _supervisor_events(run, t0_wall) if variant == "supervisor" else {}
        if "hang_detected" in events:
            marks["detection"] = events["hang_detected"]
        phases, prev = {}, 0.0
        for name in HANG_PHASES if fault == "stop" else PHASES:  # a phase seen late by the poller never counts negative
            at = marks.get(name, prev)
            phases[name] = round(max(0.0, at - prev), 3)
            prev = max(prev, at)
        result: dict[str, Any] = {"total": round(marks["first_step"], 3), "phases": phases}
        if allowance is not None and last_step:
            # auto hang detection: from the moment its threshold was reached (the job's last step + the allowance
            # status named) to the first step of the relaunched attempt
            result["threshold_s"] = allowance
            result["beyond_threshold"] = round(t0_wall + marks["first_step"] - last_step[0] - allowance, 3)
        if variant == "supervisor":
            # hang_detected where no hang was made is a false positive (a hang round's own is its first one)
            result["hang_false_positives"] = max(0, count_events(run.run_dir, "hang_detected") - (fault == "stop"))
            result["supervisor_events"] = events
            result["steps_lost"] = _steps_lost(run)
            result["warm_workers"] = warm
            resumed = re.search(r"event=loaded rank=0 path=(\S+)", run.text(2))
            result["resumed_from"] = resumed.group(1) if resumed else None
        return result
    finally:
        tagged.close()
        shutil.rmtree(root, ignore_errors=True)


def run(repeats: int = 4, kill_step: int = 12, model: dict[str, Any] | None = None,
        variants: tuple[str, ...] = VARIANTS, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Median recovery seconds per variant (runs interleaved, the order rotating every repeat)."""
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for r in range(repeats):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            if v == "naive_loop" and r >= NAIVE_MAX_REPEATS:
                continue
            runs[v].append(measure_once(v, kill_step=kill_step, model=model))
            if progress:
                progress(f"recovery {v} #{r + 1}: {runs[v][-1]['total']} s")
    result: dict[str, Any] = {v: median(x["total"] for x in runs[v]) for v in variants}
    if "supervisor" in runs and "torchrun_restart" in runs and result["torchrun_restart"]:
        result["ratio"] = round(result["supervisor"] / result["torchrun_restart"], 3)
    if "supervisor" in runs and "torchrun_restart" in runs:  # context for the noise: each round's own ratio
        result["round_ratios"] = [round(s["total"] / t["total"], 3)
                                  for s, t in zip(runs["supervisor"], runs["torchrun_restart"])]
    result["breakdown"] = {v: {ph: median(x["phases"][ph] for x in runs[v]) for ph in PHASES} for v in variants}
    result["steps_lost_errors"] = steps_lost_errors(runs.get("supervisor", []))
    result["hang_false_positives"] = [x["hang_false_positives"] for x in runs.get("supervisor", [])]
    result["runs"] = runs
    result["repeats"] = repeats
    return result


def steps_lost_errors(runs: list[dict[str, Any]]) -> list[int | None]:
    """Each supervised round's reported - true steps lost (None where the truth could not be read)."""
    return [r["steps_lost"]["error"] for r in runs if "steps_lost" in r]


def warm_workers(result: dict[str, Any]) -> dict[str, Any] | None:
    """`warm_workers`: the idle warm workers' memory at the supervisor rounds' steady state (medians)."""
    seen = [x["warm_workers"] for x in result.get("runs", {}).get("supervisor", []) if x.get("warm_workers")]
    if not seen:
        return None
    return {key: median(x[key] for x in seen) for key in ("idle_rss_mb", "idle_uss_mb", "workers", "per_worker_rss_mb")}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps(run(progress=lambda s: print(s, flush=True)), indent=2))
