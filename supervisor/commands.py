"""`run`, `status`, `logs`, `stop`: the supervisor's own commands (checkpoint commands live in checkpoints/cli)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from supervisor.config import Config, load_config
from supervisor.errors import EXIT_NOT_OK, EXIT_OK, ConfigError
from supervisor.eventlog import LOG_FILE, configure, get_logger, render_line
from supervisor.runlock import RunLock
from supervisor.state import read_status, remove_torn_writes
from supervisor.statusview import render_status

__all__ = ["register"]


def _config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", required=True, metavar="CONFIG", help="job.toml")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("run", help="run the job under supervision (foreground)")
    _config_arg(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("status", help="state, step, last checkpoint, restarts, free disk")
    _config_arg(p)
    p.add_argument("--json", action="store_true", help="print state.json plus supervisor_running")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("logs", help="the supervisor's structured log, or the job's output")
    _config_arg(p)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    p.add_argument("-n", "--lines", type=int, default=50, metavar="N", help="last N lines (default 50)")
    p.add_argument("--job", action="store_true", help="the current attempt's job output instead")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("stop", help="SIGTERM the supervisor and wait for it to exit")
    _config_arg(p)
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="default: stop_timeout_s + 30")
    p.set_defaults(func=cmd_stop)


def _check_program(cfg: Config) -> None:
    prog = cfg.job.command[0]
    path = cfg.job.env.get("PATH", os.environ.get("PATH"))
    found = shutil.which(prog, path=path) if os.sep not in prog else (
        str(cfg.job_cwd / prog) if os.access(cfg.job_cwd / prog, os.X_OK) else None)
    if found is None:
        raise ConfigError(f"{cfg.path}: [job.command] program {prog!r} not found or not executable")
    if not cfg.job_cwd.is_dir():
        raise ConfigError(f"{cfg.path}: [job.cwd] {cfg.job_cwd} is not a directory")


def cmd_run(args: argparse.Namespace) -> int:
    # Imported here so `status`/`logs` stay light.
    from supervisor import procs
    from supervisor.core import Core
    from supervisor.loop import Echo, EventLoop
    from supervisor.loopprobe import INTERVAL_S, LoopProbe
    from supervisor.metrics import listen_address, start_metrics
    from supervisor.notify import Notifier
    from supervisor.system import RealSystem

    cfg = load_config(args.config)
    _check_program(cfg)
    listen_address(cfg)  # a bad [metrics] listen is a config error before anything is created
    run_dir = cfg.run_dir
    for d in (run_dir, run_dir / "logs", cfg.checkpoints.dir):
        d.mkdir(parents=True, exist_ok=True, mode=0o750)
    lock = RunLock(run_dir)
    lock.acquire()
    remove_torn_writes(run_dir)
    try:
        configure(run_dir, max_bytes=cfg.supervisor.log_max_bytes, backups=cfg.supervisor.log_backups)
        log = get_logger().bind(run_dir=str(run_dir))
        previous = read_status(run_dir)
        system = RealSystem(prewarm=cfg.job.prewarm)
        if not procs.set_child_subreaper():
            log.warning("subreaper_unavailable")
        notifier = Notifier.from_env()
        core = Core(cfg, system, log, notify=notifier.status if notifier else None)
        echo = Echo(sys.stderr) if sys.stderr.isatty() else None
        # The job's output dir is watched only to echo it: each line the job logs would wake us otherwise.
        watch = [(run_dir, False), *([(run_dir / "logs", False)] if echo else []), (cfg.checkpoints.dir, True)]
        ticks = notifier.ticks(lambda: not core.done) if notifier else []
        probe = LoopProbe.from_env()  # a diagnostic for bench/loop_stall.py; None unless asked for
        if probe is not None:
            ticks.append((INTERVAL_S, probe.tick))
        loop = EventLoop(core, system, watch, echo=echo, ticks=ticks)

        def begin() -> None:
            core.begin(previous)  # READY=1 follows from the first publish after the launch (Notifier.status)

        metrics = start_metrics(cfg, lambda: core.status, log)  # reads the live Status from its own thread
        try:
            rc = loop.run(begin)
        finally:
            system.close()
            core.house.wait_idle(timeout=60)  # finish emptying .trash rather than leave it for the next run
            if metrics:
                metrics.stop()
            if probe is not None:
                probe.write()
        if notifier:
            notifier.stopping()
        return rc
    finally:
        lock.release()


def cmd_status(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    status = read_status(cfg.run_dir)
    holder = RunLock.holder(cfg.run_dir)
    if args.json:
        doc = status.to_json() if status else {}
        doc["supervisor_running"] = holder is not None
        print(json.dumps(doc, indent=2, sort_keys=True))
        return EXIT_OK if status else EXIT_NOT_OK
    if status is None:
        print(f"no supervisor state in {cfg.run_dir} (never run here, or state.json unreadable)")
        return EXIT_NOT_OK
    print(render_status(status, running=holder is not None, now=time.time()))
    return EXIT_OK


def _current_job_log(run_dir: Path) -> Path | None:
    logs = sorted((run_dir / "logs").glob("attempt-*.log"))
    return logs[-1] if logs else None


def _tail_lines(path: Path, n: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size, chunk = f.tell(), b""
            while size > 0 and chunk.count(b"\n") <= n:
                step = min(size, 65536)
                size -= step
                f.seek(size)
                chunk = f.read(step) + chunk
    except OSError:
        return []
    return chunk.decode("utf-8", "replace").splitlines()[-n:] if n > 0 else []


def cmd_logs(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    path = _current_job_log(cfg.run_dir) if args.job else cfg.run_dir / LOG_FILE
    render = (lambda s: s.rstrip("\n")) if args.job else render_line
    if path is None or not path.exists():
        print(f"no {'job output' if args.job else 'supervisor log'} in {cfg.run_dir} yet", file=sys.stderr)
        return EXIT_NOT_OK
    for line in _tail_lines(path, args.lines):
        print(render(line), flush=True)
    if not args.follow:
        return EXIT_OK
    return _follow(path, cfg.run_dir, args.job, render)


def _follow(path: Path, run_dir: Path, job: bool, render) -> int:  # type: ignore[no-untyped-def]
    """Print lines appended to `path`; reopen on rotation (supervisor.log) or a new attempt (--job)."""
    f = open(path, "rb")
    f.seek(0, 2)
    ino = os.fstat(f.fileno()).st_ino
    buf = b""
    try:
        while True:
            data = f.read()
            if data:
                buf += data
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    print(render(line.decode("utf-8", "replace")), flush=True)
                continue
            time.sleep(0.25)
            nxt = _current_job_log(run_dir) if job else path
            try:
                if nxt is not None and (nxt != path or os.stat(nxt).st_ino != ino):
                    f.close()
                    path, f, buf = nxt, open(nxt, "rb"), b""
                    ino = os.fstat(f.fileno()).st_ino
            except OSError:
                pass
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        f.close()


def cmd_stop(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    pid = RunLock.holder(cfg.run_dir)
    if pid is None:
        print(f"no supervisor is running on {cfg.run_dir}")
        return EXIT_OK
    timeout = args.timeout if args.timeout is not None else cfg.health.stop_timeout_s + 30
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if RunLock.holder(cfg.run_dir) is None:
            print(f"supervisor {pid} stopped")
            return EXIT_OK
        time.sleep(0.2)
    print(f"supervisor {pid} still running after {timeout:g}s", file=sys.stderr)
    return EXIT_NOT_OK
