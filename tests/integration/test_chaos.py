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

from pathlib import Path

import pytest

from tests.chaos import CONFIG, TORCHRUN, ChaosRun, chaos_seeds, job_config, reference, train_args
from tests.chaos_faults import plan, prepare_planted, strike
from tests.helpers import HOOKED_ENTRY
from tests.jobs.hooked_trainer import SLOW_RANK_ENV, SLOW_S_ENV
from tests.matrix_checks import assert_promises_kept
from tests.supervise import Supervisors, supervisors  # noqa: F401

SLOW_S = 0.15


@pytest.mark.timeout(900)  # the first seed also pays for the reference run; both are slower on a busy machine
@pytest.mark.parametrize("seed", chaos_seeds())
def test_seeded_faults_in_one_run_end_bit_identical(seed: int, tmp_path: Path, supervisors: Supervisors,
                                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    """Four seeded faults in one supervised run: it finishes, bit-identical, with every invariant held."""
    ref = reference(tmp_path_factory.getbasetemp())
    # Rank 0 takes SLOW_S more a step: with warm workers a relaunch takes a second on a quiet machine, and the
    # job ran to its end before the next fault found a worker to kill.
    command = [*TORCHRUN, str(HOOKED_ENTRY), *train_args(str(tmp_path / "ckpts"))[2:]]
    config = job_config(tmp_path, CONFIG, command=command, env={SLOW_RANK_ENV: "0", SLOW_S_ENV: str(SLOW_S)})
    c = ChaosRun(tmp_path, supervisors, seed, config)
    faults = plan(c.rng, prepare_planted(tmp_path / "stage", ref.ckpts))
    c.say(f"seed {seed} (rerun: FSDP_CHAOS_SEED={seed}); plan: {', '.join(map(str, faults))}")
    rc, out = strike(c, [(fault.name, fault) for fault in faults])
    assert_promises_kept(c, rc, out, attempts=1 + len(faults), ref=ref, context=f"(seed {seed})")
