"""Real PyTorch Lightning (FSDPStrategy sharded, 2 CPU ranks) under `fsdp-supervisor run`: kill, stop, resume, top-k.

Opt-in tier (`make test-clients`), skipped where lightning is not installed. The job is
tests/clients/lightning_train.py behind the one-subclass CPU shim (tests/clients/shims/lightning_cpu.py): a save
every 5 steps (one epoch), `ModelCheckpoint(save_on_exception=True)`. Lightning's resume on CPU is bit-exact at an
epoch boundary, so every step after a resume from a periodic save prints the `repr(loss)` the uninterrupted run
printed. Two ways to resume, as docs/clients.md configures them:

- `resume_args = []` with `trainer.fit(ckpt_path="last")`: Lightning loads its own `last.ckpt` (a copy). The
  supervisor must never delete it, nor count it twice (keep_last = 2 below save_top_k = 3), nor delete what
  ModelCheckpoint keeps in its top 3.
- `resume_args = ["--ckpt-path", "{checkpoint}"]`: the supervisor's pick, with `save_last="link"`; a newest save
  without its `meta.pt` (killed between the DCP files and meta.pt) is skipped.

The divergence guard through `lightning_callback()`: a NaN loss injected by the script is rolled back to the save
before it, and the relaunch skips `FSDP_SUPERVISOR_SKIP_STEPS` steps (the script's `skip_steps` handling).
"""
from __future__ import annotations

import re
import shutil
import uuid
from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="real-client tier: run `make test-clients`")

import torch

from supervisor.checkpoints import lightning
from supervisor.checkpoints.clients import commit_problem
from tests.clients.harness import (
    CLIENTS,
    NAN_AT,
    NAN_AT_ENV,
    RESTART_FAST,
    STEP_LINE,
    TORCHRUN,
    SupervisedClient,
    assert_losses_match,
    nan_rolled_back,
    printed,
    run_plain,
)
from tests.clients.layouts import LIGHTNING_ENTRY, LIGHTNING_FILES, layout_problems
from tests.supervise import Supervisors, assert_no_orphans, supervisors  # noqa: F401

pytestmark = [pytest.mark.clients, pytest.mark.timeout(1200)]

STEPS, SAVE_EVERY = 30, 5
STEP_S = 0.4  # five steps between two saves: ~2 s for the test to see a save and kill
RUN_TIMEOUT = 300
RESUMED = re.compile(r"^resumed step=(\d+) from=(\S+)$", re.M)


def lightning_command(ckpts: Path, *extra: str) -> list[str]:
    return [*TORCHRUN, str(CLIENTS / "shims" / "lightning_cpu.py"), str(CLIENTS / "lightning_train.py"),
            "--ckpt-dir", str(ckpts), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
            "--step-s", str(STEP_S), *extra]


def lightning_job(sups: Supervisors, workdir: Path, resume_args: list[str], extra: list[str],
                  checkpoints: str) -> SupervisedClient:
    workdir.mkdir(parents=True, exist_ok=True)
    ckpts = workdir / "ckpts"
    return SupervisedClient(sups, workdir, command=lightning_command(ckpts, *extra), resume_args=resume_args,
                            checkpoint_dir=ckpts, extra_toml=checkpoints + RESTART_FAST)


def steps_printed(log: str) -> dict[int, str]:
    return printed(STEP_LINE, log)


def saved_step(ckpt: Path) -> int | None:
    """The step in a save's meta.pt once it is whole (Lightning writes it last), else None."""
    if not (ckpt / "meta.pt").is_file() or commit_problem(ckpt, "dcp") is not None:
        return None
    return lightning.meta_step(ckpt)


def top_k(meta_dir: Path) -> set[str]:
    """The names ModelCheckpoint keeps, as torch itself reads them from a meta.pt."""
    meta = torch.load(meta_dir / "meta.pt", weights_only=False)
    (state,) = [s for s in meta["callbacks"].values() if "best_k_models" in s]
    return {Path(p).name for p in state["best_k_models"]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """repr(loss) of every step of one uninterrupted run; and Lightning's own layout and top-3 rotation."""
    workdir = tmp_path_factory.mktemp("lightning-reference")
    tag = uuid.uuid4().hex
    try:
        losses = steps_printed(run_plain(lightning_command(workdir / "ckpts", "--top-k", "3", "--metric", "train_loss"),
                                          workdir / "run.log", tag, RUN_TIMEOUT))
    finally:
        assert_no_orphans(tag)
    assert sorted(losses) == list(range(1, STEPS + 1))
    root = workdir / "ckpts"
    assert layout_problems(root, LIGHTNING_ENTRY, LIGHTNING_FILES) == [], \
        "Lightning's layout is not the one tests/clients/layouts.py assumes"
    kept = top_k(root / "last.ckpt")
    assert len(kept) == 3 and sorted(p.name for p in root.iterdir()) == sorted({*kept, "last.ckpt"}), \
        "save_top_k=3: Lightning itself keeps its three best and last.ckpt"
    return losses


def test_lightning_resumes_itself_from_last_ckpt(supervisors: Supervisors, tmp_path: Path,
                                                 reference: dict[int, str]) -> None:
    """resume_args = [], ckpt_path="last", save_top_k=3, keep_last=2: kill rank 1 after step 10 -> Lightning loads
    last.ckpt (step 10) and every loss matches; SIGTERM -> its save_on_exception checkpoint at the step it reached,
    exit 0; `run` again -> it resumes from there and finishes. last.ckpt and the top 3 are never deleted."""
    job = lightning_job(supervisors, tmp_path, [], ["--top-k", "3", "--metric", "train_loss"], "keep_last = 2\n")
    root = job.checkpoint_dir
    job.start()
    job.wait_for(lambda: saved_step(root / "last.ckpt") == 10, RUN_TIMEOUT, "last.ckpt to hold step 10")
    job.kill_rank(1)
    job.wait_for(lambda: len(job.attempt_logs()) >= 2 and saved_step(root / "last.ckpt") == 20, RUN_TIMEOUT,
                 "attempt 2 to save step 20")
    code = job.stop(RUN_TIMEOUT)
    assert code == 0 and job.state().get("state") == "stopped", f"SIGTERM: exit {code}\n{job.tails()}"
    logs = job.attempt_logs()
    assert max(steps_printed(logs[0])) < 15, f"the kill was meant to land before the step-15 save\n{job.tails()}"
    resumed = RESUMED.search(logs[1])
    assert resumed and resumed.groups() == ("10", str(root / "last.ckpt")), job.tails()
    reached = max(steps_printed(logs[1]))
    assert saved_step(root / "last.ckpt") == reached, (
        f"save_on_exception: the SIGTERM'd attempt reached step {reached}; last.ckpt holds "
        f"{saved_step(root / 'last.ckpt')}\n{job.tails()}")
    for i, log in enumerate(logs, 1):
        assert_losses_match(reference, log, i, STEP_LINE)

    job.start()  # the next run goes on from the emergency save, by Lightning's own choice again
    assert job.wait_exit(RUN_TIMEOUT) == 0, job.tails()
    logs = job.attempt_logs()
    resumed = RESUMED.search(logs[2])
    assert resumed and resumed.group(1) == str(reached), job.tails()
    assert min(steps_printed(logs[2])) == reached + 1 and max(steps_printed(logs[2])) == STEPS
    assert [e.get("resumed_from") for e in job.events("job_started")] == [None] * 3
    deleted = {Path(e["path"]).name for e in job.events("retention_deleted")}
    assert "last.ckpt" not in deleted and not deleted & top_k(root / "last.ckpt")
    assert top_k(root / "last.ckpt") <= {p.name for p in root.iterdir()}, "Lightning's top 3 must all be there"
    listing = {c["name"]: c for c in job.checkpoints_list()}
    last = listing["last.ckpt"]
    assert (last["complete"], last["step"], last["kept_by"] is not None) == (True, STEPS, True), last
    assert all(c["complete"] for c in listing.values()), listing
    assert layout_problems(root, LIGHTNING_ENTRY, LIGHTNING_FILES) == []


def test_lightning_resumes_from_the_supervisors_pick(supervisors: Supervisors, tmp_path: Path,
                                                     reference: dict[int, str]) -> None:
    """resume_args = ["--ckpt-path", "{checkpoint}"], save_last="link", save_top_k=-1: kill after step 10 -> the
    named step-10 save; the step-15 save without its meta.pt (cut before Lightning's last write), kill -> step 10
    again; last.ckpt is listed as an alias of the save it links to."""
    holds = tmp_path / "holds"  # the job waits after steps 10 and 15 until the test releases it
    holds.mkdir()
    job = lightning_job(supervisors, tmp_path, ["--ckpt-path", "{checkpoint}"],
                        ["--top-k", "-1", "--save-last", "link", "--hold-at", "10", "--hold-at", "15",
                         "--hold-dir", str(holds)], "keep_last = 3\n")
    root = job.checkpoint_dir
    job.start()
    job.wait_for(lambda: saved_step(root / "epoch=1-step=10.ckpt") == 10, RUN_TIMEOUT, "the step-10 save")
    job.kill_rank(1)
    (holds / "release-10").touch()
    step10 = str(root / "epoch=1-step=10.ckpt")
    started = job.wait_for(lambda: len(job.events("job_started")) >= 2 and job.events("job_started"), RUN_TIMEOUT,
                           "attempt 2")
    assert started[1]["argv"][-2:] == ["--ckpt-path", step10], job.tails()
    job.wait_for(lambda: saved_step(root / "epoch=2-step=15.ckpt") == 15, RUN_TIMEOUT, "attempt 2's step-15 save")
    (root / "epoch=2-step=15.ckpt" / "meta.pt").unlink()  # as a kill between the DCP files and meta.pt leaves it
    job.kill_rank(1)
    (holds / "release-15").touch()
    assert job.wait_exit(RUN_TIMEOUT) == 0, job.tails()
    started = job.events("job_started")
    assert [e["argv"][-2:] for e in started[1:]] == [["--ckpt-path", step10]] * 2, job.tails()
    assert [e.get("resumed_step") for e in started] == [None, 10, 10]
    logs = job.attempt_logs()
    for i, log in enumerate(logs, 1):
        assert_losses_match(reference, log, i, STEP_LINE)
    assert max(steps_printed(logs[-1])) == STEPS
    listing = {c["name"]: c for c in job.checkpoints_list()}
    assert listing["epoch=2-step=15.ckpt"]["state"] == "partial" and "meta.pt" in listing["epoch=2-step=15.ckpt"]["reason"]
    newest = max((c for c in listing.values() if c["complete"] and not c["alias_of"]), key=lambda c: c["step"])
    assert (listing["last.ckpt"]["alias_of"], listing["last.ckpt"]["step"]) == (newest["name"], STEPS)
    shutil.rmtree(root / "epoch=2-step=15.ckpt")  # ours to judge, not Lightning's: layout of the rest
    assert layout_problems(root, LIGHTNING_ENTRY, LIGHTNING_FILES) == []


SAVED = re.compile(r"step=(\d+)")


def test_lightning_nan_is_rolled_back_to_the_save_before_it(supervisors: Supervisors, tmp_path: Path) -> None:
    """lightning_callback() beats every rank's loss; the script's loss turns NaN at step 13 (attempt 1 only) ->
    `diverged` (nan), the job stopped (its save_on_exception save is diverged too), `rolled_back` to a save from
    before the onset with skip = onset - resume step + skip_after_onset; the relaunch loads that save, skips those
    steps without training, trains on to step 30 with finite losses; `completed`, exit 0."""
    ckpts = tmp_path / "ckpts"
    job, back, second = nan_rolled_back(supervisors, tmp_path, lightning_command(
        ckpts, "--top-k", "-1", "--save-last", "link"), ckpts, "--ckpt-path")
    to_step = back["to_step"]
    assert Path(back["to_checkpoint"]).name == f"epoch={to_step // SAVE_EVERY - 1}-step={to_step}.ckpt", back
    resumed = RESUMED.search(second)
    assert resumed and resumed.group(1) == str(to_step), job.tails()
    skipped = [int(n) for n in re.findall(r"^skipped step=(\d+)$", second, re.M)]
    assert skipped == list(range(to_step + 1, to_step + back["skip"] + 1)), skipped
    trained = steps_printed(second)
    assert min(trained) == to_step + back["skip"] + 1 and max(trained) == STEPS, sorted(trained)
    assert all(v != "nan" for v in trained.values()), trained
    diverged = [q for q in job.history("quarantined") if q["reason"].startswith("diverged")]
    assert all(int(SAVED.findall(Path(q["path"]).name)[-1]) > to_step for q in diverged), diverged


def test_lightning_picking_its_own_checkpoint_diverges_to_exit_3(supervisors: Supervisors, tmp_path: Path) -> None:
    """resume_args = [] (ckpt_path="last"): a relaunch would load last.ckpt, the diverged attempt's emergency save
    with NaN weights, so there is no rollback: the job is stopped and the supervisor exits 3, naming the last good
    save, which is kept."""
    ckpts = tmp_path / "ckpts"
    job = SupervisedClient(
        supervisors, tmp_path, command=lightning_command(ckpts, "--top-k", "-1", "--save-last", "link"),
        resume_args=[], checkpoint_dir=ckpts, env={NAN_AT_ENV: str(NAN_AT)},
        extra_toml="keep_last = 1\n" + RESTART_FAST)
    job.start()
    assert job.wait_exit(RUN_TIMEOUT) == 3, job.tails()
    [found] = job.history("diverged")
    assert (found["why"], found["action"]) == ("nan", "give_up") and not job.history("rolled_back"), found
    reason = job.state().get("reason") or ""
    good = re.search(r"last good checkpoint: (\S+) \(kept\)", reason)
    assert "no rollback: resume_args name no {checkpoint}" in reason and good, reason
    assert Path(good.group(1)).is_dir() and saved_step(Path(good.group(1))) in (5, 10), reason
    assert len(job.events("job_started")) == 1
