"""Real transformers `Trainer` (torch FSDP, SHARDED_STATE_DICT, 2 CPU ranks) under `fsdp-supervisor run`.

Opt-in tier (`make test-clients`), skipped where transformers is not installed. The job is
tests/clients/hf_train.py (a 2-layer Llama built from a config, no download) behind Accelerate's one-patch CPU
shim (tests/clients/shims/accelerate_cpu.py: the Trainer prepares FSDP through Accelerate). A save every 5 steps
into `<output_dir>/checkpoint-<step>/`, the Trainer's own rotation on (`save_total_limit`). Its resume is
bit-exact on CPU (it restores the RNG and skips the batches already seen), so every step after a resume prints
the `repr(loss)` the uninterrupted run printed. Both ways to resume:

- `resume_args = ["--resume_from_checkpoint", "{checkpoint}"]`: the supervisor's pick; a newest save without
  its trainer_state.json (cut before the Trainer's last write) is skipped.
- `resume_args = []` with `train(resume_from_checkpoint=True)`: the Trainer takes the highest `checkpoint-N`,
  complete or not. A torn newest is deleted before the relaunch (the job is down), so it takes the one before.
  SIGTERM with `enable_jit_checkpoint=True`: its own save at the step it reached, exit 0, and the next `run`
  goes on from there.

The divergence guard through `hf_callback()`: a NaN loss injected by the script is rolled back to the save before it.
The Trainer cannot skip data past its checkpoint's step, so the relaunch trains on the same steps again.
"""
from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="real-client tier: run `make test-clients`")

from supervisor.checkpoints import judge
from tests.clients.harness import (
    CLIENTS,
    RESTART_FAST,
    STEP_LINE,
    TORCHRUN,
    SupervisedClient,
    assert_losses_match,
    nan_rolled_back,
    printed,
    run_plain,
)
from tests.clients.layouts import HF_ENTRY, HF_FILES, layout_problems
from tests.supervise import Supervisors, assert_no_orphans, supervisors  # noqa: F401

pytestmark = [pytest.mark.clients, pytest.mark.timeout(1200)]

STEPS, SAVE_EVERY = 30, 5
STEP_S = 0.4
RUN_TIMEOUT = 300
RESUMING = re.compile(r"^resuming from=(\S+)$", re.M)


def hf_command(out: Path, *extra: str) -> list[str]:
    return [*TORCHRUN, str(CLIENTS / "shims" / "accelerate_cpu.py"), str(CLIENTS / "hf_train.py"),
            "--output-dir", str(out), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--step-s", str(STEP_S),
            *extra]


def hf_job(sups: Supervisors, workdir: Path, resume_args: list[str], extra: list[str], checkpoints: str
           ) -> SupervisedClient:
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "out"
    return SupervisedClient(sups, workdir, command=hf_command(out, *extra), resume_args=resume_args,
                            checkpoint_dir=out, extra_toml=checkpoints + RESTART_FAST)


def steps_printed(log: str) -> dict[int, str]:
    return printed(STEP_LINE, log)


def complete(ckpt: Path) -> bool:
    try:
        return ckpt.is_dir() and judge(ckpt).complete
    except Exception:  # noqa: BLE001 - vanished between the look and the judging (the Trainer's rotation)
        return False


def cut_in_half(shard: Path) -> None:
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """repr(loss) of every step of one uninterrupted run; the Trainer's layout and its own rotation (limit 2)."""
    workdir = tmp_path_factory.mktemp("hf-reference")
    tag = uuid.uuid4().hex
    try:
        losses = steps_printed(run_plain(hf_command(workdir / "out", "--total-limit", "2"), workdir / "run.log",
                                          tag, RUN_TIMEOUT))
    finally:
        assert_no_orphans(tag)
    assert sorted(losses) == list(range(1, STEPS + 1))
    out = workdir / "out"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-25", "checkpoint-30"]
    assert layout_problems(out, HF_ENTRY, HF_FILES) == [], \
        "the Trainer's layout is not the one tests/clients/layouts.py assumes"
    return losses


def test_hf_resumes_from_the_supervisors_pick(supervisors: Supervisors, tmp_path: Path,
                                              reference: dict[int, str]) -> None:
    """Kill after checkpoint-10 -> `--resume_from_checkpoint .../checkpoint-10`; checkpoint-15 without its
    trainer_state.json, kill -> checkpoint-10 again. save_total_limit = 3 and keep_last = 2 both on."""
    job = hf_job(supervisors, tmp_path, ["--resume_from_checkpoint", "{checkpoint}"], ["--total-limit", "3"],
                 "keep_last = 2\n")
    root = job.checkpoint_dir
    job.start()
    job.wait_for(lambda: complete(root / "checkpoint-10"), RUN_TIMEOUT, "checkpoint-10")
    job.kill_rank(1)
    job.wait_for(lambda: len(job.attempt_logs()) >= 2 and complete(root / "checkpoint-15"), RUN_TIMEOUT,
                 "attempt 2's checkpoint-15")
    (root / "checkpoint-15" / "trainer_state.json").unlink()  # as a kill before the Trainer's last write leaves it
    job.kill_rank(1)
    assert job.wait_exit(RUN_TIMEOUT) == 0, job.tails()
    pick = str(root / "checkpoint-10")
    started = job.events("job_started")
    assert [e["argv"][-2:] for e in started[1:]] == [["--resume_from_checkpoint", pick]] * 2, job.tails()
    assert [(e.get("resumed_from"), e.get("resumed_step")) for e in started] == [(None, None), (pick, 10), (pick, 10)]
    logs = job.attempt_logs()
    for i, log in enumerate(logs, 1):
        assert_losses_match(reference, log, i, STEP_LINE)
    assert min(steps_printed(logs[1])) == 11 and max(steps_printed(logs[-1])) == STEPS
    listing = [(c["name"], c["complete"], c["step"]) for c in job.checkpoints_list()]
    assert listing and all(ok and step == int(name.split("-")[1]) for name, ok, step in listing), listing
    assert layout_problems(root, HF_ENTRY, HF_FILES) == []


def test_hf_picks_its_own_and_stops_gracefully(supervisors: Supervisors, tmp_path: Path,
                                               reference: dict[int, str]) -> None:
    """resume_args = [], resume_from_checkpoint=True: a torn checkpoint-10 is deleted before the relaunch, so the
    Trainer takes checkpoint-5; SIGTERM -> its JIT checkpoint at the step it reached, exit 0; `run` again -> it
    goes on from there. save_total_limit = 2 and keep_last = 3 both on; no resume point is claimed; what the
    Trainer's rotation removes is logged as `checkpoints_vanished`."""
    job = hf_job(supervisors, tmp_path, [], ["--resume-auto", "--jit-checkpoint", "--total-limit", "2"],
                 "keep_last = 3\n")
    root = job.checkpoint_dir
    job.start()
    job.wait_for(lambda: complete(root / "checkpoint-10"), RUN_TIMEOUT, "checkpoint-10")
    cut_in_half(root / "checkpoint-10" / "pytorch_model_fsdp_0" / "__1_0.distcp")
    job.kill_rank(1)
    job.wait_for(lambda: len(job.attempt_logs()) >= 2 and complete(root / "checkpoint-15"), RUN_TIMEOUT,
                 "attempt 2's checkpoint-15")
    code = job.stop(RUN_TIMEOUT)
    assert code == 0 and job.state().get("state") == "stopped", f"SIGTERM: exit {code}\n{job.tails()}"
    logs = job.attempt_logs()
    resumed = RESUMING.search(logs[1])
    assert resumed and resumed.group(1) == str(root / "checkpoint-5"), job.tails()
    cleared = [Path(e["path"]).name for e in job.events("retention_deleted") if "would load" in e["reason"]]
    assert cleared == ["checkpoint-10"], job.events("retention_deleted")
    for i, log in enumerate(logs, 1):
        assert_losses_match(reference, log, i, STEP_LINE)
    newest = max(int(p.name.split("-")[1]) for p in root.iterdir() if complete(p))
    reached = max(steps_printed(logs[1]))
    # The JIT save happens in on_step_begin (or on_step_end) of the step after the flag is set; a step begun
    # after it still runs and is lost
    assert 15 < newest and reached - 1 <= newest <= reached, \
        f"the JIT checkpoint is at step {newest}, the attempt reached {reached}"

    job.start()
    assert job.wait_exit(RUN_TIMEOUT) == 0, job.tails()
    logs = job.attempt_logs()
    resumed = RESUMING.search(logs[2])
    assert resumed and resumed.group(1) == str(root / f"checkpoint-{newest}"), job.tails()
    assert_losses_match(reference, logs[2], 3, STEP_LINE)
    assert min(steps_printed(logs[2])) == newest + 1 and max(steps_printed(logs[2])) == STEPS
    assert [e.get("resumed_from") for e in job.events("job_started")] == [None] * 3
    assert job.state().get("quarantined") in (None, [])
    assert layout_problems(root, HF_ENTRY, HF_FILES) == []
    # save_total_limit = 2 removed checkpoint-5 once attempt 2 had saved 10 and 15: said, as not the supervisor's
    vanished = {Path(p).name for e in job.events("checkpoints_vanished") for p in e["paths"]}
    assert "checkpoint-5" in vanished, job.events("checkpoints_vanished")


def test_hf_default_full_state_dict_resumes_from_checkpoint_20(supervisors: Supervisors, tmp_path: Path) -> None:
    """The Trainer's defaults (no FSDP: model.safetensors, optimizer.pt, ..., trainer_state.json in checkpoint-N): each
    save is judged, not foreign, so a kill after checkpoint-20 resumes from it (before: a silent fresh start)."""
    out = tmp_path / "out"
    job = SupervisedClient(supervisors, tmp_path, command=hf_command(out, "--no-fsdp", "--save-every", "10"),
                           checkpoint_dir=out, resume_args=["--resume_from_checkpoint", "{checkpoint}"],
                           extra_toml="keep_last = 3\n" + RESTART_FAST)
    job.start()
    job.wait_for(lambda: complete(out / "checkpoint-20"), RUN_TIMEOUT, "checkpoint-20")
    assert (out / "checkpoint-20" / "model.safetensors").is_file(), sorted(p.name for p in out.iterdir())
    job.kill_rank(1)
    assert job.wait_exit(RUN_TIMEOUT) == 0, job.tails()
    pick = str(out / "checkpoint-20")
    started = job.events("job_started")
    assert [(e.get("resumed_from"), e.get("resumed_step")) for e in started] == [(None, None), (pick, 20)], job.tails()
    second = job.attempt_logs()[1]
    assert min(steps_printed(second)) == 21 and max(steps_printed(second)) == STEPS, job.tails()
    listing = [(c["name"], c["complete"], c["step"]) for c in job.checkpoints_list()]
    assert listing == [("checkpoint-10", True, 10), ("checkpoint-20", True, 20), ("checkpoint-30", True, 30)], listing


def test_hf_nan_is_rolled_back_to_the_save_before_it(supervisors: Supervisors, tmp_path: Path,
                                                    reference: dict[int, str]) -> None:
    """hf_callback() beats the logged loss (its NaN filter off); the loss turns NaN at step 13 (attempt 1 only) ->
    `diverged` (nan), the job stopped, `rolled_back` to a checkpoint from before the onset; the relaunch is told the
    skip but the Trainer cannot skip: it resumes exactly and trains on the same data, every loss equal to the
    uninterrupted run's; `completed`, exit 0."""
    out = tmp_path / "out"
    job, back, second = nan_rolled_back(supervisors, tmp_path, hf_command(out), out, "--resume_from_checkpoint")
    to_step = back["to_step"]
    assert back["to_checkpoint"] == str(job.checkpoint_dir / f"checkpoint-{to_step}"), back
    assert f"not skipping {back['skip']} steps" in second, job.tails()
    assert min(steps_printed(second)) == to_step + 1 and max(steps_printed(second)) == STEPS
    assert_losses_match(reference, second, 2, STEP_LINE)
    listing = {c["name"]: c for c in job.checkpoints_list()}
    assert all(c["complete"] for c in listing.values()), listing
