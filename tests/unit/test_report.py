"""The summary of scripted histories (tables), the HTML page (marks, escaping, nothing fetched), `report` exits."""
from __future__ import annotations

import json
import os
import stat
import threading
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.cli.app import main
from supervisor.daemon.recorder import HistoryRecorder
from supervisor.history.fold import Fold, summarize
from supervisor.history.html import render_html
from supervisor.history.records import HISTORY_FILE, KINDS
from supervisor.history.svg import time_ticks
from supervisor.policy.state import Status
from tests.fakes import RecordingLog
from tests.supervise import REPO, write_config


def rec(t: float, kind: str, **fields: Any) -> dict[str, Any]:
    return {"v": 1, "t": t, "kind": kind, **fields}


def start(t: float, n: int, step: int | None = None) -> dict[str, Any]:
    return rec(t, "attempt_start", attempt=n, resumed_from=None if step is None else f"/c/step_{step}", resumed_step=step)


def beat(t: float, n: int, step: int, train_s: float = 0.0, save_s: float = 0.0, **kw: Any) -> dict[str, Any]:
    return rec(t, "beat", attempt=n, step=step, phase=kw.pop("phase", "train"), loss=kw.pop("loss", 1.0),
               train_s=train_s, save_s=save_s, **kw)


def end(t: float, n: int, reason: str, max_step: int | None, train_s: float = 0.0, save_s: float = 0.0,
        at: float | None = None) -> dict[str, Any]:
    return rec(t, "attempt_exit", attempt=n, at=t if at is None else at, reason=reason, code=1, signal=None,
               detail=None, max_step=max_step, train_s=train_s, save_s=save_s)


CRASH_AND_RESUME = [
    rec(0, "supervisor_start"), start(0, 1), beat(10, 1, 1), rec(10, "first_step", attempt=1, step=1),
    beat(100, 1, 91, train_s=90), rec(95, "checkpoint_committed", attempt=1, step=50, path="/c/step_50"),
    end(102, 1, "signal", 91, train_s=90, save_s=2, at=101), start(103, 2, 50), beat(130, 2, 50, phase="load"),
    rec(140, "first_step", attempt=2, step=51), beat(140, 2, 51), beat(200, 2, 110, train_s=60),
    end(201, 2, "stopped", 110, train_s=60, save_s=3), rec(202, "supervisor_end", state="stopped", reason="signal"),
]
CRASH_LOOP_THEN_RECOVERY = [
    rec(0, "supervisor_start"), start(0, 1), beat(50, 1, 50, train_s=50), end(100, 1, "crash", 50, train_s=50),
    start(101, 2, 40), beat(110, 2, 40, phase="load"), end(150, 2, "oom", 40),
    start(160, 3, 40), rec(200, "first_step", attempt=3, step=41), beat(200, 3, 41), beat(260, 3, 100, train_s=60),
    end(260, 3, "completed", 100, train_s=60), rec(261, "supervisor_end", state="completed", reason="completed"),
]
STOP_THEN_NEXT_SESSION = [
    rec(0, "supervisor_start"), start(0, 1), beat(100, 1, 100, train_s=90), end(110, 1, "stopped", 100, train_s=90),
    rec(111, "supervisor_end", state="stopped", reason="signal"),
    rec(5000, "supervisor_start"), start(5000, 2, 100), rec(5020, "first_step", attempt=2, step=101),
    beat(5100, 2, 180, train_s=80), end(5100, 2, "completed", 180, train_s=80),
    rec(5101, "supervisor_end", state="completed", reason="completed"),
]
KILLED_SUPERVISOR = [  # no supervisor_end: the session ends at its last record; the orphan had no exit
    rec(0, "supervisor_start"), start(0, 1), beat(400, 1, 40, train_s=400),
    rec(600, "supervisor_start"), start(610, 2, 30), beat(700, 2, 60, train_s=80),
]
KILLED_IN_BACKOFF = [  # a failure, the supervisor killed before the relaunch, the next run a day later
    rec(0, "supervisor_start"), start(0, 1), beat(50, 1, 50, train_s=50), end(100, 1, "crash", 50, train_s=50),
    rec(86400, "supervisor_start"), start(86400, 2, 40), rec(86450, "first_step", attempt=2, step=41),
    beat(86500, 2, 90, train_s=50), end(86500, 2, "completed", 90, train_s=50),
    rec(86501, "supervisor_end", state="completed", reason="completed"),
]
CLOCK_STEPPED_BACK = [  # NTP steps the clock back an hour 1000 s in; the records go on from there
    rec(10_000, "supervisor_start"), start(10_000, 1), beat(11_000, 1, 1000, train_s=1000),
    beat(7_400, 1, 1001, train_s=1000), beat(8_400, 1, 2000, train_s=2000),
    end(8_400, 1, "completed", 2000, train_s=2000),
    rec(8_401, "supervisor_end", state="completed", reason="completed"),
]
NO_HEARTBEAT = [
    rec(0, "supervisor_start"), start(0, 1), end(100, 1, "crash", None), start(101, 2, None),
    end(200, 2, "completed", None), rec(200, "supervisor_end", state="completed", reason="completed"),
]


@pytest.mark.parametrize(("records", "expected"), [
    pytest.param(CRASH_AND_RESUME, {
        "attempts": 2, "failures": 1, "wall_s": 202, "restart_latency_s": [39], "steps_lost": [41],
        "productive_s": 150 - 41 * 90 / 91, "checkpoint_overhead_s": 5, "exit_reasons": {"signal": 1, "stopped": 1},
        "checkpoints_committed": 1, "sessions": 1, "last_step": 110,
        # launch to first step: 10 + 37; the failure seen at 101 to the relaunch at 103; 41 steps redone at 90/91 s each
        "startup_s": 47, "restart_s": 2, "lost_s": 41 * 90 / 91, "other_s": 0}, id="crash-and-resume"),
    pytest.param(CRASH_LOOP_THEN_RECOVERY, {
        "attempts": 3, "failures": 2, "wall_s": 261, "restart_latency_s": [100], "steps_lost": [10, 0],
        "productive_s": 110 - 10 * 1.0, "exit_reasons": {"completed": 1, "crash": 1, "oom": 1}}, id="crash-loop"),
    pytest.param(STOP_THEN_NEXT_SESSION, {
        "attempts": 2, "failures": 0, "wall_s": 111 + 101, "restart_latency_s": [], "steps_lost": [],
        "productive_s": 170, "sessions": 2}, id="stop-then-next-session"),
    pytest.param(KILLED_SUPERVISOR, {
        "attempts": 2, "failures": 0, "wall_s": 400 + 100, "steps_lost": [], "productive_s": 480 - 10 * 10,
        "sessions": 2}, id="killed-supervisor"),
    pytest.param(NO_HEARTBEAT, {
        "attempts": 2, "failures": 1, "restart_latency_s": [], "steps_lost": [], "goodput": None,
        # no step ever reported: the times only beats measure are unknown (null, as the HTML's `unknown`), not 0
        "productive_s": None, "startup_s": None, "restart_s": None, "other_s": None, "lost_s": None,
        "checkpoint_overhead_s": None}, id="no-heartbeat"),
    pytest.param(KILLED_IN_BACKOFF, {
        "attempts": 2, "failures": 1, "wall_s": 100 + 101, "restart_latency_s": [], "steps_lost": [10]},
        id="killed-in-backoff"),
    pytest.param(CLOCK_STEPPED_BACK, {"wall_s": 2001, "productive_s": 2000}, id="clock-stepped-back"),
    pytest.param(CRASH_AND_RESUME + [{**r, "t": r["t"] + 1000, **({"at": r["at"] + 1000} if "at" in r else {})}
                                     for r in CRASH_AND_RESUME], {
        "attempts": 4, "failures": 2, "wall_s": 404, "restart_latency_s": [39, 39], "steps_lost": [41, 41],
        "sessions": 2}, id="two-histories-concatenated"),
])
def test_summary_of_scripted_histories(records: list[dict[str, Any]], expected: dict[str, Any]) -> None:
    """Each number is the documented function of the records (supervisor/history/fold.py, docs/history.md)."""
    got = summarize(records).to_json()
    for key, value in expected.items():
        assert got[key] == (pytest.approx(value, abs=1e-3) if isinstance(value, (int, float)) else value), key
    if got["last_step"] is not None:
        assert got["goodput"] == pytest.approx(got["productive_s"] / got["wall_s"], abs=1e-4)
    parts = ("productive_s", "startup_s", "restart_s", "lost_s", "checkpoint_overhead_s", "other_s")
    if got["last_step"] is None:
        assert all(got[k] is None for k in parts) and all(v is None for v in got["time_lost_s"].values()), got
        return
    assert sum(got[k] for k in parts) >= got["wall_s"] - 1e-3 and all(got[k] >= 0 for k in parts)


HANG_AND_RESUME = [  # attempt 1 trains 100 steps in 100 s, reaches step 63 by its ranks' own beats, hangs
    rec(0, "supervisor_start"), start(0, 1), rec(1, "first_beat", attempt=1, step=0, phase="load"),
    beat(37, 1, 0, phase="train"), beat(100, 1, 60, train_s=60),
    rec(110, "hang", attempt=1, at=110, step=63, idle_s=10, ranks=[{"rank": 1, "why": "stopped"}], stacks="/s.txt"),
    {**end(114, 1, "hang", 63, train_s=63), "progress_at": 100.0, "detected_at": 110.0, "hung_ranks": [1],
     "reached_by": "ranks"},
    start(114.5, 2, 53), rec(118.4, "first_beat", attempt=2, step=0, phase="load"),
    rec(120.1, "first_step", attempt=2, step=54, from_step=53), beat(120.1, 2, 54),
    beat(150, 2, 80, train_s=30), end(150, 2, "stopped", 80, train_s=30),
    rec(151, "supervisor_end", state="stopped", reason="signal"),
]


def test_a_failure_s_cost_split_by_phase() -> None:
    """Steps reached (the exit's max_step) minus resumed, and the time from the last progress to training again."""
    got = summarize(HANG_AND_RESUME).to_json()
    assert got["steps_lost"] == [10]
    [loss] = got["losses"]
    assert loss["reached"] == 63 and loss["resumed"] == 53 and loss["hung_ranks"] == [1]
    assert loss["time_lost_s"] == pytest.approx({"detection": 10, "stop": 4, "relaunch": 0.5, "worker_start": 3.9,
                                                 "load": 1.7, "redo": 10.0})
    assert got["time_lost_s"] == pytest.approx(loss["time_lost_s"])


def test_the_page_shows_what_each_failure_cost() -> None:
    """The failures table: hung rank, steps reached / resumed / lost, each phase's seconds, where the stacks are."""
    fold = Fold(keep=True).add_all(HANG_AND_RESUME)
    page = render_html(fold, fold.summary(), source="job.toml", generated=200.0)
    table = page.split("What failures cost", 1)[1].split("</table>", 1)[0]
    assert "<td>1</td><td>hang</td><td>1</td><td>63 / 53 / 10</td>" in table and "/s.txt" in table
    assert "<td>10.0</td><td>4.0</td><td>0.5</td><td>3.9</td><td>1.7</td><td>10.0</td>" in table
    assert "hang at step 63: rank 1: stopped; stacks: /s.txt" in page  # the timeline's mark


def test_steps_lost_by_a_throttled_heartbeat_are_said_to_be_a_lower_bound() -> None:
    """A job without per-rank files: the step reached is its node heartbeat's, which may lag the job (once a
    second): the loss says so (`reached_by`), and the page shows the steps lost as a lower bound."""
    records = [{**r, "reached_by": "heartbeat"} if r["kind"] == "attempt_exit" and r["attempt"] == 1 else r
               for r in HANG_AND_RESUME]
    fold = Fold(keep=True).add_all(records)
    [loss] = fold.summary().to_json()["losses"]
    assert loss["steps_lost"] == 10 and loss["reached_by"] == "heartbeat"
    assert summarize(HANG_AND_RESUME).to_json()["losses"][0]["reached_by"] == "ranks"
    table = render_html(fold, fold.summary(), source="job.toml", generated=200.0).split("What failures cost", 1)[1]
    assert "<td>63 / 53 / at least 10</td>" in table


def test_a_job_that_picks_its_own_checkpoint_loses_from_its_load_step() -> None:
    """No resume_step from the supervisor (resume_args = []): the relaunch's first_step says where it resumed."""
    records = [
        rec(0, "supervisor_start"), start(0, 1), beat(100, 1, 91, train_s=90), end(102, 1, "signal", 91, train_s=90),
        start(103, 2, None), beat(130, 2, 50, phase="load"),
        rec(140, "first_step", attempt=2, step=51, from_step=50), beat(140, 2, 51),
    ]
    assert summarize(records).steps_lost == [41]
    never_trained = [*records[:6], end(135, 2, "crash", None)]
    summary = summarize(never_trained)
    assert summary.steps_lost == [] and summary.losses[0].steps_lost is None


def test_live_session_runs_to_now() -> None:
    """Without a supervisor_end, `now` extends the running session's wall time (not a finished one's)."""
    live = CRASH_AND_RESUME[:-1]
    assert summarize(live, now=1202).wall_s == pytest.approx(1202)
    assert summarize(CRASH_AND_RESUME, now=1202).wall_s == pytest.approx(202)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.fixed_dictionaries(
    {"v": st.just(1), "t": st.one_of(st.floats(0, 1e6), st.floats()), "kind": st.sampled_from(KINDS)},
    optional={k: st.one_of(st.none(), st.integers(-5, 5), st.integers(-10**400, 10**400), st.floats(allow_nan=True),
                           st.text(max_size=3), st.sampled_from(["\ud800", "<s>"]), st.lists(st.integers(), max_size=2))
              for k in ("attempt", "step", "resumed_step", "max_step", "train_s", "save_s", "at", "reason", "loss",
                        "val_loss", "path", "detail")}),
    max_size=25))
def test_any_record_soup_folds_without_error(records: list[dict[str, Any]]) -> None:
    """Wrong types and impossible orders (hand edits, other versions) cost fields, never an exception."""
    fold = Fold(keep=True).add_all(records)
    s = fold.summary(now=2e6)
    assert s.goodput is None or 0 <= s.goodput <= 1
    render_html(fold, s, source="x", generated=0.0).encode("utf-8")


@pytest.mark.parametrize("bad", [
    {"t": 1e300}, {"t": 1e18}, {"t": -1e12}, {"step": 10**400}, {"max_step": 10**400}, {"resumed_step": 10**400},
    {"attempt": 10**400}, {"at": 1e300}, {"at": -1e300}, {"path": "/c/\udcff\ud800"}, {"detail": "\ud800"},
])
def test_absurd_values_cost_a_record_not_the_page(bad: dict[str, Any]) -> None:
    """Times beyond any clock, integers beyond any float, lone surrogates (a path's undecodable bytes): the page
    still renders, small, and encodes as UTF-8 (each used to raise, or draw 700,000 time ticks)."""
    records = [*CRASH_AND_RESUME[:6], {**CRASH_AND_RESUME[6], **bad}, {**CRASH_AND_RESUME[7], **bad},
               {**CRASH_AND_RESUME[8], **bad}, {**rec(150, "quarantined", path="/c/x", reason="r"), **bad},
               *CRASH_AND_RESUME[9:]]
    fold = Fold(keep=True).add_all(records)
    s = fold.summary()
    assert s.goodput is not None and 0 <= s.goodput <= 1 and 0 <= s.wall_s < 1e6
    assert all(0 <= x < 1e6 for x in s.restart_latency_s)
    page = render_html(fold, s, source="x", generated=0.0)
    assert len(page.encode("utf-8")) < 100_000


def test_time_axis_of_any_span_has_a_few_ticks() -> None:
    """Ticks stay a handful however long the span (past 30 days the interval grows in whole 30-day units)."""
    for span in (10, 86400 * 40, 86400 * 3650, 1e11):
        ticks = time_ticks(0, span)
        assert 2 <= len(ticks) <= 7 and ticks == sorted(ticks)


class Marks(HTMLParser):
    """Tags and the classes of SVG elements in a page."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: Counter[str] = Counter()
        self.classes: Counter[str] = Counter()
        self.attrs: set[str] = set()
        self.csp = False
        self._svg = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags[tag] += 1
        a = dict(attrs)
        self.attrs |= set(a)
        self.csp = self.csp or a.get("http-equiv") == "Content-Security-Policy"
        self._svg += tag == "svg"
        if self._svg:
            self.classes.update((a.get("class") or "").split())

    def handle_endtag(self, tag: str) -> None:
        self._svg -= tag == "svg"


def marks(page: str) -> Marks:
    m = Marks()
    m.feed(page)
    return m


class TestPage:
    def test_marks_escaping_and_nothing_fetched(self) -> None:
        """Attempts, commits, restarts, loss, val_loss and quarantines are drawn; hostile text stays text; the page
        has no script, no link and no source to fetch, and a CSP that forbids them anyway."""
        hostile = '<script>alert(1)</script>"><img src=x onerror=alert(1)>'
        records = [*CRASH_AND_RESUME[:6], rec(96, "quarantined", path=f"/c/{hostile}", reason=hostile),
                   {**CRASH_AND_RESUME[6], "detail": hostile}, *CRASH_AND_RESUME[7:]]
        records.insert(12, beat(150, 2, 70, val_loss=0.9))
        fold = Fold(keep=True).add_all(records)
        page = render_html(fold, fold.summary(), source=f"/run/{hostile}", generated=300.0)
        m = marks(page)
        assert "<script" not in page and "<img" not in page and "&lt;script&gt;" in page
        assert not {"script", "img", "link", "iframe", "object", "embed"} & set(m.tags)
        assert not {"src", "href", "onerror"} & m.attrs and m.csp
        assert m.classes["attempt"] == 2 and m.classes["commit"] == 1 and m.classes["quarantine"] == 1
        assert m.classes["restart"] >= 2 and m.classes["loss"] >= 2 and m.classes["val-loss"] >= 2
        assert m.classes["reason-signal"] == 1 and m.classes["reason-stopped"] == 1 and m.classes["rate"] >= 1

    def test_a_divergence_and_its_rollback_are_marked(self) -> None:
        """`diverged` and `rolled_back` are drawn on the timeline (the divergence on the loss chart too), with their
        step and why / where to."""
        records = [*CRASH_AND_RESUME[:6], rec(96, "diverged", step=70, onset_step=68, why="nan"),
                   rec(97, "rolled_back", from_step=70, to_checkpoint="/c/step_00000060", skip=18),
                   *CRASH_AND_RESUME[6:]]
        fold = Fold(keep=True).add_all(records)
        page = render_html(fold, fold.summary(), source="/run", generated=300.0)
        assert "diverged at step 70: nan" in page and "rolled back at step 70: /c/step_00000060" in page
        assert marks(page).classes["diverged"] == 1  # and on the loss chart, at its step


class TestCommand:
    def run(self, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
        rc = main(["report", *args])
        out, err = capsys.readouterr()
        return rc, out, err

    def history(self, tmp_path: Path, lines: list[dict[str, Any]] | bytes) -> Path:
        cfg = write_config(tmp_path, ["true"])
        run_dir = tmp_path / ".fsdp-supervisor"
        run_dir.mkdir(exist_ok=True)
        data = lines if isinstance(lines, bytes) else b"".join(json.dumps(r).encode() + b"\n" for r in lines)
        (run_dir / HISTORY_FILE).write_bytes(data)
        return cfg

    def test_json_and_html(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """--json prints the summary; the default writes run_dir/report.html and prints its path; -o anywhere."""
        cfg = self.history(tmp_path, CRASH_AND_RESUME)
        rc, out, _ = self.run(capsys, "-c", str(cfg), "--json")
        assert rc == 0 and json.loads(out)["steps_lost"] == [41]
        assert not (tmp_path / ".fsdp-supervisor" / "report.html").exists()
        rc, out, _ = self.run(capsys, "-c", str(cfg))
        assert rc == 0 and out.strip() == str(tmp_path / ".fsdp-supervisor" / "report.html")
        assert marks(Path(out.strip()).read_text()).classes["attempt"] == 2
        rc, out, _ = self.run(capsys, "-c", str(cfg), "--json", "-o", str(tmp_path / "r.html"))
        assert rc == 0 and json.loads(out)["attempts"] == 2 and (tmp_path / "r.html").exists()

    def test_commits_beside_the_checkpoints_on_disk(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """Five commits, two left by retention: the report says both, not "checkpoints 5" (issue 22, item 6)."""
        from tests.jobs.dcp_files import write_checkpoint

        commits = [rec(10.0 * i, "checkpoint_committed", attempt=1, step=i, path=f"/c/step_{i}") for i in range(1, 6)]
        cfg = self.history(tmp_path, [*CRASH_AND_RESUME[:-1], *commits, CRASH_AND_RESUME[-1]])
        for step in (4, 5):
            write_checkpoint(tmp_path / "ckpts", step)
        rc, out, _ = self.run(capsys, "-c", str(cfg), "--json")
        doc = json.loads(out)
        assert rc == 0 and (doc["checkpoints_committed"], doc["checkpoints_on_disk"]) == (6, 2)
        rc, out, _ = self.run(capsys, "-c", str(cfg))
        assert "<th>checkpoints</th><td>6 committed, 2 on disk</td>" in Path(out.strip()).read_text()

    def test_the_page_explains_goodput(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """Start-up, restarts, redone work and the rest beside goodput; a stepless job's goodput is unknown."""
        page = render_html(Fold(keep=True).add_all(CRASH_AND_RESUME), summarize(CRASH_AND_RESUME), source="x",
                           generated=0.0)
        for cell in ("<th>start-up</th><td>47s</td>", "<th>restarts</th><td>2s</td>", "<th>lost (redone)</th><td>40s</td>",
                     "<th>other</th><td>0s</td>"):
            assert cell in page
        page = render_html(Fold(keep=True).add_all(NO_HEARTBEAT), summarize(NO_HEARTBEAT), source="x", generated=0.0)
        assert "<th>goodput</th><td>unknown (no steps reported)</td>" in page

    @pytest.mark.parametrize("content", [None, "dir", b"garbage\n{\"v\": 1}\n"])
    def test_no_history_is_exit_1_in_one_line(self, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              content: bytes | str | None) -> None:
        """No history yet, an unreadable one, or nothing readable in it: one line on stderr, exit 1."""
        cfg = self.history(tmp_path, content if isinstance(content, bytes) else [])
        path = tmp_path / ".fsdp-supervisor" / HISTORY_FILE
        if content is None:
            path.unlink()
        elif content == "dir":
            path.unlink()
            path.mkdir()
        rc, out, err = self.run(capsys, "-c", str(cfg), "--json")
        assert rc == 1 and out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err

    def test_unwritable_output_is_exit_2(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """An output path in a missing directory is a usage error: exit 2, one line."""
        cfg = self.history(tmp_path, CRASH_AND_RESUME)
        rc, _, err = self.run(capsys, "-c", str(cfg), "-o", str(tmp_path / "missing" / "r.html"))
        assert rc == 2 and len(err.strip().splitlines()) == 1 and "cannot write" in err

    def test_output_never_replaces_a_file_of_the_run_dir(self, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
        """`-o` onto history.jsonl (or state.json) is refused, exit 2: it used to replace the history with its page."""
        cfg = self.history(tmp_path, CRASH_AND_RESUME)
        history = tmp_path / ".fsdp-supervisor" / HISTORY_FILE
        before = history.read_bytes()
        for target in (history, tmp_path / ".fsdp-supervisor" / "logs" / ".." / "state.json"):
            rc, out, err = self.run(capsys, "-c", str(cfg), "-o", str(target))
            assert rc == 2 and out == "" and "refusing" in err and len(err.strip().splitlines()) == 1
        assert history.read_bytes() == before and not (tmp_path / ".fsdp-supervisor" / "state.json").exists()

    def test_output_through_links_into_fifos_and_to_stdout(self, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
        """`-o -` prints the page; a symlink is written through (it stays a link); a FIFO (like /dev/stdout) is
        written into, not replaced by a regular file."""
        cfg = self.history(tmp_path, CRASH_AND_RESUME)
        rc, out, _ = self.run(capsys, "-c", str(cfg), "-o", "-")
        assert rc == 0 and out.startswith("<!DOCTYPE html>") and not (REPO / "-").exists()
        (tmp_path / "link").symlink_to("page.html")
        rc, _, _ = self.run(capsys, "-c", str(cfg), "-o", str(tmp_path / "link"))
        assert rc == 0 and (tmp_path / "link").is_symlink() and (tmp_path / "page.html").read_text().startswith("<!")
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # the page (~7 KB) fits the pipe: no thread needed
        try:
            rc, _, _ = self.run(capsys, "-c", str(cfg), "-o", str(fifo))
            assert rc == 0 and stat.S_ISFIFO(fifo.lstat().st_mode) and os.read(reader, 100).startswith(b"<!DOCTYPE")
        finally:
            os.close(reader)

    def test_a_fifo_in_place_of_the_history_is_refused_at_once(self, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
        """A FIFO named history.jsonl is "not a regular file" (exit 1), where opening it used to hang forever."""
        cfg = self.history(tmp_path, [])
        path = tmp_path / ".fsdp-supervisor" / HISTORY_FILE
        path.unlink()
        os.mkfifo(path)
        done: list[tuple[int, str, str]] = []
        worker = threading.Thread(target=lambda: done.append(self.run(capsys, "-c", str(cfg))), daemon=True)
        worker.start()
        worker.join(20)
        if not done:  # release the hung open() so that the thread ends
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            worker.join(5)
        assert done and done[0][0] == 1 and "not a regular file" in done[0][2]


def test_recent_losses_are_one_per_step() -> None:
    """A step's train, eval and save beats carry the same loss, and a resume's load and first beat repeat the
    checkpoint's: `loss_recent` holds each step once (it held step 20 four times). A resume behind shows the jump."""
    records = [rec(0, "supervisor_start"), start(0, 1), beat(1, 1, 10, loss=3.0), beat(2, 1, 10, phase="eval", loss=3.0),
               beat(3, 1, 10, phase="save", loss=3.0), beat(4, 1, 20, loss=2.5), beat(5, 1, 20, phase="eval", loss=2.5),
               end(6, 1, "stopped", 20), start(7, 2, 20), beat(8, 2, 20, phase="load", loss=2.5), beat(9, 2, 20, loss=2.5),
               beat(10, 2, 30, loss=2.0), end(11, 2, "crash", 30), start(12, 3, 20),
               beat(13, 3, 20, phase="load", loss=2.5), beat(14, 3, 20, loss=2.5), beat(15, 3, 21, loss=2.4)]
    assert list(Fold().add_all(records).recent_loss) == [3.0, 2.5, 2.0, 2.5, 2.4]


def test_no_none_on_the_page() -> None:
    """A resume from a checkpoint without a step, a commit without one, a deletion without a reason: no `None`."""
    records = [rec(0, "supervisor_start"), start(0, 1), end(5, 1, "crash", None),
               rec(6, "attempt_start", attempt=2, resumed_from="/c/epoch_3", resumed_step=None),
               rec(7, "checkpoint_committed", attempt=2, path="/c/epoch_4"), rec(8, "retention_deleted", path="/c/epoch_1"),
               rec(9, "quarantined", path="/c/epoch_0"), end(10, 2, "completed", None)]
    page = render_html(Fold(keep=True).add_all(records), summarize(records), source="x", generated=0.0)
    assert "None" not in page and "<td title=\"/c/epoch_3\">epoch_3</td>" in page


def test_the_step_rate_is_one_labelled_line_per_attempt() -> None:
    """A stop and a resume: the rate chart has a line for each attempt that trained, each named by its number."""
    import re

    records = [rec(0, "supervisor_start"), start(0, 1), *[beat(t, 1, t * 10) for t in range(1, 20)],
               end(20, 1, "stopped", 190), rec(21, "supervisor_end", state="stopped", reason="signal"),
               rec(30, "supervisor_start"), start(30, 2, 190), *[beat(t, 2, 190 + (t - 40) * 5) for t in range(40, 60)],
               end(60, 2, "completed", 285), rec(61, "supervisor_end", state="completed", reason="completed")]
    page = render_html(Fold(keep=True).add_all(records), summarize(records), source="x", generated=0.0)
    chart = page[page.index('class="rate-chart"'):]
    chart = chart[:chart.index("</svg>")]
    assert re.findall(r"<title>(attempt \d+): steps per second</title>", chart) == ["attempt 1", "attempt 2"]
    assert chart.count('class="rate"') == 2 and ">#1</text>" in chart and ">#2</text>" in chart


def test_a_job_without_a_heartbeat_shows_unknown_not_zero() -> None:
    """Issue 35 item 10: no beats, two kills, commits: times only beats measure are `unknown`, the last step is the
    newest checkpoint's (it said "productive 0s, time lost 0.0 s, last step n/a")."""
    records = [rec(0, "supervisor_start"), start(0, 1), rec(60, "checkpoint_committed", attempt=1, step=20, path="/c/e20"),
               end(90, 1, "signal", None), start(91, 2, 20), rec(150, "checkpoint_committed", attempt=2, step=40,
                                                                  path="/c/e40"),
               end(184, 2, "completed", None), rec(185, "supervisor_end", state="completed", reason="completed")]
    fold = Fold(keep=True).add_all(records)
    table = render_html(fold, fold.summary(), source="x", generated=200.0).split('<table class="summary">', 1)[1]
    for label in ("productive", "start-up", "checkpoint overhead", "lost (redone)", "time lost"):
        assert f"<th>{label}</th><td>unknown</td>" in table, label
    assert "<th>last step</th><td>40 (the newest checkpoint&#x27;s)</td>" in table or \
        "<th>last step</th><td>40 (the newest checkpoint's)</td>" in table, table


def test_status_json_of_a_job_without_a_heartbeat_has_no_made_up_times(tmp_path: Path) -> None:
    """Issue 35 item 10: `status --json` said productive_s 0.0, startup_s (all of it) and time_lost_s zeros; only the
    wall time is known, the rest is left out (docs/operations.md: unknown values are left out, not 0)."""
    records = [rec(0, "supervisor_start"), start(0, 1), end(90, 1, "signal", None), start(91, 2, 20)]
    T0 = 1_700_000_000.0
    recorder = HistoryRecorder(tmp_path / HISTORY_FILE, now=lambda: T0 + 120, log=RecordingLog())
    recorder.fold.add_all([{**r, "t": r["t"] + T0, **({"at": r["at"] + T0} if "at" in r else {})} for r in records])
    st = Status()
    recorder.annotate(st)
    assert st.goodput is None and list(st.goodput_parts) == ["wall_s"] and st.time_lost_s == {}, st
