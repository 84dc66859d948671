"""The setup matrix (tests/matrix.py): the reference trainer (2 CPU ranks) supervised in users' setups - a plain
root, a symlink onto another file system, a mount point under a read-only parent, a root re-created mid-run -
with a second supervisor trying the same root, the supervisor suspended, backup copies in the root, and one
fault (a worker, the agent, a save, the supervisor mid-delete). After every run the invariants are checked as
code: resumed whenever a complete checkpoint existed, never two jobs on one root, nothing deleted that the run
did not write, final weights bit-identical with an uninterrupted run of the same seed and world size.

`make test` runs a seeded sample (printed with its seed: FSDP_CHAOS_SEED=N replays it); `make soak` runs every
cell (FSDP_MATRIX=full). The mounts need root: those cells skip, saying why, without it.
"""
from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from supervisor.checkpoints import newest_complete
from tests.chaos import STEPS, assert_same_weights, chaos_seeds, export_weights, reference
from tests.chaos_faults import assert_no_incomplete_final_dirs
from tests.helpers import assert_no_orphans
from tests.matrix import Cell, session_cells
from tests.matrix_checks import deletion_violations, resume_violations
from tests.matrix_events import CellRun, plan
from tests.matrix_setup import build_root, plant_foreign, prepopulate
from tests.mounts import mounts  # noqa: F401
from tests.supervise import Supervisors, supervisors  # noqa: F401

SEED = chaos_seeds()[0]  # one seed per session for the chaos tier: FSDP_CHAOS_SEED replays the sample and its moments


@pytest.mark.timeout(900)  # may pay for the shared reference run too
@pytest.mark.parametrize("cell", session_cells(SEED), ids=str)
def test_setup_cell_keeps_every_promise(cell: Cell, tmp_path: Path, supervisors: Supervisors, mounts: list[Path],
                                        tmp_path_factory: pytest.TempPathFactory) -> None:
    """One supervised run in the cell's setup, with its events and fault: it completes, bit-identical, having
    resumed at every launch, never run two jobs on the root, and deleted nothing that was not the run's."""
    ref = reference(tmp_path_factory.getbasetemp())
    root = build_root(cell.root, tmp_path, mounts)
    seed = random.Random(f"{SEED}:{cell}").randrange(2**31)
    c = CellRun(tmp_path, supervisors, seed, cell, root, ref)
    start = c.rng.choice([0, 5, 10, 15])
    prepopulate(root.resolved, ref.ckpts, start)
    c.keep.add(*plant_foreign(root.resolved, tmp_path), c.other)
    events = plan(c)
    c.say(f"cell {cell} (rerun: FSDP_CHAOS_SEED={SEED} pytest tests/integration/test_matrix.py -k '{cell}', or every "
          f"cell: FSDP_MATRIX=full); root from step {start}; events: {', '.join(name for name, _ in events)}")
    started = time.monotonic()
    c.monitor.start()
    try:
        c.start_supervisor()
        c.wait_running(1)
        for name, event in events:
            t0 = time.monotonic()
            c.say(f"{name}: {event(c)} [{time.monotonic() - t0:.1f}s]")
            assert_no_incomplete_final_dirs(c)
            assert c.strays() == [], f"processes outside the supervisor's tree after {name}"
        c.fast()
        rc, out = c.finish()
    finally:
        c.monitor.stop()
    c.say(f"finished in {time.monotonic() - started:.1f}s, {c.attempt()} attempts")
    assert rc == 0, out
    st = c.dirs.state()
    assert st["state"] == "completed" and st["attempt"] == 2, (st, c.notes)  # one fault: exactly one relaunch
    assert c.monitor.violations == [] and c.monitor.max_jobs == 1, c.monitor.violations
    assert resume_violations(c) == []
    assert deletion_violations(c) == []
    assert c.keep.changed() == []
    if not root.retention:
        assert c.dirs.events("retention_stopped") and not c.dirs.events("retention_deleted")
    if cell.root != "recreated":  # a pass while the root is moved aside fails (and says so): elsewhere none may
        assert not c.dirs.events("checkpoint_scan_failed"), c.dirs.events("checkpoint_scan_failed")
    assert_no_orphans(supervisors.tag)
    assert_no_incomplete_final_dirs(c)
    final = newest_complete(c.dirs.root)
    assert final is not None and final.step == STEPS
    assert_same_weights(export_weights(final.path, tmp_path / "out.pt"), ref.weights, f"(cell {cell}, seed {seed})")
