"""deploy/slurm/fsdp-supervisor.sbatch on a real Slurm cluster: what each way a Slurm job ends does to the run.

The reference trainer (tiny model, CPU ranks on gloo, one world of two ranks: two on one node, or one on each of
two nodes) under the script, submitted with sbatch to the cluster of tests/slurm/conftest.py. A run interrupted by
the time limit, a requeue or a stop must end bit-identical to the uninterrupted one, resumed from the emergency
checkpoint written at the step where it stopped; a cancel must stay cancelled; exit 2 and 3 must not be requeued;
no process of any job may be left. `FSDP_TEST_SLURM_SBATCH=PATH make test-slurm` runs them against another script.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers import assert_no_orphans, compare_checkpoints
from tests.slurm.cluster import Cluster, SlurmJob, settle
from tests.slurm.conftest import Jobs

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]

SAVE_EVERY = 200
# Long enough that the time limit's warning, sent at Slurm's first look (every 30 s) after it is due, lands mid-run.
STEPS = 2400
SHORT = 800  # a run that need not outlast a warning
MODEL = "--seed 7 --d-model 32 --n-layers 1 --n-heads 2 --seq-len 32 --batch-size 4 --log-every 100"
ONE_NODE = ("--nodes=1",)
TWO_NODES = ("--nodes=2",)


def trainer(steps: int) -> str:
    return f"--steps {steps} --save-every {SAVE_EVERY} {MODEL}"


def ranks(nodes: int) -> dict[str, str]:
    """GPUS_PER_NODE (ranks per node) for a world of two."""
    return {"GPUS_PER_NODE": str(2 // nodes)}


@pytest.fixture(scope="module")
def uninterrupted(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmJob]:
    """The normal run, to the end: what every interrupted run must equal."""
    js = Jobs(cluster, tmp_path_factory.mktemp("uninterrupted"))
    try:
        job = js.submit("run", *ONE_NODE, TRAINER_ARGS=trainer(STEPS), **ranks(1))
        job.wait_ended(timeout=600)
        yield job
    finally:
        js.finish()
        assert_no_orphans(js.tag)


def stopped_by(job: SlurmJob, nodes: int = 1) -> int:
    """The step every node's supervisor stopped at, once the job is requeued or gone: the emergency checkpoint's."""
    states = [job.node_state(n) for n in range(nodes)]
    assert [s.get("state") for s in states] == ["stopped"] * nodes, states
    step = states[0]["step"]
    assert all(s["step"] == step and (s.get("latest_checkpoint") or {}).get("step") == step for s in states), \
        f"no emergency checkpoint at the step the run stopped: {states}"
    assert job.checkpoint(step).is_dir() and step < STEPS
    return step  # type: ignore[no-any-return]


def resumed_and_finished(job: SlurmJob, uninterrupted: SlurmJob, step: int, nodes: int = 1) -> None:
    """After one requeue: the next allocation resumed from `step` and ended equal to the uninterrupted run."""
    info = job.wait_ended(timeout=600)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), info
    assert sorted(s for n in range(nodes) for s in job.resumed_steps(n)) == [step], "not resumed from the emergency save"
    cmp = compare_checkpoints(uninterrupted.checkpoint(STEPS), job.checkpoint(STEPS), job.workdir)
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr


class TestHowARunEnds:
    def test_normal_run_finishes(self, uninterrupted: SlurmJob) -> None:
        """A run that ends by itself: COMPLETED with exit 0, never requeued, its last checkpoint written."""
        info = uninterrupted.show()
        assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), info
        assert uninterrupted.node_state()["state"] == "completed" and uninterrupted.checkpoint(STEPS).is_dir()

    def test_time_limit_saves_requeues_and_resumes(self, jobs: Jobs, uninterrupted: SlurmJob) -> None:
        """The time limit's warning: every supervisor stops, the emergency checkpoint is written, the script requeues
        once, and the next allocation resumes from that checkpoint and ends bit-identical to the uninterrupted run."""
        job = jobs.submit("time-limit", *ONE_NODE, "--time=10", TRAINER_ARGS=trainer(STEPS), **ranks(1))
        job.wait(lambda: job.training(SAVE_EVERY), 300, "training past the first checkpoint")
        job.near_time_limit()
        job.wait(job.pending, 180, "the requeue after the time limit's warning")
        step = stopped_by(job)
        assert "job_killed" not in job.supervisor_log() and "survivors_killed" not in job.supervisor_log()
        job.release(time_limit_min=10)
        resumed_and_finished(job, uninterrupted, step)

    def test_scancel_cancels_for_good(self, jobs: Jobs) -> None:
        """A plain scancel: Slurm's SIGTERM stops every supervisor gracefully (the emergency checkpoint is written
        within KillWait), and the job stays cancelled: no requeue."""
        job = jobs.submit("scancel", *ONE_NODE, TRAINER_ARGS=trainer(100_000), **ranks(1))
        job.wait(lambda: job.training(SAVE_EVERY), 300, "training past the first checkpoint")
        jobs.cluster.run("scancel", str(job.id))
        info = job.wait_ended(timeout=120)
        stopped_by(job)
        settle(5)  # a requeue by the script would show by now
        info = job.show()
        assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), info

    def test_scontrol_requeue_requeues_once(self, jobs: Jobs, uninterrupted: SlurmJob) -> None:
        """`scontrol requeue`: the emergency checkpoint, exactly one requeue (Slurm's; the script adds none), and
        the next allocation resumes from that checkpoint."""
        job = jobs.submit("requeue", *ONE_NODE, TRAINER_ARGS=trainer(SHORT), **ranks(1))
        job.wait(lambda: job.training(SAVE_EVERY), 300, "training past the first checkpoint")
        jobs.cluster.run("scontrol", "requeue", str(job.id))
        job.wait(job.pending, 120, "the requeue")
        step = stopped_by(job)
        job.release()
        info = job.wait_ended(timeout=600)
        assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), info
        assert job.resumed_steps() == [step] and job.checkpoint(SHORT).is_dir()

    def test_config_error_exit_2_is_not_requeued(self, jobs: Jobs) -> None:
        """A supervisor that exits 2 (here: the job's program does not exist) fails the job with 2, no requeue."""
        job = jobs.submit("exit-2", *ONE_NODE, TORCHRUN="/nonexistent/torchrun", **ranks(1))
        info = job.wait_ended(timeout=120)
        settle(5)
        info = job.show()
        assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "2:0", "0"), info
        assert "program '/nonexistent/torchrun' not found" in job.output()

    def test_gave_up_exit_3_is_not_requeued(self, jobs: Jobs) -> None:
        """A supervisor that gives up (a crash loop: the trainer rejects its arguments) fails the job with 3."""
        job = jobs.submit("exit-3", *ONE_NODE, TRAINER_ARGS="--no-such-flag", TORCHRUN_MAX_RESTARTS="0",
                          BACKOFF_INITIAL_S="0.5", **ranks(1))
        info = job.wait_ended(timeout=400)
        settle(5)
        info = job.show()
        assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "3:0", "0"), info
        assert job.node_state()["state"] == "failed"


class TestTwoNodes:
    def test_stopped_at_the_time_limit_and_resumed(self, jobs: Jobs, uninterrupted: SlurmJob) -> None:
        """One supervisor per emulated node (n1, n2: names that do not resolve, NodeAddr 127.0.0.1), rendezvous at
        the head node's NodeAddr: the time limit stops both (a `stop` step on each), both write the same emergency
        checkpoint, the requeued job resumes from it and ends bit-identical to the one-node run of two ranks."""
        job = jobs.submit("two-nodes", *TWO_NODES, "--time=10", TRAINER_ARGS=trainer(STEPS), **ranks(2))
        job.wait(lambda: job.training(SAVE_EVERY), 300, "training past the first checkpoint")
        job.near_time_limit()
        job.wait(job.pending, 180, "the requeue after the time limit's warning")
        step = stopped_by(job, nodes=2)
        job.release(time_limit_min=10)
        resumed_and_finished(job, uninterrupted, step, nodes=2)
        logs = [job.supervisor_log(n) for n in (0, 1)]
        assert "retention_deleted" in logs[0] and "retention_deleted" not in logs[1], "only node 0 prunes"
