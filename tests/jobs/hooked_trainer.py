"""TEST-ONLY trainer entry: the reference trainer with hooks that stop it at an exact point, set by environment.

The production trainer has no test code paths; tests that must act at one precise moment of a save launch this
script instead of `-m trainer` (`torchrun ... tests/jobs/hooked_trainer.py ARGS`, or `python
tests/jobs/hooked_trainer.py ARGS` for one process). It wraps the trainer's functions, then runs
tests/trainer_rc.py, which runs `python -m trainer` in-process (and records the exit code where a test asks).
Each hook is inert unless its variable is set:

FSDP_TRAINER_TEST_STALL_COMMIT_STEP=N   rank 0 sleeps before committing the save of step N (DCP wrote it all,
                                        no manifest, no rename), so a test can kill it mid-save.
FSDP_TRAINER_TEST_HOLD_SAVE_STEP=N      every rank holds the save of step N (once the previous save committed,
FSDP_TRAINER_TEST_HOLD_SAVE_UNTIL=F     before writing anything) until the file F exists (at most 600 s), so a
                                        test can act between two saves (fill the disk).
FSDP_TRAINER_TEST_STALL_BEST_STEP=N     the best model of step N stalls between its weights and its best.json.
FSDP_TRAINER_TEST_HOLD_TRAIN_STEP=N,M   every rank holds after step N (its save, if any, committed), before the
FSDP_TRAINER_TEST_HOLD_TRAIN_UNTIL=F    next step, until the file F.N exists (at most 600 s), and so on for each
                                        listed step: a test can kill a rank at known steps (warm workers, tiers).
FSDP_TRAINER_TEST_PACE_SAVES=1          every save waits (at most 60 s) until the supervisor's state.json names the
                                        newest checkpoint committed in the root: its pass (and retention) has
                                        seen the last save. A job saving faster than a pass can prune behind it
                                        (50 ms steps here) would race retention; this one still runs out of
                                        space if retention does not free what it should.
FSDP_TRAINER_TEST_SLOW_RANK=R           rank R sleeps S seconds in every optimizer step (after the backward's last
FSDP_TRAINER_TEST_SLOW_S=S              collective, before the loss all-reduce): a straggler the others wait for.
FSDP_TRAINER_TEST_SLOW_WHILE=F          with SLOW_RANK: only while the file F exists (a job a test slows down on cue,
                                        so that it still trains, but does not finish, while the test waits).
FSDP_TRAINER_TEST_SAVE_GATE=F           while the file F exists, every rank holds its next save (once the previous
                                        save committed, before writing anything) and shows it by a file
                                        `F.held-<rank>` (removed when it goes on): a test acts between two saves.
FSDP_TRAINER_TEST_NAN_AT_SAMPLE=S       the loss is NaN (so are the weights after its step) on the step whose global
                                        batch begins at sample S: bad data, which a rollback's skip avoids.
FSDP_TRAINER_TEST_NAN_AT_STEP=N         the loss is NaN on step N whatever its data: a divergence no skip avoids.
FSDP_TRAINER_TEST_SPIKE_SAMPLES=A,B     the loss is 50 times higher (finite; Adam's steps hardly change) on every
                                        step whose global batch begins at a sample in [A, B): a spike in bad data.
"""
from __future__ import annotations

import json
import os
import re
import runpy
import time
from pathlib import Path
from typing import Any

STALL_COMMIT_ENV = "FSDP_TRAINER_TEST_STALL_COMMIT_STEP"
HOLD_SAVE_STEP_ENV = "FSDP_TRAINER_TEST_HOLD_SAVE_STEP"
HOLD_SAVE_UNTIL_ENV = "FSDP_TRAINER_TEST_HOLD_SAVE_UNTIL"
STALL_BEST_ENV = "FSDP_TRAINER_TEST_STALL_BEST_STEP"
PACE_SAVES_ENV = "FSDP_TRAINER_TEST_PACE_SAVES"
HOLD_TRAIN_STEP_ENV = "FSDP_TRAINER_TEST_HOLD_TRAIN_STEP"
HOLD_TRAIN_UNTIL_ENV = "FSDP_TRAINER_TEST_HOLD_TRAIN_UNTIL"
SLOW_RANK_ENV = "FSDP_TRAINER_TEST_SLOW_RANK"
SLOW_S_ENV = "FSDP_TRAINER_TEST_SLOW_S"
SLOW_WHILE_ENV = "FSDP_TRAINER_TEST_SLOW_WHILE"
SAVE_GATE_ENV = "FSDP_TRAINER_TEST_SAVE_GATE"
NAN_SAMPLE_ENV = "FSDP_TRAINER_TEST_NAN_AT_SAMPLE"
NAN_STEP_ENV = "FSDP_TRAINER_TEST_NAN_AT_STEP"
SPIKE_ENV = "FSDP_TRAINER_TEST_SPIKE_SAMPLES"
_POISON = [False]  # this step's loss is to be NaN (set before each step)
_SCALE = [1.0]  # this step's loss is multiplied by this
PACE_MAX_S = 60.0
_COMMITTED = re.compile(r"step_(\d{8})")  # the reference trainer's committed name (supervisor/layout.py)
HOLD_MAX_S = 600.0
STALL_S = 3600.0  # "forever": the test kills the process
HERE = Path(__file__).resolve()
RC_ENTRY = HERE.parents[1] / "trainer_rc.py"


def _hold(step: int) -> None:
    until = os.environ.get(HOLD_SAVE_UNTIL_ENV)
    if until and os.environ.get(HOLD_SAVE_STEP_ENV) == str(step):
        deadline = time.monotonic() + HOLD_MAX_S
        while not os.path.exists(until) and time.monotonic() < deadline:
            time.sleep(0.05)


def _gate() -> None:
    """SAVE_GATE: wait (at most HOLD_MAX_S) while the gate file exists, saying so by `<gate>.held-<rank>`."""
    gate = os.environ.get(SAVE_GATE_ENV)
    if not gate or not os.path.exists(gate):
        return
    held = Path(f"{gate}.held-{os.environ.get('RANK', '0')}")
    held.touch()
    try:
        deadline = time.monotonic() + HOLD_MAX_S
        while os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        held.unlink(missing_ok=True)


def _seen_step(run_dir: Path) -> int:
    try:
        latest = json.loads((run_dir / "state.json").read_text()).get("latest_checkpoint") or {}
    except (OSError, ValueError):
        return -1
    return latest.get("step") if isinstance(latest.get("step"), int) else -1


def _pace(root: Path) -> None:
    """Wait until the supervisor has seen the newest checkpoint committed in `root` (see PACE_SAVES)."""
    run_dir = os.environ.get("FSDP_SUPERVISOR_RUN_DIR")
    if not os.environ.get(PACE_SAVES_ENV) or not run_dir:
        return
    names = [m for e in (os.listdir(root) if root.is_dir() else []) if (m := _COMMITTED.fullmatch(e))]
    newest = max((int(m[1]) for m in names), default=-1)
    deadline = time.monotonic() + PACE_MAX_S
    while _seen_step(Path(run_dir)) < newest and time.monotonic() < deadline:
        time.sleep(0.02)


def install() -> None:
    """Wrap the trainer's save, commit and best-model write with the hooks (imports torch)."""
    import trainer.best
    import trainer.checkpoint
    import trainer.loop
    from trainer.checkpoint import Checkpointer, SaveResult

    save, commit = Checkpointer.save, Checkpointer._commit

    def held_save(self: Checkpointer, step: int, state: dict[str, Any], **kwargs: Any) -> SaveResult:
        self.wait()  # the previous save commits first (save's own first step, a no-op when repeated)
        _hold(step)
        _gate()
        _pace(self.root)
        return save(self, step, state, **kwargs)

    def stalled_commit(self: Checkpointer, result: SaveResult) -> None:
        if trainer.checkpoint._rank() == 0 and os.environ.get(STALL_COMMIT_ENV) == str(result.step):
            time.sleep(STALL_S)
        commit(self, result)

    train_step = trainer.loop.Trainer.train_step

    def held_train_step(self: trainer.loop.Trainer) -> float:
        step, until = self.progress.step, os.environ.get(HOLD_TRAIN_UNTIL_ENV)
        _POISON[0] = (os.environ.get(NAN_SAMPLE_ENV) == str(self.progress.sample_index)
                      or os.environ.get(NAN_STEP_ENV) == str(step + 1))
        spike = [int(v) for v in os.environ.get(SPIKE_ENV, "").split(",") if v]
        _SCALE[0] = 50.0 if spike and spike[0] <= self.progress.sample_index < spike[1] else 1.0
        if until and str(step) in os.environ.get(HOLD_TRAIN_STEP_ENV, "").split(","):
            deadline = time.monotonic() + HOLD_MAX_S
            while not os.path.exists(f"{until}.{step}") and time.monotonic() < deadline:
                time.sleep(0.05)
        try:
            return train_step(self)
        finally:
            _POISON[0], _SCALE[0] = False, 1.0

    lm_loss = trainer.loop.lm_loss

    def poisoned_loss(*args: Any, **kwargs: Any) -> Any:
        loss = lm_loss(*args, **kwargs)
        return loss * float("nan") if _POISON[0] else loss * _SCALE[0]

    trainer.loop.lm_loss = poisoned_loss  # type: ignore[assignment]
    trainer.loop.Trainer.train_step = held_train_step  # type: ignore[method-assign]
    Checkpointer.save = held_save  # type: ignore[method-assign]
    Checkpointer._commit = stalled_commit  # type: ignore[method-assign]

    write_atomic = trainer.best.write_atomic

    def stalled_write_atomic(path: Path, data: bytes, *args: Any, **kwargs: Any) -> Any:
        # write_best's last write: best.json, after the weights are in place
        if path.name == trainer.best.BEST_FILE and os.environ.get(STALL_BEST_ENV) == str(json.loads(data)["step"]):
            time.sleep(STALL_S)
        return write_atomic(path, data, *args, **kwargs)

    trainer.best.write_atomic = stalled_write_atomic  # type: ignore[assignment]
    _slow_rank()


def _slow_rank() -> None:
    """SLOW_RANK: that rank's optimizer steps take SLOW_S longer (the class is patched before the trainer builds one)."""
    if os.environ.get(SLOW_RANK_ENV) is None or os.environ.get(SLOW_RANK_ENV) != os.environ.get("RANK"):
        return
    import torch

    delay = float(os.environ.get(SLOW_S_ENV, "0.2"))
    only_while = os.environ.get(SLOW_WHILE_ENV)
    step = torch.optim.AdamW.step

    def slow_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if only_while is None or os.path.exists(only_while):
            time.sleep(delay)
        return step(self, *args, **kwargs)

    torch.optim.AdamW.step = slow_step  # type: ignore[method-assign]


if __name__ == "__main__":
    install()
    runpy.run_path(str(RC_ENTRY), run_name="__main__")
