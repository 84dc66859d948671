"""Alerts: the events that need a person, sent to `[notify]`'s command and webhook off the loop (docs/operations.md).

One more subscriber of the run's events (daemon/events.py): `alert_of` picks the alerts (pure), `Alerts` holds back
one of a kind within `min_interval_s` and sends the rest through the System seam's off-loop work; the outcome comes
back as an `AlertSent` event (the history records it; a failing channel is one warning until it works again).
"""
from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from supervisor.config import Config
from supervisor.daemon import events as ev
from supervisor.host import procs
from supervisor.observe.redact import MASK, looks_secret, redact_argv
from supervisor.policy.state import State, Status

if TYPE_CHECKING:
    from supervisor.daemon.system import System

__all__ = ["SCHEMA", "Alerts", "alert_of", "render", "deliver"]

SCHEMA = 1
_IN_FLIGHT = 8  # deliveries at once: more (a storm with min_interval_s = 0) are dropped, and recorded as such
_OUTPUT_BYTES = 2000  # of a command's output, kept for the warning
_TRIES, _BACKOFF_S = 3, 1.0  # webhook tries, and the first wait between them (doubling)


def alert_of(event: Any) -> tuple[str, str] | None:
    """(kind, reason) when `event` is an alert, else None."""
    if isinstance(event, ev.Finished):
        if event.state is State.FAILED:
            return "gave_up", event.reason
        if event.state is State.COMPLETED:
            return "completed", event.reason
        return ("stopped", f"{event.reason}; the emergency save failed") if event.save_failed else None
    if isinstance(event, ev.HangRecorded):
        ranks = ", ".join(f"rank {r}: {why}" for r, why in event.job.hung_ranks) or "ranks not known"
        return "hang_detected", f"no progress for {event.idle_s} s ({ranks}); relaunching"
    if isinstance(event, ev.Alarm):
        return event.kind, event.reason
    if isinstance(event, ev.PassAbsorbed):  # the next save may not fit, or retention cannot free what it must
        result, newest = event.result, event.result.newest
        if pressure := next((f.message for f in result.findings if f.kind == "disk_pressure"), None):
            return "disk_low", pressure
        if result.disk_free is not None and newest is not None and result.disk_free < newest.size_bytes:
            return "disk_low", (f"free {result.disk_free / 2**30:.2f} GiB on the checkpoint file system < the newest "
                                f"checkpoint's {newest.size_bytes / 2**30:.2f} GiB: the next save may not fit")
    return None


def render(cfg: Config, status: Status, kind: str, reason: str, *, at: float, suppressed: int = 0) -> dict[str, Any]:
    """The alert's JSON object (schema: docs/operations.md), with no secret: values of the job's and our
    environment's secret-looking variables, and `--token x`/`KEY=x` words, are masked."""
    for name, value in {**os.environ, **cfg.job.env}.items():
        reason = reason.replace(value, MASK) if looks_secret(name) and len(value) >= 6 else reason
    latest = status.latest_checkpoint
    return {
        "schema": SCHEMA, "event": kind, "reason": " ".join(redact_argv(reason.split(" ")))[:2000], "at": round(at, 3),
        "run": {"config": str(cfg.path), "host": socket.gethostname(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                "run_dir": str(cfg.run_dir)},
        "state": status.state.value, "attempt": status.attempt, "step": status.step,
        "last_checkpoint": None if latest is None else {"path": latest["path"], "step": latest["step"]},
        "suppressed": suppressed,
    }


def text_of(alert: Mapping[str, Any]) -> str:
    """The webhook's one-line `text` (what a Slack or Mattermost channel shows)."""
    run, ck = alert["run"], alert["last_checkpoint"]
    where = run["host"] + (f" (Slurm job {run['slurm_job_id']})" if run["slurm_job_id"] else "")
    return (f"fsdp-supervisor {alert['event']} on {where}, {run['config']}: step {alert['step']}, last checkpoint "
            f"{ck['path'] if ck else 'none'}: {alert['reason']}").replace("\n", " ")


_WRAP = """import os, signal, subprocess, sys
try:
    p = subprocess.Popen(sys.argv[2:], stdout=2, preexec_fn=os.setpgrp)
except OSError as e:
    sys.exit(print("cannot start it:", e.strerror or e))
try:
    print(p.wait(float(sys.argv[1])))
except subprocess.TimeoutExpired:
    os.killpg(p.pid, signal.SIGKILL)
    print("timeout")
"""


SESSIONS: set[int] = set()  # of the commands running now (their wrapper's pid): never a finished job's survivors
STARTING = threading.Lock()  # held while one starts, and while survivors are killed: a new one is in SESSIONS
EXITING = -1  # in SESSIONS once `drain` gave up waiting: the supervisor exits, no command starts


def session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:  # gone
        return None


def _run(argv: list[str], data: Mapping[str, Any], timeout: float) -> tuple[str, str]:
    """Run `argv` with `data`'s JSON on stdin: (its exit code, "timeout" or why it did not start; its output's
    tail). A small Python wrapper, in a session of its own, reports the exit code (the daemon's loop reaps every
    child: ours could lose it) and kills the command's group on timeout."""
    with tempfile.TemporaryFile() as out:
        try:  # the command's output goes to a temp file: what it prints costs no memory and never blocks it
            with STARTING:
                if EXITING in SESSIONS:
                    return "the supervisor exited", ""
                proc = subprocess.Popen([sys.executable, "-I", "-c", _WRAP, str(timeout), *argv], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=out, close_fds=True, start_new_session=True)
                SESSIONS.add(proc.pid)
        except OSError as exc:
            return f"cannot start the wrapper: {exc}", ""
        try:
            said, _ = proc.communicate(json.dumps(data).encode(), timeout=timeout + 5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            said = b"timeout"
        finally:
            SESSIONS.discard(proc.pid)
        end = out.seek(0, os.SEEK_END)
        out.seek(max(0, end - _OUTPUT_BYTES))
        return said.strip().decode(errors="replace") or "no exit code", out.read().decode(errors="replace").strip()


def run_command(argv: list[str], alert: Mapping[str, Any], timeout: float) -> str | None:
    """Run `argv` with the alert on stdin; None, or why it failed."""
    code, tail = _run(argv, alert, timeout)
    if code == "0":
        return None
    what = f"timed out after {timeout:g} s" if code == "timeout" else f"exit {code}" if code[-1:].isdigit() else code
    return f"{argv[0]}: {what}" + (f": {' '.join(tail[-300:].split())}" if tail else "")  # one line


_POST = """import base64, json, sys, urllib.error, urllib.parse, urllib.request as rq
class NoRedirect(rq.HTTPRedirectHandler):
    def redirect_request(self, *args): return None  # a 3xx is an HTTPError: the alert failed
w = json.load(sys.stdin)
u, head = urllib.parse.urlsplit(w["url"]), {"Content-Type": "application/json"}
if u.username is not None:  # http://user:password@host/: basic auth, as curl does (urllib takes them for the host)
    auth = urllib.parse.unquote(u.username) + ":" + urllib.parse.unquote(u.password or "")
    head["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    u = u._replace(netloc=u.netloc.rpartition("@")[2])
try:
    rq.build_opener(NoRedirect).open(rq.Request(u.geturl(), json.dumps(w["body"]).encode(), head, method="POST")).close()
except urllib.error.HTTPError as e:  # a redirect or a refusal will not change on a retry (exit 2)
    sys.exit(print("HTTP", e.code) or (2 if 300 <= e.code < 500 and e.code != 429 else 1))
except urllib.error.URLError as e:  # refused, unreachable, a bad certificate
    sys.exit(print(e.reason) or 1)
except Exception as e:  # a URL urllib cannot use: its message may quote the URL, a secret
    sys.exit(print(type(e).__name__) or 2)
"""


def post_webhook(url: str, alert: Mapping[str, Any], timeout: float, *, tries: int = _TRIES,
                 sleep: Callable[[float], None] = time.sleep) -> str | None:
    """POST the alert plus `text` as JSON; None, or why the last try failed (the URL, a secret, is never said).
    Each try is a child that timeout_s ends, like a command: a server that answers byte by byte holds it no longer."""
    error = "no try"
    for i in range(tries):
        if i:
            sleep(_BACKOFF_S * 2 ** (i - 1))
        code, said = _run([sys.executable, "-I", "-c", _POST], {"url": url, "body": {**alert, "text": text_of(alert)}},
                          timeout)
        if code == "0":
            return None
        error = f"timed out after {timeout:g} s" if code == "timeout" else said[-300:] or f"exit {code}"
        if code == "2":
            break
    return error


def deliver(cfg: Config, alert: Mapping[str, Any]) -> dict[str, str | None]:
    """Send `alert` through every configured channel: {channel: error or None}."""
    n = cfg.notify
    return {**({"command": run_command(n.command, alert, n.timeout_s)} if n.command else {}),
            **({"webhook": post_webhook(n.webhook, alert, n.timeout_s)} if n.webhook else {})}


class Alerts:
    """The bus's subscriber that sends alerts; `send` is also `notify-test`'s way in."""

    def __init__(self, cfg: Config, status: Status, *, system: System, publish: Callable[[ev.Event], None]) -> None:
        self.cfg, self.status, self.sys, self.publish = cfg, status, system, publish
        self._last: dict[str, float] = {}  # kind -> monotonic time of its last alert sent
        self._held: dict[str, int] = {}  # kind -> alerts held back since (min_interval_s)
        self._in_flight = 0
        self._sending = threading.Condition()  # counts deliveries not yet returned, for `drain`
        self._unfinished = 0
        self._failing: set[str] = set()  # channels whose last delivery failed (warned once until they work)

    def notify(self, event: Any) -> None:
        found = alert_of(event)
        if found is not None and found[0] in self.cfg.notify.events:
            self.send(*found)

    def send(self, kind: str, reason: str) -> None:
        now, last = self.sys.monotonic(), self._last.get(kind)
        if last is not None and now - last < self.cfg.notify.min_interval_s:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        if self._in_flight >= _IN_FLIGHT:
            self._sent(kind, {"all": f"dropped: {_IN_FLIGHT} alerts are being sent"}, flight=0)
            return
        self._last[kind], self._in_flight = now, self._in_flight + 1
        alert = render(self.cfg, self.status, kind, reason, at=self.sys.now(), suppressed=self._held.pop(kind, 0))
        with self._sending:
            self._unfinished += 1
        self.sys.run_off_loop(functools.partial(self._deliver, alert), functools.partial(self._sent, kind))

    def _deliver(self, alert: dict[str, Any]) -> dict[str, str | None]:  # off the loop
        try:
            return deliver(self.cfg, alert)
        finally:
            with self._sending:
                self._unfinished -= 1
                self._sending.notify_all()

    def drain(self) -> bool:
        """At exit: wait up to timeout_s + 5 s for the alerts being sent (a give-up's above all), or until a SIGINT or
        SIGTERM cuts it short; whether all were. What is still being sent then is killed: no alert outlives us."""
        cut = threading.Event()
        old = {s: signal.signal(s, lambda *_: cut.set()) for s in (signal.SIGINT, signal.SIGTERM)}
        deadline = time.monotonic() + self.cfg.notify.timeout_s + 5
        try:
            with self._sending:
                while self._unfinished and not cut.is_set() and time.monotonic() < deadline:
                    self._sending.wait(0.1)
                if not self._unfinished:
                    return True
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
        with STARTING:  # none starts after this
            SESSIONS.add(EXITING)
            procs.named([p for p in procs.descendants() if session_of(p.pid) in SESSIONS], signal.SIGKILL)
        return False

    def _sent(self, kind: str, outcome: dict[str, str | None] | BaseException, flight: int = 1) -> None:
        self._in_flight -= flight
        if isinstance(outcome, BaseException):  # a bug: the alert is lost, never the run
            outcome = {"all": f"{type(outcome).__name__}: {outcome}"}
        failed = {channel for channel, error in outcome.items() if error}
        warn = bool(failed - self._failing)
        self._failing = (self._failing | failed) - {c for c, error in outcome.items() if not error}
        self.publish(ev.AlertSent(kind, outcome, warn))
