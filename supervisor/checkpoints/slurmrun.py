"""Which run of which Slurm job a supervisor is in: a claim from an earlier run of the same job is stale at once
(claim.py), because Slurm starts a requeued job only after every process of its previous run has ended."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["SlurmRun"]


@dataclass(frozen=True)
class SlurmRun:
    """The Slurm job a supervisor runs in, and which run of it (SLURM_RESTART_COUNT: absent, then 1, 2, ... after
    each requeue). `cluster` is SLURM_CLUSTER_NAME: job ids are per cluster."""

    cluster: str
    job_id: str
    restart: int

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> SlurmRun | None:
        job_id = environ.get("SLURM_JOB_ID", "")
        if not job_id:
            return None
        count = environ.get("SLURM_RESTART_COUNT", "")
        return cls(environ.get("SLURM_CLUSTER_NAME", ""), job_id, int(count) if count.isdigit() else 0)

    @classmethod
    def from_doc(cls, doc: Any) -> SlurmRun | None:
        if not isinstance(doc, dict):
            return None
        cluster, job_id, restart = doc.get("cluster"), doc.get("job"), doc.get("restart")
        if not (isinstance(cluster, str) and isinstance(job_id, str) and isinstance(restart, int)):
            return None
        return cls(cluster, job_id, restart)

    def doc(self) -> dict[str, Any]:
        return {"cluster": self.cluster, "job": self.job_id, "restart": self.restart}

    def follows(self, other: SlurmRun | None) -> bool:
        """This is a later run of the Slurm job `other` ran in (pure)."""
        return (other is not None and (other.cluster, other.job_id) == (self.cluster, self.job_id)
                and other.restart < self.restart)
