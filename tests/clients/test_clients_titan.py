"""Real torchtitan (llama3 debug model, 2 CPU ranks) under `fsdp-supervisor run`: kill, torn newest, resume.

Opt-in tier (`make test-clients`): needs torchtitan installed, which `make test`'s venv has not, so these
are skipped there. Losses are compared with one uninterrupted supervised run of the same job: torchtitan
prints loss to 5 and grad_norm to 4 decimals per step (rank 0), and its resume is deterministic on CPU
(seeded init, data position and LR schedule restored from the checkpoint), so every step logged after a
resume must print exactly what the uninterrupted run printed for that step.
"""
from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest

pytest.importorskip("torchtitan", reason="real-client tier: run `make test-clients`")

from tests.clients.assets import write_titan_assets
from tests.clients.harness import CLIENTS, TORCHRUN, SupervisedClient, run_plain
from tests.clients.layouts import TITAN_ENTRY, TITAN_FILES, layout_problems
from tests.supervise import Supervisors, assert_no_orphans, supervisors  # noqa: F401

pytestmark = [pytest.mark.clients, pytest.mark.timeout(1500)]

STEPS, INTERVAL = 20, 5
RUN_TIMEOUT = 600
STEP_LINE = re.compile(r"step:\s+(\d+)\s+loss:\s+(\S+)\s+grad_norm:\s+(\S+)")
LOADED = re.compile(r"Loading the checkpoint from (\S+)\.\n")
RESTART = "\n[restart]\nbackoff_initial_s = 0.5\nbackoff_max_s = 2\n"
HEALTH = "\n[health]\nstop_timeout_s = 30\n"


def titan_command(workdir: Path, assets: Path, *extra: str) -> list[str]:
    return [*TORCHRUN, str(CLIENTS / "shims" / "titan_cpu.py"),
            "--module", "tests.clients.titan_tiny", "--config", "debugmodel_2layers",
            "--hf_assets_path", str(assets / "tokenizer"), "--dataloader.dataset_path", str(assets / "data"),
            "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.steps", str(STEPS),
            "--checkpoint.enable", "--checkpoint.interval", str(INTERVAL), "--dump_folder", str(workdir / "dump"),
            "--parallelism.spmd_backend", "partial_dtensor",
            # torchtitan seeds its init from rank 0's torch RNG unless given a seed, and torch 2.13 seeds that RNG
            # randomly per process: without this two fresh runs print different losses from step 1
            "--debug.seed", "0", *extra]


def titan_job(sups: Supervisors, workdir: Path, assets: Path, resume_args: list[str], *, checkpoints: str = "",
              restart: str = "", extra: tuple[str, ...] | list[str] = ()) -> SupervisedClient:
    """A supervised torchtitan job in `workdir`; `checkpoints` and `restart` are extra TOML for those sections."""
    workdir.mkdir(parents=True, exist_ok=True)
    return SupervisedClient(sups, workdir, command=titan_command(workdir, assets, *extra), resume_args=resume_args,
                            checkpoint_dir=workdir / "dump" / "checkpoint",
                            extra_toml=checkpoints + RESTART + restart + HEALTH)


def steps_printed(log: str) -> dict[int, tuple[str, str]]:
    """step -> (loss, grad_norm) as torchtitan printed them (each line is logged twice: keep the first)."""
    out: dict[int, tuple[str, str]] = {}
    for m in STEP_LINE.finditer(log):
        out.setdefault(int(m.group(1)), (m.group(2), m.group(3)))
    return out


def loaded_from(log: str) -> str | None:
    """The checkpoint dir torchtitan says it loaded in one attempt, or None (fresh start)."""
    m = LOADED.search(log)
    return Path(m.group(1)).name if m else None


def committed(job: SupervisedClient, step: int) -> Path | None:
    meta = job.checkpoint_dir / f"step-{step}" / ".metadata"
    return meta.parent if meta.exists() else None


def cut_shard_in_half(ckpt: Path) -> None:
    shard = ckpt / "__1_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("titan-assets")
    write_titan_assets(root)
    return root


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> dict[int, tuple[str, str]]:
    """One uninterrupted run of the same command without the supervisor: what every step printed; and the
    layout torchtitan wrote, checked against tests/clients/layouts.py (what the reproduction writes)."""
    workdir = tmp_path_factory.mktemp("titan-reference")
    tag = uuid.uuid4().hex
    try:
        printed = steps_printed(run_plain(titan_command(workdir, assets), workdir / "run.log", tag, RUN_TIMEOUT))
    finally:
        assert_no_orphans(tag)
    assert sorted(printed) == list(range(1, STEPS + 1))
    assert layout_problems(workdir / "dump" / "checkpoint", TITAN_ENTRY, TITAN_FILES) == [], \
        "torchtitan's layout is not the one tests/clients/layouts.py (and the reproduction) assume"
    return printed


def assert_losses_match(reference: dict[int, tuple[str, str]], log: str, attempt: int) -> None:
    got = steps_printed(log)
    assert got, f"attempt {attempt} printed no training step"
    diff = {s: (v, reference.get(s)) for s, v in got.items() if reference.get(s) != v}
    assert not diff, f"attempt {attempt}: steps whose (loss, grad_norm) differ from the uninterrupted run: {diff}"


def assert_clean_listing(job: SupervisedClient, *, purging: bool = False) -> None:
    """Every step-N complete with step N, and only torchtitan's files in its folder. `purging` (keep_latest_k
    below the saves made): torchtitan's purge thread is destroyed at exit, so the purge after the last save may
    stop half-way and leave an older step-N with its `.metadata` but not all its shards; those are `torn`
    (torchtitan loads the highest step, the store never picks them, retention removes them after
    partial_max_age_s)."""
    listing = job.checkpoints_list()
    newest = max((c["step"] for c in listing if c["complete"]), default=0)
    purged = {c["name"] for c in listing if purging and c["state"] == "torn" and "is missing" in (c["reason"] or "")
              and c["step"] < newest}
    bad = [(c["name"], c["state"], c["reason"], c["step"]) for c in listing if c["name"] not in purged
           and (not c["complete"] or c["step"] != int(c["name"].split("-")[1]))]
    assert not bad, f"`checkpoints list` shows torchtitan checkpoints as not complete or with the wrong step: {bad}"
    problems = layout_problems(job.checkpoint_dir, TITAN_ENTRY, TITAN_FILES, ignore=frozenset(purged))
    assert problems == [], f"files or folders that torchtitan did not write, inside its checkpoint folder: {problems}"


def launched_resume_args(job: SupervisedClient, attempt: int) -> list[str]:
    """The last two argv elements of attempt `attempt` (1-based) as the supervisor logged its launch."""
    started = job.wait_for(lambda: (e := job.events("job_started")) and len(e) >= attempt and e, RUN_TIMEOUT,
                           f"attempt {attempt} to be launched")
    return started[attempt - 1].get("argv", [])[-2:]


def test_titan_resumes_from_the_supervisors_pick(supervisors: Supervisors, tmp_path: Path, assets: Path,
                                                 reference: dict[int, tuple[str, str]]) -> None:
    """Kill a rank -> resume from the newest step; cut the newest shard, kill -> resume from the step before."""
    job = titan_job(supervisors, tmp_path, assets, ["--checkpoint.load_step", "{step}"]).start()
    job.wait_for(lambda: committed(job, 10), RUN_TIMEOUT, "step-10 to be committed")
    job.kill_rank(1)
    args = launched_resume_args(job, 2)
    assert args == ["--checkpoint.load_step", "10"], (
        f"the supervisor must pass its pick as `--checkpoint.load_step 10` ({{step}} replaced by the step of "
        f"the checkpoint it chose); it launched attempt 2 with ... {args}\n{job.tails()}")
    job.wait_for(lambda: len(job.attempt_logs()) >= 2 and committed(job, 15), RUN_TIMEOUT,
                 "attempt 2 to commit step-15")
    cut_shard_in_half(job.checkpoint_dir / "step-15")
    job.kill_rank(1)
    args = launched_resume_args(job, 3)
    assert args == ["--checkpoint.load_step", "10"], (
        f"step-15 is torn: the supervisor's pick is step-10, passed as `--checkpoint.load_step 10`; "
        f"attempt 3 got ... {args}\n{job.tails()}")
    code = job.wait_exit(RUN_TIMEOUT)
    assert code == 0, f"the supervisor exited {code}\n{job.tails()}"
    logs = job.attempt_logs()
    assert [loaded_from(log) for log in logs] == [None, "step-10", "step-10"], job.tails()
    assert [e.get("resumed_step") for e in job.events("job_started")] == [None, 10, 10]
    for i, log in enumerate(logs, 1):
        assert_losses_match(reference, log, i)
    assert max(steps_printed(logs[-1])) == STEPS
    assert_clean_listing(job)


def test_titan_picks_its_own_past_a_torn_newest_and_stops(supervisors: Supervisors, tmp_path: Path, assets: Path,
                                                           reference: dict[int, tuple[str, str]]) -> None:
    """resume_args = [] (torchtitan picks step-N itself) with its own rotation (keep_latest_k = 2) and ours
    (keep_last = 3): cut the newest shard and kill -> the supervisor deletes the torn step-10 before the relaunch
    (the job is down, and torchtitan would load it), so torchtitan loads step-5; SIGTERM -> torchtitan has no
    handler and saves nothing, the supervisor exits 0 'stopped'; `run` again -> torchtitan loads its newest and
    finishes. No resume point is claimed, nothing is quarantined, every loss is the uninterrupted run's."""
    job = titan_job(supervisors, tmp_path, assets, [], checkpoints="keep_last = 3\n",
                    extra=["--checkpoint.keep_latest_k", "2"])
    job.start()
    job.wait_for(lambda: committed(job, 10), RUN_TIMEOUT, "step-10 to be committed")
    cut_shard_in_half(job.checkpoint_dir / "step-10")
    job.kill_rank(1)
    job.wait_for(lambda: len(job.attempt_logs()) >= 2 and committed(job, 15), RUN_TIMEOUT, "attempt 2 to commit step-15")
    assert job.stop(RUN_TIMEOUT) == 0 and job.state().get("state") == "stopped", job.tails()
    job.start()
    assert job.wait_exit(RUN_TIMEOUT) == 0, job.tails()
    logs = job.attempt_logs()
    assert [loaded_from(log) for log in logs] == [None, "step-5", "step-15"], job.tails()
    cleared = [Path(e["path"]).name for e in job.events("retention_deleted") if "would load" in e["reason"]]
    assert cleared == ["step-10"], job.events("retention_deleted")
    claims = [e.get("resumed_from") for e in job.events("job_started")]
    assert claims == [None] * 3, f"with empty resume_args the supervisor passes nothing, so it claims nothing: {claims}"
    assert (job.state().get("quarantined") or []) == []
    for i, log in enumerate(logs, 1):
        assert_losses_match(reference, log, i)
    assert max(steps_printed(logs[-1])) == STEPS
    assert_clean_listing(job, purging=True)
