"""tests/slurm: the opt-in tier that runs the sbatch script on a real Slurm cluster (`make test-slurm`).

One cluster per session (deploy/slurm/local-cluster.sh: munged, slurmctld, two slurmd on this host), stopped at the
end; each scenario's jobs are cancelled at its end and none of their processes may be left. Skipped with one line
unless `make test-slurm` asked for it (FSDP_TEST_SLURM=1), when not root, or when Slurm cannot be installed.
"""
from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import assert_no_orphans
from tests.slurm.cluster import Cluster, SlurmJob, unavailable

OPT_IN = "FSDP_TEST_SLURM"


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if os.environ.get(OPT_IN) != "1":
        pytest.skip("opt-in tier: `make test-slurm` runs it (a real Slurm cluster on this host)")
    why = unavailable()
    if why is not None:
        pytest.skip(why)
    c = Cluster(tmp_path_factory.mktemp("slurm-cluster"))
    c.up()
    try:
        yield c
    finally:
        c.down()


class Jobs:
    """The scenario's submissions: all of them carry one tag, and all of them end with the scenario."""

    def __init__(self, cluster: Cluster, workdir: Path) -> None:
        self.cluster, self.workdir = cluster, workdir
        self.tag = uuid.uuid4().hex
        self.submitted: list[SlurmJob] = []

    def submit(self, name: str, *sbatch_args: str, **env: str) -> SlurmJob:
        job = self.cluster.submit(self.workdir / name, self.tag, *sbatch_args, **env)
        self.submitted.append(job)
        return job

    def finish(self) -> None:
        """Cancel what is still queued or running, wait until Slurm has ended it (KillWait included)."""
        for job in self.submitted:
            if not job.ended():
                self.cluster.run("scancel", str(job.id))
        for job in self.submitted:
            job.wait_ended(timeout=180)


@pytest.fixture
def jobs(cluster: Cluster, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Jobs]:
    js = Jobs(cluster, tmp_path)
    try:
        yield js
    finally:
        try:
            js.finish()
        finally:
            report = getattr(request.node, "rep_call", None)
            if report is not None and report.failed:
                for job in js.submitted:
                    print(f"--- job {job.id}: {job.show()}\n{job.output()[-4000:]}")
                print(cluster.logs())
            assert_no_orphans(js.tag)
