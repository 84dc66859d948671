"""The supervisor's brain: reacts to events (job exit, signal, file change, timer) through the `System` seam.

The event loop (supervisor/loop.py) turns the OS into calls on `Core`; tests call the same methods with a
fake `System` and replay histories. Restart decisions are delegated to the pure `policy` module and
checkpoint housekeeping to `housekeeping.Housekeeper`.
"""
from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor import policy
from supervisor.config import CHECKPOINT_PLACEHOLDER, Config
from supervisor.exits import classify_exit, root_cause, signal_name
from supervisor.housekeeping import Housekeeper
from supervisor.redact import redact_argv, redact_env
from supervisor.state import State, Status, write_status
from supervisor.system import System

__all__ = ["Core", "HEARTBEAT_FILE", "EXIT_CODES"]

HEARTBEAT_FILE = "heartbeat.json"
EXIT_CODES = {State.COMPLETED: 0, State.STOPPED: 0, State.FAILED: 3}
_SCAN_DEBOUNCE_S = 0.5


@dataclass
class _Job:
    """The attempt in flight."""

    number: int
    pid: int
    started_mono: float
    resumed_from: str | None
    resumed_step: int | None
    error_file: Path
    log_path: Path
    oom_before: int | None
    max_step: int | None = None
    new_checkpoint: bool = False
    hang: bool = False
    stopping: bool = False
    beat_mono: float | None = None
    beat: dict[str, Any] = field(default_factory=dict)


class Core:
    def __init__(self, cfg: Config, system: System, log: Any, notify: Any = None) -> None:
        self.cfg, self.sys, self.log = cfg, system, log
        self.notify = notify  # optional callable(status) for sd_notify STATUS= lines
        self.run_dir = cfg.run_dir
        self.heartbeat_path = self.run_dir / HEARTBEAT_FILE
        self.status = Status(pid=os.getpid(), started_at=system.now(), config=str(cfg.path))
        self.history: list[policy.Attempt] = []
        self.job: _Job | None = None
        self.exit_code: int | None = None
        self.high_water_step: int | None = None
        self.house = Housekeeper(cfg, log, now=system.now)

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def begin(self, previous: Status | None) -> None:
        """Stop a job orphaned by a killed supervisor, then launch the first attempt."""
        if previous is not None and previous.job_pid and not previous.state.final:
            stopped = self.sys.stop_orphan(
                previous.job_pid, previous.job_create_time, previous.job_cmdline, self.cfg.health.stop_timeout_s
            )
            if stopped:
                self.log.warning("orphan_job_stopped", job_pid=previous.job_pid, pids=stopped)
        if previous is not None:  # attempt numbers continue so logs/attempt-NNNN.log stay unique
            self.status.attempt = previous.attempt
            self.status.restarts = previous.restarts if not previous.state.final else 0
        self.status.quarantined = self.house.quarantined()
        self.sys.timers.set("retention", self.sys.monotonic() + self.cfg.checkpoints.retention_interval_s)
        self._launch()

    @property
    def done(self) -> bool:
        return self.exit_code is not None

    def _finish(self, state: State, reason: str) -> None:
        self.status.transition(state)
        self.status.reason = reason
        self.status.job_pid = None
        self.status.next_launch_at = None
        self.exit_code = EXIT_CODES[state]
        for t in ("launch", "hang", "stop_kill", "scan", "retention"):
            self.sys.timers.cancel(t)
        self._publish()

    def _sync_disk(self) -> None:
        self.status.disk_free_bytes = self.house.disk_free
        self.status.checkpoint_bytes = self.house.checkpoint_bytes

    def _publish(self) -> None:
        self.status.updated_at = self.sys.now()
        write_status(self.run_dir, self.status)
        if self.notify is not None:
            self.notify(self.status)

    # ---- launching -------------------------------------------------------------------------------------------
    def _job_env(self, number: int, error_file: Path) -> dict[str, str]:
        env = dict(os.environ)
        # torchrun SIGKILLs workers 30 s after forwarding SIGTERM unless told otherwise; an emergency save must
        # get the whole stop_timeout_s the user granted (an explicit setting in env or --shutdown-timeout wins).
        env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") or f"{self.cfg.health.stop_timeout_s:g}"
        # torchrun's rendezvous store shared with the workers keeps the previous round's keys: restarted workers
        # of a multi-node job then hang in init_process_group (pytorch/pytorch#135712; measured: README, More than one node).
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        env.update(self.cfg.job.env)
        env.update(
            FSDP_SUPERVISOR_HEARTBEAT=str(self.heartbeat_path),
            FSDP_SUPERVISOR_ATTEMPT=str(number),
            FSDP_SUPERVISOR_RUN_DIR=str(self.run_dir),
            TORCHELASTIC_ERROR_FILE=str(error_file),
        )
        return env

    def _launch(self) -> None:
        number = self.status.attempt + 1
        if self.status.state is State.BACKOFF:
            self.status.transition(State.STARTING)
        self.house.prune()  # before each launch
        ckpt = self.house.newest()
        argv = list(self.cfg.job.command)
        if ckpt is not None:
            argv += [a.replace(CHECKPOINT_PLACEHOLDER, str(ckpt.path)) for a in self.cfg.job.resume_args]
        error_file = self.run_dir / "errors" / f"attempt-{number:04d}.json"
        error_file.parent.mkdir(parents=True, exist_ok=True)
        error_file.unlink(missing_ok=True)
        self.heartbeat_path.unlink(missing_ok=True)  # a stale beat must not look like progress
        log_path = self.run_dir / "logs" / f"attempt-{number:04d}.log"
        oom_before = self.sys.oom_kills()
        try:
            pid, ctime = self.sys.spawn(argv, cwd=self.cfg.job_cwd, env=self._job_env(number, error_file), log_path=log_path)
        except OSError as exc:
            self.log.error("launch_failed", attempt=number, argv=redact_argv(argv), error=str(exc))
            self._finish(State.FAILED, f"cannot launch {argv[0]!r}: {exc}")
            return
        now_m = self.sys.monotonic()
        self.job = _Job(
            number=number, pid=pid, started_mono=now_m, resumed_from=str(ckpt.path) if ckpt else None,
            resumed_step=ckpt.step if ckpt else None, error_file=error_file, log_path=log_path, oom_before=oom_before,
        )
        self.house.in_use = ckpt.path if ckpt else None
        st = self.status
        st.attempt, st.job_pid, st.job_create_time, st.job_cmdline = number, pid, ctime, argv
        st.resumed_from, st.next_launch_at = self.job.resumed_from, None
        st.step, st.step_at, st.phase, st.loss, st.rate_steps_per_s = None, None, None, None, None
        st.latest_checkpoint = self.house.latest_json()
        self._sync_disk()
        st.transition(State.RUNNING)
        self.log.info(
            "job_started", attempt=number, pid=pid, resumed_from=self.job.resumed_from,
            resumed_step=self.job.resumed_step, argv=redact_argv(argv), env=redact_env(self.cfg.job.env),
            log=str(log_path),
        )
        self._arm_hang_timer(startup=True)
        self._publish()

    # ---- job exit --------------------------------------------------------------------------------------------
    def on_job_exit(self, pid: int, returncode: int) -> None:
        job = self.job
        if job is None or pid != job.pid:
            return
        self._on_scan()  # a commit the file watcher missed (e.g. on NFS) still counts as progress
        self.job = None
        for t in ("hang", "stop_kill"):
            self.sys.timers.cancel(t)
        survivors = self.sys.reap_survivors()
        if survivors:
            self.log.warning("survivors_killed", attempt=job.number, processes=[f"{p}:{n}" for p, n in survivors])
        info = classify_exit(
            returncode, at=self.sys.now(), we_stopped=job.stopping and not job.hang, hang=job.hang,
            oom_before=job.oom_before, oom_after=self.sys.oom_kills() if returncode else None,
            cause=root_cause(job.error_file, job.log_path) if returncode else None,
        )
        note = self.house.full_disk_note() if returncode else None
        if note:  # the likeliest cause, whatever the job's own error says
            info.detail = f"{info.detail}; {note}" if info.detail else note
        self.status.last_exit = info
        self.status.job_pid = self.status.job_create_time = self.status.job_cmdline = None
        latest = self.house.latest_step()
        progressed = job.new_checkpoint or (
            job.max_step is not None and (self.high_water_step is None or job.max_step > self.high_water_step)
        )
        if job.max_step is not None:
            self.high_water_step = max(job.max_step, self.high_water_step or job.max_step)
        attempt = policy.Attempt(
            number=job.number, started_at=job.started_mono, ended_at=self.sys.monotonic(), succeeded=returncode == 0,
            reason=info.reason, resumed_from=job.resumed_from, resumed_step=job.resumed_step,
            max_step=job.max_step, new_checkpoint=job.new_checkpoint, progressed=progressed,
        )
        self.history.append(attempt)
        self.log.info(
            "job_exited", attempt=job.number, code=info.code, signal=info.signal, reason=info.reason,
            detail=info.detail, duration_s=round(attempt.duration, 3), max_step=job.max_step,
            latest_checkpoint_step=latest, progressed=progressed,
        )
        if self.status.state is State.STOPPING:
            self._finish(State.STOPPED, "stopped by signal")
            self.log.info("stopped", attempt=job.number, reason=info.reason)
            return
        self._maybe_quarantine()
        decision = policy.decide(self.history, self.cfg.restart, jitter=self.sys.random())
        if isinstance(decision, policy.Finish):
            self._finish(State.COMPLETED, decision.reason)
            self.log.info("completed", attempts=len(self.history))
        elif isinstance(decision, policy.GiveUp):
            self._finish(State.FAILED, decision.reason)
            self.log.error("gave_up", reason=decision.reason, attempts=len(self.history))
        else:
            self.status.transition(State.BACKOFF)
            self.status.restarts += 1
            self.status.next_launch_at = self.sys.now() + decision.delay_s
            self.sys.timers.set("launch", self.sys.monotonic() + decision.delay_s)
            self.log.info("backoff", delay_s=round(decision.delay_s, 3), reason=decision.reason, restarts=self.status.restarts)
            self._publish()

    def _maybe_quarantine(self) -> None:
        path = policy.quarantine_candidate(self.history, self.cfg.restart.quarantine_after)
        if path is None or path in self.status.quarantined:
            return
        reason = f"{self.cfg.restart.quarantine_after} consecutive attempts failed right after loading it"
        self.house.quarantine(Path(path), reason)
        self.status.quarantined = self.house.quarantined()
        self.log.error("quarantined", path=path, reason=reason)

    # ---- signals ---------------------------------------------------------------------------------------------
    def on_signal(self, signum: int) -> None:
        if signum not in (signal.SIGINT, signal.SIGTERM):
            return
        if self.status.state is State.STOPPING:
            self.log.warning("stop_forced", signal=signal_name(signum))
            if self.job is not None:
                self.sys.kill_job_tree(self.job.pid)
            return
        if self.status.state.final:
            return
        self.status.transition(State.STOPPING)
        self.log.info("stopping", signal=signal_name(signum), job_pid=self.job.pid if self.job else None)
        if self.job is None:  # in backoff: nothing to stop
            self._finish(State.STOPPED, "stopped by signal")
            self.log.info("stopped", attempt=self.status.attempt, reason="no job running")
            return
        self._terminate_job()
        self._publish()

    def _terminate_job(self) -> None:
        """SIGTERM the torchrun agent only (it forwards to workers once); SIGKILL after stop_timeout_s."""
        assert self.job is not None
        self.job.stopping = True
        self.sys.timers.cancel("hang")
        self.sys.send_signal(self.job.pid, signal.SIGTERM)
        self.sys.timers.set("stop_kill", self.sys.monotonic() + self.cfg.health.stop_timeout_s)

    # ---- timers ----------------------------------------------------------------------------------------------
    def on_timer(self, name: str) -> None:
        handler = {
            "launch": self._launch,
            "hang": self._on_hang,
            "hang_term": self._on_hang_term,
            "stop_kill": self._on_stop_kill,
            "scan": self._on_scan,
            "retention": self._on_retention,
        }.get(name)
        if handler is not None:
            handler()

    def _on_stop_kill(self) -> None:
        if self.job is not None:
            killed = self.sys.kill_job_tree(self.job.pid)
            self.log.warning("job_killed", attempt=self.job.number, after_s=self.cfg.health.stop_timeout_s, processes=len(killed))

    def _arm_hang_timer(self, startup: bool = False) -> None:
        h = self.cfg.health
        if self.job is None or self.job.stopping:
            return
        if startup:
            timeout = h.startup_timeout_s
        elif self.job.beat.get("phase") in ("load", "save"):
            timeout = h.save_timeout_s
        else:
            timeout = h.hang_timeout_s
        if timeout > 0 and (startup or h.hang_timeout_s > 0):
            self.sys.timers.set("hang", self.sys.monotonic() + timeout)
        else:
            self.sys.timers.cancel("hang")

    def _on_hang(self) -> None:
        job = self.job
        if job is None or job.stopping:
            return
        job.hang = True
        idle = None if job.beat_mono is None else round(self.sys.monotonic() - job.beat_mono, 1)
        self.log.error("hang_detected", attempt=job.number, step=job.beat.get("step"), phase=job.beat.get("phase"), idle_s=idle)
        dumped = self.sys.signal_workers(job.pid, signal.SIGUSR1)
        self.log.info("stack_dump_requested", workers=dumped, log=str(job.log_path))
        self.sys.timers.set("hang_term", self.sys.monotonic() + self.cfg.health.stack_dump_wait_s)

    def _on_hang_term(self) -> None:
        if self.job is not None and self.job.hang:
            self._terminate_job()

    # ---- files -----------------------------------------------------------------------------------------------
    def on_file_event(self, path: Path) -> None:
        if path == self.heartbeat_path:
            self._on_heartbeat()
        elif self.house.concerns(path) and not self.sys.timers.pending("scan"):
            self.sys.timers.set("scan", self.sys.monotonic() + _SCAN_DEBOUNCE_S)

    def _on_heartbeat(self) -> None:
        job = self.job
        try:
            beat = json.loads(self.heartbeat_path.read_text())
            step = int(beat["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return  # torn or foreign: the next beat will do
        if job is None or beat == job.beat:
            return
        st, now = self.status, self.sys.now()
        if st.step is not None and st.step_at is not None and step > st.step and now > st.step_at:
            rate = (step - st.step) / (now - st.step_at)
            st.rate_steps_per_s = rate if st.rate_steps_per_s is None else 0.7 * st.rate_steps_per_s + 0.3 * rate
        if st.step != step:
            st.step, st.step_at = step, now
        st.phase, st.loss = beat.get("phase"), beat.get("loss")
        job.beat, job.beat_mono = beat, self.sys.monotonic()
        job.max_step = step if job.max_step is None else max(job.max_step, step)
        self._arm_hang_timer()
        self._publish()

    def _on_scan(self) -> None:
        new = self.house.refresh()
        if new is None:
            return
        self.log.info("checkpoint_committed", path=str(new.path), step=new.step, size_bytes=new.size_bytes)
        if self.job is not None:
            self.job.new_checkpoint = True
        self.status.latest_checkpoint = self.house.latest_json()
        self.house.prune()
        self._sync_disk()
        self._publish()

    def _on_retention(self) -> None:
        self._on_scan()  # also catches commits inotify cannot see (network filesystems, other nodes)
        self.house.prune()
        self._sync_disk()
        self.sys.timers.set("retention", self.sys.monotonic() + self.cfg.checkpoints.retention_interval_s)
        self._publish()
