"""An unfinished save's idleness (retention's rule 3) across a step of the wall clock (issue 35 item 8).

Its age is read on the file clock when a pass first sees its newest mtime, then counted on the monotonic clock: a
+2 h step of the wall clock while a save is in flight does not make it "idle 7200 s"; really idle, it still goes.
"""
from __future__ import annotations

import time
from pathlib import Path

from supervisor.config import load_config
from supervisor.daemon.housekeeping import Housekeeper
from tests.chaos import job_config
from tests.jobs.dcp_files import write_checkpoint


def test_a_wall_clock_step_does_not_age_a_save_in_flight(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    for step in (10, 20):
        write_checkpoint(root, step)
    partial = write_checkpoint(root, 30)
    (partial / ".metadata").unlink()
    wall, mono = [time.time()], [100.0]
    house = Housekeeper(load_config(job_config(tmp_path, "")), log=None, now=lambda: wall[0], monotonic=lambda: mono[0])

    def deleted() -> list[str]:
        return [d.name for d in house.run_pass(generation=0, protect=()).deleted]

    assert deleted() == [] and partial.is_dir()
    wall[0] += 7200  # the clock steps 2 h ahead; 10 s pass
    mono[0] += 10
    assert deleted() == [] and partial.is_dir()
    mono[0] += 3600  # now it has been idle an hour and 10 s, by the monotonic clock
    assert deleted() == ["step_00000030"] and not partial.exists()


def test_old_debris_still_goes_at_the_first_pass(tmp_path: Path) -> None:
    """Unfinished saves already idle past partial_max_age_s when first seen are not given a fresh hour."""
    root = tmp_path / "ckpts"
    write_checkpoint(root, 10)
    partial = write_checkpoint(root, 30)
    (partial / ".metadata").unlink()
    house = Housekeeper(load_config(job_config(tmp_path, "")), log=None, now=lambda: time.time() + 7200)
    assert [d.name for d in house.run_pass(generation=0, protect=()).deleted] == ["step_00000030"]
