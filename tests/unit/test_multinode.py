"""Two nodes on one machine: two supervisors, torchrun's c10d rendezvous, one shared checkpoint dir.

Also the scheduler examples shipped for multi-node runs (Slurm sbatch, Kubernetes Job).
"""
from __future__ import annotations

from tests.supervise import REPO, Supervisors, supervisors, wait_for  # noqa: F401

# ---- scheduler examples ---------------------------------------------------------------------------------------
SBATCH = REPO / "deploy" / "slurm" / "fsdp-supervisor.sbatch"


class TestSlurmScript:
    def test_slurm_directives(self) -> None:
        """One task per node, a pre-timeout USR1 to the batch shell alone, and requeue allowed."""
        directives = [line.split(None, 1)[1] for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH ")]
        assert "--ntasks-per-node=1" in directives and "--requeue" in directives
        assert any(d.startswith("--signal=B:USR1@") for d in directives)
