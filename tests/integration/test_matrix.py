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
from pathlib import Path

import pytest

from tests.chaos import chaos_seeds, reference
from tests.chaos_faults import strike
from tests.matrix import Cell, session_cells
from tests.matrix_checks import assert_promises_kept
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
    rc, out = strike(c, events, before_the_end=c.fast)
    assert rc == 0, out
    assert c.keep.changed() == []
    if not root.retention:
        assert c.dirs.events("retention_stopped") and not c.dirs.events("retention_deleted")
    if cell.root != "recreated":  # a pass while the root is moved aside fails (and says so): elsewhere none may
        assert not c.dirs.events("checkpoint_scan_failed"), c.dirs.events("checkpoint_scan_failed")
    assert_promises_kept(c, rc, out, attempts=2, ref=ref, context=f"(cell {cell}, seed {seed})")  # one fault: one relaunch
