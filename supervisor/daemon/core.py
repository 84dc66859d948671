"""The supervisor's brain: reacts to events (job exit, signal, file change, timer) through the `System` seam.

The event loop (daemon/loop.py) turns the OS into calls on `Core`; tests call the same methods with a fake
`System`. Decisions are the pure policy modules'; Core's parts (`passes`, `events`, `hangs`, `stops`,
`attemptfiles`) own their state: docs/design.md, 'The picture'. Every write can fail: logged and survived, and
`close()` makes sure state.json never claims a live supervisor after it exited (docs/design.md, 'Notes for
maintainers').
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from supervisor.checkpoints.claim import RootClaim
from supervisor.checkpoints.completeness import CORRUPT
from supervisor.checkpoints.tiers import TierClaims
from supervisor.config import Config
from supervisor.contract import ENV_SKIP_STEPS, HEARTBEAT_FILE, SKIP_STEPS_PLACEHOLDER, Beat
from supervisor.daemon import events as ev
from supervisor.daemon.attemptfiles import AttemptFiles, try_write
from supervisor.daemon.divergence import Guard
from supervisor.daemon.elsewhere import Elsewhere
from supervisor.daemon.evidence import read_beat, root_cause
from supervisor.daemon.hangs import Hangs
from supervisor.daemon.housekeeping import Housekeeper, PassResult
from supervisor.daemon.passes import PassScheduler
from supervisor.daemon.publisher import StatePublisher
from supervisor.daemon.recorder import HistoryRecorder
from supervisor.daemon.statefile import STATE_FILE
from supervisor.daemon.stops import Stops
from supervisor.daemon.system import System
from supervisor.daemon.timers import Timer, TimerKey
from supervisor.errors import EXIT_GAVE_UP, EXIT_OK, EXIT_SUPERVISOR_FAILED, CheckpointError
from supervisor.host.identity import run_token
from supervisor.host.log import Log
from supervisor.observe.redact import redact_argv, scrub, secret_values
from supervisor.policy import restarts, resume
from supervisor.policy.attempt import RunningAttempt, apply_beat, job_env, named_by_beat
from supervisor.policy.exits import classify_exit
from supervisor.policy.state import ExitReason, State, Status
from supervisor.policy.stopsave import emergency_save_failure

__all__ = ["Core", "EXIT_CODES"]

EXIT_CODES = {State.COMPLETED: EXIT_OK, State.STOPPED: EXIT_OK, State.FAILED: EXIT_GAVE_UP}  # `run`'s, by final state
_SCAN_DEBOUNCE_S = 0.5
_LAUNCH_SCAN_TRIES = 3  # passes that could not read the root before a launch gives up (a blip may pass)


class Core:
    def __init__(self, cfg: Config, system: System, log: Log, notify: Callable[[Status], object] | None = None,
                 history: HistoryRecorder | None = None, claim: RootClaim | TierClaims | None = None) -> None:
        self.cfg, self.sys, self.log = cfg, system, log
        self.history = history  # run_dir/history.jsonl (supervisor.daemon.recorder): a subscriber, and its numbers
        self.run_dir = cfg.run_dir
        self.heartbeat_path = self.run_dir / HEARTBEAT_FILE
        self.status = Status(pid=os.getpid(), started_at=system.now(), config=str(cfg.path))
        self.attempts: list[restarts.Attempt] = []  # those the restart policy still needs (restarts.window)
        self.let_go = 0  # attempts dropped from that list
        self.job: RunningAttempt | None = None
        self.ended: RunningAttempt | None = None  # the attempt that exited, until a pass lets it be judged
        self.exit_code: int | None = None
        self.high_water_step: int | None = None
        self.house = Housekeeper(cfg, log, now=system.file_now, monotonic=system.monotonic)
        self.claim = self.house.claim = claim  # this job's claim on the checkpoint root (checkpoints/claim.py)
        self._root_id: tuple[int, int] | None = None  # the root the passes look at (re-created: a new one)
        self.watch_stale = False  # the root was replaced: the loop watches it anew (and clears this)
        self.in_use: Path | None = None  # the checkpoint the running attempt resumed from: never pruned
        self.passes = PassScheduler(self.house, system, self._on_pass)
        self.publisher = StatePublisher(self.run_dir, system, log, history.annotate if history else None, notify)
        # Every event published once; the log, the history and state.json subscribe (run.py adds the alerts)
        self.bus = ev.Bus([ev.to_log(log), *([history.notify] if history else []), self.publisher.notify_event])
        # Every rank's heartbeat, the hang timers and the fast kill (daemon/hangs.py)
        self.hangs = Hangs(cfg, system, log, self.bus, self.status, refresh=self._on_heartbeat,
                           publish=self._publish_beat, loss=self._on_loss)
        self.guard = Guard(cfg, log, self.bus, self.status)  # the loss watched, rollbacks (daemon/divergence.py)
        self.house.hold = self.guard.protected
        self._launch_pending = False
        self._scan_failures = 0  # consecutive passes that could not read the root when a launch waited on them
        self.token = ""  # the run dir's job token (supervisor/host/identity.py), set by `begin`
        self._unmarked: set[str] = set()  # quarantined here, but the marker could not be written
        self._choice_logged = False  # resume_choice_left_to_job is said once
        # Requested stops: signals, the grace, a predecessor's orphaned job (daemon/stops.py)
        self.stops = Stops(cfg, system, log, self.status, cancel_hang=self.hangs.cancel, publish=self._publish,
                           finish=lambda: self._finish(State.STOPPED, self.stops.reason), end_attempt=self._end_attempt)
        self.files = AttemptFiles(cfg, system, log)  # the attempt's error file and bounded log
        roots = [cfg.checkpoints.dir, *filter(None, [cfg.checkpoints.local_dir]), cfg.run_dir]
        self.elsewhere = Elsewhere(cfg.job_cwd, cfg.job.command, roots, since=system.now())  # saves outside the root
        self.secrets = secret_values({**os.environ, **cfg.job.env}, [*cfg.job.command, *cfg.job.resume_args])

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def begin(self, previous: Status | None) -> None:
        """Stop any job a killed supervisor left running on this run dir, then launch the first attempt.

        The job is found by the run dir's token in its environment (supervisor/host/identity.py), so a `#!` script,
        a prewarmed job or a lost state.json hide nothing. It is stopped off the loop: its emergency save may take up to
        stop_timeout_s, during which `stop` and `stop --force` must still work.
        """
        self.bus.publish(ev.SupervisorStarted())
        token, error = run_token(self.run_dir, previous.run_token if previous is not None else None)
        if error:
            self.log.warning("run_dir_write_failed", what="job token", error=error)
        self.token = self.status.run_token = token
        if previous is not None:
            self.status.restarts = previous.restarts if not previous.state.final else 0
            self.status.rollbacks = previous.rollbacks if not previous.state.final else 0
        # Attempt numbers continue so logs/attempt-NNNN.log and the history's attempts stay unique, even when
        # state.json was lost and only the history remembers them.
        self.status.attempt = max(previous.attempt if previous else 0, self.history.last_attempt if self.history else 0)
        self.guard.resumed(self.status.attempt)
        self.sys.timers.set(Timer.RETENTION, self.sys.monotonic() + self.cfg.checkpoints.retention_interval_s)
        self.sys.run_off_loop(self.stops.stop_orphans(self.run_dir, token), self._on_orphans_stopped)
        self._publish()  # `status` shows this supervisor, starting, not the killed one's last words

    def _on_orphans_stopped(self, outcome: list[int] | BaseException) -> None:
        """The previous supervisor's job, if any, is gone (or we stop anyway): now launch."""
        self.stops.orphans_stopped(outcome)
        if not self.done:
            self._request_launch()

    @property
    def done(self) -> bool:
        return self.exit_code is not None

    def _finish(self, state: State, reason: str, *, save_failed: bool = False) -> None:
        self.status.transition(state)
        self.status.reason = reason
        self.status.job_pid = None
        self.status.next_launch_at = None
        self.exit_code = EXIT_CODES[state]
        self._launch_pending = False
        for t in Timer:
            self.sys.timers.cancel(t)
        self.bus.publish(ev.Finished(state, reason, self.status.attempt, save_failed))  # the run's attempts, all sessions
        self._publish()

    def _sync_disk(self) -> None:
        last = self.house.last
        self.status.disk_free_bytes = self.house.disk_free
        if last is not None and last.error is None:
            self.status.checkpoint_bytes = last.checkpoint_bytes
            self.status.quarantined = last.quarantined
            self.status.corrupt = [str(c.path) for c in last.checkpoints if c.state == CORRUPT]
            self.status.best_checkpoint = self.house.best_json()
        self.status.latest_checkpoint = self.house.latest_json()
        self.status.retention_stopped = self.house.retention_stopped

    def _publish(self) -> None:
        self.bus.publish(ev.StatusChanged(self.status))

    # ---- leaving -----------------------------------------------------------------------------------------------
    def abandon(self, error: BaseException) -> int:
        """The event loop failed (a bug, or an error nothing else caught): stop the job, record why; the exit code.

        The job is stopped as on SIGTERM (its emergency checkpoint gets stop_timeout_s), because no supervisor
        will be watching it; the exit code is 1, which systemd's Restart=on-failure retries (2 and 3 it does not).
        """
        self.log.error("supervisor_failed", error=f"{type(error).__name__}: {error}", exc_info=error)
        job, self.job = self.job, None
        if job is not None and job.agent_exit is not None:  # only the workers its agent left: nobody would reap them
            self.sys.reap_survivors()
        elif job is not None:
            stopped = self.sys.stop_job(job.pid, self.cfg.health.stop_timeout_s)
            self.log.warning("job_stopped", attempt=job.number, pids=stopped, reason="supervisor failed")
        stopping = self.status.state is State.STOPPING
        if not self.status.state.final:
            self.status.transition(State.STOPPED if stopping else State.FAILED, abrupt=True)  # whatever it was doing
            self.status.reason = self.stops.reason if stopping else f"supervisor failed: {type(error).__name__}: {error}"
        self.status.job_pid = self.status.job_create_time = self.status.job_cmdline = None
        self.status.next_launch_at = None
        self.exit_code = EXIT_CODES[State.STOPPED] if stopping else EXIT_SUPERVISOR_FAILED
        self._publish()
        return self.exit_code

    def close(self) -> None:
        """On the way out, whatever happened: state.json must not claim a supervisor that no longer runs.

        If the last write failed, try once more; if that fails too, remove the file (`status` then says
        "no state" rather than "running"); if even that fails the run lock, released by the kernel when
        we exit, still tells `status` that nobody runs.
        """
        if self.publisher.write_error is None and self.status.state.final:
            return
        if not self.status.state.final:  # left without a verdict (e.g. interrupted before the loop ran)
            self.status.transition(State.STOPPED, abrupt=True)
            self.status.reason = self.status.reason or "supervisor exited"
            self.status.job_pid = self.status.job_create_time = self.status.job_cmdline = None
        self._publish()
        if self.publisher.write_error is not None:
            path = self.run_dir / STATE_FILE
            if try_write(self.log, "remove stale state.json", lambda: path.unlink(missing_ok=True)):
                self.log.warning("state_removed", path=str(path), reason="it could not be updated")

    # ---- housekeeping passes ---------------------------------------------------------------------------------
    def _request_pass(self, *, may_delete: bool = True) -> None:
        self.passes.request(self._protected(), may_delete=may_delete, settled=self._settled())

    def _settled(self) -> bool:
        """A launch waits, no save can be in flight (no job, no orphan of a predecessor) and the job picks its own
        checkpoint (no {checkpoint} in resume_args): a pass may clear the cut-short saves above the newest complete
        one, which the job would otherwise load at every start (retention.py, rule 3). Only a node that prunes."""
        return (self._launch_pending and self.job is None and self.stops.orphans is None and self.cfg.checkpoints.prune
                and resume.chooses_itself(self.cfg.job.resume_args))

    def _protected(self) -> list[Path]:
        good = self.guard.protected(self.house.last.checkpoints if self.house.last else [])
        return [self.in_use, *good] if self.in_use else good

    def _on_pass(self, outcome: PassResult | BaseException) -> None:
        """A pass finished (on the loop thread): note commits, then do what was waiting for it."""
        result = self.passes.finished(outcome)
        if self.done:
            return
        if self.job is not None and result.disk_free is not None:
            low = self.job.low_free
            self.job.low_free = result.disk_free if low is None else min(low, result.disk_free)
        new = self.house.absorb(result)
        if result.error is None:
            self.guard.mark(result.checkpoints, self.status.attempt, self._quarantine)
        self._note_root(result.root_id)
        self.bus.publish(ev.PassAbsorbed(result, new))
        if new is not None:
            job = self.job or self.ended
            if job is not None:
                job.new_checkpoint = True
            self.elsewhere.committed(self.sys.monotonic())
            self.status.root_idle = None
            if self.job is not None and self.in_use is not None and new.path != self.in_use:
                self.in_use = None  # the attempt saved past its resume point: that one may go now
                self.house.clear_in_use()
        self._sync_disk()
        self._check_root_idle()
        if self.ended is not None:
            self._judge_exit()
        elif self._launch_pending and self.status.state in (State.STARTING, State.BACKOFF):
            if result.error is None and not result.verified:
                self._request_pass()  # begun before the launch was asked for: its resume point is unread
            elif result.settled or result.error is not None or not self._settled():
                self._launch(result)  # a failed look is _plan's to judge (retry, or refuse)
            else:  # the job would pick its own checkpoint: first clear what it must not pick
                self._request_pass()
        if not self.done:
            self.passes.follow_up(self._protected(), settled=self._settled())
        if not self.done:
            self._publish()

    def _note_root(self, root_id: tuple[int, int] | None) -> None:
        """A pass found the root re-created in place (a new inode): say so, and have the loop watch the new one."""
        if root_id is None:
            return
        if self._root_id is not None and root_id != self._root_id:
            self.log.warning("checkpoint_root_replaced", root=str(self.house.root), action="watching the new one")
            self.watch_stale = True
        self._root_id = root_id

    def run_dir_restored(self) -> None:
        """The run dir was removed under us and is back, locked again (host/runlock.py): write state.json anew."""
        self.log.warning("run_dir_restored", run_dir=str(self.run_dir),
                         detail="it was removed while the supervisor ran; made again and locked")
        self._publish()

    def on_watch_restored(self, path: Path) -> None:
        """The loop watches `path` again after it was deleted or replaced: look at what happened meanwhile."""
        self.log.warning("watch_restored", path=str(path))
        if path == self.house.root:
            self.passes.changed()
            self._request_pass(may_delete=False)

    # ---- launching -------------------------------------------------------------------------------------------
    def _request_launch(self) -> None:
        """Launch as soon as a pass has said which checkpoint to resume from."""
        self._launch_pending = self.house.verify_launch = True  # never a resume point unread (daemon/integrity.py)
        fresh = self.passes.fresh()
        if fresh is not None and fresh.verified and (fresh.settled or not self._settled()):
            self._launch(fresh)
        else:
            self._request_pass()

    def _plan(self, scan: PassResult) -> resume.Launch | resume.Refuse | None:
        """What to launch with, a refusal, or None to look at the root again (it could not be read)."""
        job, ck = self.cfg.job, self.cfg.checkpoints
        # A failed look is never a result (docs/design.md): whatever the root holds decides the launch, unless the
        # job picks its own checkpoint and no bytes need checking. allow_fresh_start is about checkpoints seen unusable.
        if scan.error is not None and (ck.integrity or not resume.chooses_itself(job.resume_args)):
            self._scan_failures += 1
            if self._scan_failures < _LAUNCH_SCAN_TRIES:
                delay = max(1.0, self.cfg.restart.backoff_initial_s)
                self.log.warning("launch_deferred", reason="checkpoint root unreadable", error=scan.error, retry_s=delay)
                self.sys.timers.set(Timer.LAUNCH, self.sys.monotonic() + delay)
                return None
            return resume.Refuse(f"cannot tell whether {ck.dir} holds a checkpoint to resume from: {scan.error}")
        self._scan_failures = 0
        plan = resume.plan_resume(scan.checkpoints, resume_args=job.resume_args,
                                  allow_fresh_start=ck.allow_fresh_start,
                                  skip=self._unmarked | self.guard.marked, checks_loads=self.house.loads_checked)
        if isinstance(plan, resume.Launch) and resume.chooses_itself(job.resume_args) and not self._choice_logged:
            self._choice_logged = True  # said once: the job, not the supervisor, decides what it loads
            self.log.info("resume_choice_left_to_job", resume_args=list(job.resume_args), root=str(ck.dir))
        return plan

    def bound_output(self) -> None:
        """Keep the running attempt's log under `job_log_max_bytes` (daemon/attemptfiles.py); called every tick."""
        self.files.bound(self.job)

    def _launch(self, scan: PassResult) -> None:
        self._launch_pending = self.house.verify_launch = False
        plan = self._plan(scan)
        if plan is None:
            return
        if isinstance(plan, resume.Refuse):
            self._finish(State.FAILED, plan.reason)
            return
        if (plan.checkpoint is None and not plan.args and not resume.chooses_itself(self.cfg.job.resume_args)
                and self.elsewhere.must_look(len(self.attempts))):  # a fresh relaunch: did the job save elsewhere?
            self.sys.run_off_loop(self.elsewhere.look, lambda found: self._looked(found, scan))
            return
        held = self.claim.check() if self.claim is not None else None  # one job per root, checked every launch
        if held is not None:
            self._finish(State.FAILED, held)
            return
        number = self.status.attempt + 1
        if self.status.state is State.BACKOFF:
            self.status.transition(State.STARTING)
        ckpt = plan.checkpoint
        skip = self.guard.launching(number, ckpt)
        argv = [*self.cfg.job.command, *(a.replace(SKIP_STEPS_PLACEHOLDER, str(skip)) for a in plan.args)]
        error_file = self.run_dir / "errors" / f"attempt-{number:04d}.json"
        log_path = self.run_dir / "logs" / f"attempt-{number:04d}.log"
        output = self.files.prepare(error_file, log_path, [
            ("heartbeat", lambda: self.heartbeat_path.unlink(missing_ok=True)), ("per-rank heartbeats", self.hangs.prepare)])
        oom_before = self.sys.oom_kills()
        try:
            env = job_env(self.cfg, os.environ, number=number, heartbeat=self.heartbeat_path, error_file=error_file,
                          token=self.token)
            env[ENV_SKIP_STEPS] = str(skip)
            pid, ctime = self.sys.spawn(argv, cwd=self.cfg.job_cwd, env=env, log_path=output)
        except OSError as exc:
            self.log.error("launch_failed", attempt=number, argv=redact_argv(argv), error=str(exc))
            self._finish(State.FAILED, f"cannot launch {argv[0]!r}: {exc}")
            return
        now_m = self.sys.monotonic()
        self.elsewhere.started(now_m)
        self.job = RunningAttempt(
            number=number, pid=pid, started_mono=now_m, resumed_from=str(ckpt.path) if ckpt else None,
            resumed_step=ckpt.step if ckpt else None, error_file=error_file, log_path=log_path, oom_before=oom_before,
        )
        self.in_use = ckpt.path if ckpt else None
        if ckpt is not None:  # visible to every prune of the root, not only to our own passes
            self.house.mark_in_use(ckpt.path, pid, ctime)
        st = self.status
        st.attempt, st.job_pid, st.job_create_time, st.job_cmdline = number, pid, ctime, argv
        st.resumed_from, st.next_launch_at = self.job.resumed_from, None
        st.step, st.step_at, st.phase, st.loss, st.val_loss, st.rate_steps_per_s = None, None, None, None, None, None
        self._sync_disk()
        st.transition(State.RUNNING)
        self.bus.publish(ev.AttemptStarted(self.job, argv, self.cfg.job.env,
                                           resume.passed_over(scan.checkpoints, ckpt) if ckpt else ()))
        self.hangs.started(self.job)
        self.guard.started()
        self._publish()

    # ---- job exit --------------------------------------------------------------------------------------------
    def on_job_exit(self, pid: int, returncode: int) -> None:
        """The job's process ended: classify it now, judge it once a pass has looked at the checkpoints.

        During a graceful stop the agent can end before its workers: Slurm signals every process of a step, and
        torchrun, signalled two or three times, stops waiting for its workers and exits. Whatever it left keeps the
        rest of stop_timeout_s to finish the emergency save; the attempt ends when the last of them has exited
        (every exit of an adopted process comes here too), or when Timer.STOP_KILL kills them.
        """
        job = self.job
        if job is None:
            return
        if pid != job.pid:
            if job.agent_exit is not None and not self.sys.survivors():
                self._end_attempt(job, job.agent_exit)
            return
        self.guard.alive = False  # a divergence in its last beats is acted on at its judgement, not by a stop
        self._on_heartbeat()  # its last beat, if the file watcher has not delivered it yet: the phase it died in
        if not self.stops.agent_exited(job, returncode):
            self._end_attempt(job, returncode)

    def _end_attempt(self, job: RunningAttempt, returncode: int) -> None:
        """The attempt is over (its agent exited, and any worker it left has exited or was killed)."""
        self.hangs.ended(job)  # every rank's last beat (the step it reached); no hang timer is due any more
        self.job, self.in_use = None, None  # its resume point is no longer in use
        self.house.clear_in_use()
        self.sys.timers.cancel(Timer.STOP_KILL)
        survivors = self.sys.reap_survivors()
        if survivors:
            self.log.warning("survivors_killed", attempt=job.number, processes=[f"{p}:{n}" for p, n in survivors])
        info = classify_exit(
            returncode, at=self.sys.now(), we_stopped=job.stopping and not job.hang, hang=job.hang,
            oom_before=job.oom_before, oom_after=self.sys.oom_kills() if returncode else None,
            cause=root_cause(job.error_file, job.log_path) if returncode else None,
        )
        info.detail, info.last_output = scrub(info.detail, self.secrets), scrub(info.last_output, self.secrets)  # job text
        note = self.house.full_disk_note(job.low_free) if returncode else None
        if note:  # the likeliest cause, whatever the job's own error says
            info.detail = f"{info.detail}; {note}" if info.detail else note
        self.status.last_exit = info
        self.status.job_pid = self.status.job_create_time = self.status.job_cmdline = None
        self.status.rate_steps_per_s = None  # nothing trains now: a rate would be the dead attempt's
        job.end(returncode, info, self.sys.monotonic())
        self.ended = job
        # A commit the file watcher missed (e.g. on NFS) still counts as progress; this pass is also the
        # attempt's final retention pass, with its resume point no longer protected.
        self._request_pass()
        self._publish()

    def _judge_exit(self) -> None:
        job, self.ended = self.ended, None
        assert job is not None and job.info is not None
        info = job.info
        latest = self.house.latest_step()
        progressed = job.new_checkpoint or (
            job.max_step is not None and (self.high_water_step is None or job.max_step > self.high_water_step)
        )
        if job.max_step is not None:
            self.high_water_step = max(job.max_step, self.high_water_step or job.max_step)
        attempt = job.judged(progressed=progressed,
                             beat_checkpoint=named_by_beat(job, self.house.last.checkpoints if self.house.last else []))
        verdict = self.guard.verdict if self.guard.found and self.guard.found[0] == job.number else None
        if verdict is None:  # a rollback is no crash: no restart budget, no crash-loop count
            self.attempts, let_go = restarts.window([*self.attempts, attempt], self.cfg.restart)
            self.let_go += let_go
        written = self.guard.written(self.house.last.checkpoints if self.house.last else [], latest)
        failed = emergency_save_failure(job, latest_step=written, disk_note=self.house.full_disk_note(job.low_free),
                                        grace_s=self.cfg.health.stop_timeout_s) if job.stopping else None
        if failed:  # the history's record says so too: the real exit code, and why
            info.code, info.detail = job.returncode if job.returncode and job.returncode > 0 else info.code, failed
            self.stops.reason = f"{self.stops.reason}; {failed}"
            self.log.error("emergency_save_failed", attempt=job.number, code=job.returncode, reason=failed)
        self.bus.publish(ev.AttemptExited(job, attempt, info, latest))
        if self.status.state is State.STOPPING:
            clean = info.reason == ExitReason.STOPPED and not info.code and info.signal is None
            self._finish(State.STOPPED, self.stops.reason, save_failed=not clean or bool(failed))  # its emergency save
            return
        if verdict == "give_up":
            self._finish(State.FAILED, self.guard.reason())
            return
        if verdict is not None:
            self.status.transition(State.BACKOFF)
            self.sys.timers.set(Timer.LAUNCH, self.sys.monotonic())
            return
        self._maybe_quarantine()
        decision = restarts.decide(self.attempts, self.cfg.restart, jitter=self.sys.random(), before=self.let_go)
        if isinstance(decision, restarts.Finish):
            self._finish(State.COMPLETED, decision.reason)
        elif isinstance(decision, restarts.GiveUp):
            self._finish(State.FAILED, decision.reason)
        else:
            self.status.transition(State.BACKOFF)
            self.status.restarts += 1
            self.status.next_launch_at = self.sys.now() + decision.delay_s
            self.sys.timers.set(Timer.LAUNCH, self.sys.monotonic() + decision.delay_s)
            self.log.info("backoff", delay_s=round(decision.delay_s, 3), reason=decision.reason,
                          restarts=self.status.restarts)
            if (streak := restarts.crash_loop(self.attempts, self.cfg.restart)) is not None:
                self.bus.publish(ev.Alarm("crash_loop", f"{streak} attempts in a row failed without progress (last: "
                                          f"{info.reason}); one more gives up", {"failures": streak}))

    def _maybe_quarantine(self) -> None:
        """Quarantine a checkpoint only on evidence that the failures are its own (restarts.quarantine_candidate)."""
        found = (restarts.corrupt_quarantine(self.attempts[-1], self.status.last_exit.detail
                                             if self.status.last_exit else None)
                 or restarts.quarantine_candidate(self.attempts, self.cfg.restart.quarantine_after))
        if found is None or found.path in self.status.quarantined or found.path in self._unmarked:
            return
        self._quarantine(found.path, found.reason)

    def _quarantine(self, path: str, reason: str) -> None:
        self._unmarked.add(path)  # not resumed from again by this supervisor, whether or not the marker lands
        self.passes.changed()  # the root changed (or should have): the last pass no longer names the resume point
        try:
            self.house.quarantine(Path(path), reason)
        except (CheckpointError, OSError) as exc:  # vanished, read-only, full: this run still avoids it
            self.log.error("quarantine_failed", path=path, reason=reason, error=str(exc))
            return
        self._unmarked.discard(path)
        self.status.quarantined = [*self.status.quarantined, path]
        self.bus.publish(ev.Quarantined(path, reason))

    # ---- signals ---------------------------------------------------------------------------------------------
    def on_signal(self, signum: int) -> None:
        """A stop signal: the stop controller acts on the attempt; the run's outcome is carried out here."""
        self.stops.on_signal(signum, self.job, exit_pending=self.ended is not None)

    # ---- timers ----------------------------------------------------------------------------------------------
    def on_timer(self, key: TimerKey) -> None:
        handlers = {
            Timer.LAUNCH: self._request_launch,
            Timer.STOP_KILL: lambda: self.stops.on_kill_timer(self.job),
            Timer.SCAN: self._on_scan,
            Timer.RETENTION: self._on_retention,
            Timer.PUBLISH: self._publish,
        }
        job_handlers = {  # the running attempt's (daemon/hangs.py)
            Timer.HANG: self.hangs.on_hang,
            Timer.HANG_DUMPS: self.hangs.on_dumps,
            Timer.HANG_TERM: self.hangs.on_term,
            Timer.HANG_KILL: self.hangs.on_kill,
            Timer.RANKS: self.hangs.on_ranks_timer,
        }
        handler = handlers.get(key) if isinstance(key, Timer) else None
        if handler is not None:
            handler()
        elif isinstance(key, Timer) and key in job_handlers and self.job is not None:
            job_handlers[key](self.job)

    def _on_scan(self) -> None:
        self._request_pass(may_delete=False)

    def _on_retention(self) -> None:
        """Periodic pass: also catches commits inotify cannot see (network filesystems, other nodes)."""
        self._request_pass()
        self.sys.timers.set(Timer.RETENTION, self.sys.monotonic() + self.cfg.checkpoints.retention_interval_s)

    # ---- files -----------------------------------------------------------------------------------------------
    def cares(self, path: Path) -> bool:
        """Whether a file event at `path` is one `on_file_event` acts on (asked on the file watcher's thread)."""
        return path == self.heartbeat_path or self.house.concerns(path)

    def on_file_event(self, path: Path) -> None:
        if path == self.heartbeat_path:
            self._on_heartbeat()
        elif self.house.concerns(path):
            self.passes.changed()
            if not self.sys.timers.pending(Timer.SCAN):
                self.sys.timers.set(Timer.SCAN, self.sys.monotonic() + _SCAN_DEBOUNCE_S)

    def _read_beat(self) -> Beat | None:
        beat, problems = read_beat(self.heartbeat_path)
        job = self.job
        if problems and job is not None and not job.beat_warned:
            job.beat_warned = True  # one warning per attempt: a bad writer beats every second
            self.log.warning("heartbeat_invalid", attempt=job.number, problems=problems[:3])
        return beat

    def _on_heartbeat(self) -> None:
        job = self.job
        if job is None:
            return
        beat = self._read_beat()
        if beat is None or beat == job.beat:
            return
        apply_beat(self.status, beat, self.sys.now(), job.rate)
        self.elsewhere.beat(job.beat, beat)
        job.beat, job.beat_mono = beat, self.sys.monotonic()
        self.house.loads_checked |= beat.checks_loads  # from now on its load checks the trainer library's checksums
        self._check_root_idle()
        self.hangs.seen(job, None, beat)  # the step it reached, and the hang timer set again
        self.bus.publish(ev.BeatRead(job.number, beat))
        self._publish_beat()

    def _looked(self, found: list[Path] | BaseException, scan: PassResult) -> None:
        """The search before a fresh relaunch ended (daemon/elsewhere.py): give up naming what it found, or launch."""
        if self.done:
            return
        if isinstance(found, BaseException):  # a bug in the search costs the search, not the relaunch
            self.log.warning("checkpoints_elsewhere_unknown", error=f"{type(found).__name__}: {found}")
        reason = None if isinstance(found, BaseException) else self.elsewhere.refusal(found, self.log)
        if reason:
            self._finish(State.FAILED, reason)
        else:
            self._launch(scan)

    def _check_root_idle(self) -> None:
        idle = self.elsewhere.idle(self.sys.monotonic(), beats=self.job.beat is not None) if self.job else None
        if idle:
            self.status.root_idle = idle
            self.log.warning("checkpoint_root_idle", root=str(self.house.root), detail=idle)

    def _on_loss(self, job: RunningAttempt, rank: int | None, beat: Beat) -> None:
        """A new beat (the node's or a rank's) for the divergence guard, which may ask for a graceful stop."""
        if self.guard.feed(job.number, rank, beat) is None:
            return
        if self.guard.stopping and self.guard.alive and not job.stopping and self.status.state is State.RUNNING:
            self.stops.terminate(job)
        self._request_pass(may_delete=False)
        self._publish()

    def _publish_beat(self) -> None:
        self.bus.publish(ev.StatusChanged(self.status, beat=True))
