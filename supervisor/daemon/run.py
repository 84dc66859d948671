"""`fsdp-supervisor run`'s composition root: builds the supervisor's parts from a config and runs the loop.

Everything with a lifetime is created here, in order, and closed here, in reverse, whatever the loop's end; the
order's reason: docs/design.md, 'Notes for maintainers'.
"""
from __future__ import annotations

import os
import sys

from supervisor.checkpoints.claim import RootClaim, SlurmRun
from supervisor.checkpoints.metadata import child as metadata_child
from supervisor.checkpoints.tiers import TierClaims
from supervisor.config import Config
from supervisor.daemon import preflight
from supervisor.daemon.alerts import Alerts
from supervisor.daemon.core import Core
from supervisor.daemon.loop import Echo, EventLoop
from supervisor.daemon.recorder import HistoryRecorder
from supervisor.daemon.statefile import read_status, remove_torn_writes
from supervisor.daemon.system import RealSystem
from supervisor.errors import ConfigError, SidecarError
from supervisor.host import procs
from supervisor.host.runlock import RunLock
from supervisor.observe.console import NOT_ECHOED, SUMMARY_EVERY_S, TICK_S, Console, Progress, shown_path
from supervisor.observe.eventlog import configure, get_logger, reopen_file
from supervisor.observe.metrics import listen_address, start_metrics
from supervisor.observe.notify import Notifier
from supervisor.observe.redact import secret_values

__all__ = ["run"]


def run(cfg: Config) -> int:
    """Supervise `cfg`'s job until it completes, is stopped or is given up; the exit code of `run`."""
    preflight.check_setup(cfg)  # config errors come before anything is created
    listen_address(cfg)
    preflight.make_dirs(cfg)
    run_dir = cfg.run_dir
    lock = RunLock(run_dir)
    try:
        lock.acquire()
    except OSError as exc:  # e.g. something else planted under the lock's name
        raise ConfigError(f"{cfg.path}: [supervisor.run_dir] cannot lock {run_dir}: {exc.strerror or exc}") from None
    roots = [cfg.checkpoints.dir, *([cfg.checkpoints.local_dir] if cfg.checkpoints.local_dir is not None else [])]
    claim = TierClaims([RootClaim(root, job=preflight.rendezvous_key(cfg.job.command), config=cfg.path,
                                  run_dir=run_dir, refresh_s=cfg.checkpoints.retention_interval_s,
                                  slurm=SlurmRun.from_env(os.environ)) for root in roots])
    try:
        try:
            notes = claim.acquire()  # ClaimedError (exit 2): another job runs on this root
        except (OSError, SidecarError) as exc:  # no folder can hold it: run, but say a second job goes unnoticed
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            notes = [("root_claim_failed", f"{why}: a second job on this checkpoint root is not detected")]
        remove_torn_writes(run_dir)
        console = Console.for_stderr()
        configure(run_dir, max_bytes=cfg.supervisor.log_max_bytes, backups=cfg.supervisor.log_backups, console=console,
                  secrets=secret_values({**os.environ, **cfg.job.env}, [*cfg.job.command, *cfg.job.resume_args]))
        log = get_logger().bind(run_dir=str(run_dir))
        if not console.tty:  # nohup, `run > out.log`, CI, Slurm: say once what this output holds
            console.note(NOT_ECHOED.format(every=SUMMARY_EVERY_S, logs=shown_path(str(run_dir / "logs"))))
        for warning in preflight.command_warnings(cfg.job.command):
            log.warning("config_warning", key="job.command", detail=warning)
        for event, detail in notes:
            log.warning(event, root=str(claim.root), detail=detail)
        previous = read_status(run_dir)
        system = RealSystem(prewarm=cfg.job.prewarm, warm_workers=cfg.job.prewarm_workers,
                            warm_modules=cfg.job.prewarm_modules)
        # The loop thread waits for the GIL up to one switch interval per system call while another thread
        # computes (5 ms by default): a large .metadata is parsed in a child, which shares no GIL with the
        # loop (metadata_child), and what other threads do (small parses, history compaction) yields within 1 ms.
        sys.setswitchinterval(0.001)
        metadata_child.isolate(min_bytes=1 << 20)
        if not procs.set_child_subreaper():
            log.warning("subreaper_unavailable")
        notifier = Notifier.from_env()
        history = HistoryRecorder.for_run_dir(run_dir, now=system.now, log=log)
        core = Core(cfg, system, log, notify=notifier.status if notifier else None, history=history, claim=claim)
        alerts = Alerts(cfg, core.status, system=system, publish=core.bus.publish)
        if cfg.notify.command or cfg.notify.webhook:
            core.bus.append(alerts.notify)
        if (tier := preflight.tier_problem(cfg)) is not None:  # training goes on with durable saves only
            core.status.local_tier = f"degraded: {tier}"
            log.warning("local_tier_unusable", dir=str(cfg.checkpoints.local_dir), reason=tier)
            if not core.house.local_root or not core.house.local_root.is_dir():  # a file, or none: nothing to watch
                core.house.local_root = None  # or scan (a scan's "not a directory" gave up: exit 3)
        core.house.check_retention()  # a root whose deletions cannot be parked: said now, before the first pass
        echo = Echo(console) if console.tty else None
        # The job's output dir is watched only to echo it: each line the job logs would wake us otherwise. The root
        # is watched by its resolved path: inotify does not follow a symlinked root to its target's events. The
        # node-local tier's commits are progress too.
        local = core.house.local_root
        watch = [(run_dir, False), *([(run_dir / "logs", False)] if echo else []), (core.house.root, True),
                 *([(local, True)] if local is not None else [])]
        progress = Progress(console, lambda: core.status)  # a live row on a terminal, else a line every 10 s

        def keep_run_dir() -> None:  # a run dir removed under us: made again, locked again
            if lock.restore():
                reopen_file()
                core.run_dir_restored()

        ticks = [*(notifier.ticks(lambda: not core.done) if notifier else []), (TICK_S, progress.tick),
                 (TICK_S, core.bound_output), (TICK_S, keep_run_dir)]
        loop = EventLoop(core, system, watch, echo=echo, ticks=ticks)
        metrics = start_metrics(cfg, lambda: core.status, log)  # reads the live Status from its own thread
        try:
            # READY=1 follows from the first publish after the launch (Notifier.status)
            rc = loop.run(lambda: core.begin(previous))
        except Exception as exc:  # noqa: BLE001 - a bug, or an error nothing caught: stop the job, exit 1, never 2
            rc = core.abandon(exc)
        finally:
            core.close()  # state.json never claims a supervisor that has exited
            progress.finish()
            system.close()
            core.house.wait_idle(timeout=60)  # finish emptying .trash rather than leave it for the next run
            if alerts.drain():  # the run's last alerts (gave up, a failed emergency save) go out before we exit
                for done, result in system.finished_work():  # their outcomes, into the history
                    done(result)
            history.close()
            if metrics:
                metrics.stop()
        if notifier:
            notifier.stopping()
        return rc
    finally:
        claim.release()
        lock.release()
