"""One attempt of the job: what the core remembers about it, and the decisions that need only that.

`Core` owns the events and the side effects; this module holds the attempt's record (`RunningAttempt`, from the launch to
the judgement, which builds the restart policy's frozen `Attempt`) and the small pure decisions taken from it.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.checkpoints import CheckpointInfo
from supervisor.checkpoints.naming import is_temporary
from supervisor.config import Config, HealthSection
from supervisor.contract import (
    ENV_ATTEMPT,
    ENV_ERROR_FILE,
    ENV_HEARTBEAT,
    ENV_HEARTBEAT_DIR,
    ENV_LOCAL_DIR,
    ENV_RUN_DIR,
    ENV_RUN_TOKEN,
    RANK_HEARTBEAT_DIR,
    SLOW_PHASES,
    Beat,
    Phase,
)
from supervisor.policy.restarts import Attempt
from supervisor.policy.state import ExitInfo, ExitReason, Status

__all__ = ["RunningAttempt", "StepRate", "job_env", "apply_beat", "hang_timeout", "named_by_beat", "RATE_WINDOW_S",
           "REACHED_BY_RANKS", "REACHED_BY_HEARTBEAT"]

_TORCHRUN_GRACE_EXTRA_S = 86400  # torchrun's own stop grace: stop_timeout_s and this (see job_env)

# RunningAttempt.reached_by (attempt_exit's `reached_by`): whose beat max_step is. The ranks' files are written every step
# (exact); the node's file alone may lag the job (the trainer writes it once a second): steps lost are a lower bound.
REACHED_BY_RANKS = "ranks"
REACHED_BY_HEARTBEAT = "heartbeat"
TIER_FAILING = "degraded: the job says: "  # status.local_tier from the job's beats (its `local_tier`)

RATE_WINDOW_S = 30.0  # the step rate is measured over about this much of the attempt's latest steps
_RATE_MIN_SPAN_S = 2.0  # less than this between the first and the last step seen: no rate yet


class StepRate:
    """Steps per second over the attempt's recent steps: (newest step - oldest) / the time between them.

    Each sample is a step the job reached and when: the job's own `time` from its heartbeat where it gives one (its
    log's clock, unaffected by when we got around to reading the file), else the time we read it. The oldest sample
    kept is the newest one at least `RATE_WINDOW_S` old, so a long save or evaluation slows the rate as it slowed the
    job, and two beats read a millisecond apart never make a burst.
    """

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, t: float, step: int) -> float | None:
        """Take in a step reached at `t`; the rate now (None until the samples span `_RATE_MIN_SPAN_S`)."""
        if self._samples and (step < self._samples[-1][1] or t < self._samples[-1][0]):
            self._samples.clear()  # a step or a clock gone backwards: begin again
        if not self._samples or step > self._samples[-1][1]:
            self._samples.append((t, step))
        while len(self._samples) > 2 and self._samples[1][0] <= t - self.window_s:
            self._samples.popleft()
        (t0, s0), (t1, s1) = self._samples[0], self._samples[-1]
        return (s1 - s0) / (t1 - t0) if t1 - t0 >= _RATE_MIN_SPAN_S else None


@dataclass
class RunningAttempt:
    """One attempt's record, from its launch to its judgement (then `judged()` is what the policy keeps)."""

    number: int
    pid: int
    started_mono: float
    resumed_from: str | None
    resumed_step: int | None
    error_file: Path
    log_path: Path
    oom_before: int | None
    max_step: int | None = None  # the highest step it reached, by its heartbeats (every rank's, every step)
    reached_by: str | None = None  # whose beat max_step is: REACHED_BY_RANKS or REACHED_BY_HEARTBEAT
    new_checkpoint: bool = False
    hang: bool = False
    stopping: bool = False  # we asked it to stop (a requested stop, a hang): an exit 0 now is no completion
    progress_at: float | None = None  # wall time its step last advanced (the beat's own time when believable)
    detected_at: float | None = None  # wall time its hang was detected
    hung_ranks: list[tuple[int, str]] = field(default_factory=list)  # (rank, why) named at its hang
    stacks: str | None = None  # where its hang's stack dumps were kept
    beat_mono: float | None = None
    beat: Beat | None = None
    beat_warned: bool = False
    ranks_warned: bool = False  # a bad per-rank heartbeat (or too many of them) was said (once per attempt)
    log_warned: bool = False  # a failed rotation of its log was said (once per attempt)
    rotating: bool = False  # a rotation of its log is running off the loop
    low_free: int | None = None  # least free bytes on the checkpoint file system seen during the attempt
    rate: StepRate = field(default_factory=StepRate)  # steps per second over its recent steps
    agent_exit: int | None = None  # the agent's exit code while workers it left finish a graceful stop (Core)
    # Set by `end`: the exit is known, but it is judged only once a pass has said what the attempt committed.
    returncode: int | None = None
    info: ExitInfo | None = None
    ended_mono: float | None = None

    def end(self, returncode: int, info: ExitInfo, at_mono: float) -> None:
        self.returncode, self.info, self.ended_mono = returncode, info, at_mono

    def judged(self, *, progressed: bool, beat_checkpoint: str | None) -> Attempt:
        """The ended attempt as the restart policy sees it (built once, here)."""
        assert self.info is not None and self.ended_mono is not None, "judged before it ended"
        return Attempt(
            number=self.number, started_at=self.started_mono, ended_at=self.ended_mono,
            # An exit 0 after we asked the job to stop (its SIGTERM handler exits 0) finished nothing.
            succeeded=self.returncode == 0 and not (self.stopping or self.hang),
            reason=ExitReason(self.info.reason), resumed_from=self.resumed_from,
            resumed_step=self.resumed_step, max_step=self.max_step, new_checkpoint=self.new_checkpoint,
            progressed=progressed, last_phase=self.beat.phase if self.beat else None, beat=self.beat is not None,
            beat_checkpoint=beat_checkpoint,
        )


def job_env(cfg: Config, environ: Mapping[str, str], *, number: int, heartbeat: Path, error_file: Path,
            token: str) -> dict[str, str]:
    """The attempt's environment: ours, then the config's `[job] env`, then the job contract's variables."""
    env = dict(environ)
    # torchrun SIGKILLs workers 30 s after forwarding SIGTERM unless told otherwise; an emergency save must
    # get the whole stop_timeout_s the user granted (an explicit setting in env or --shutdown-timeout wins).
    # The supervisor ends the stop after stop_timeout_s, not counting time it was frozen with the job (Slurm's
    # suspend); torchrun's clock counts it and would SIGKILL a suspended save on waking, so its grace only backs
    # ours up: a day more. Whole seconds: torchrun int()s it when it starts ("90.5", "1e+06" failed every launch).
    grace = str(math.ceil(cfg.health.stop_timeout_s) + _TORCHRUN_GRACE_EXTRA_S)
    env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") or grace
    # torchrun's rendezvous store shared with the workers keeps the previous round's keys: restarted workers
    # of a multi-node job then hang in init_process_group (pytorch/pytorch#135712; docs/operations.md, More
    # than one node).
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    env.update(cfg.job.env)
    if cfg.checkpoints.local_dir is not None:
        env[ENV_LOCAL_DIR] = str(cfg.checkpoints.local_dir)
    env.update({
        ENV_HEARTBEAT: str(heartbeat),
        ENV_HEARTBEAT_DIR: str(cfg.run_dir / RANK_HEARTBEAT_DIR),
        ENV_ATTEMPT: str(number),
        ENV_RUN_DIR: str(cfg.run_dir),
        ENV_ERROR_FILE: str(error_file),
        ENV_RUN_TOKEN: token,
    })
    return env


def apply_beat(status: Status, beat: Beat, now: float, rate: StepRate) -> None:
    """Move `status` to a new beat: step, phase, losses, and the rate over the attempt's recent steps."""
    step = beat.step
    if beat.phase != Phase.LOAD:  # a load beat names the checkpoint's step, not one trained now
        status.rate_steps_per_s = rate.add(beat.time if beat.time is not None else now, step)
    if status.step != step:
        status.step, status.step_at = step, now
    status.phase, status.loss = beat.phase, beat.loss
    if beat.val_loss is not None:
        status.val_loss = beat.val_loss
    if beat.local_tier or (status.local_tier or "").startswith(TIER_FAILING):  # cleared once its saves work again
        status.local_tier = f"{TIER_FAILING}{beat.local_tier}" if beat.local_tier else None


def hang_timeout(health: HealthSection, beat: Beat | None, *, startup: bool, p99: float | None = None) -> float | None:
    """Seconds of silence before the attempt counts as hung, or None when hang detection is off.

    The allowances (startup, load/save/eval, "auto" from `p99`, None while too few steps were seen):
    docs/operations.md, 'Hangs and stragglers' ("On by default").
    """
    auto = health.hang_timeout_s == "auto"
    if startup:
        timeout = health.startup_timeout_s
    elif beat is not None and (beat.phase in SLOW_PHASES or (auto and beat.phase == Phase.EVAL)):
        timeout = health.save_timeout_s
    elif isinstance(health.hang_timeout_s, str):
        timeout = health.save_timeout_s if p99 is None else max(health.hang_min_s, health.hang_factor * p99)
    else:
        timeout = health.hang_timeout_s
    return timeout if timeout > 0 and (startup or auto or health.hang_timeout_s) else None


def named_by_beat(job: RunningAttempt, checkpoints: Sequence[CheckpointInfo]) -> str | None:
    """The checkpoint a job that picks its own was loading when it ended: its `load` beat's step, if one matches."""
    beat = job.beat
    if job.resumed_from is not None or beat is None or beat.phase != Phase.LOAD or beat.step <= 0:
        return None  # told what to load, or no sign of a load: step 0 is a beat before the job chose
    named = [c for c in checkpoints if c.step == beat.step and not is_temporary(c.name)]
    return str(named[0].path) if len(named) == 1 else None
