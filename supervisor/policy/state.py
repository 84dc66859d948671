"""The supervisor's state machine; `supervisor.daemon.statefile` renders it on disk as `run_dir/state.json`.

Everything shown is rendered from `Status`. The allowed transitions (anything else is a bug and raises) and the
abrupt end: docs/design.md, 'Notes for maintainers'.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from typing_extensions import NotRequired, TypedDict

from supervisor.vocabulary import Vocabulary

__all__ = ["State", "ExitReason", "ExitInfo", "Status", "TRANSITIONS", "ABRUPT_ENDS", "output_beyond"]



class State(Vocabulary):
    STARTING = "starting"
    RUNNING = "running"
    BACKOFF = "backoff"
    STOPPING = "stopping"
    COMPLETED = "completed"
    STOPPED = "stopped"
    FAILED = "failed"

    @property
    def final(self) -> bool:
        return self in (State.COMPLETED, State.STOPPED, State.FAILED)


TRANSITIONS: dict[State, frozenset[State]] = {
    State.STARTING: frozenset({State.RUNNING, State.STOPPING, State.FAILED, State.BACKOFF}),
    State.RUNNING: frozenset({State.BACKOFF, State.STOPPING, State.COMPLETED, State.FAILED}),
    State.BACKOFF: frozenset({State.STARTING, State.STOPPING, State.FAILED}),
    State.STOPPING: frozenset({State.STOPPED}),
    State.COMPLETED: frozenset(),
    State.STOPPED: frozenset(),
    State.FAILED: frozenset(),
}

class ExitReason(Vocabulary):
    """Why an attempt ended (`ExitInfo.reason`; `job_exited`'s `reason`; the history's attempts)."""

    COMPLETED = "completed"  # exit 0, not asked to stop
    STOPPED = "stopped"  # we asked it to stop (a signal to the supervisor, an orphan stop)
    CRASH = "crash"  # a non-zero exit code
    SIGNAL = "signal"  # killed by a signal (the agent or a worker)
    OOM = "oom"  # SIGKILLed while the cgroup's OOM-kill counter rose
    HANG = "hang"  # stopped by us after its heartbeat stalled
    CORRUPT = "corrupt"  # its load found bytes that fail their checksums (CheckpointCorruptError): not a crash


ABRUPT_ENDS = frozenset({State.STOPPED, State.FAILED})  # where `transition(..., abrupt=True)` may go


@dataclass
class ExitInfo:
    code: int | None
    signal: str | None
    reason: ExitReason | str  # str: a word this version does not know (state.json of a newer release), kept
    at: float
    detail: str | None = None  # root-cause rank and exception from torchrun's error file, if any
    last_output: list[str] | None = None  # a failure's last lines of job output (torchrun's own left out)


def output_beyond(detail: str | None, lines: list[str] | None) -> list[str]:
    """A failure's last output lines, unless they are only the line its `detail` already ends with."""
    if lines and len(lines) == 1 and detail and detail.endswith(lines[0].strip()):
        return []
    return lines or []


@dataclass
class Status:
    """Everything `status` shows; serialized as state.json (field names are a public interface)."""

    state: State = State.STARTING
    pid: int = 0
    job_pid: int | None = None
    job_create_time: float | None = None  # with job_pid: identifies an orphan of a killed supervisor
    job_cmdline: list[str] | None = None
    run_token: str | None = None  # the run dir's job token (also in run_dir/job.token; supervisor/host/identity.py)
    attempt: int = 0
    restarts: int = 0
    started_at: float = 0.0
    last_exit: ExitInfo | None = None
    step: int | None = None
    step_at: float | None = None
    phase: str | None = None
    loss: float | None = None
    val_loss: float | None = None  # the latest evaluation the heartbeat reported
    rate_steps_per_s: float | None = None
    resumed_from: str | None = None
    latest_checkpoint: dict[str, Any] | None = None  # {path, step, mtime}
    # {path, step, metric, value}: the best complete checkpoint by keep_best's metric (else val_loss, min)
    best_checkpoint: dict[str, Any] | None = None
    disk_free_bytes: int | None = None
    checkpoint_bytes: int | None = None  # bytes in complete checkpoints under the root
    quarantined: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)  # those of `quarantined` whose bytes failed their checksums
    retention_stopped: str | None = None  # why retention deletes nothing (no usable trash next to the root)
    root_idle: str | None = None  # the job saves, but nothing reaches the root (daemon/elsewhere.py)
    local_tier: str | None = None  # "degraded: why" when the node-local tier cannot be written
    next_launch_at: float | None = None
    reason: str | None = None  # why the supervisor ended (gave up, completed, stopped)
    # From the run's history (supervisor.history.fold has the definitions):
    goodput: float | None = None  # productive training time / supervisor wall time; None: unknown (no steps)
    # wall_s and where it went: productive_s, startup_s, restart_s, lost_s, checkpoint_overhead_s, other_s
    goodput_parts: dict[str, float] = field(default_factory=dict)
    loss_recent: list[float] = field(default_factory=list)  # the last sampled losses, oldest first
    restart_latency_s: list[float] = field(default_factory=list)  # per recovery: failure seen -> training again
    steps_lost: list[int] = field(default_factory=list)  # per failure followed by a relaunch (the latest 100)
    steps_lost_total: int = 0  # over every failure of the run
    # Time lost to failures, in total by phase: detection, stop, relaunch, worker_start, load, redo (seconds).
    time_lost_s: dict[str, float] = field(default_factory=dict)
    last_failure: dict[str, Any] | None = None  # the latest failure's loss: steps reached/resumed/lost, time split
    # Every rank watched (the job's per-rank heartbeats): {rank, step, phase, step_s, at, straggler} per rank.
    ranks: list[dict[str, Any]] = field(default_factory=list)
    stragglers: list[int] = field(default_factory=list)  # ranks flagged as stragglers now
    last_hang: dict[str, Any] | None = None  # {attempt, at, step, idle_s, ranks: [{rank, why}], stacks}
    hang_detection: str | None = None  # the running attempt's hang allowance, or why there is none (policy/ranks.py)
    # The open divergence (supervisor/daemon/divergence.py): onset_step, step, rank, loss, why, rollbacks, last_good.
    divergence: dict[str, Any] | None = None
    rollbacks: int = 0  # divergences rolled back over the run
    divergence_guard: str | None = None  # why the running attempt's loss is not watched (daemon/divergence.py)
    config: str | None = None
    updated_at: float = 0.0

    def transition(self, new: State, *, abrupt: bool = False) -> None:
        """Move to `new` along TRANSITIONS; `abrupt`: the supervisor is leaving, any unfinished state may end."""
        if abrupt and not self.state.final and new in ABRUPT_ENDS:
            self.state = new
            return
        if new is not self.state and new not in TRANSITIONS[self.state]:
            raise RuntimeError(f"illegal state transition {self.state.value} -> {new.value}")
        self.state = new

    def to_json(self) -> dict[str, Any]:
        """A strict-JSON dict: a non-finite float (which no validated input should produce) becomes null."""
        d: dict[str, Any] = _finite_only(asdict(self))
        d["state"] = self.state.value
        return d

    @classmethod
    def from_json(cls, data: bytes | str) -> Status:
        """Rebuild a Status from state.json's text; ValueError when it is not JSON or a field has the wrong type (a
        hand edit, another version): pydantic, strict (no "5" for 5, no NaN), and integers within 64 bits."""
        json.loads(data, parse_int=_int64)  # JSON reads integers of any size: a 400-digit one is no state of ours
        st: Status = _adapter(Status).validate_json(data, strict=True)
        if st.last_exit is not None and st.last_exit.reason in _EXIT_REASONS:
            st.last_exit.reason = ExitReason(st.last_exit.reason)
        if st.latest_checkpoint is not None:  # `status` does arithmetic on its fields
            _adapter(_CheckpointRef).validate_python(st.latest_checkpoint, strict=True)
        if st.best_checkpoint is not None:
            _adapter(_BestRef).validate_python(st.best_checkpoint, strict=True)
        return st


_FINITE = {"allow_inf_nan": False}  # pydantic's ConfigDict (pydantic is imported when state.json is read)
ExitInfo.__pydantic_config__ = Status.__pydantic_config__ = _FINITE  # type: ignore[attr-defined]


class _CheckpointRef(TypedDict):
    __pydantic_config__ = _FINITE  # type: ignore[misc]
    path: NotRequired[str | None]
    step: NotRequired[int | None]
    mtime: NotRequired[float | None]


class _BestRef(TypedDict):
    __pydantic_config__ = _FINITE  # type: ignore[misc]
    path: str
    step: NotRequired[int | None]
    metric: str
    value: float


@functools.cache
def _adapter(kind: Any) -> Any:
    from pydantic import TypeAdapter

    return TypeAdapter(kind)  # built on first use: `status` and `run` read state.json once


def _int64(digits: str) -> int:
    value = int(digits)
    if not -(2**63) <= value < 2**63:
        raise ValueError("an integer beyond 64 bits")
    return value


def _finite_only(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_only(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_only(v) for v in value]
    return value


_EXIT_REASONS = frozenset(r.value for r in ExitReason)
