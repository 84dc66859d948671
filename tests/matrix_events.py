"""What happens to a matrix cell's run: a second supervisor tries the root, the supervisor is suspended, a backup
copy appears, the root is re-created, and one fault ends an attempt (the kill points of tests/chaos_faults.py).

`CellRun` is a `ChaosRun` (tests/chaos.py) that also knows its cell, its root and what must stay untouched;
`plan(c)` draws the events of its cell in a seeded order with seeded parameters. Each event checks the outcome
specific to it and returns a one-line note; the run-wide invariants are tests/matrix_checks.py's.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from supervisor.checkpoints import newest_complete
from tests.chaos import CONFIG, STEPS, TIMEOUT, TORCHRUN, ChaosRun, Reference, job_config, train_args
from tests.chaos_faults import (
    PLANTED,
    assert_no_incomplete_final_dirs,
    kill_at_random_moment,
    kill_during_save,
    kill_supervisor_mid_retention,
    prepare_planted,
    take_over,
)
from tests.helpers import HOOKED_ENTRY, suspended, wait_for
from tests.jobs.hooked_trainer import SAVE_GATE_ENV, SLOW_RANK_ENV, SLOW_S_ENV, SLOW_WHILE_ENV
from tests.matrix import SUSPEND_S, Cell
from tests.matrix_setup import Keep, Root
from tests.supervise import Supervisors

__all__ = ["CellRun", "plan"]

SLOW_S = 1.0  # rank 0's extra seconds per step while the events happen: time for them, and steps left for each
Event = Callable[["CellRun"], str]


class CellRun(ChaosRun):
    """One cell's supervised run (the hooked trainer, so a test can gate a save or slow the job on cue). The job
    trains slowly (SLOW_S more per step) until `fast()`: the events, a 15 s suspension included, fit in its steps."""

    def __init__(self, base: Path, supervisors: Supervisors, seed: int, cell: Cell, root: Root, ref: Reference) -> None:
        self.cell, self.where, self.ref = cell, root, ref
        self.gate, self.slow = base / "save-gate", base / "slow"
        env = {SLOW_RANK_ENV: "0", SLOW_S_ENV: str(SLOW_S), SLOW_WHILE_ENV: str(self.slow),
               SAVE_GATE_ENV: str(self.gate)}
        command = [*TORCHRUN, str(HOOKED_ENTRY), *train_args(str(root.spelled))[2:]]
        self.job = functools.partial(job_config, base, CONFIG, command=command, env=env)
        super().__init__(base, supervisors, seed, self.job(root=root.spelled), root.resolved)
        self.other = self.job(root=root.spelled if cell.contender == "other_config" else root.alias, name="b.toml")
        self.other.write_text(self.other.read_text() + '[supervisor]\nrun_dir = "run-b"\n')
        self.keep = Keep()
        self.refused: list[str] = []  # each contender's one line
        self.slow.touch()

    def fast(self) -> None:
        self.slow.unlink()

    def newest(self) -> Path:
        """The newest complete checkpoint of the run (waiting for the first one)."""
        found = wait_for(lambda: newest_complete(self.dirs.root), TIMEOUT, "a complete checkpoint")
        return found.path  # type: ignore[attr-defined]


# ---- a second supervisor on the root -----------------------------------------------------------------------
def contend(c: CellRun, holder: int) -> str:
    """`run` with the cell's contender config while the root is held (by supervisor or job `holder`): exit 2,
    one line naming the holder, nothing launched (the monitor would see a second job)."""
    p = c.supervisors.start(c.config if c.cell.contender == "same_config" else c.other)
    try:
        out, _ = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise AssertionError(f"a second `run` ({c.cell.contender}) on the root was not refused") from None
    lines = [line for line in out.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1 and f"pid {holder}" in out, (p.returncode, out)
    c.refused.append(lines[0])
    return f"{c.cell.contender} refused (exit 2): {lines[0][:160]}"


def contend_while_training(c: CellRun) -> str:
    c.wait_training(1)
    assert c.proc is not None
    return contend(c, c.proc.pid)


# ---- the supervisor suspended ------------------------------------------------------------------------------
def suspend(c: CellRun, contend_meanwhile: bool) -> str:
    """SIGSTOP the supervisor for SUSPEND_S while the job trains on (slowly: it cannot finish meanwhile), then
    SIGCONT: no hang verdict, no relaunch (the attempt count at the end says so), the job keeps training."""
    attempt = c.attempt()
    before = c.wait_training(1)
    assert c.proc is not None
    t0, also = time.monotonic(), ""
    with suspended(c.proc):
        if contend_meanwhile:
            also = f"; meanwhile {contend(c, c.proc.pid)}"
        time.sleep(max(0.0, SUSPEND_S - (time.monotonic() - t0)))
    during = c.dirs.beat().step - before  # type: ignore[union-attr]
    assert during >= 3, f"the job did not train while its supervisor was suspended ({during} steps)"
    step = c.wait_training(2, past=before + during)
    assert c.attempt() == attempt and not c.dirs.events("hang_detected"), c.dirs.events("hang_detected")
    return f"SIGSTOP supervisor {SUSPEND_S:.0f}s at step {before}: the job trained {during} steps meanwhile, " \
           f"then on to {step} in the same attempt{also}"


# ---- a copy appears in the root ----------------------------------------------------------------------------
def backup(c: CellRun, kind: str) -> str:
    """Copy checkpoints into the root as a user does (`cp -a`): a `backup/` folder, a `step_N.bak`, or both. The
    folder also holds the last checkpoint of another run of this job, newer than anything this run has: ranked,
    it would be resumed from."""
    c.wait_training(1)
    newest, made = c.newest(), []
    if kind in ("backup_dir", "both"):
        folder = c.dirs.root / "backup"
        shutil.copytree(c.ref.ckpts / f"step_{STEPS:08d}", folder / f"step_{STEPS:08d}")
        shutil.copytree(newest, folder / newest.name)
        made.append(folder)
    if kind in ("bak_copy", "both"):
        shutil.copytree(newest, c.dirs.root / f"{newest.name}.bak")
        made.append(c.dirs.root / f"{newest.name}.bak")
    c.keep.add(*made)
    return f"copied {newest.name} into {', '.join(p.name for p in made)}"


# ---- the root re-created -----------------------------------------------------------------------------------
def recreate(c: CellRun) -> str:
    """Between two saves (the trainer held at its next one), move the root aside and restore it from that copy:
    a new directory under the same path. Commits into it must be seen and resumed from."""
    c.wait_training(1)
    c.gate.touch()
    wait_for(lambda: all(Path(f"{c.gate}.held-{r}").exists() for r in (0, 1)), 120, "both ranks held at a save")
    root, old = c.dirs.root, c.dirs.base / "ckpts.old"
    with c.monitor.lock:  # nothing is lost: the restored root holds all it held
        os.rename(root, old)
        shutil.copytree(old, root, symlinks=True)
    c.keep.add(old)  # the copy moved aside is the user's now
    newest = c.dirs.newest_step()
    c.gate.unlink()
    step = c.wait_commit(above=newest)
    wait_for(lambda: (c.dirs.state().get("latest_checkpoint") or {}).get("step", 0) >= step, 60,
             f"the supervisor to see step {step} in the re-created root")
    assert c.dirs.events("checkpoint_root_replaced") or c.dirs.events("watch_restored")
    return f"root moved to {old.name} and restored from it at step {newest}; step {step} committed there and seen"


# ---- the fault that ends an attempt ------------------------------------------------------------------------
def kill_supervisor_retention_stopped(c: CellRun, planted: Path, while_orphaned: Callable[[], str] | None) -> str:
    """Where retention cannot delete (nothing to catch mid-delete): SIGKILL the supervisor with an old
    checkpoint planted, then a new supervisor. The planted one is still there afterwards."""
    attempt = c.attempt()
    c.wait_training(1)
    shutil.copytree(planted, c.dirs.root / PLANTED)  # another file system: copied, not renamed, in
    c.wait_training(c.rng.randint(1, 3))
    assert c.proc is not None
    c.proc.kill()
    c.proc.wait(30)
    assert_no_incomplete_final_dirs(c)
    st, agent, also = take_over(c, attempt, while_orphaned)
    assert (c.dirs.root / PLANTED).is_dir(), "retention was stopped, yet the planted checkpoint was deleted"
    return f"SIGKILL supervisor (retention stopped); {also}new supervisor stopped orphan {agent}, " \
           f"resumed from {st['resumed_from']}"


def kill(c: CellRun, contend_orphaned: bool) -> str:
    victims = {"worker": ["rank0", "rank1"], "agent": ["agent"], "during_save": ["rank0", "rank1", "agent"]}
    if c.cell.kill in ("worker", "agent"):
        return kill_at_random_moment(c, c.rng.choice(victims[c.cell.kill]), c.rng.randint(1, 3))
    if c.cell.kill == "during_save":
        return kill_during_save(c, c.rng.choice(victims["during_save"]), round(c.rng.uniform(0.0, 0.2), 3))
    stage = c.where.stage
    stage.mkdir(exist_ok=True)
    planted = prepare_planted(stage, c.ref.ckpts)
    meanwhile = None
    if contend_orphaned:
        def meanwhile() -> str:
            job = c.dirs.job()
            assert job is not None
            return contend(c, job.pid)
    if c.where.retention:
        return kill_supervisor_mid_retention(c, planted, meanwhile)
    return kill_supervisor_retention_stopped(c, planted, meanwhile)


def plan(c: CellRun) -> list[tuple[str, Event]]:
    """The cell's events in a seeded order; the contender strikes at a seeded moment: while the job trains,
    while the supervisor is suspended, or while a killed supervisor's job runs on without it."""
    moments = ["training", *(["suspended"] if c.cell.suspend else []),
               *(["orphaned"] if c.cell.kill == "supervisor" and c.cell.contender != "same_config" else [])]
    moment = c.rng.choice(moments)
    events: list[tuple[str, Event]] = [
        (f"backup({c.cell.backup})", lambda c: backup(c, c.cell.backup)),
        (f"kill({c.cell.kill})", lambda c: kill(c, moment == "orphaned")),
    ]
    if c.cell.suspend:
        events.append(("suspend", lambda c: suspend(c, moment == "suspended")))
    if c.cell.root == "recreated":
        events.append(("recreate", recreate))
    if moment == "training":
        events.append((f"contend({c.cell.contender})", contend_while_training))
    c.rng.shuffle(events)
    return events
