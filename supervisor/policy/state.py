"""The supervisor's state machine; `supervisor.daemon.statefile` renders it on disk as `run_dir/state.json`.

`status`, sd_notify's STATUS= line, metrics and the logs are all rendered from `Status`, never from ad-hoc
strings. Allowed transitions (anything else is a bug and raises):

    starting ──> running ──> backoff ──> starting
       │  │         │  └───> completed | failed
       │  │         └──────> stopping ──> stopped
       │  └────────────────> failed  (launch error)
       └──> stopping ─────────────────────────────> stopped
    backoff ──> stopping | failed

The supervisor leaving without a verdict (its loop failed, or it was interrupted before the loop ran) ends
any state that is not final as `stopped` or `failed`: `Status.transition(new, abrupt=True)`, never a bare
assignment.
"""
from __future__ import annotations

import math
import types
import typing
from dataclasses import asdict, dataclass, field
from typing import Any

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


ABRUPT_ENDS = frozenset({State.STOPPED, State.FAILED})  # where `transition(..., abrupt=True)` may go


@dataclass
class ExitInfo:
    code: int | None
    signal: str | None
    reason: ExitReason | str  # str: a word this version does not know (state.json of a newer release), kept
    at: float
    detail: str | None = None  # root-cause rank and exception from torchrun's error file, if any
    last_output: list[str] | None = None  # a failure's last lines of job output (torchrun's own left out)

    def output_beyond_detail(self) -> list[str]:
        return output_beyond(self.detail, self.last_output)


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
    retention_stopped: str | None = None  # why retention deletes nothing (no usable trash next to the root)
    next_launch_at: float | None = None
    reason: str | None = None  # why the supervisor ended (gave up, completed, stopped)
    # From the run's history (supervisor.history.fold has the definitions):
    goodput: float | None = None  # productive training time / supervisor wall time; None: unknown (no steps)
    # wall_s and where it went: productive_s, startup_s, restart_s, lost_s, checkpoint_overhead_s, other_s
    goodput_parts: dict[str, float] = field(default_factory=dict)
    loss_recent: list[float] = field(default_factory=list)  # the last sampled losses, oldest first
    restart_latency_s: list[float] = field(default_factory=list)  # per recovery: failure seen -> training again
    steps_lost: list[int] = field(default_factory=list)  # per failure followed by a relaunch
    # Time lost to failures, in total by phase: detection, stop, relaunch, worker_start, load, redo (seconds).
    time_lost_s: dict[str, float] = field(default_factory=dict)
    last_failure: dict[str, Any] | None = None  # the latest failure's loss: steps reached/resumed/lost, time split
    # Every rank watched (the job's per-rank heartbeats): {rank, step, phase, step_s, at, straggler} per rank.
    ranks: list[dict[str, Any]] = field(default_factory=list)
    stragglers: list[int] = field(default_factory=list)  # ranks flagged as stragglers now
    last_hang: dict[str, Any] | None = None  # {attempt, at, step, idle_s, ranks: [{rank, why}], stacks}
    # The open divergence (supervisor/daemon/divergence.py): onset_step, step, rank, loss, why, rollbacks, last_good.
    divergence: dict[str, Any] | None = None
    rollbacks: int = 0  # divergences rolled back over the run
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
    def from_json(cls, d: dict[str, Any]) -> Status:
        """Rebuild a Status; ValueError when a field has the wrong type (a hand edit, another version)."""
        if not isinstance(d, dict):
            raise ValueError("state.json is not a JSON object")
        known = _typed(cls, d)
        known["state"] = State(known.get("state", "starting"))
        if isinstance(known.get("last_exit"), dict):
            last = dict(known["last_exit"])
            if isinstance(last.get("reason"), str) and last["reason"] in _EXIT_REASONS:
                last["reason"] = ExitReason(last["reason"])
            known["last_exit"] = ExitInfo(**_typed(ExitInfo, last, every=True))
        ck = known.get("latest_checkpoint")  # a dict by now; `status` does arithmetic on its fields
        if ck is not None and not all(_conforms(ck.get(k), t) for k, t in _CHECKPOINT_FIELDS.items()):
            raise ValueError("state.json: latest_checkpoint is not {path, step, mtime}")
        best = known.get("best_checkpoint")
        if best is not None and not all(_conforms(best.get(k), t) for k, t in _BEST_FIELDS.items()):
            raise ValueError("state.json: best_checkpoint is not {path, step, metric, value}")
        return cls(**known)


def _finite_only(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_only(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_only(v) for v in value]
    return value


_EXIT_REASONS = frozenset(r.value for r in ExitReason)
_CHECKPOINT_FIELDS: dict[str, Any] = {"path": str | None, "step": int | None, "mtime": float | None}
_BEST_FIELDS: dict[str, Any] = {"path": str, "step": int | None, "metric": str, "value": float}


def _conforms(value: Any, hint: Any) -> bool:
    """Does a JSON value fit a field's type hint? Numbers must be finite and fit in 64 bits."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, a) for a in args)
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) and _conforms(v, args[1]) for k, v in value.items())
    if hint in (int, float):
        if type(value) is int:  # compared as an int: a 400-digit one overflows math.isfinite
            return abs(value) < 2**63
        return hint is float and type(value) is float and math.isfinite(value) and abs(value) < 2**63
    if hint is type(None):
        return value is None
    return isinstance(value, hint)


def _typed(cls: type, d: dict[str, Any], every: bool = False) -> dict[str, Any]:
    """The fields of dataclass `cls` found in `d` (all of them if `every`), each checked against its hint."""
    hints = typing.get_type_hints(cls)
    out = {k: d.get(k) for k in hints} if every else {k: v for k, v in d.items() if k in hints}
    for k, v in out.items():
        if k != "state" and not (k == "last_exit" and isinstance(v, dict)) and not _conforms(v, hints[k]):
            raise ValueError(f"state.json: {k} has the wrong type")
    return out
