"""The reference trainer and a tutorial-style FSDP1 user script under `fsdp-supervisor run`, as the clients are.

Part of the opt-in tier (`make test-clients`) so that its table (docs/clients.md) has one row per client measured
the same way: kill a worker -> resume from the newest complete with every loss as in an uninterrupted run; a torn
newest (its rank-1 shard cut in half) -> skipped; SIGTERM -> the client's own graceful behaviour, and the next
`run` goes on; retention with the client's own rotation on; nothing of ours in the checkpoint folder.
Both resume from the supervisor's pick (`{checkpoint}`). The kills land wherever the job is after a commit: the
expected pick is the store's newest complete checkpoint at the moment of the kill.

- the reference trainer (`python -m trainer`): `step_<N>/` with its manifest; on SIGTERM all ranks agree on a
  step and save it (the emergency save); no rotation of its own (the supervisor's keep_last is its rotation).
- tests/jobs/user_dcp_script.py (FSDP1, after the PyTorch DCP tutorial): `epoch_<E>/` from epoch 0, keeps its
  newest 3 itself (`--keep 3`); no signal handling at all.
"""
from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="real-client tier: run `make test-clients`")

from supervisor.checkpoints import newest_complete
from supervisor.layout import LINEAGE_FILE
from tests.clients.harness import (
    RESTART_FAST,
    STEP_LINE,
    TORCHRUN,
    SupervisedClient,
    assert_losses_match,
    printed,
    run_plain,
)
from tests.clients.layouts import tree
from tests.supervise import REPO, Supervisors, assert_no_orphans, supervisors  # noqa: F401

pytestmark = [pytest.mark.clients, pytest.mark.timeout(1200)]

STEPS = 40
RUN_TIMEOUT = 300
TRAINER_LINE = re.compile(r"event=train rank=0 step=(\d+) loss=(\S+)")


def trainer_command(ckpts: Path) -> list[str]:
    return [*TORCHRUN, "-m", "trainer", "--checkpoint-dir", str(ckpts), "--steps", str(STEPS), "--save-every", "10",
            "--seed", "3", "--log-every", "1", "--d-model", "128", "--seq-len", "128"]


def tutorial_command(ckpts: Path) -> list[str]:
    return [*TORCHRUN, str(REPO / "tests" / "jobs" / "user_dcp_script.py"), "--ckpt-dir", str(ckpts),
            "--epochs", str(STEPS), "--save-every", "5", "--keep", "3", "--step-s", "0.3"]


CLIENT = {  # name -> (command, resume flag, printed-loss pattern, checkpoint name pattern, steps printed)
    "trainer": (trainer_command, "--resume", TRAINER_LINE, re.compile(r"step_(\d{8})"), range(1, STEPS + 1)),
    "tutorial": (tutorial_command, "--resume-from", STEP_LINE, re.compile(r"epoch_(\d+)"), range(STEPS)),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[int, str], frozenset[str]]]:
    """Per client: every step's printed loss in one uninterrupted run, and the files of one of its checkpoints."""
    out = {}
    for name, (command, _, pattern, entry, steps) in CLIENT.items():
        workdir = tmp_path_factory.mktemp(f"{name}-reference")
        tag = uuid.uuid4().hex
        try:
            losses = printed(pattern, run_plain(command(workdir / "ckpts"), workdir / "run.log", tag, RUN_TIMEOUT))
        finally:
            assert_no_orphans(tag)
        assert sorted(losses) == list(steps), f"{name}: {sorted(losses)}"
        dirs = sorted(p for p in (workdir / "ckpts").iterdir() if entry.fullmatch(p.name))
        out[name] = (losses, tree(dirs[-1]))
    return out


def commit_after(job: SupervisedClient, step: int) -> Callable[[], object]:
    def newer() -> object:
        c = newest_complete(job.checkpoint_dir) if job.checkpoint_dir.is_dir() else None
        return c if c is not None and (c.step or 0) > step else None
    return newer


def cut_newest_shard(job: SupervisedClient) -> tuple[int, Path]:
    """Tear the newest complete checkpoint (rank 1's shard cut in half); (its step, the newest complete after it)."""
    newest = newest_complete(job.checkpoint_dir)
    assert newest is not None and newest.step is not None
    shard = newest.path / "__1_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    before = newest_complete(job.checkpoint_dir)
    assert before is not None and before.step is not None and before.step < newest.step
    return newest.step, before.path


@pytest.mark.parametrize("client", sorted(CLIENT))
def test_kill_torn_stop_and_resume(supervisors: Supervisors, tmp_path: Path, client: str,
                                   references: dict[str, tuple[dict[int, str], frozenset[str]]]) -> None:
    """Kill -> the newest complete; a torn newest, kill -> the one before; SIGTERM -> exit 0 'stopped' and the next
    run resumes from the newest complete (the reference trainer's emergency save at the step it reached; the
    tutorial script's last periodic save); every printed loss equals the uninterrupted run's."""
    command, flag, pattern, entry, steps = CLIENT[client]
    reference, files = references[client]
    ckpts = tmp_path / "ckpts"
    job = SupervisedClient(supervisors, tmp_path, command=command(ckpts), resume_args=[flag, "{checkpoint}"],
                           checkpoint_dir=ckpts, extra_toml="keep_last = 2\n" + RESTART_FAST).start()
    first = job.wait_for(commit_after(job, 0), RUN_TIMEOUT, "a first checkpoint")
    picks = [newest_complete(ckpts).path]  # type: ignore[union-attr]
    job.kill_rank(1)
    job.wait_for(lambda: len(job.attempt_logs()) >= 2, RUN_TIMEOUT, "attempt 2")
    job.wait_for(commit_after(job, max(first.step, int(entry.fullmatch(picks[0].name).group(1)))), RUN_TIMEOUT,
                 "attempt 2's first checkpoint")
    _, before = cut_newest_shard(job)
    picks.append(before)
    job.kill_rank(1)
    job.wait_for(lambda: len(job.attempt_logs()) >= 3 and job.state().get("state") == "running", RUN_TIMEOUT,
                 "attempt 3")
    job.wait_for(commit_after(job, int(entry.fullmatch(before.name).group(1))), RUN_TIMEOUT,
                 "attempt 3's first checkpoint")
    assert job.stop(RUN_TIMEOUT) == 0 and job.state().get("state") == "stopped", job.tails()
    reached = max(printed(pattern, job.attempt_logs()[-1]))
    saved = newest_complete(ckpts)
    assert saved is not None and saved.step is not None
    if client == "trainer":
        assert saved.step == reached, f"the emergency save holds step {saved.step}, the attempt reached {reached}"
    job.start()
    assert job.wait_exit(RUN_TIMEOUT) == 0, job.tails()
    started = job.events("job_started")
    assert [e.get("resumed_from") for e in started] == [None, *map(str, picks), str(saved.path)], job.tails()
    for i, log in enumerate(job.attempt_logs(), 1):
        assert_losses_match(reference, log, i, pattern)
    assert max(printed(pattern, job.attempt_logs()[-1])) == steps[-1]
    assert not [e for e in job.events("retention_deleted") if Path(e["path"]).parent != ckpts]
    # the reference trainer sets a torn step_N aside as `.tmp-step_N-incomplete-<nonce>` when it saves that step again
    own = [p for p in ckpts.iterdir() if entry.fullmatch(p.name)]
    foreign = [p.name for p in ckpts.iterdir()  # the trainer library keeps the run's lineage in its root
               if p not in own and not p.name.startswith(".tmp-step_") and p.name != LINEAGE_FILE]
    foreign += [p.name for p in own if tree(p) - files]
    assert foreign == [], f"not written by the {client} (or not as it writes): {foreign}"
    listing = [(c["name"], c["complete"], c["step"]) for c in job.checkpoints_list() if entry.fullmatch(c["name"])]
    assert listing and all(ok and step == int(entry.fullmatch(name).group(1)) for name, ok, step in listing), listing
