"""A scripted `System` for replaying histories through `Core` without processes or real time."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.daemon.timers import Timers

POLLS = frozenset({"ranks", "hang_dumps"})  # periodic looks, left out of `advance`'s list of fired timers


@dataclass
class Spawned:
    pid: int
    argv: list[str]
    env: dict[str, str]
    at: float  # fake monotonic time


@dataclass
class FakeSystem:
    clock: float = 1000.0
    jitter: float = 0.5
    oom: int | None = None
    timers: Timers = field(default_factory=Timers)
    spawned: list[Spawned] = field(default_factory=list)
    signals: list[tuple[int, int]] = field(default_factory=list)  # (pid, sig)
    worker_signals: list[tuple[int, int]] = field(default_factory=list)
    killed_trees: list[int] = field(default_factory=list)
    orphans_stopped: list[int] = field(default_factory=list)
    orphan_searches: list[tuple[str, Path, tuple[int, float] | None]] = field(default_factory=list)
    orphan_timeouts: list[float] = field(default_factory=list)
    orphans: list[int] = field(default_factory=list)  # what the next orphan search finds
    jobs_stopped: list[int] = field(default_factory=list)  # stop_job (the supervisor failing)
    left_behind: list[tuple[int, str]] = field(default_factory=list)  # live descendants after the agent's exit
    terminal: bool = False  # whether a SIGINT now counts as Ctrl+C in the supervisor's own terminal
    workers: dict[int, tuple[int, str]] = field(default_factory=dict)  # what worker_states says: rank -> (pid, state)
    next_pid: int = 100
    defer_work: bool = False  # True: off-loop work waits for `finish_work()` (a pass "still running")
    pending_work: list[tuple[Callable[[], Any], Callable[[Any], None]]] = field(default_factory=list)

    def run_off_loop(self, work: Callable[[], Any], done: Callable[[Any], None]) -> None:
        if self.defer_work:
            self.pending_work.append((work, done))
            return
        self._run(work, done)

    @staticmethod
    def _run(work: Callable[[], Any], done: Callable[[Any], None]) -> None:
        try:
            result = work()
        except Exception as exc:  # noqa: BLE001 - like RealSystem: the exception goes to `done`
            result = exc
        done(result)

    def finish_work(self) -> int:
        """Run the deferred off-loop work (and any it queues) to completion; returns how many ran."""
        n = 0
        while self.pending_work:
            self._run(*self.pending_work.pop(0))
            n += 1
        return n

    def now(self) -> float:
        return 1_700_000_000.0 + self.clock

    def monotonic(self) -> float:
        return self.clock

    def file_now(self) -> float:
        return self.now()

    def random(self) -> float:
        return self.jitter

    def spawn(self, argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], log_path: Path | None) -> tuple[int, float]:
        self.next_pid += 1
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log_path.touch()
        self.spawned.append(Spawned(self.next_pid, list(argv), dict(env), self.clock))
        return self.next_pid, self.now()

    def send_signal(self, pid: int, sig: int) -> None:
        self.signals.append((pid, sig))

    def signal_workers(self, pid: int, sig: int) -> list[int]:
        self.worker_signals.append((pid, sig))
        return [pid + 1000]

    def worker_states(self, pid: int) -> dict[int, tuple[int, str]]:
        return dict(self.workers)

    def kill_job_tree(self, pid: int) -> list[tuple[int, str]]:
        self.killed_trees.append(pid)
        return [(pid, "torchrun")]

    def survivors(self) -> list[tuple[int, str]]:
        return list(self.left_behind)

    def reap_survivors(self) -> list[tuple[int, str]]:
        killed, self.left_behind = self.left_behind, []
        return killed

    def oom_kills(self) -> int | None:
        return self.oom

    def stop_orphans(self, token: str, run_dir: Path, timeout: float) -> list[int]:
        self.orphan_searches.append((token, run_dir))
        self.orphan_timeouts.append(timeout)
        found = list(self.orphans)
        self.orphans_stopped += found
        return found

    def stop_job(self, pid: int, timeout: float) -> list[int]:
        self.jobs_stopped.append(pid)
        return [pid]

    def on_terminal(self) -> bool:
        return self.terminal

    def advance(self, seconds: float, core: Any) -> list[str]:
        """Move the clock, firing due timers in order through `core.on_timer`; returns their names, less the polls
        (POLLS: the per-rank heartbeat look every second, the check for stack dumps every 0.1 s)."""
        fired = []
        end = self.clock + seconds
        while True:
            nxt = self.timers.next_deadline()
            if nxt is None or nxt > end:
                break
            self.clock = max(self.clock, nxt)
            for name in self.timers.pop_due(self.clock):
                if str(name) not in POLLS:
                    fired.append(name)
                core.on_timer(name)
        self.clock = end
        return fired


class RecordingLog:
    """Stands in for a structlog logger: records (event, fields)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def bind(self, **_: Any) -> RecordingLog:
        return self

    def _rec(self, event: str, **kw: Any) -> None:
        self.events.append((event, kw))

    info = warning = error = debug = _rec

    def names(self) -> list[str]:
        return [e for e, _ in self.events]
