"""The divergence guard with the real reference trainer under torchrun (2 CPU ranks) and the supervisor.

A NaN is injected by tests/jobs/hooked_trainer.py: tied to the data (a batch a rollback's skip avoids) or to a step
(a divergence no skip avoids).
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from supervisor.checkpoints.markers import quarantine_reason
from tests.helpers import HOOKED_ENTRY, Launcher, compare_checkpoints, torchrun  # noqa: F401
from tests.jobs.hooked_trainer import NAN_SAMPLE_ENV, NAN_STEP_ENV, SPIKE_ENV
from tests.supervise import Supervisors, supervisors, write_config  # noqa: F401

STEPS, SAVE_EVERY, SEED, WORLD, BATCH = 40, 10, 3, 2, 8
NAN_STEP = 25  # its batch begins at sample (NAN_STEP - 1) * WORLD * BATCH
AFTER = 2  # skip_after_onset
TRAIN = ["--checkpoint-dir", "ckpts", "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--seed", str(SEED),
         "--log-every", "5"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
            "--max-restarts=0", str(HOOKED_ENTRY)]
TIMEOUT = 300


def config(tmp_path: Path, env: dict[str, str], extra: str) -> Path:
    cfg = write_config(tmp_path, TORCHRUN + TRAIN, extra)
    text = cfg.read_text().replace('resume_args = ["--resume", "{checkpoint}"]',
                                   'resume_args = ["--resume", "{checkpoint}", "--skip-steps", "{skip_steps}"]')
    hooks = ", ".join(f'{k} = "{v}"' for k, v in env.items())
    cfg.write_text(text.replace('env = { OMP_NUM_THREADS = "1" }', f'env = {{ OMP_NUM_THREADS = "1", {hooks} }}'))
    return cfg


def history(tmp_path: Path, kind: str) -> list[dict]:
    lines = (tmp_path / ".fsdp-supervisor" / "history.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


class TestDivergence:
    def test_bad_data_is_rolled_back_skipped_and_equals_a_resume_by_hand(
            self, tmp_path: Path, supervisors: Supervisors, torchrun: Launcher) -> None:
        """A NaN on the batch of step 25: stopped, relaunched from step 20 with 5 + 2 data steps skipped, finished;
        its last checkpoint equals, bit for bit, a run resumed from step 20 by hand with --skip-steps 7."""
        sample = (NAN_STEP - 1) * WORLD * BATCH
        cfg = config(tmp_path, {NAN_SAMPLE_ENV: str(sample)},
                     f"keep_last = 0\n[health]\nstop_timeout_s = 60\n[divergence]\nskip_after_onset = {AFTER}\n")
        p = supervisors.start(cfg)
        out, _ = p.communicate(timeout=TIMEOUT)
        assert p.returncode == 0, out[-3000:]
        [found] = history(tmp_path, "diverged")
        assert (found["onset_step"], found["why"]) == (NAN_STEP, "nan")
        [back] = history(tmp_path, "rolled_back")
        root = tmp_path / "ckpts"
        assert back["to_checkpoint"] == str(root / "step_00000020") and back["skip"] == NAN_STEP - 20 + AFTER
        diverged = [q for q in history(tmp_path, "quarantined") if q["reason"].startswith("diverged")]
        assert diverged, "the diverged attempt's saves after the onset are marked"
        assert quarantine_reason(root / "step_00000020") is None
        state = json.loads((tmp_path / ".fsdp-supervisor" / "state.json").read_text())
        assert state["state"] == "completed" and state["rollbacks"] == 1 and state["restarts"] == 0

        by_hand = tmp_path / "by_hand"
        by_hand.mkdir()
        shutil.copytree(root / "step_00000020", by_hand / "step_00000020")
        job = torchrun.run(["--checkpoint-dir", by_hand, "--steps", STEPS, "--save-every", SAVE_EVERY, "--seed", SEED,
                            "--resume", by_hand / "step_00000020", "--skip-steps", NAN_STEP - 20 + AFTER],
                           timeout=TIMEOUT)
        assert job.proc.returncode == 0, job.text()[-3000:]
        same = compare_checkpoints(by_hand / f"step_{STEPS:08d}", root / f"step_{STEPS:08d}", tmp_path)
        assert same.returncode == 0, same.stdout + same.stderr

    def test_a_spike_with_saves_inside_never_resumes_one(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """The loss 50x higher on the batches of steps 41-100 (saves every 10): seen as a spike, every save from step 41
        on is diverged, the relaunch resumes step 40, skips past the window and finishes."""
        first, last = 41, 100
        cfg = config(tmp_path, {SPIKE_ENV: f"{(first - 1) * WORLD * BATCH},{last * WORLD * BATCH}"},
                     "keep_last = 0\n[health]\nstop_timeout_s = 60\n[divergence]\nskip_after_onset = 70\n")
        cfg.write_text(cfg.read_text().replace(f'"--steps", "{STEPS}"', '"--steps", "120"'))
        p = supervisors.start(cfg)
        out, _ = p.communicate(timeout=TIMEOUT)
        assert p.returncode == 0, out[-3000:]
        [found] = history(tmp_path, "diverged")
        assert found["why"] == "spike" and first <= found["onset_step"] <= last
        [back] = history(tmp_path, "rolled_back")
        assert back["to_step"] < first
        diverged = {int(Path(q["path"]).name.rsplit("_", 1)[1]) for q in history(tmp_path, "quarantined")
                    if q["reason"].startswith("diverged")}
        assert set(range(first + 9, found["step"] + 1, 10)) <= diverged, "every save inside the spike seen is diverged"
        resumed = [s["resumed_step"] for s in history(tmp_path, "attempt_start")]
        assert resumed == [None, back["to_step"]]

    def test_a_divergence_no_skip_avoids_gives_up_keeping_the_last_good_checkpoint(
            self, tmp_path: Path, supervisors: Supervisors) -> None:
        """NaN at step 25 whatever the data: one rollback, the same again, exit 3 naming the onset and step 20, which
        is still on disk although keep_last = 1 is fewer than the diverged saves."""
        cfg = config(tmp_path, {NAN_STEP_ENV: str(NAN_STEP)},
                     f"keep_last = 1\n[health]\nstop_timeout_s = 60\n[divergence]\nskip_after_onset = {AFTER}\n"
                     "max_rollbacks = 1\n")
        p = supervisors.start(cfg)
        out, _ = p.communicate(timeout=TIMEOUT)
        assert p.returncode == 3, out[-3000:]
        state = json.loads((tmp_path / ".fsdp-supervisor" / "state.json").read_text())
        root = tmp_path / "ckpts"
        assert f"at step {NAN_STEP}" in state["reason"] and str(root / "step_00000020") in state["reason"]
        assert len(history(tmp_path, "diverged")) == 2 and len(history(tmp_path, "rolled_back")) == 1
        diverged = [q["path"] for q in history(tmp_path, "quarantined") if q["reason"].startswith("diverged")]
        assert len(diverged) == 2, "each attempt's emergency save (the same step) is marked"
        assert (root / "step_00000020" / ".metadata").is_file() and quarantine_reason(root / "step_00000020") is None
