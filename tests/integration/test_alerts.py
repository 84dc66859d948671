"""Alerts through real channels: an http.server on 127.0.0.1 and a real command; failures cost one warning."""
from __future__ import annotations

import contextlib
import json
import queue
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from supervisor.cli.app import main
from supervisor.daemon import events as ev
from supervisor.daemon.alerts import Alerts, post_webhook
from supervisor.daemon.recorder import HistoryRecorder
from supervisor.history.records import HISTORY_FILE, read_history
from supervisor.policy.state import State
from tests.fakes import FakeSystem
from tests.supervise import FAKEJOB, Supervisors, supervisors, wait_for, write_config  # noqa: F401
from tests.unit.test_core import exit_job, make_core

DEFAULTS = ["gave_up", "diverged", "rolled_back", "hang_detected", "crash_loop", "disk_low", "stopped"]


class Hook(BaseHTTPRequestHandler):
    """Answers as `server.mode` says: ok, 500, redirect, hold (until `server.release` is set), or trickle (a header
    line every 0.2 s for 6 s: each read is quick, the answer is not)."""

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        srv: Any = self.server
        srv.bodies.put({**json.loads(body), "authorization": self.headers["Authorization"]})
        if srv.mode == "trickle":
            self.wfile.write(b"HTTP/1.1 200 OK\r\n")
            with contextlib.suppress(OSError):  # the client hung up
                for _ in range(30):
                    self.wfile.write(b"X-Slow: 1\r\n")
                    self.wfile.flush()
                    srv.release.wait(0.2)
        if srv.mode in ("hold", "trickle"):
            srv.release.wait(30)
        code = {"ok": 200, "500": 500, "redirect": 302, "hold": 200, "trickle": 200}[srv.mode]
        self.send_response(code)
        if code == 302:
            self.send_header("Location", "http://127.0.0.1:1/elsewhere")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[Any]:
    srv: Any = ThreadingHTTPServer(("127.0.0.1", 0), Hook)  # a free port
    srv.bodies, srv.mode, srv.release = queue.Queue(), "ok", threading.Event()
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.release.set()
    srv.shutdown()


class Threads:
    """The System seam's off-loop work on real threads, `done` handed back to the test's "loop" (`drain`)."""

    def __init__(self, fake: FakeSystem) -> None:
        self.fake = fake
        self.done: queue.Queue[tuple[Callable[[Any], None], Any]] = queue.Queue()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fake, name)

    def run_off_loop(self, work: Callable[[], Any], done: Callable[[Any], None]) -> None:
        threading.Thread(target=lambda: self.done.put((done, work())), daemon=True).start()

    def drain(self, n: int) -> None:
        for _ in range(n):
            done, result = self.done.get(timeout=60)
            done(result)


def _writer(out: Path) -> list[str]:
    return [sys.executable, "-c", f"import sys; open({str(out)!r}, 'a').write(sys.stdin.read() + '\\n')"]


def _events() -> list[ev.Event]:
    hung = SimpleNamespace(hung_ranks=[(1, "stopped (SIGSTOP)")])
    low = SimpleNamespace(findings=[], disk_free=1, newest=SimpleNamespace(size_bytes=10))
    return [ev.Finished(State.FAILED, "crash loop", 4), ev.Alarm("diverged", "loss 9.1 > 3x"),
            ev.Alarm("rolled_back", "to step_100"), ev.HangRecorded(hung, 30.0),  # type: ignore[arg-type]
            ev.Alarm("crash_loop", "3 in a row"), ev.PassAbsorbed(low, None),  # type: ignore[arg-type]
            ev.Finished(State.STOPPED, "SIGTERM", 2, save_failed=True)]


def test_every_default_event_reaches_both_channels(tmp_path: Path, server: Any) -> None:
    """Each default event: one JSON object on the command's stdin and one POST (the same plus `text`)."""
    out = tmp_path / "alerts.jsonl"
    url = f"http://127.0.0.1:{server.server_port}/hook"
    core, fake, log = make_core(tmp_path, job=f'[notify]\ncommand = {json.dumps(_writer(out))}\nwebhook = "{url}"')
    threads = Threads(fake)
    alerts = Alerts(core.cfg, core.status, system=threads, publish=core.bus.publish)  # type: ignore[arg-type]
    core.bus.append(alerts.notify)
    for event in _events():
        core.bus.publish(event)
    threads.drain(len(DEFAULTS))
    posted = [server.bodies.get_nowait() for _ in DEFAULTS]
    ran = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(p["event"] for p in posted) == sorted(r["event"] for r in ran) == sorted(DEFAULTS)
    assert all(p["text"].startswith(f"fsdp-supervisor {p['event']} on ") for p in posted)
    assert all("text" not in r and r["run"]["config"] == str(core.cfg.path) for r in ran)
    assert "alert_failed" not in log.names()


@pytest.mark.parametrize("mode", ["500", "redirect", "unreachable", "slow"])
def test_failing_channels_cost_one_warning_and_never_delay_a_restart(tmp_path: Path, server: Any, mode: str) -> None:
    """A command that fails and a webhook that fails (500, a redirect, a closed port, no answer within timeout_s):
    the job is relaunched while the alerts are still being sent, one alert_failed, every outcome in the history."""
    server.mode = "hold" if mode == "slow" else mode
    port = 1 if mode == "unreachable" else server.server_port
    cmd = [sys.executable, "-c", "import sys; sys.stdin.read(); print('x' * 100000); sys.exit(3)"]
    notify = (f'[notify]\ncommand = {json.dumps(cmd)}\nwebhook = "http://127.0.0.1:{port}/"\n'
              'min_interval_s = 0\ntimeout_s = 1')
    core, fake, log = make_core(tmp_path, restart="max_no_progress_restarts = 2", job=notify)
    history = HistoryRecorder.for_run_dir(core.run_dir, now=fake.now, log=log)
    core.bus.append(history.notify)
    threads = Threads(fake)
    core.bus.append(Alerts(core.cfg, core.status, system=threads, publish=core.bus.publish).notify)
    core.begin(None)
    exit_job(core, fake, 1)
    fake.advance(core.sys.timers.next_deadline() - fake.clock, core)
    exit_job(core, fake, 1)  # 2 without progress: crash_loop, alerted off the loop
    fake.advance(core.sys.timers.next_deadline() - fake.clock, core)
    assert len(fake.spawned) == 3  # relaunched while the alert is still out
    exit_job(core, fake, 1)  # gave up: a second alert
    assert core.status.state is State.FAILED
    server.release.set()
    threads.drain(2)
    assert log.names().count("alert_failed") == 1
    history.close()
    recs = [r for r in read_history(core.run_dir / HISTORY_FILE)[0] if r["kind"] == "alert"]
    assert sorted(r["event"] for r in recs) == ["crash_loop", "gave_up"] and not any(r["ok"] for r in recs)
    assert all(r["outcome"]["command"].startswith(f"{cmd[0]}: exit 3") for r in recs)
    assert all(len(r["outcome"]["command"]) < 400 for r in recs)


def test_webhook_retries_with_backoff_then_gives_up(server: Any) -> None:
    """A 500 is retried (3 tries, waits of 1 then 2 s); a redirect is not followed nor retried."""
    waits: list[float] = []
    server.mode = "500"
    url = f"http://127.0.0.1:{server.server_port}/"
    assert post_webhook(url, {"event": "x", "run": {"host": "h", "slurm_job_id": None, "config": "c"}, "step": 1,
                              "last_checkpoint": None, "reason": "r"}, 5, sleep=waits.append) == "HTTP 500"
    assert waits == [1.0, 2.0] and server.bodies.qsize() == 3


def test_webhook_timeout_bounds_a_whole_try_and_the_url_is_never_said(server: Any) -> None:
    """timeout_s ends a try whose server answers byte by byte; user:password in the URL is basic auth; a URL urllib
    cannot use is one line that does not quote it (it may hold a secret), never an exception."""
    alert = {"event": "x", "run": {"host": "h", "slurm_job_id": None, "config": "c"}, "step": 1,
             "last_checkpoint": None, "reason": "r"}
    server.mode = "trickle"
    url = f"http://127.0.0.1:{server.server_port}/"
    assert post_webhook(url, alert, 1, tries=1) == "timed out after 1 s"
    server.mode = "ok"
    assert post_webhook(f"http://bob:s3cr%40t@127.0.0.1:{server.server_port}/", alert, 5) is None
    assert [server.bodies.get_nowait()["authorization"] for _ in range(2)] == [None, "Basic Ym9iOnMzY3JAdA=="]
    assert post_webhook("http://127.0.0.1:T0KEN/hooks/T0KEN", alert, 5) == "InvalidURL"


def test_notify_test_command(tmp_path: Path, server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """notify-test: exit 0 when every channel took the test alert, 1 when one failed, 2 without a channel."""
    out = tmp_path / "alerts.jsonl"
    cfg = tmp_path / "job.toml"
    base = '[job]\ncommand = ["python"]\n[checkpoints]\ndir = "ckpts"\n'
    cfg.write_text(base + f'[notify]\ncommand = {json.dumps(_writer(out))}\n'
                   f'webhook = "http://127.0.0.1:{server.server_port}/"\n')
    assert main(["notify-test", "-c", str(cfg)]) == 0
    assert json.loads(out.read_text())["event"] == "test" == server.bodies.get_nowait()["event"]
    server.mode = "500"
    assert main(["notify-test", "-c", str(cfg)]) == 1 and capsys.readouterr().err == "webhook: HTTP 500\n"
    noisy = [sys.executable, "-c", "print('Traceback\\n  boom\\nError: x'); raise SystemExit(7)"]
    cfg.write_text(base + f'[notify]\ncommand = {json.dumps(noisy)}\n')  # one line per channel, whatever it prints
    assert main(["notify-test", "-c", str(cfg)]) == 1
    assert capsys.readouterr().err == f"command: {sys.executable}: exit 7: Traceback boom Error: x\n"
    cfg.write_text(base)
    assert main(["notify-test", "-c", str(cfg)]) == 2


def test_an_alert_command_is_no_job_survivor(tmp_path: Path) -> None:
    """An alert command (and what it starts) running when an attempt ends is neither a survivor nor killed with them."""
    from supervisor.daemon.alerts import run_command
    from supervisor.daemon.system import RealSystem

    mark = tmp_path / "done"
    child = f"import time, pathlib; time.sleep(1.5); pathlib.Path({str(mark)!r}).write_text('ok')"
    cmd = [sys.executable, "-c", f"import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', {child!r}]))"]
    result: list[str | None] = []
    t = threading.Thread(target=lambda: result.append(run_command(cmd, {"event": "test"}, 30)))
    t.start()
    system = RealSystem()
    try:
        wait = threading.Event()
        while not alerts_running() and t.is_alive():
            wait.wait(0.05)
        wait.wait(0.5)  # the command's own child is up
        assert system.survivors() == [] and system.reap_survivors() == []
    finally:
        t.join(30)
        system.close()
    assert result == [None] and mark.read_text() == "ok"


def test_alert_commands_starting_while_survivors_are_killed_are_left_alone() -> None:
    """A hang's alert starts as the hung job's leftovers are killed: a command (or its wrapper) that was starting
    then is not taken for one of them (it was, and the alert said 'no exit code')."""
    from supervisor.daemon.alerts import run_command
    from supervisor.daemon.system import RealSystem

    cmd = [sys.executable, "-c", "import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', '']))"]
    results: list[str | None] = []
    threads = [threading.Thread(target=lambda: results.append(run_command(cmd, {"event": "test"}, 30)))
               for _ in range(12)]
    system = RealSystem()
    try:
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            assert system.reap_survivors() == []
    finally:
        for t in threads:
            t.join(60)
        system.close()
    assert results == [None] * 12


def alerts_running() -> bool:
    from supervisor.daemon.alerts import SESSIONS

    return bool(SESSIONS)


def test_a_hanging_command_is_killed_with_what_it_started(tmp_path: Path) -> None:
    """A command that never ends (and its child): killed, process group and all, after timeout_s; one error."""
    from supervisor.daemon.alerts import run_command

    pid_file = tmp_path / "child.pid"
    child = f"import os, time, pathlib; pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid())); time.sleep(600)"
    cmd = [sys.executable, "-c", f"import subprocess, sys; subprocess.call([sys.executable, '-c', {child!r}])"]
    error = run_command(cmd, {"event": "test"}, 2)
    assert error is not None and "timed out after 2 s" in error
    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(int(pid_file.read_text())).wait(10)  # psutil.TimeoutExpired if it outlived the kill


def test_a_real_run_alerts_its_crash_loop_and_give_up(tmp_path: Path, server: Any, supervisors: Supervisors) -> None:
    """`fsdp-supervisor run` wires the alerts: a job that always fails alerts crash_loop, then gave_up (exit 3), to
    the webhook and the command, each outcome recorded in the history."""
    out = tmp_path / "alerts.jsonl"
    cmd = [sys.executable, str(FAKEJOB), "--exit", "1"]
    extra = (f'[restart]\nbackoff_initial_s = 0.05\nbackoff_max_s = 0.1\n[notify]\ncommand = {json.dumps(_writer(out))}\n'
             f'webhook = "http://127.0.0.1:{server.server_port}/"\n')
    p = supervisors.start(write_config(tmp_path, cmd, extra))
    p.communicate(timeout=120)
    assert p.returncode == 3
    posted = [server.bodies.get(timeout=30)["event"] for _ in range(2)]
    assert sorted(posted) == ["crash_loop", "gave_up"]
    recs = read_history(tmp_path / ".fsdp-supervisor" / HISTORY_FILE)[0]
    assert sorted(r["event"] for r in recs if r["kind"] == "alert" and r["ok"]) == ["crash_loop", "gave_up"]
    assert sorted(json.loads(line)["event"] for line in out.read_text().splitlines()) == ["crash_loop", "gave_up"]


def test_a_stop_signal_cuts_the_wait_for_alerts_and_kills_them(tmp_path: Path, supervisors: Supervisors) -> None:
    """A completed run waits for its alert; SIGTERM then ends the wait (the run's exit code, not the signal's, and
    its cleanup done) and the alert command, which ignores SIGTERM, does not outlive the supervisor."""
    pid_file = tmp_path / "alert.pid"
    sleeper = (f"import os, pathlib, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
               f"pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid())); time.sleep(600)")
    extra = f'[notify]\ncommand = {json.dumps([sys.executable, "-c", sleeper])}\nevents = ["completed"]\ntimeout_s = 600\n'
    p = supervisors.start(write_config(tmp_path, [sys.executable, str(FAKEJOB), "--steps", "2"], extra))
    wait_for(pid_file.exists, 60, "the completed alert's command")
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=60)
    assert p.returncode == 0
    command = int(pid_file.read_text())
    wait_for(lambda: not psutil.pid_exists(command) or psutil.Process(command).status() == psutil.STATUS_ZOMBIE,
             10, "the alert command's end")


def test_a_command_that_cannot_start_says_why(tmp_path: Path) -> None:
    """A missing program is one line naming it and the reason, no traceback."""
    from supervisor.daemon.alerts import run_command

    missing = str(tmp_path / "no-such-program")
    assert run_command([missing], {"event": "test"}, 5) == f"{missing}: cannot start it: No such file or directory"
