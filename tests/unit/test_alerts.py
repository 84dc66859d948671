"""Alerts: which events alert, the JSON schema (docs/operations.md), redaction, the rate limit, crash_loop."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import supervisor.daemon.alerts as alerts_mod
from supervisor.daemon import events as ev
from supervisor.daemon.alerts import Alerts, alert_of, render, text_of
from supervisor.policy.restarts import Attempt, crash_loop
from supervisor.policy.state import State
from tests.fakes import FakeSystem, RecordingLog
from tests.unit.test_core import exit_job, make_core

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def _pass(free: int | None, newest_bytes: int | None, findings: list[Any] = ()) -> ev.PassAbsorbed:  # type: ignore[assignment]
    newest = None if newest_bytes is None else SimpleNamespace(size_bytes=newest_bytes)
    return ev.PassAbsorbed(SimpleNamespace(findings=list(findings), disk_free=free, newest=newest), None)  # type: ignore[arg-type]


HUNG = SimpleNamespace(hung_ranks=[(1, "stopped (SIGSTOP)")])


@pytest.mark.parametrize(("event", "kind"), [
    (ev.Finished(State.FAILED, "crash loop", 4), "gave_up"),
    (ev.Finished(State.COMPLETED, "completed", 1), "completed"),
    (ev.Finished(State.STOPPED, "SIGTERM", 2, save_failed=True), "stopped"),
    (ev.Finished(State.STOPPED, "SIGTERM", 2), None),  # a clean stop needs nobody
    (ev.HangRecorded(HUNG, 31.0), "hang_detected"),  # type: ignore[arg-type]
    (ev.Alarm("crash_loop", "3 in a row"), "crash_loop"),
    (ev.Alarm("diverged", "loss spike"), "diverged"),
    (_pass(10, 100), "disk_low"),  # the next save may not fit
    (_pass(10, 5, [SimpleNamespace(kind="disk_pressure", message="free 1 GiB < min_free_gb=5")]), "disk_low"),
    (_pass(100, 5), None),
    (_pass(None, 5), None),
    (ev.Quarantined("/c/step_1", "x"), None),
])
def test_alert_of(event: Any, kind: str | None) -> None:
    """The events that alert, and the kind each one is."""
    found = alert_of(event)
    assert (found[0] if found else None) == kind


@pytest.mark.parametrize(("failures", "limit", "expected"), [
    ([1], 3, None), ([1, 1], 3, None), ([1, 1, 1], 3, 3), ([1, 1, 1, 1], 3, None),
    ([0, 1, 1, 1], 3, 3), ([1, 0, 1, 1], 3, None), ([1, 1], 2, 2), ([1], 1, None), ([1], 0, None),
])
def test_crash_loop_is_one_failure_short_of_the_give_up(failures: list[int], limit: int, expected: int | None) -> None:
    """crash_loop: N failures in a row without progress, N = max_no_progress_restarts (at least 2): the next gives up.
    (1: a failure without progress, 0: one that progressed)."""
    history = [Attempt(i, 0.0, 1.0, False, "crash", None, None, None, False, not f) for i, f in enumerate(failures)]
    assert crash_loop(history, SimpleNamespace(max_no_progress_restarts=limit)) == expected  # type: ignore[arg-type]


def _documented_fields() -> set[str]:
    """The field names of docs/operations.md's alert schema table (the first column of its rows)."""
    text = DOCS.read_text()
    section = text[text.index("### Alert JSON"):]
    section = section[:section.index("\n#", 1)]
    return set(re.findall(r"^\| `([\w.]+)` \|", section, re.M))


def test_schema_is_the_documented_one(tmp_path: Path) -> None:
    """Every field of an alert, and of its `run`, is in docs/operations.md's table, and every documented one is sent."""
    core, fake, _ = make_core(tmp_path)
    alert = render(core.cfg, core.status, "gave_up", "why", at=fake.now())
    sent = {*alert, *(f"run.{k}" for k in alert["run"]), *(f"last_checkpoint.{k}" for k in ("path", "step")), "text"}
    assert sent == _documented_fields()
    assert alert["schema"] == alerts_mod.SCHEMA == 1


def test_no_secret_in_an_alert(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A secret-looking variable's value (the job's env or ours) and `--api-key x` words never reach an alert."""
    monkeypatch.setenv("WANDB_API_KEY", "s3cr3t-wandb")
    core, fake, _ = make_core(tmp_path, job='env = {HF_TOKEN = "hf_abcdefgh"}')
    reason = "crash: login hf_abcdefgh failed; argv --api-key zzz-top WANDB_API_KEY=s3cr3t-wandb"
    alert = render(core.cfg, core.status, "gave_up", reason, at=fake.now())
    blob = repr(alert) + text_of(alert)
    assert "hf_abcdefgh" not in blob and "s3cr3t-wandb" not in blob and "zzz-top" not in blob
    assert "***" in alert["reason"]


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The alerts delivered (through a stand-in for the channels: a command named "fail" fails)."""
    out: list[dict[str, Any]] = []

    def deliver(cfg: Any, alert: dict[str, Any]) -> dict[str, str | None]:
        out.append(alert)
        return {"command": "exit 1" if cfg.notify.command == ["fail"] else None}

    monkeypatch.setattr(alerts_mod, "deliver", deliver)
    return out


def _alerts(tmp_path: Path, notify: str) -> tuple[Any, FakeSystem, RecordingLog]:
    core, fake, log = make_core(tmp_path, job=f"[notify]\n{notify}")
    core.bus.append(Alerts(core.cfg, core.status, system=fake, publish=core.bus.publish).notify)
    return core, fake, log


def test_crash_loop_then_give_up_alerts_once_each_and_is_recorded(tmp_path: Path, sent: list[dict[str, Any]]) -> None:
    """A crash loop through Core: one crash_loop alert (3 failures without progress), then gave_up; each outcome
    comes back on the bus (the history's subscriber records it)."""
    core, fake, log = _alerts(tmp_path, 'command = ["true"]\nmin_interval_s = 0')
    seen: list[ev.AlertSent] = []
    core.bus.append(lambda e: seen.append(e) if isinstance(e, ev.AlertSent) else None)
    core.begin(None)
    while not core.done:
        exit_job(core, fake, 1)
        if not core.done:
            fake.advance(core.sys.timers.next_deadline() - fake.clock, core)
    assert [a["event"] for a in sent] == ["crash_loop", "gave_up"]
    assert sent[0]["attempt"] == 3 and "one more gives up" in sent[0]["reason"]
    assert [s.kind for s in seen] == ["crash_loop", "gave_up"] and not any(s.warn for s in seen)
    assert "crash_loop" in log.names()


def test_min_interval_holds_back_and_counts(tmp_path: Path, sent: list[dict[str, Any]]) -> None:
    """At most one alert per kind per min_interval_s; the next one says how many were held back."""
    core, fake, _ = _alerts(tmp_path, 'command = ["true"]\nmin_interval_s = 60')
    for _ in range(5):
        core.bus.publish(ev.Alarm("crash_loop", "again"))
    core.bus.publish(ev.Alarm("disk_low", "full"))  # another kind: not held back
    fake.clock += 61
    core.bus.publish(ev.Alarm("crash_loop", "again"))
    assert [(a["event"], a["suppressed"]) for a in sent] == [("crash_loop", 0), ("disk_low", 0), ("crash_loop", 4)]


def test_events_not_chosen_do_not_alert(tmp_path: Path, sent: list[dict[str, Any]]) -> None:
    """`events` chooses: completed is off by default, and a kind left out never alerts."""
    core, _, _ = _alerts(tmp_path, 'command = ["true"]\nevents = ["gave_up"]')
    core.bus.publish(ev.Finished(State.COMPLETED, "completed", 1))
    core.bus.publish(ev.Alarm("crash_loop", "x"))
    core.bus.publish(ev.Finished(State.FAILED, "budget", 1))
    assert [a["event"] for a in sent] == ["gave_up"]


def test_a_failing_channel_is_one_warning(tmp_path: Path, sent: list[dict[str, Any]]) -> None:
    """A command that keeps failing: alert_failed once, not once per alert; the run goes on."""
    core, _, log = _alerts(tmp_path, 'command = ["fail"]\nmin_interval_s = 0')
    for kind in ("crash_loop", "disk_low", "crash_loop"):
        core.bus.publish(ev.Alarm(kind, "x"))
    assert len(sent) == 3 and log.names().count("alert_failed") == 1


def test_an_alert_names_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Config path, host, the Slurm job id when there is one, the step and the last checkpoint, in the JSON and
    in the webhook's one line."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    core, fake, _ = make_core(tmp_path)
    core.status.step, core.status.latest_checkpoint = 120, {"path": "/c/step_100", "step": 100, "mtime": 1.0}
    alert = render(core.cfg, core.status, "hang_detected", "no progress", at=fake.now())
    assert alert["run"]["slurm_job_id"] == "4242" and alert["run"]["config"] == str(core.cfg.path)
    assert alert["step"] == 120 and alert["last_checkpoint"] == {"path": "/c/step_100", "step": 100}
    line = text_of(alert)
    assert "\n" not in line and "Slurm job 4242" in line and "step 120" in line and "/c/step_100" in line


@pytest.mark.parametrize(("code", "save_failed"), [(0, False), (-9, True), (1, True)])
def test_a_stop_whose_emergency_save_failed_alerts(tmp_path: Path, code: int, save_failed: bool) -> None:
    """SIGTERM, then the job exits: 0 is a clean stop (no alert); killed after stop_timeout_s, or failing, is
    `stopped` with a failed emergency save."""
    import signal

    core, fake, _ = make_core(tmp_path)
    finished: list[ev.Finished] = []
    core.bus.append(lambda e: finished.append(e) if isinstance(e, ev.Finished) else None)
    core.begin(None)
    core.on_signal(signal.SIGTERM)
    exit_job(core, fake, code)
    assert core.status.state is State.STOPPED and [f.save_failed for f in finished] == [save_failed]
    assert (alert_of(finished[0]) is not None) == save_failed
