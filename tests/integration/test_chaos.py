"""Chaos tier: one supervised run of the reference trainer (2 CPU ranks) takes four faults in a seeded random
order at seeded random moments, and still ends bit-identical to an uninterrupted run.

The faults (tests/chaos_faults.py): SIGKILL of a worker or the agent at a random step; SIGKILL while a save's
temporary dir exists; SIGSTOP of a worker (a hang) during which a shard of the newest checkpoint is truncated
(it must be skipped); SIGKILL of the supervisor in the middle of a retention delete, then a new supervisor (the
orphaned job must be stopped first). Throughout, a monitor checks: never two jobs on the checkpoint dir, state.json always
parses, the newest complete checkpoint never goes backwards; at the end every launch is checked to have resumed from
the newest complete checkpoint the root held (tests/matrix_checks.py). Reproduce a run with FSDP_CHAOS_SEED=<seed>;
FSDP_CHAOS_SOAK=K runs K more seeds (see docs/reliability.md).
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from supervisor.checkpoints import newest_complete
from tests.chaos import STEPS, ChaosRun, assert_same_weights, chaos_seeds, export_weights, job_config, reference
from tests.chaos_faults import assert_no_incomplete_final_dirs, plan, prepare_planted
from tests.helpers import assert_no_orphans
from tests.matrix_checks import deletion_violations, resume_violations
from tests.supervise import Supervisors, supervisors  # noqa: F401

CONFIG = """keep_last = 2
[restart]
backoff_initial_s = 0.2
backoff_max_s = 1
max_no_progress_restarts = 6
[health]
hang_timeout_s = 8
stack_dump_wait_s = 1
stop_timeout_s = 6
"""


@pytest.mark.timeout(900)  # the first seed also pays for the reference run; both are slower on a busy machine
@pytest.mark.parametrize("seed", chaos_seeds())
def test_seeded_faults_in_one_run_end_bit_identical(seed: int, tmp_path: Path, supervisors: Supervisors,
                                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    """Four seeded faults in one supervised run: it finishes, bit-identical, with every invariant held."""
    ref = reference(tmp_path_factory.getbasetemp())
    c = ChaosRun(tmp_path, supervisors, seed, job_config(tmp_path, CONFIG))
    faults = plan(c.rng, prepare_planted(tmp_path / "stage", ref.ckpts))
    c.say(f"seed {seed} (rerun: FSDP_CHAOS_SEED={seed}); plan: {', '.join(map(str, faults))}")
    started = time.monotonic()
    c.monitor.start()
    try:
        c.start_supervisor()
        c.wait_running(1)
        for fault in faults:
            t0 = time.monotonic()
            c.say(f"{fault.name}: {fault(c)} [{time.monotonic() - t0:.1f}s]")
            assert_no_incomplete_final_dirs(c)
            assert c.strays() == [], f"processes outside the supervisor's tree after {fault.name}"
        rc, out = c.finish()
    finally:
        c.monitor.stop()
    c.say(f"finished in {time.monotonic() - started:.1f}s, {c.attempt()} attempts")
    assert rc == 0, out
    st = c.dirs.state()
    assert st["state"] == "completed" and st["attempt"] == 1 + len(faults), (st, c.notes)
    assert c.monitor.violations == [], c.monitor.violations
    assert c.monitor.max_jobs == 1
    assert resume_violations(c) == []  # every launch resumed from the newest complete checkpoint the root held
    assert deletion_violations(c) == []
    assert_no_orphans(supervisors.tag)
    c.torn.clear()
    assert_no_incomplete_final_dirs(c)
    final = newest_complete(c.dirs.root)
    assert final is not None and final.step == STEPS
    assert_same_weights(export_weights(final.path, tmp_path / "out.pt"), ref.weights, f"(seed {seed})")
