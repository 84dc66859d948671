"""Pure restart decisions: restart now, after a backoff, or give up. No I/O, no clock, no randomness.

The event loop records one `Attempt` per launch and asks `decide()` what to do next; jitter comes in as
a number in [0, 1) so tables and property tests can pin it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from supervisor.checkpoints.integrity import CORRUPT_PREFIX
from supervisor.config import RestartSection
from supervisor.contract import Phase
from supervisor.policy.state import ExitReason

__all__ = ["Attempt", "Restart", "GiveUp", "Finish", "Decision", "Quarantine", "decide", "backoff_delay",
           "quarantine_candidate", "corrupt_quarantine", "window"]

KEEP_PROGRESSED = 32  # older attempts kept for the quarantine's "it loaded and trained before" (one per checkpoint)


@dataclass(frozen=True)
class Attempt:
    """What the loop learned about one finished launch."""

    number: int
    started_at: float  # monotonic seconds
    ended_at: float
    succeeded: bool  # exit code 0
    reason: ExitReason  # the exit's classification (policy/exits.py)
    resumed_from: str | None = None  # checkpoint path passed via resume_args ({checkpoint} or {step}); else None
    resumed_step: int | None = None
    max_step: int | None = None  # highest heartbeat step seen during the attempt
    new_checkpoint: bool = False  # a newer complete checkpoint appeared during the attempt
    progressed: bool = False  # a step beyond every earlier attempt, or a new checkpoint
    beat: bool = False  # the attempt wrote at least one valid heartbeat
    last_phase: Phase | None = None  # the phase of its last heartbeat (LOAD at exit: it died loading)
    beat_checkpoint: str | None = None  # a job picking its own: the checkpoint its `load` beat's step names

    @property
    def duration(self) -> float:
        return self.ended_at - self.started_at


@dataclass(frozen=True)
class Restart:
    delay_s: float
    reason: str


@dataclass(frozen=True)
class GiveUp:
    reason: str


@dataclass(frozen=True)
class Finish:
    reason: str


Decision = Restart | GiveUp | Finish


def _healthy(a: Attempt, cfg: RestartSection) -> bool:
    return a.progressed or (cfg.reset_after_s > 0 and a.duration >= cfg.reset_after_s)


def backoff_delay(history: Sequence[Attempt], cfg: RestartSection, jitter: float) -> float:
    """Exponential in the unhealthy failures since the last healthy attempt, capped, with jitter.

    A failure of a healthy attempt (one that progressed or ran reset_after_s) waits only
    healthy_restart_delay_s (default 0: at once, as torchrun's own restart does): a crash after hours of
    training is not a crash loop, and every second of delay is idle accelerators. From the next unhealthy
    failure on: backoff_initial_s, then times backoff_multiplier per failure. After a success (policy
    "always") the wait is backoff_initial_s.
    """
    last = history[-1]
    spread = cfg.backoff_jitter * (2.0 * jitter - 1.0)
    if not last.succeeded and _healthy(last, cfg):
        return max(0.0, cfg.healthy_restart_delay_s * (1.0 + spread))
    failures = 0
    for a in reversed(history):
        if a.succeeded or _healthy(a, cfg):
            break
        failures += 1
    base = min(cfg.backoff_max_s, cfg.backoff_initial_s * cfg.backoff_multiplier ** max(0, failures - 1))
    return max(0.0, min(cfg.backoff_max_s, base * (1.0 + spread)))


def _no_progress_streak(history: Sequence[Attempt]) -> int:
    n = 0
    for a in reversed(history):
        if a.succeeded or a.progressed:
            break
        n += 1
    return n


def _corrupt_load(a: Attempt) -> bool:
    """Ended by a load that found rotten bytes in a checkpoint we know: that checkpoint's fault, not the job's."""
    return a.reason == ExitReason.CORRUPT and _loading(a) is not None


def decide(history: Sequence[Attempt], cfg: RestartSection, *, jitter: float = 0.5, before: int = 0) -> Decision:
    """What to do after the last attempt in `history` ended (history is non-empty; `before`: attempts `window` let go).

    An attempt whose load found a known checkpoint corrupt is relaunched at once and counts for nothing (no
    restart, no failure): that checkpoint is quarantined (`corrupt_quarantine`), so each such attempt uses one up.
    """
    if _corrupt_load(history[-1]):
        return Restart(0.0, reason=ExitReason.CORRUPT)
    history = [a for a in history if not _corrupt_load(a)]
    last = history[-1]
    restarts_so_far = before + len(history) - 1
    if last.succeeded and cfg.policy != "always":
        return Finish(ExitReason.COMPLETED)
    if not last.succeeded and cfg.policy == "never":
        return GiveUp(f"job failed ({last.reason}) and restart policy is 'never'")
    if restarts_so_far >= cfg.max_restarts:
        return GiveUp(f"restart budget spent: {restarts_so_far} of max_restarts={cfg.max_restarts}")
    streak = _no_progress_streak(history)
    if streak > cfg.max_no_progress_restarts:
        return GiveUp(
            f"crash loop: {streak} consecutive failed attempts without progress "
            f"(max_no_progress_restarts={cfg.max_no_progress_restarts}); last: {last.reason}"
        )
    return Restart(backoff_delay(history, cfg, jitter), reason=ExitReason.COMPLETED if last.succeeded else last.reason)


def crash_loop(history: Sequence[Attempt], cfg: RestartSection) -> int | None:
    """The failures in a row without progress when one more gives up (and there were at least 2): a crash loop."""
    streak = _no_progress_streak(history)
    return streak if 2 <= streak == cfg.max_no_progress_restarts else None


def window(history: Sequence[Attempt], cfg: RestartSection) -> tuple[list[Attempt], int]:
    """The attempts `decide` and the quarantine still need, and how many others (not corrupt loads) it let go.

    The last max_no_progress_restarts + quarantine_after + 2 (no streak is longer: one more gives up), and of the older
    ones the newest that progressed per checkpoint loaded, at most KEEP_PROGRESSED (`quarantine_candidate` asks whether
    one trained): thousands of restarts keep a few dozen attempts, and every answer stays the same.
    """
    recent, cut, n = cfg.max_no_progress_restarts + cfg.quarantine_after + 2, len(history), 0
    while cut > 0 and (n < recent or len(history) - cut < recent):  # as many, not counting corrupt loads (`decide`)
        cut -= 1
        n += not _corrupt_load(history[cut])
    old, progressed = history[:cut], {(a.resumed_from, a.beat_checkpoint): a for a in history[:cut] if a.progressed}
    keep = sorted(progressed.values(), key=old.index)[-KEEP_PROGRESSED:]  # dict order is first-seen: the newest's place
    let_go = sum(not _corrupt_load(a) for a in old) - sum(not _corrupt_load(a) for a in keep)
    return [*keep, *history[cut:]], let_go


@dataclass(frozen=True)
class Quarantine:
    path: str
    reason: str


def _loading(a: Attempt) -> str | None:
    """The checkpoint an attempt was loading: the one passed to it, else the one its `load` heartbeat named."""
    return a.resumed_from or a.beat_checkpoint


def _stalled(a: Attempt) -> bool:
    """Failed without getting anywhere: no new checkpoint, no heartbeat step past the one it resumed at."""
    past = a.max_step is not None and a.resumed_step is not None and a.max_step > a.resumed_step
    return not a.succeeded and not a.new_checkpoint and not past


def corrupt_quarantine(a: Attempt, detail: str | None) -> Quarantine | None:
    """The checkpoint whose bytes the attempt's load found failing their checksums, at once; `detail`: its error."""
    path = _loading(a)
    if not _corrupt_load(a) or path is None:
        return None
    return Quarantine(path, f"{CORRUPT_PREFIX}its bytes fail their checksums: {detail or 'CheckpointCorruptError'}")


def quarantine_candidate(history: Sequence[Attempt], quarantine_after: int) -> Quarantine | None:
    """The checkpoint to quarantine, with the evidence, or None: only a failure specific to it counts.

    The last `quarantine_after` attempts must all have failed without progress while loading the same
    checkpoint C - passed to them by resume_args, or named by their `load` heartbeat - and each must carry
    evidence that C, not the job, is what fails:
    - with a heartbeat: its last beat said `load` (the attempt died loading C);
    - without one (the job writes none): C was passed to it, and earlier in this run an attempt passed
      another checkpoint made progress (the job can load and train).
    Never when an earlier attempt of this run loaded C and made progress: C is fine, something else fails.
    An attempt that died in `train`, or wrote no beat when it writes them, or that picked its own
    checkpoint without naming it, is no evidence: a bad node, a broken install or a bug fails every
    checkpoint alike, and quarantining the good ones would end in a fresh start or a give-up.
    """
    if quarantine_after <= 0 or len(history) < quarantine_after:
        return None
    tail, earlier = history[-quarantine_after:], history[:-quarantine_after]
    path = _loading(tail[0])
    if path is None or any(_loading(a) != path or not _stalled(a) for a in tail):
        return None
    if any(a.progressed and _loading(a) == path for a in earlier):
        return None  # it loaded and trained before: what fails now is not the checkpoint
    if all(a.last_phase == Phase.LOAD for a in tail):
        return Quarantine(path, f"{quarantine_after} consecutive attempts died while loading it (heartbeat phase load)")
    loads_others = any(a.progressed and a.resumed_from not in (None, path) for a in earlier)
    if loads_others and all(not a.beat and a.resumed_from == path for a in tail):
        return Quarantine(path, f"{quarantine_after} consecutive attempts failed right after loading it, while an "
                                "earlier attempt loaded another checkpoint and trained")
    return None
