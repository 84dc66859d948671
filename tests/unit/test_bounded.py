"""Flat over a month: what the daemon keeps per attempt is bounded, and replaying a long history is linear."""
from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest

import supervisor.daemon.alerts as alerts_mod
from supervisor.daemon.alerts import Alerts
from supervisor.daemon.core import Core
from supervisor.daemon.recorder import HistoryRecorder
from supervisor.history.fold import Fold, fold_lines, summarize
from supervisor.history.html import render_html
from supervisor.history.records import COMPACT_BYTES, HISTORY_FILE, parse_lines, read_history
from tests.fakes import FakeSystem, RecordingLog
from tests.unit.test_core import beat, exit_job, make_core


def deep_size(root: object) -> int:
    """Bytes of everything reachable from `root` (sys.getsizeof summed over a walk), less the fakes' own records."""
    seen: set[int] = set()
    todo, total = [root], 0
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, (type, types.ModuleType, types.FunctionType, FakeSystem, RecordingLog)):
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        if isinstance(o, dict):
            todo += [*o.keys(), *o.values()]
        elif isinstance(o, (list, tuple, set, frozenset)) or type(o).__name__ == "deque":
            todo += list(o)  # type: ignore[call-overload]
        elif isinstance(o, types.MethodType):
            todo.append(o.__self__)
        else:
            todo += [getattr(o, name) for name in getattr(type(o), "__slots__", ()) if hasattr(o, name)]
            todo += [vars(o)] if hasattr(o, "__dict__") else []
    return total


def _crash_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                compact_bytes: int = COMPACT_BYTES) -> tuple[Core, Callable[[int], None]]:
    """A Core with its history and alerts, and a way to run n attempts: each beats, some progress, all crash."""
    monkeypatch.setattr(alerts_mod, "deliver", lambda cfg, alert: {"command": None})
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # 6,000 of them on a shared disk: minutes, and nothing to learn
    core, fake, log = make_core(tmp_path, restart="max_restarts = 100000\nmax_no_progress_restarts = 5",
                                job='[notify]\ncommand = ["true"]\nmin_interval_s = 0')
    history = HistoryRecorder(core.run_dir / HISTORY_FILE, now=fake.now, log=log, compact_bytes=compact_bytes)
    core = Core(core.cfg, fake, log, history=history)
    core.bus.append(Alerts(core.cfg, core.status, system=fake, publish=core.bus.publish).notify)
    core.begin(None)
    step = [0]

    def attempts(n: int) -> None:
        for i in range(n):
            step[0] += 7 if i % 4 else 0  # every fourth attempt gets nowhere
            beat(core, step[0])
            exit_job(core, fake, 1)
            deadline = fake.timers.next_deadline()
            assert deadline is not None and not core.done
            fake.advance(deadline - fake.clock, core)
        log.events.clear()  # the fake's own record
        del fake.spawned[:-1]
    return core, attempts


def test_a_thousand_attempts_cost_no_more_than_a_hundred(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """1,000 attempts through the fake system: the core's structures (restart window, per-attempt records, history
    fold, evidence, hang and divergence state, alerts) hold no more after 1,000 than after 150, give or take a little."""
    core, attempts = _crash_loop(tmp_path, monkeypatch)
    attempts(150)
    fold = core.history.fold  # type: ignore[union-attr]
    at_100, counts_100 = deep_size(core), (len(core.attempts), len(fold.attempts), len(fold.losses))
    attempts(850)
    assert core.status.attempt == 1001 and fold.count == 1001
    assert core.status.steps_lost_total == fold.ledger.steps_lost_total > sum(core.status.steps_lost)  # the counter
    assert (len(core.attempts), len(fold.attempts), len(fold.losses)) == counts_100
    assert len(fold.restart_latency_s) <= 100 and len(fold.steps_lost) <= 100 and len(fold._by_number) <= 100
    assert deep_size(core) <= at_100 + 16 * 1024


def test_a_crash_loop_s_history_stays_within_its_cap_and_adds_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fast crash loop writes events only (nothing to thin): compaction folds its oldest attempts into one
    `folded` record, so the file stays within the cap however many attempts, and `report`'s totals stay the
    daemon's own (a crash mid-compaction: tests/unit/test_history.py)."""
    cap = 32 * 1024
    core, attempts = _crash_loop(tmp_path, monkeypatch, compact_bytes=cap)
    history = core.history
    assert history is not None
    sizes = []
    for _ in range(8):
        attempts(100)
        history.close()  # a compaction in flight finishes
        sizes.append(history.size)
    assert history.compactions >= 8 and max(sizes) <= cap + 4096, sizes
    records, skipped = read_history(history.path)
    assert skipped == 0 and sum(r["kind"] == "folded" for r in records) == 1 and records[0]["kind"] == "folded"
    assert sum(r["kind"] == "attempt_start" for r in records) < 200
    mine, read = history.fold.summary().to_json(), summarize(records).to_json()
    assert read["attempts"] == mine["attempts"] == 801 and read["steps_lost_total"] == mine["steps_lost_total"] > 0
    for key in ("failures", "wall_s", "productive_s", "goodput", "startup_s", "restart_s", "lost_s", "other_s",
                "checkpoint_overhead_s", "exit_reasons", "checkpoints_committed", "sessions", "last_step"):
        assert read[key] == pytest.approx(mine[key], abs=0.01), key
    assert read["time_lost_s"] == pytest.approx(mine["time_lost_s"], abs=0.01)
    assert read["losses"] == mine["losses"][-len(read["losses"]):]  # the latest, as they were


def _history(attempts: int) -> bytes:
    """A crash loop's history.jsonl: each attempt starts and loads; every other one trains a few steps; all crash."""
    out, t = [], 1_700_000_000.0
    out.append({"v": 1, "t": t, "kind": "supervisor_start", "pid": 1, "version": "x"})
    for n in range(1, attempts + 1):
        step, trains = 10 * (n // 2), n % 2
        out += [{"v": 1, "t": t + 1, "kind": "attempt_start", "attempt": n, "resumed_from": None, "resumed_step": step},
                {"v": 1, "t": t + 2, "kind": "first_beat", "attempt": n, "step": step, "phase": "load"}]
        if trains:
            out += [{"v": 1, "t": t + 3, "kind": "beat", "attempt": n, "step": step + 5, "phase": "train", "loss": 1.0,
                     "train_s": 1.0, "save_s": 0.0},
                    {"v": 1, "t": t + 3, "kind": "first_step", "attempt": n, "step": step + 5, "from_step": step}]
        out.append({"v": 1, "t": t + 4, "kind": "attempt_exit", "attempt": n, "at": t + 4, "reason": "crash", "code": 1,
                    "signal": None, "detail": "boom", "max_step": step + 5 * trains, "progressed": bool(trains),
                    "new_checkpoint": False, "train_s": float(trains), "save_s": 0.0})
        t += 5
    return b"".join(json.dumps(r).encode() + b"\n" for r in out)


def _totals(data: bytes) -> dict[str, object]:
    s = summarize(parse_lines(data)[0]).to_json()
    return {k: v for k, v in s.items() if k not in ("losses", "steps_lost", "restart_latency_s")}


def test_folding_keeps_every_total_and_the_latest_attempts() -> None:
    """`fold_lines`: within budget (header included), whole attempts, the same totals; folding a folded file again
    carries the first fold's totals on; a file within budget is left as it is, the latest two attempts always stay."""
    data = b"".join(json.dumps(json.loads(x), separators=(",", ":")).encode() + b"\n" for x in _history(3000).splitlines())
    once = fold_lines(data, 64 * 1024)
    assert len(once) <= 64 * 1024 and once.startswith(b'{"v":1,') and b'"kind":"folded"' in once.split(b"\n")[0]
    assert json.loads(once.split(b"\n")[1])["kind"] == "attempt_start" and _totals(once) == _totals(data)
    more = b"".join(x + b"\n" for x in data.split(b"\n")[-40:-1])  # the last 8 attempts written once more
    twice = fold_lines(once + more, 16 * 1024)
    assert len(twice) <= 16 * 1024 and _totals(twice) == _totals(once + more)
    assert fold_lines(once, 1 << 20) == once
    two = fold_lines(_history(2), 10)  # over budget, but the latest two attempts stay whole
    assert two.count(b'"attempt_start"') == 2 and _totals(two) == _totals(_history(2))


def _calls(work: Callable[[], object]) -> int:
    """Python and builtin calls `work` made: the replay's work, counted rather than timed."""
    prof = cProfile.Profile()
    prof.runcall(work)
    return pstats.Stats(prof, stream=io.StringIO()).total_calls  # type: ignore[attr-defined,no-any-return]


def _report(path: Path) -> str:
    fold = Fold(keep=True).add_all(json.loads(line) for line in path.read_bytes().splitlines())
    return render_html(fold, fold.summary(), source=str(path), generated=1.8e9)


def test_replaying_a_long_history_is_linear(tmp_path: Path) -> None:
    """Start-up (the recorder's fold), `report`'s fold and page: 20k attempts cost 8 times the work of 2.5k, not
    64 times; a state.json's numbers cost the same (a quadratic replay took 31 s at start-up, 53 s for `report`)."""
    work = {}
    for n in (2_500, 20_000):
        path = tmp_path / str(n) / HISTORY_FILE
        path.parent.mkdir()
        path.write_bytes(_history(n))
        rec: list[HistoryRecorder] = []
        start = _calls(lambda: rec.append(HistoryRecorder(path, now=lambda: 1.8e9, log=RecordingLog())))  # noqa: B023
        assert rec[0].fold.count == n and rec[0].last_attempt == n
        status = make_core(tmp_path / f"c{n}")[0].status
        publish = _calls(lambda: rec[0].annotate(status))  # noqa: B023
        report = _calls(lambda: _report(path))  # noqa: B023
        work[n] = (start, publish, report)
    (start, publish, report), (start_8x, publish_8x, report_8x) = work[2_500], work[20_000]
    assert start_8x <= 8.8 * start and report_8x <= 8.8 * report  # 8 times the attempts (quadratic: 64 times)
    assert publish_8x <= publish + 1000  # a state.json's numbers cost the same whatever came before
