"""`run`, `status`, `logs`, `stop`: the supervisor's own commands (the checkpoint commands: cli/checkpoints.py)."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from supervisor.cli.argtypes import add_config_arg, non_negative_float, non_negative_int
from supervisor.config import Config, load_config
from supervisor.daemon.statefile import read_status
from supervisor.errors import EXIT_NOT_OK, EXIT_NOT_RUNNING, EXIT_OK, UsageError
from supervisor.host.joblog import attempt_number
from supervisor.host.regularfile import open_regular
from supervisor.host.runlock import LOCK_FILE, RunLock
from supervisor.observe.eventlog import LOG_FILE, render_line
from supervisor.observe.lines import LineSplitter, tail_lines
from supervisor.observe.redact import redact_argv, scrub, secret_values
from supervisor.observe.sanitize import visible
from supervisor.observe.statusview import render_status
from supervisor.policy.state import Status

__all__ = ["register"]

_FOLLOW_CHUNK = 1 << 20


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("run", help="run the job under supervision (foreground)")
    add_config_arg(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "status", help="state, step, last checkpoint, restarts, free disk",
        epilog="exit codes (systemctl status's): 0 a supervisor is running on the run dir; 3 none is (the run "
        "completed, stopped, failed or never ran here: --json's `state` says which); 2 usage or config error")
    add_config_arg(p)
    p.add_argument("--json", action="store_true", help="print state.json plus supervisor_running")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("logs", help="the supervisor's structured log, or the job's output")
    add_config_arg(p)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    p.add_argument("-n", "--lines", type=non_negative_int, default=50, metavar="N", help="last N lines (default 50)")
    p.add_argument("--job", action="store_true",
                   help="the current attempt's job output instead (each line as a terminal shows it: its last \\r frame)")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser(
        "stop", help="stop gracefully (the job writes an emergency checkpoint) and wait for the supervisor to exit",
        description="Ask the running supervisor to stop: it sends SIGTERM to the job, which writes an emergency "
        "checkpoint and exits, then the supervisor exits 0 without a restart (the next `run` resumes from that "
        "checkpoint). A stop is never escalated by accident: running `stop` again, or another SIGTERM or SIGINT, "
        "only waits for the stop already in progress. Only `stop --force` (SIGUSR2 to the supervisor), or a second "
        "Ctrl+C typed in the supervisor's own terminal, kills the job at once; stop_timeout_s after the SIGTERM the "
        "supervisor kills it anyway.",
        epilog="exit codes: 0 the supervisor has exited (or none was running); 1 it is still stopping when --timeout "
        "ran out (nothing was cut short: the job may still be writing its checkpoint; run `stop` again to keep "
        "waiting); 2 usage or config error",
    )
    add_config_arg(p)
    p.add_argument("--timeout", type=non_negative_float, default=None, metavar="S",
                   help="how long to wait (default: stop_timeout_s + 30; with --force: 30)")
    p.add_argument("--force", action="store_true",
                   help="kill the job now (SIGUSR2 to the supervisor): an emergency checkpoint being written is lost")
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("notify-test", help="send a test alert through [notify]'s command and webhook",
                       epilog="exit codes: 0 every configured channel took it; 1 one failed (said on stderr); 2 usage "
                       "or config error, or [notify] has no command and no webhook")
    add_config_arg(p)
    p.set_defaults(func=cmd_notify_test)


def cmd_notify_test(args: argparse.Namespace) -> int:
    from supervisor.daemon.alerts import deliver, render

    cfg = load_config(args.config)
    if not (cfg.notify.command or cfg.notify.webhook):
        raise UsageError(f"{cfg.path}: [notify] has no command and no webhook: nothing to test")
    status = read_status(cfg.run_dir) or Status(pid=os.getpid(), started_at=time.time(), config=str(cfg.path))
    outcome = deliver(cfg, render(cfg, status, "test", "a test alert (fsdp-supervisor notify-test)", at=time.time()))
    for channel, error in outcome.items():
        print(f"{channel}: {error or 'sent'}", file=sys.stderr if error else sys.stdout)
    return EXIT_NOT_OK if any(outcome.values()) else EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    from supervisor.daemon.run import run  # here: `status`/`logs` stay light

    return run(load_config(args.config))


def _running(cfg: Config, *, say: bool = True) -> tuple[int | None, Path]:
    """The supervisor running this config: (its pid, its run dir), found by the run dir's lock, else by its
    claim on the checkpoint root (checkpoints/claim.py) - which still names it when the run dir was removed,
    or the config's `run_dir` was edited while it ran. (None, the config's run dir) when none runs."""
    from supervisor.checkpoints.claim import live_holders  # here: only when the run dir has no lock holder

    pid = RunLock.holder(cfg.run_dir)
    if pid is not None:
        return pid, cfg.run_dir
    try:  # another user's run dir: its lock cannot be read, which is no "not running"
        os.close(os.open(cfg.run_dir / LOCK_FILE, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC))
    except PermissionError:
        raise UsageError(f"cannot tell whether a supervisor runs on {cfg.run_dir}: permission denied; run this as "
                         "the user that runs it") from None
    except OSError:
        pass  # none there, or a symlink or a FIFO: nobody holds that lock
    host = socket.gethostname()
    for h in live_holders(cfg.checkpoints.dir):
        if h.host == host and h.config == str(cfg.path):
            run_dir = Path(h.run_dir)
            if say and run_dir != cfg.run_dir:
                print(f"note: supervisor {h.pid} runs this config with run dir {run_dir} (the config now says "
                      f"{cfg.run_dir})", file=sys.stderr)
            return h.pid, run_dir
    return None, cfg.run_dir


def cmd_status(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    holder, run_dir = _running(cfg)
    status = read_status(run_dir)
    rc = EXIT_OK if holder is not None else EXIT_NOT_RUNNING  # systemctl's codes: 0 running, 3 not running
    if args.json:
        doc = status.to_json() if status else {}
        doc["supervisor_running"] = holder is not None
        if doc.get("job_cmdline"):  # state.json keeps it exactly (an orphan's identity); what is shown is masked
            doc["job_cmdline"] = scrub(redact_argv(doc["job_cmdline"]), secret_values({**os.environ, **cfg.job.env}, []))
        print(json.dumps(doc, indent=2, sort_keys=True))
        return rc
    if status is None:
        running = f"supervisor {holder} is running, but there is " if holder is not None else ""
        print(f"{running}no supervisor state in {run_dir} (never run here, or state.json unreadable)")
        return rc
    tty = sys.stdout.isatty() and "utf" in (sys.stdout.encoding or "").lower()
    print(render_status(status, running=holder is not None, now=time.time(), spark=tty))
    return rc


def _current_job_log(run_dir: Path) -> Path | None:
    """The newest attempt's log: by number, since attempt-10000.log sorts before attempt-9999.log as text."""
    numbered = [(n, p) for p in (run_dir / "logs").glob("attempt-*.log") if (n := attempt_number(p.name)) is not None]
    return max(numbered)[1] if numbered else None




def cmd_logs(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    path = _current_job_log(cfg.run_dir) if args.job else cfg.run_dir / LOG_FILE
    colors = sys.stdout.isatty() and not os.environ.get("NO_COLOR")  # the job's colors, never its other controls

    def render(line: str) -> str:
        return visible(line.rstrip("\n"), colors=colors) if args.job else visible(render_line(line), colors=False)

    if path is None or not path.exists():
        print(f"no {'job output' if args.job else 'supervisor log'} in {cfg.run_dir} yet", file=sys.stderr)
        return EXIT_NOT_OK
    try:
        f = open(open_regular(path), "rb")  # noqa: SIM115 - closed by the caller below
    except OSError as exc:  # e.g. a FIFO planted under the name: nothing to show, and never a block
        if args.follow:
            print(f"cannot follow {path}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_NOT_OK
        return EXIT_OK
    with f:
        # The last lines, read in bounded time (lines.tail_lines), then -f goes on from the very offset they
        # ended at: a line appended in between (a crash's traceback) is neither lost nor shown twice.
        end = f.seek(0, 2)
        for line in tail_lines(f, args.lines, end=end):
            print(render(line.decode("utf-8", "replace")), flush=True)
        if not args.follow:
            return EXIT_OK
        return _follow(f, end, path, cfg.run_dir, args.job, render)


def _follow(f: BinaryIO, offset: int, path: Path, run_dir: Path, job: bool, render: Callable[[str], str]) -> int:
    """Print lines appended to `path` (open as `f`) from `offset`; reopen on rotation or a new attempt (--job).

    Read in bounded chunks through a LineSplitter, so a job writing megabytes without a newline costs
    neither memory nor quadratic time here. Before moving on to the next file, the old one is read to its
    end: what a crashing job printed last (its traceback) comes right before the next attempt starts.
    """
    def show(lines: list[bytes]) -> None:
        for line in lines:
            print(render(line.decode("utf-8", "replace")), flush=True)

    f.seek(offset)
    ino = os.fstat(f.fileno()).st_ino
    lines = LineSplitter()
    try:
        while True:
            data = f.read(_FOLLOW_CHUNK)
            if data:
                show(lines.feed(data))
                continue
            if os.fstat(f.fileno()).st_size < f.tell():  # truncated in place: the live attempt log was rotated
                f.seek(0)
                continue
            time.sleep(0.25)
            nxt = _current_job_log(run_dir) if job else path
            with contextlib.suppress(OSError):
                if nxt is not None and (nxt != path or os.stat(nxt).st_ino != ino):
                    new = open(open_regular(nxt), "rb")  # noqa: SIM115 - replaces f, closed with it
                    while data := f.read(_FOLLOW_CHUNK):  # the rest of the old file first
                        show(lines.feed(data))
                    show([lines.frame] if lines.frame else [])
                    f.close()
                    path, f, lines = nxt, new, LineSplitter()
                    ino = os.fstat(f.fileno()).st_ino
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        f.close()


def cmd_stop(args: argparse.Namespace) -> int:
    from supervisor.host.signals import FORCE_STOP_SIGNAL
    from supervisor.policy.state import State

    cfg = load_config(args.config)
    pid, run_dir = _running(cfg)
    if pid is None:
        print(f"no supervisor is running on {cfg.run_dir}")
        return EXIT_OK
    status = read_status(run_dir)
    try:
        if args.force:
            timeout = 30.0 if args.timeout is None else args.timeout
            os.kill(pid, FORCE_STOP_SIGNAL)
            print(f"supervisor {pid}: force stop sent (the job is killed; a checkpoint being written is lost)")
        else:
            timeout = cfg.health.stop_timeout_s + 30 if args.timeout is None else args.timeout
            # Only the lock holder's own state counts: a SIGKILLed predecessor's `stopping` stays in state.json
            # until the new supervisor has stopped its orphan and written its own, and nobody is stopping then.
            if status is not None and status.state is State.STOPPING and status.pid == pid:
                print(f"supervisor {pid} is already stopping; waiting for it (up to {timeout:g}s)")
            else:  # a repeat would do no harm either: the supervisor treats it as "still stopping"
                os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:  # it exited between the lock check and the signal
        print(f"supervisor {pid} stopped")
        return EXIT_OK
    deadline = time.monotonic() + timeout
    while _running(cfg, say=False)[0] == pid:
        if time.monotonic() >= deadline:
            print(f"supervisor {pid} is still stopping after {timeout:g}s: the stop is in progress and nothing was cut "
                  f"short (the job may still be writing its emergency checkpoint); run `stop` again to keep waiting, or "
                  f"`stop --force` to kill the job now", file=sys.stderr)
            return EXIT_NOT_OK
        time.sleep(0.2)
    print(f"supervisor {pid} stopped")
    return EXIT_OK
