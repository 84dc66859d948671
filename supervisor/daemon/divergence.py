"""The divergence guard, Core's part: watch the loss of every beat, mark the saves after the onset, roll back.

The detector is policy/divergence.py; what follows a divergence (the `divergence.json` record, quarantine of
the saves from `since` on, protection of the last good ones, the rollback with `{skip_steps}`, `max_rollbacks`,
when it closes): docs/operations.md, 'What happens when things go wrong'. Its end is no crash: no restart
budget, no crash-loop count.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from supervisor.checkpoints import CheckpointInfo
from supervisor.config import Config
from supervisor.contract import DIVERGED, Beat
from supervisor.daemon.events import Alarm, Bus
from supervisor.host.atomic import write_atomic
from supervisor.host.log import Log
from supervisor.host.regularfile import read_json
from supervisor.policy.divergence import Detector, Diverged, Open, diverged_saves, last_good, same_region, skip_steps
from supervisor.policy.resume import chooses_itself
from supervisor.policy.state import Status

__all__ = ["Guard", "DIVERGENCE_FILE", "read_open"]

DIVERGENCE_FILE = "divergence.json"  # in the run dir: the open divergence, if any
_UNGUARDED_AFTER = 20  # beats of an attempt without a loss before the log says the guard is off for it


def read_open(run_dir: Path) -> Open | None:
    """The open divergence kept in `run_dir`, None when there is none; OSError or ValueError when it is unreadable."""
    try:
        return Open.from_json(read_json(run_dir / DIVERGENCE_FILE, 4096))
    except FileNotFoundError:
        return None


class Guard:
    def __init__(self, cfg: Config, log: Log, bus: Bus, status: Status) -> None:
        self.cfg, self.log, self.bus, self.status = cfg.divergence, log, bus, status
        self.keep_last = cfg.checkpoints.keep_last
        self.aimed = not chooses_itself(cfg.job.resume_args)  # else the relaunch loads what the job picks: no rollback
        self.path = cfg.run_dir / DIVERGENCE_FILE
        try:
            self.open = read_open(cfg.run_dir)
        except (OSError, ValueError) as exc:
            self.open = None
            log.warning("divergence_state_unreadable", path=str(self.path), error=str(exc)[:200])
        self.found: tuple[int, Diverged] | None = None  # (attempt, divergence) to act on at that attempt's end
        self.verdict: str | None = None  # "rollback" or "give_up": what the attempt's end brings
        self.marked: set[str] = set()  # diverged saves quarantined (or to be) by this supervisor: never resumed
        self._seen: set[tuple[str, float]] = set()  # (path, mtime) marked: a save of the same step later is another
        self._detector: Detector | None = None
        self._lossless = 0  # beats of this attempt without a loss
        self.alive = False  # the attempt's process runs (Core clears it when the exit is seen)
        self.good: str | None = None  # the last good checkpoint of the open divergence, by the latest pass
        self._seed: Beat | None = None  # the launch's resume point and the loss it recorded: the level to start from
        self._show()

    def _show(self) -> None:
        op = self.open
        self.status.divergence = {**op.to_json(), "last_good": self.good, "action": self.cfg.action} if op else None

    def _save(self, new: Open | None) -> None:
        self.open = new
        self._show()
        try:
            if new is None:
                self.path.unlink(missing_ok=True)
            else:
                write_atomic(self.path, json.dumps(new.to_json()).encode())
        except OSError as exc:  # this session still knows it; a restart would not
            self.log.error("run_dir_write_failed", what="divergence state", error=str(exc))

    # ---- an attempt's beats ------------------------------------------------------------------------------
    def started(self) -> None:
        self.found, self.verdict, self._lossless, self.alive = None, None, 0, True
        self.status.divergence_guard = None
        off = self.cfg.action == "off"
        self._detector = None if off else Detector(self.cfg.spike_factor, self.cfg.spike_patience)
        if self._detector is not None and self._seed is not None:  # a spike that outlasts a rollback's skip is
            self._detector.feed(None, self._seed)  # one still: the resumed losses are no level of their own

    def feed(self, attempt: int, rank: int | None, beat: Beat) -> Diverged | None:
        """A new beat of `attempt`: the divergence it reveals (once per attempt), else None."""
        if self._detector is None or self.found is not None:
            return None
        if beat.loss is None and beat.loss_bad is None:
            self._lossless += 1
            if self._lossless == _UNGUARDED_AFTER:
                self.log.warning("divergence_unguarded", attempt=attempt, reason="its heartbeats carry no loss")
                self.status.divergence_guard = "off: the job's heartbeats carry no loss"
        else:  # guarded: beats without a loss in between (HF's steps not logged) say nothing
            self._lossless = _UNGUARDED_AFTER + 1
        op = self.open
        if op is not None and attempt > op.attempt and beat.loss is not None \
                and beat.step >= op.onset_step + self.cfg.skip_after_onset:
            self.log.info("divergence_closed", onset_step=op.onset_step, step=beat.step, attempt=attempt)
            self._save(None)
        found = self._detector.feed(rank, beat)
        if found is None:
            return None
        self.found = (attempt, found)
        before = self.open if same_region(self.open, found, self.cfg.skip_after_onset) else None
        rollbacks = before.rollbacks if before else 0
        self._save(Open(found.onset_step, found.step, found.rank, found.loss, found.why, attempt, rollbacks,
                        before.resume_step if before else None, before.skip if before else 0, found.since))
        if self.cfg.action == "rollback" and rollbacks < self.cfg.max_rollbacks and self.aimed:
            self.verdict = "rollback"
        elif self.cfg.action != "warn":
            self.verdict = "give_up"
        action = self.verdict or self.cfg.action
        self.bus.publish(Alarm("diverged", f"{found.why} loss {found.loss} at step {found.step} (rank {found.rank}), "
                               f"onset step {found.onset_step}; {action}", {
                                   "attempt": attempt, "onset_step": found.onset_step, "step": found.step,
                                   "rank": found.rank, "loss": found.loss, "why": found.why,
                                   "level": None if found.level is None else round(found.level, 4), "action": action}))
        return found

    def reason(self) -> str:
        """Why the supervisor gives up (at the diverged attempt's end: its saves are marked by then)."""
        assert self.found is not None and self.open is not None
        found, rollbacks = self.found[1], self.open.rollbacks
        loss = found.why if found.loss is None else f"{found.loss:.6g} (level {found.level or 0:.6g})"
        tried = f" after {rollbacks} rollback(s) of the same region" if rollbacks else ""
        if not self.aimed and self.cfg.action == "rollback":  # its newest save may be from after the onset
            tried = " (no rollback: resume_args name no {checkpoint} or {step}, the job would load its own pick)"
        return (f"diverged ({found.why}) at step {found.onset_step} (seen at step {found.step}, loss {loss}){tried}; "
                f"last good checkpoint: {self.good or 'none'} (kept)")

    def resumed(self, attempt: int) -> None:
        """A restarted supervisor whose last attempt diverged and was not rolled back yet: its first launch is that
        rollback (with the skip), unless the region's rollbacks are spent."""
        op = self.open
        if op is not None and op.attempt == attempt and self.cfg.action == "rollback" \
                and op.rollbacks < self.cfg.max_rollbacks:
            self.found = (attempt, Diverged(op.onset_step, op.step, op.rank, op.loss, op.why, since=op.since))
            self.verdict = "rollback"

    @property
    def stopping(self) -> bool:
        """The divergence found asks for the job to be stopped."""
        return self.verdict is not None

    # ---- checkpoints --------------------------------------------------------------------------------------
    def mark(self, checkpoints: Sequence[CheckpointInfo], attempt: int,
             quarantine: Callable[[str, str], None]) -> None:
        """Quarantine the saves of the diverged attempt from the onset on (until the next attempt is launched)."""
        op = self.open
        if op is None or attempt > op.attempt:
            return
        since = op.onset_step if op.since is None else op.since
        for c in diverged_saves(checkpoints, since):
            if (str(c.path), c.mtime) not in self._seen:  # a pass that began before the marker was written
                self._seen.add((str(c.path), c.mtime))
                self.marked.add(str(c.path))  # never resumed, whether or not the marker lands
                quarantine(str(c.path), f"{DIVERGED}saved after the last normal loss before the onset at step "
                                        f"{op.onset_step} ({op.why})")
        good = last_good(checkpoints, since, 1)
        self.good = str(good[0].path) if good else None
        self._show()

    def written(self, checkpoints: Sequence[CheckpointInfo], latest: int | None) -> int | None:
        """The newest step saved, the diverged saves counted (written, though never resumed): whether a stop's
        emergency save landed is judged by it."""
        steps = [c.step for c in checkpoints if c.complete and c.step is not None and str(c.path) in self.marked]
        return max([*steps, *([] if latest is None else [latest])], default=None)

    def protected(self, checkpoints: Sequence[CheckpointInfo]) -> list[Path]:
        """While a divergence is open: the last good checkpoint and the keep_last good ones before it."""
        op = self.open
        if op is None:
            return []
        since = op.onset_step if op.since is None else op.since
        return [c.path for c in last_good(checkpoints, since, 1 + self.keep_last)]

    # ---- the relaunch -------------------------------------------------------------------------------------
    def launching(self, attempt: int, checkpoint: CheckpointInfo | None) -> int:
        """A launch: the data steps it skips (0 unless it rolls a divergence back), said as `rolled_back`. From now on
        the markers on disk say what is diverged (one that could not be written: Core's unmarked set): a good save of
        the same step by this attempt replaces a diverged one (trainer/commit.py) and may be resumed."""
        self.marked = set()
        loss = checkpoint.metrics.get("loss") if checkpoint is not None and checkpoint.step is not None else None
        self._seed = None if loss is None or checkpoint is None else Beat(checkpoint.step or 0, loss=loss)
        if self.verdict != "rollback" or self.found is None or self.open is None:
            self.verdict = None
            return 0
        op, self.verdict = self.open, None
        resume = (checkpoint.step or 0) if checkpoint is not None else 0
        skip = skip_steps(op.onset_step, resume, self.cfg.skip_after_onset, op)
        self._save(Open(op.onset_step, op.step, op.rank, op.loss, op.why, op.attempt, op.rollbacks + 1, resume, skip,
                        op.since))
        self.status.rollbacks += 1
        to = str(checkpoint.path) if checkpoint else None
        self.bus.publish(Alarm("rolled_back", f"from step {op.step} to {to or 'a fresh start'}, skipping {skip} steps",
                               {"attempt": attempt, "from_step": op.step, "to_checkpoint": to,
                                "to_step": checkpoint.step if checkpoint else None, "skip": skip}))
        return skip
