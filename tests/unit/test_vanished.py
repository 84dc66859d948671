"""Housekeeper: a complete or pinned checkpoint gone without retention deleting it is said (issue 35 item 11)."""
from __future__ import annotations

import shutil
from pathlib import Path

from supervisor import checkpoints as store
from supervisor.config import load_config
from supervisor.daemon.housekeeping import Housekeeper
from tests.chaos import job_config
from tests.fakes import RecordingLog
from tests.jobs.dcp_files import write_checkpoint


def house(tmp_path: Path, toml: str) -> tuple[Housekeeper, RecordingLog]:
    log = RecordingLog()
    h = Housekeeper(load_config(job_config(tmp_path, toml)), log=log, now=lambda: 0.0)  # type: ignore[arg-type]
    return h, log


def vanished(h: Housekeeper, log: RecordingLog, generation: int) -> list[dict]:
    h.absorb(h.run_pass(generation=generation, protect=()))
    return [kw for e, kw in log.events if e == "checkpoints_vanished"]


def test_a_client_s_rotation_of_a_pinned_and_a_committed_checkpoint_is_said_once(tmp_path: Path) -> None:
    """The HF Trainer's save_total_limit removes checkpoint-10 (pinned) and checkpoint-20 between two passes."""
    root = tmp_path / "ckpts"
    for step in (10, 20, 30):
        write_checkpoint(root, step, name=f"checkpoint-{step}")
    store.pin(root / "checkpoint-10")
    h, log = house(tmp_path, "keep_last = 0\n")
    assert vanished(h, log, 0) == []  # the baseline
    for step in (10, 20):
        shutil.rmtree(root / f"checkpoint-{step}")
    write_checkpoint(root, 40, name="checkpoint-40")
    assert vanished(h, log, 1) == [{
        "count": 2, "paths": [str(root / "checkpoint-20"), str(root / "checkpoint-10")], "steps": [20, 10],
        "pinned": [str(root / "checkpoint-10")],
        "detail": "not deleted by this run's retention (the job's own rotation, or by hand)"}]
    assert len(vanished(h, log, 2)) == 1  # said once


def test_retention_s_own_deletions_and_unfinished_saves_are_not(tmp_path: Path) -> None:
    """keep_last = 1 deletes the older saves itself; a partial save the job removed was never committed."""
    root = tmp_path / "ckpts"
    for step in (10, 20):
        write_checkpoint(root, step, name=f"checkpoint-{step}")
    (root / "checkpoint-30").mkdir()  # a save in flight
    h, log = house(tmp_path, "keep_last = 1\n")
    assert vanished(h, log, 0) == []
    write_checkpoint(root, 40, name="checkpoint-40")
    shutil.rmtree(root / "checkpoint-30")
    assert vanished(h, log, 1) == [] and not (root / "checkpoint-20").exists()  # retention deleted 20 (and 10)


def test_a_node_that_does_not_prune_says_nothing_of_another_node_s_retention(tmp_path: Path) -> None:
    """prune = false on all but one node of a multi-node job: what the pruning node's retention deletes from the
    shared root is not a vanished checkpoint on every other node."""
    root = tmp_path / "ckpts"
    for step in (10, 20, 30):
        write_checkpoint(root, step)
    h, log = house(tmp_path, "prune = false\nkeep_last = 1\n")
    assert vanished(h, log, 0) == []
    other, _ = house(tmp_path, "keep_last = 1\n")  # node 0's supervisor on the same root
    other.absorb(other.run_pass(generation=0, protect=()))
    assert [c.step for c in store.scan(root) if c.complete] == [30]
    assert vanished(h, log, 1) == []


def test_a_root_moved_aside_or_removed_and_made_again_is_said(tmp_path: Path) -> None:
    """`mv ckpts ckpts.old && mkdir ckpts` (or `rm -rf ckpts && mkdir ckpts`) between two passes: every checkpoint
    the job could resume from is gone from the root; a checkpoint copied into the new root is not."""
    root = tmp_path / "ckpts"
    for step in (10, 20):
        write_checkpoint(root, step)
    h, log = house(tmp_path, "keep_last = 0\n")
    assert vanished(h, log, 0) == []
    root.rename(tmp_path / "ckpts.old")
    root.mkdir()
    shutil.copytree(tmp_path / "ckpts.old" / "step_00000020", root / "step_00000020")
    assert [e["steps"] for e in vanished(h, log, 1)] == [[10]]
