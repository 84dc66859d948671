"""Realistic histories without running anything: the real `HistoryRecorder` driven by a scripted clock.

    python -m tests.history_demo --out DIR --png docs/report.png    # the screenshot in docs/report.png
    python -m tests.history_demo --month --out DIR                  # a 30-day run: file size, compactions

The demo is a 4-hour run with the failures the supervisor exists for (a killed rank, a hang, a checkpoint that
crashes the job on load and is quarantined, a stop and a resume the next morning); the month is 30 days of
training with a failure every two days and a checkpoint every 10 minutes. Tests use both (tests/unit/test_history.py,
tests/integration/test_report_browser.py). `screenshot` renders a page in headless Chromium.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from supervisor.contract import Beat
from supervisor.daemon import events as ev
from supervisor.daemon.recorder import HistoryRecorder
from supervisor.history.fold import Fold
from supervisor.history.records import HISTORY_FILE, read_history
from supervisor.policy.restarts import Attempt
from supervisor.policy.state import ExitInfo, State

__all__ = ["SimRun", "demo", "month", "render_report", "screenshot", "chromium", "main"]


def launch_event(number: int, resumed_from: str | None, resumed_step: int | None) -> ev.AttemptStarted:
    """The event of attempt `number`'s launch (the recorder reads only these fields of its Job)."""
    job = SimpleNamespace(number=number, resumed_from=resumed_from, resumed_step=resumed_step)
    return ev.AttemptStarted(job, [], {})  # type: ignore[arg-type]


START = 1_700_000_000.0  # 2023-11-14 22:13 UTC


class _Log:
    """Counts what the recorder logs (a simulation has no log file)."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def _rec(self, event: str, **_: Any) -> None:
        self.events.append(event)

    info = warning = error = _rec


def loss_at(step: int) -> float:
    """A deterministic loss curve with noise: a resumed run continues it exactly, like the real trainer."""
    noise = math.sin(step * 12.9898) * 43758.5453 % 1.0 - 0.5
    return 2.1 + 6.0 * math.exp(-step / 2500) + 0.08 * noise


@dataclass
class SimRun:
    """One run dir's history, written by the real recorder while a scripted clock advances."""

    path: Path
    step_s: float = 0.5  # seconds per training step
    beat_s: float = 1.0  # seconds between heartbeats (the trainer's throttle)
    save_every: int = 1200
    save_s: float = 4.0  # blocking part of a save
    eval_every: int = 2400
    eval_s: float = 30.0
    keep: int = 3  # retention keep_last
    dense_from: float = math.inf  # from this time on, beat every second whatever beat_s says
    root: str = "/data/run/ckpts"
    clock: float = START
    log: _Log = field(default_factory=_Log)
    max_bytes: int = 0
    number: int = 0
    ckpts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rec = HistoryRecorder(self.path, now=lambda: self.clock, log=self.log)

    def _ckpt(self, step: int) -> str:
        return f"{self.root}/step_{step:08d}"

    def _beat(self, step: int, phase: str, val: float | None = None) -> None:
        self.rec.beat(self.number, Beat(step, self.clock, phase, loss_at(step), val))
        self._measure()

    def _measure(self) -> None:
        self.max_bytes = max(self.max_bytes, self.rec.size)
        if self.rec.compacting:  # a real compaction (~0.1 s) is done before the next beat; this clock outruns it
            self.rec.close()

    def _commit(self, step: int) -> None:
        self.ckpts.append(step)
        deleted = [SimpleNamespace(path=self._ckpt(s), reason="keep_last", size_bytes=4 << 30)
                   for s in self.ckpts[:-self.keep]]
        del self.ckpts[:-self.keep]
        info = SimpleNamespace(path=self._ckpt(step), step=step, size_bytes=4 << 30)
        self.rec.notify(ev.PassAbsorbed(SimpleNamespace(deleted=deleted), info))  # type: ignore[arg-type]

    def session(self) -> None:
        self.rec.notify(ev.SupervisorStarted())

    def end(self, state: State, reason: str) -> None:
        self.rec.notify(ev.Finished(state, reason, self.number))

    def wait(self, seconds: float) -> None:
        self.clock += seconds

    def quarantine(self) -> None:
        step = self.ckpts.pop()
        self.rec.notify(ev.Quarantined(self._ckpt(step), "2 consecutive attempts failed right after loading it"))

    def attempt(self, run_s: float, reason: str, *, code: int | None = 1, sig: str | None = None,
                detail: str | None = None, startup_s: float = 40.0) -> None:
        """Launch from the newest checkpoint, train for `run_s` seconds (or until loading fails), end so."""
        self.number += 1
        resumed = self.ckpts[-1] if self.ckpts else None
        step = resumed or 0
        started = self.clock
        self.rec.notify(launch_event(self.number, self._ckpt(resumed) if resumed is not None else None, resumed))
        self.clock += 3.0
        self._beat(step, "load")
        self.clock += startup_s
        self._beat(step, "load")
        end, fstep, committed = started + run_s, float(step), False
        while self.clock < end:
            self.clock += 1.0 if self.clock >= self.dense_from else self.beat_s
            fstep += (1.0 if self.clock >= self.dense_from else self.beat_s) / self.step_s
            new = int(fstep)
            saves, evals = new // self.save_every > step // self.save_every, new // self.eval_every > step // self.eval_every
            step = new
            self._beat(step, "train")
            if evals:
                self._beat(step, "eval")
                self.clock += self.eval_s
                self._beat(step, "train", val=loss_at(step) + 0.12)
            if saves:
                self._beat(step, "save")
                self.clock += self.save_s
                self._beat(step, "train")
                self._commit(step)
                committed = True
        if reason == "stopped":  # the emergency checkpoint of a graceful stop
            self._beat(step, "save")
            self.clock += self.save_s
            self._commit(step)
            committed = True
        at = self.clock + 0.2
        info = ExitInfo(code=code, signal=sig, reason=reason, at=at, detail=detail)
        self.clock += 0.6  # the housekeeping pass that judges the exit
        self.rec.attempt_exit(Attempt(self.number, started, at, reason == "completed", reason,
                                      self._ckpt(resumed) if resumed is not None else None, resumed, step,
                                      committed, step > (resumed or 0)), info)
        self._measure()


def demo(out: Path) -> Path:
    """A 4-hour run with the usual faults, in out/history.jsonl; returns its path."""
    sim = SimRun(out / HISTORY_FILE, step_s=0.5, save_every=1200, eval_every=2400)
    sim.session()
    sim.attempt(3300, "signal", code=1, detail="rank 5: exitcode -9 (SIGKILL)")
    sim.wait(1.5)
    sim.attempt(2900, "hang", code=None, sig="SIGTERM", detail="no heartbeat for 600 s in phase train")
    sim.wait(1.0)
    for _ in range(2):  # a checkpoint that looks complete but crashes the job on load
        sim.attempt(30, "crash", code=1, detail="rank 0: RuntimeError: storage has wrong byte size", startup_s=35)
        sim.wait(2.0)
    sim.quarantine()
    sim.attempt(2400, "stopped", code=0, detail=None)
    sim.end(State.STOPPED, "stopped by signal")
    sim.wait(1200)  # the next morning, in the story: a shorter gap keeps the picture readable
    sim.session()
    sim.attempt(3000, "completed", code=0)
    sim.end(State.COMPLETED, "completed")
    sim.rec.close()
    return sim.path


def month(out: Path, *, beat_s: float = 30.0, dense_s: float = 6 * 3600, days: float = 30.0) -> SimRun:
    """30 days of training (2 steps/s, a checkpoint every 10 minutes, retention keep_last 3, an eval every 30
    minutes), a killed rank every two days; heartbeats every `beat_s` seconds, and every second for the last
    `dense_s` seconds (the part thinning keeps at full resolution: 1 gives a true beat-per-second month)."""
    sim = SimRun(out / HISTORY_FILE, step_s=0.5, beat_s=beat_s, save_every=1200, eval_every=3600,
                 dense_from=START + days * 86400 - dense_s)
    sim.session()
    total = days * 86400
    while sim.clock - START < total - 60:
        run = min(2 * 86400, total - (sim.clock - START))
        last = run < 2 * 86400
        sim.attempt(run, "stopped" if last else "signal", code=0 if last else 1,
                    detail=None if last else "rank 3: exitcode -9 (SIGKILL)")
        sim.wait(2.0)
    sim.end(State.STOPPED, "stopped by signal")
    sim.rec.close()
    return sim


def chromium() -> str | None:
    """The headless browser to render with, if one is installed."""
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def screenshot(page: Path, png: Path, *, size: tuple[int, int] = (1200, 900), timeout: float = 90) -> None:
    """Render `page` in headless Chromium into `png`; its whole process group is killed if it hangs."""
    exe = chromium()
    if exe is None:
        raise FileNotFoundError("chromium is not installed (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="report-chromium-") as profile:
        argv = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--hide-scrollbars", f"--user-data-dir={profile}", f"--screenshot={png.resolve()}",
                f"--window-size={size[0]},{size[1]}", page.resolve().as_uri()]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its renderer and GPU helpers too
            proc.wait()
    if proc.returncode != 0 or not png.exists():
        raise RuntimeError(f"chromium exited {proc.returncode}: {err.decode(errors='replace')[-500:]}")


def render_report(history: Path) -> Path:
    """report.html beside a history file, as `report` would write it."""
    from supervisor.history.html import render_html

    records, _ = read_history(history)
    fold = Fold(keep=True).add_all(records)
    page = history.with_name("report.html")
    page.write_text(render_html(fold, fold.summary(), source=str(history), generated=fold.last_t or START))
    return page


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.history_demo", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None,
                   help="directory for history.jsonl and report.html (default: a new temp dir)")
    p.add_argument("--png", type=Path, default=None, help="also screenshot the page here (needs chromium)")
    p.add_argument("--month", action="store_true", help="simulate 30 days and print the history's size")
    p.add_argument("--beat-s", type=float, default=1.0, help="--month: seconds between heartbeats (default 1)")
    a = p.parse_args(argv)
    out = a.out or Path(tempfile.mkdtemp(prefix="history-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / HISTORY_FILE).unlink(missing_ok=True)
    if a.month:
        began = time.perf_counter()
        sim = month(out, beat_s=a.beat_s, dense_s=0)
        records, _ = read_history(sim.path)
        print(f"30 days, a beat every {a.beat_s:g} s: {sim.path.stat().st_size} bytes at the end, at most "
              f"{sim.max_bytes} bytes, {sim.rec.compactions} compactions, {len(records)} records "
              f"({sum(r['kind'] == 'beat' for r in records)} samples); simulated in {time.perf_counter() - began:.1f} s")
        history = sim.path
    else:
        history = demo(out)
    page = render_report(history)
    print(page)
    if a.png is not None:
        a.png.parent.mkdir(parents=True, exist_ok=True)
        screenshot(page, a.png)
        print(a.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
