"""Real Accelerate (FSDP2 plugin, 2 CPU ranks) under `fsdp-supervisor run`: kill a rank, resume, layout.

Opt-in tier (`make test-clients`), skipped where accelerate is not installed. The job is
tests/clients/accelerate_train.py behind the one-patch CPU shim, configured as deploy/examples/accelerate.toml:
`resume_args = ["--resume-from", "{checkpoint}"]` (the script calls `accelerator.load_state(path)` with the
supervisor's pick) and the supervisor's `keep_last = 3` (no `total_limit`: one deleter per folder). It saves
`checkpoints/checkpoint_<i>` every 5 steps and records the step in `trainer_state.json`. The kill lands
between two saves (`--step-s` makes a step last long enough for that): there Accelerate's own `load_state()`
would pick the same folder; a save cut short, where it would not, is covered by the fast reproductions
(tests/clients/test_client_reproductions.py). The uninterrupted reference run uses `total_limit = 3` instead,
to check Accelerate's own cleanup against tests/clients/layouts.py. Its resume is bit-exact on CPU, so every
step after the resume must print the same `repr(loss)` as the uninterrupted run.
"""
from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="real-client tier: run `make test-clients`")

from tests.clients.harness import CLIENTS, TORCHRUN, SupervisedClient, run_plain
from tests.clients.layouts import ACCELERATE_ENTRY, ACCELERATE_FILES, layout_problems
from tests.supervise import Supervisors, assert_no_orphans, supervisors  # noqa: F401

pytestmark = [pytest.mark.clients, pytest.mark.timeout(900)]

STEPS, SAVE_EVERY, KEEP = 30, 5, 3
STEP_S = 0.5  # four steps between the step-10 save and the next: ~2 s for the test to see the save and kill
RUN_TIMEOUT = 300
STEP_LINE = re.compile(r"^step=(\d+) loss=(\S+)$", re.M)
RESUMED = re.compile(r"^resumed step=(\d+) from=(\S+)$", re.M)
# as deploy/examples/accelerate.toml: the supervisor's keep rule, Accelerate's total_limit off
TOML = f"keep_last = {KEEP}\n\n[restart]\nbackoff_initial_s = 0.5\nbackoff_max_s = 2\n\n[health]\nstop_timeout_s = 30\n"


def accelerate_command(project: Path, *extra: str) -> list[str]:
    return [*TORCHRUN, str(CLIENTS / "shims" / "accelerate_cpu.py"), str(CLIENTS / "accelerate_train.py"),
            "--project-dir", str(project), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
            "--step-s", str(STEP_S), *extra]


def accelerate_job(sups: Supervisors, workdir: Path) -> SupervisedClient:
    workdir.mkdir(parents=True, exist_ok=True)
    project = workdir / "project"
    return SupervisedClient(sups, workdir, command=accelerate_command(project),
                            resume_args=["--resume-from", "{checkpoint}"], checkpoint_dir=project / "checkpoints",
                            extra_toml=TOML)


def steps_printed(log: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in STEP_LINE.finditer(log)}


def saved(job: SupervisedClient, step: int) -> bool:
    """A checkpoint_<i> whose sidecar (written after save_state returned) names `step`."""
    for sidecar in job.checkpoint_dir.glob("checkpoint_*/trainer_state.json"):
        try:
            if json.loads(sidecar.read_text()).get("global_step") == step:
                return True
        except (OSError, ValueError):
            continue
    return False


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """repr(loss) of every step of one uninterrupted run without the supervisor; and the layout Accelerate
    wrote, checked against tests/clients/layouts.py (what the reproduction writes)."""
    workdir = tmp_path_factory.mktemp("accelerate-reference")
    tag = uuid.uuid4().hex
    try:
        printed = steps_printed(run_plain(accelerate_command(workdir / "project", "--total-limit", "3"),
                                          workdir / "run.log", tag, RUN_TIMEOUT))
    finally:
        assert_no_orphans(tag)
    assert sorted(printed) == list(range(1, STEPS + 1))
    root = workdir / "project" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_3", "checkpoint_4", "checkpoint_5"]
    assert layout_problems(root, ACCELERATE_ENTRY, ACCELERATE_FILES) == [], \
        "Accelerate's layout is not the one tests/clients/layouts.py (and the reproduction) assume"
    return printed


def test_accelerate_resumes_from_the_supervisors_pick(supervisors: Supervisors, tmp_path: Path,
                                                      reference: dict[int, str]) -> None:
    """Kill rank 1 after the step-10 save: the supervisor passes checkpoint_1, Accelerate's load_state(path)
    resumes at 11 and every loss matches; keep_last = 3 leaves checkpoint_3..5, and nothing of ours."""
    job = accelerate_job(supervisors, tmp_path).start()
    job.wait_for(lambda: saved(job, 10), RUN_TIMEOUT, "the step-10 save (checkpoint_1/trainer_state.json)")
    job.kill_rank(1)
    code = job.wait_exit(RUN_TIMEOUT)
    assert code == 0, f"the supervisor exited {code}\n{job.tails()}"
    logs = job.attempt_logs()
    assert len(logs) == 2, job.tails()
    killed_after = max(steps_printed(logs[0]))
    assert killed_after < 15, (
        f"attempt 1 printed up to step {killed_after}: the kill was meant to land between the step-10 and step-15 "
        f"saves (a slow machine? raise STEP_S)\n{job.tails()}")
    started = job.events("job_started")
    pick = str(job.checkpoint_dir / "checkpoint_1")
    assert [e.get("argv", [])[-2:] for e in started[1:]] == [["--resume-from", pick]]
    assert [(e.get("resumed_from"), e.get("resumed_step")) for e in started] == [(None, None), (pick, 10)], \
        "the supervisor's pick is checkpoint_1 with step 10 (from its trainer_state.json)"
    resumed = RESUMED.search(logs[1])
    assert resumed and resumed.group(1) == "10" and Path(resumed.group(2)).name == "checkpoint_1", job.tails()
    for i, log in enumerate(logs, 1):
        diff = {s: (v, reference.get(s)) for s, v in steps_printed(log).items() if reference.get(s) != v}
        assert not diff, f"attempt {i}: steps whose loss differs from the uninterrupted run: {diff}"
    assert min(steps_printed(logs[1])) == 11 and max(steps_printed(logs[1])) == STEPS

    problems = layout_problems(job.checkpoint_dir, ACCELERATE_ENTRY, ACCELERATE_FILES)
    assert problems == [], f"files or folders Accelerate did not write, inside its checkpoints folder: {problems}"
    listing = [(c["name"], c["complete"], c["state"], c["reason"], c["step"]) for c in job.checkpoints_list()]
    expected = [(f"checkpoint_{i}", True, "complete", None, (i + 1) * SAVE_EVERY) for i in (3, 4, 5)]
    assert listing == expected, (
        "`checkpoints list` must show each checkpoint_<i> (nested DCP dirs pytorch_model_fsdp_0/ and optimizer_0/"
        " plus Accelerate's files) as complete, with the training step from trainer_state.json, not the save"
        f" ordinal in the name, and keep_last = {KEEP} the newest three:\n got      {listing}\n expected {expected}")


def test_accelerate_picks_its_own_past_a_torn_newest_and_stops(supervisors: Supervisors, tmp_path: Path,
                                                               reference: dict[int, str]) -> None:
    """resume_args = [] (the script calls load_state() with no argument) and Accelerate's own rotation
    (total_limit = 3, the supervisor's keep_last = 0: one deleter per folder): cut the step-10 save's model shard
    and kill -> the supervisor deletes it before the relaunch (load_state() would take it), so load_state() takes
    the step-5 one; SIGTERM -> Accelerate saves nothing, the supervisor exits 0 'stopped'; `run` again ->
    load_state() takes the newest and the run finishes. Every loss is the uninterrupted run's."""
    workdir = tmp_path
    project = workdir / "project"
    job = SupervisedClient(supervisors, workdir, command=accelerate_command(project, "--total-limit", "3"),
                           resume_args=[], checkpoint_dir=project / "checkpoints",
                           extra_toml=TOML.replace(f"keep_last = {KEEP}", "keep_last = 0")).start()
    job.wait_for(lambda: saved(job, 10), RUN_TIMEOUT, "the step-10 save")
    (torn,) = [p.parent for p in job.checkpoint_dir.glob("checkpoint_*/trainer_state.json")
               if json.loads(p.read_text()).get("global_step") == 10]
    shard = torn / "pytorch_model_fsdp_0" / "__1_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    job.kill_rank(1)
    job.wait_for(lambda: len(job.attempt_logs()) >= 2 and saved(job, 15), RUN_TIMEOUT, "attempt 2's step-15 save")
    assert job.stop(RUN_TIMEOUT) == 0 and job.state().get("state") == "stopped", job.tails()
    job.start()
    assert job.wait_exit(RUN_TIMEOUT) == 0, job.tails()
    logs = job.attempt_logs()
    resumed = [RESUMED.search(log) for log in logs[1:]]
    assert [m.group(1) if m else None for m in resumed] == ["5", "15"], job.tails()
    cleared = [Path(e["path"]).name for e in job.events("retention_deleted") if "would load" in e["reason"]]
    assert cleared == [torn.name], job.events("retention_deleted")
    assert [e.get("resumed_from") for e in job.events("job_started")] == [None] * 3
    for i, log in enumerate(logs, 1):
        diff = {s: (v, reference.get(s)) for s, v in steps_printed(log).items() if reference.get(s) != v}
        assert not diff, f"attempt {i}: steps whose loss differs from the uninterrupted run: {diff}"
    assert max(steps_printed(logs[-1])) == STEPS
    assert len(list(job.checkpoint_dir.iterdir())) == 3, "total_limit = 3: Accelerate keeps three"
    problems = layout_problems(job.checkpoint_dir, ACCELERATE_ENTRY, ACCELERATE_FILES)
    assert problems == [], f"files or folders Accelerate did not write, inside its checkpoints folder: {problems}"
