"""The reference trainer under real torchrun (2 CPU ranks, gloo): exact resume, async save, signals, export,
evaluation and the best model.

One uninterrupted reference run (evaluation off) is the yardstick: every interrupted-and-resumed run must end
(and save every common step) with weights bit-identical to it, with evaluation on or off. Interruptions happen
at a randomly drawn step; the drawn values are in the assertion messages.
"""
from __future__ import annotations

import json
import random
import re
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from supervisor.checkpoints import DiskUsage, RetentionRules, newest_complete, plan_retention, scan, verify
from supervisor.layout import MANIFEST_NAME, METADATA_NAME, TMP_PREFIX, step_dir_name
from tests.helpers import Job, Launcher, logged_steps, module_torchrun, torchrun, wait_for  # noqa: F401
from tests.jobs.hooked_trainer import STALL_BEST_ENV, STALL_COMMIT_ENV
from trainer.best import BEST_FILE, WEIGHTS_FILE
from trainer.heartbeat import HEARTBEAT_ENV

STEPS, SAVE_EVERY = 24, 4
BASE = ["--steps", STEPS, "--save-every", SAVE_EVERY, "--log-every", 1, "--seed", 7]
EVAL = ["--eval-every", SAVE_EVERY, "--eval-batches", 2]
JOB_TIMEOUT = 240
SIGUSR1_BURST = 50  # stack dumps asked of one rank during async saves


def complete_steps(root: Path) -> dict[int, Path]:
    """Complete `step_<N>` checkpoints under `root`, by step."""
    out = {}
    for path in root.iterdir():
        if path.name.startswith("step_") and verify(path).complete:
            out[int(path.name.split("_")[1])] = path
    return out


def weights(path: Path) -> dict:
    from trainer.export import load_model_weights

    return load_model_weights(path)


def assert_same_weights(a: Path, b: Path, context: str) -> None:
    import torch

    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys(), context
    differ = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not differ, f"{context}: {a.name} vs {b.name} differ in {differ[:5]}"


def assert_same_rng_and_progress(a: Path, b: Path, context: str) -> None:
    """Every rank's RNG states and the progress counters are equal: nothing drew from them that the other did not."""
    import torch
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    sa, sb = (_load_state_dict_from_keys({"rng", "train"}, checkpoint_id=str(p)) for p in (a, b))
    assert sa["train"] == sb["train"], context
    for rank, states in sa["rng"].items():
        other = sb["rng"][rank]
        assert states["python"] == other["python"] and torch.equal(states["torch"], other["torch"]), f"{context} {rank}"


def manifest(path: Path) -> dict:
    return json.loads((path / MANIFEST_NAME).read_text())


def assert_best_is_the_lowest(root: Path, best_dir: Path, context: str) -> None:
    """best.json names the checkpoint with the lowest val_loss any manifest recorded; its weights are that one's."""
    import torch
    from safetensors.torch import load_file

    recorded = {step: manifest(p)["metrics"]["val_loss"] for step, p in complete_steps(root).items()
                if "val_loss" in manifest(p)["metrics"]}
    lowest = min(recorded, key=lambda step: (recorded[step], -step))
    best = json.loads((best_dir / BEST_FILE).read_text())
    assert best == {"step": lowest, "val_loss": recorded[lowest], "checkpoint": str(root / step_dir_name(lowest))}, \
        f"{context}: {recorded}"
    exported, saved = load_file(best_dir / WEIGHTS_FILE), weights(root / step_dir_name(lowest))
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved), context


def assert_ok(job: Job) -> None:
    """The job exited 0 and every rank recorded exit code 0."""
    assert job.proc.returncode == 0, job.text()[-4000:]
    codes = job.rank_exit_codes()
    assert codes and set(codes.values()) == {0}, codes


def current_step(job: Job) -> int:
    return max(logged_steps(job.text()), default=-1)


def wait_step(job: Job, step: int) -> int:
    """Block until rank 0 logged a step >= `step`; returns the step seen."""
    def seen() -> int | None:
        if job.proc.poll() is not None:
            raise AssertionError(f"job exited early (rc={job.proc.returncode}):\n{job.text()[-3000:]}")
        now = current_step(job)
        return now if now >= step else None

    return wait_for(seen, JOB_TIMEOUT, f"step {step}")  # type: ignore[return-value]


@dataclass
class Reference:
    root: Path
    heartbeat: Path
    job: Job


@pytest.fixture(scope="module")
def reference(module_torchrun: Launcher, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """One uninterrupted FSDP2 run with synchronous saves every SAVE_EVERY steps."""
    tmp = tmp_path_factory.mktemp("reference")
    hb = tmp / "heartbeat.json"
    job = module_torchrun.run([*BASE, "--checkpoint-dir", tmp / "ckpts"], env={HEARTBEAT_ENV: str(hb)},
                              timeout=JOB_TIMEOUT)
    assert_ok(job)
    return Reference(tmp / "ckpts", hb, job)


@dataclass
class BestRun:
    root: Path
    best_dir: Path
    stall_step: int
    resumed: Job
    heartbeat: Path


@pytest.fixture(scope="module")
def best_run(module_torchrun: Launcher, tmp_path_factory: pytest.TempPathFactory) -> BestRun:
    """FSDP2 with evaluation and `--export-best <root>/best`: rank 0 SIGKILLed at a random new best, after its
    checkpoint committed and its weights were written but before its best.json; resumed."""
    tmp = tmp_path_factory.mktemp("best")
    root = tmp / "ckpts"
    best_dir = root / "best"
    args = [*BASE, *EVAL, "--checkpoint-dir", root, "--export-best", best_dir]
    stall = random.choice(range(2 * SAVE_EVERY, STEPS, SAVE_EVERY))  # a best.json of an earlier step exists
    job = module_torchrun.torchrun(args, env={STALL_BEST_ENV: str(stall)}, hooked=True)
    rank0 = job.worker_of_rank(0)
    committed, exported = root / step_dir_name(stall) / MANIFEST_NAME, best_dir / WEIGHTS_FILE

    def stalled() -> bool:
        if job.proc.poll() is not None:
            raise AssertionError(f"job exited early (rc={job.proc.returncode}):\n{job.text()[-3000:]}")
        return committed.exists() and exported.exists() and exported.stat().st_mtime_ns >= committed.stat().st_mtime_ns

    wait_for(stalled, JOB_TIMEOUT, f"the best model of step {stall} written, its best.json not yet")
    rank0.kill()
    assert job.wait(JOB_TIMEOUT) != 0
    assert json.loads((best_dir / BEST_FILE).read_text())["step"] == stall - SAVE_EVERY, f"stall={stall}"
    hb = tmp / "heartbeat.json"
    resumed = module_torchrun.run(args, env={HEARTBEAT_ENV: str(hb)}, timeout=JOB_TIMEOUT)
    return BestRun(root, best_dir, stall, resumed, hb)


class TestBitExactResume:
    def test_sigkill_at_a_random_new_best_resumes_bit_exact(self, best_run, reference) -> None:
        """FSDP2 with evaluation: rank 0 SIGKILLed at a random step (a new best's export), resumed with --resume auto:
        every save equals the (evaluation off) reference's weights, RNG states and counters."""
        stall = best_run.stall_step
        assert_ok(best_run.resumed)
        assert f"event=resuming rank=0 path={best_run.root / step_dir_name(stall)} " in best_run.resumed.text(), stall
        done = complete_steps(best_run.root)
        assert STEPS in done, f"stall={stall}"
        for step, path in sorted(done.items()):
            context = f"stall={stall} step={step}"
            assert_same_weights(path, reference.root / step_dir_name(step), context)
            assert_same_rng_and_progress(path, reference.root / step_dir_name(step), context)


@dataclass
class MidSave:
    root: Path
    save_step: int
    tmp_dir: Path
    before: dict[int, Path]
    resumed: Job


@pytest.fixture(scope="module")
def fsdp1_mid_save(reference, module_torchrun: Launcher, tmp_path_factory: pytest.TempPathFactory) -> MidSave:
    """FSDP1 with evaluation: rank 0 SIGKILLed at a random save, after DCP wrote everything but before the
    commit; resumed."""
    root = tmp_path_factory.mktemp("fsdp1") / "ckpts"
    args = [*BASE, *EVAL, "--fsdp", 1, "--checkpoint-dir", root, "--export-best", root.parent / "best"]
    save_step = random.choice(range(2 * SAVE_EVERY, STEPS, SAVE_EVERY))
    job = module_torchrun.torchrun(args, env={STALL_COMMIT_ENV: str(save_step)}, hooked=True)
    rank0 = job.worker_of_rank(0)
    pattern = f"{TMP_PREFIX}{step_dir_name(save_step)}-*/{METADATA_NAME}"
    tmp_dir = wait_for(lambda: next(root.glob(pattern), None), JOB_TIMEOUT, f"the written save of step {save_step}")
    rank0.kill()
    assert job.wait(JOB_TIMEOUT) != 0
    before = complete_steps(root)
    return MidSave(root, save_step, tmp_dir.parent, before, module_torchrun.run(args, timeout=JOB_TIMEOUT))


class TestFsdp1MidSave:
    def test_interrupted_save_stays_temporary(self, fsdp1_mid_save) -> None:
        """The killed save keeps its temp name and no manifest; the newest complete one is the save before."""
        run = fsdp1_mid_save
        assert run.tmp_dir.exists() and not (run.tmp_dir / MANIFEST_NAME).exists()
        assert max(run.before) == run.save_step - SAVE_EVERY, (run.save_step, sorted(run.before))
        assert f"event=resuming rank=0 path={run.root / step_dir_name(run.save_step - SAVE_EVERY)} " in run.resumed.text()

    def test_fsdp1_resume_is_bit_exact(self, fsdp1_mid_save, reference) -> None:
        """FSDP1 (SHARDED_STATE_DICT) with evaluation resumes exactly; on this model it even matches FSDP2 (with
        evaluation off) bit for bit."""
        run = fsdp1_mid_save
        assert_ok(run.resumed)
        done = complete_steps(run.root)
        assert STEPS in done, f"save_step={run.save_step}"
        for step, path in sorted(done.items()):
            assert_same_weights(path, reference.root / step_dir_name(step), f"fsdp1 save_step={run.save_step} step={step}")

    def test_fsdp1_best_model_is_its_checkpoint(self, fsdp1_mid_save) -> None:
        """FSDP1's FULL_STATE_DICT gather gives the bits of the checkpoint best.json names."""
        run = fsdp1_mid_save
        assert_best_is_the_lowest(run.root, run.root.parent / "best", f"fsdp1 save_step={run.save_step}")


class TestEvaluation:
    def test_every_evaluated_step_is_saved_with_its_val_loss(self, best_run) -> None:
        """Each evaluation's val_loss is in the manifest of the checkpoint saved at that step."""
        done = complete_steps(best_run.root)
        assert sorted(done) == list(range(SAVE_EVERY, STEPS + 1, SAVE_EVERY))
        values = [manifest(done[s])["metrics"]["val_loss"] for s in sorted(done)]
        assert all(isinstance(v, float) and 0 < v < 10 for v in values), values

    def test_heartbeat_carries_the_last_val_loss(self, best_run) -> None:
        """The final beat repeats the last evaluation's val_loss."""
        beat = json.loads(best_run.heartbeat.read_text())
        assert beat["val_loss"] == manifest(best_run.root / step_dir_name(STEPS))["metrics"]["val_loss"]


class TestBestModel:
    def test_interrupted_export_is_finished_on_resume(self, best_run) -> None:
        """The resumed run sees step N's manifest beat best.json and exports the loaded weights at once."""
        text, stall = best_run.resumed.text(), best_run.stall_step
        assert f"event=best_model_recovered rank=0 step={stall} " in text, f"stall={stall}\n{text[-3000:]}"

    def test_best_json_names_the_lowest_val_loss_and_holds_its_weights(self, best_run) -> None:
        """best.json: the lowest val_loss any manifest recorded, and model.safetensors equals that checkpoint's export."""
        assert_best_is_the_lowest(best_run.root, best_run.best_dir, f"stall={best_run.stall_step}")

    def test_a_best_cut_short_at_the_final_step_is_exported_by_the_done_run(self, torchrun, tmp_path) -> None:
        """One process, killed between the final step's new best checkpoint and its best.json, with temporaries
        of a killed write in DIR: the relaunch has no step left, yet exports that best and removes ours (another
        program's `.tmpAb12Cd` beside them is not ours and stays)."""
        root, best_dir = tmp_path / "ckpts", tmp_path / "best"
        args = ["--steps", 8, "--save-every", 4, "--eval-every", 4, "--eval-batches", 1, "--d-model", 32,
                "--n-heads", 2, "--seed", 7, "--checkpoint-dir", root, "--export-best", best_dir]
        job = torchrun.single(args, env={STALL_BEST_ENV: "8"}, hooked=True)
        committed, exported = root / step_dir_name(8) / MANIFEST_NAME, best_dir / WEIGHTS_FILE

        def stalled() -> bool:
            if job.proc.poll() is not None:
                raise AssertionError(f"job exited early (rc={job.proc.returncode}):\n{job.text()[-3000:]}")
            return committed.exists() and exported.exists() and exported.stat().st_mtime_ns >= committed.stat().st_mtime_ns

        wait_for(stalled, JOB_TIMEOUT, "the best model of the final step written, its best.json not yet")
        job.kill()
        assert json.loads((best_dir / BEST_FILE).read_text())["step"] == 4
        for leftover in (f".{WEIGHTS_FILE}.0badf00d.tmp", ".tmpAb12Cd"):
            (best_dir / leftover).write_bytes(b"x" * 1000)
        resumed = torchrun.run(args, nproc=None, timeout=JOB_TIMEOUT)
        text = resumed.text()
        assert resumed.proc.returncode == 0 and "event=already_done rank=0 step=8 " in text, text[-3000:]
        assert "event=best_model_recovered rank=0 step=8 " in text, text[-3000:]
        assert_best_is_the_lowest(root, best_dir, "final step")
        assert sorted(p.name for p in best_dir.iterdir()) == [".tmpAb12Cd", BEST_FILE, WEIGHTS_FILE]

    def test_best_dir_inside_the_root_is_never_a_checkpoint(self, best_run) -> None:
        """ckpts/best is foreign: listed, never the newest, never deleted by retention (even as old debris)."""
        found = {c.name: c for c in scan(best_run.root)}
        assert found["best"].state == "foreign" and not found["best"].complete
        assert newest_complete(best_run.root).name == step_dir_name(STEPS)  # type: ignore[union-attr]
        plan = plan_retention(list(found.values()), rules=RetentionRules(keep_last=1, partial_max_age_s=0),
                              disk=DiskUsage(total_bytes=1, free_bytes=0), now=10**10)
        assert best_run.best_dir not in {d.path for d in plan.deletions} and best_run.best_dir in plan.kept


@dataclass
class StoppedRun:
    root: Path
    first: Job
    stop_step: int
    signalled_at: int
    second: Job


@pytest.fixture(scope="module")
def stopped_async(module_torchrun: Launcher, tmp_path_factory: pytest.TempPathFactory) -> StoppedRun:
    """An --async-save run: SIGUSR1 to rank 0 every 20 ms (at least 50 times, until its async save of step 8 was
    committed), then SIGTERM to the torchrun agent at a random step; resumed."""
    root = tmp_path_factory.mktemp("async") / "ckpts"
    args = [*BASE, "--async-save", "--checkpoint-dir", root]
    job = module_torchrun.torchrun(args)
    k = random.randrange(3 * SAVE_EVERY, STEPS - 4)
    rank0 = job.worker_of_rank(0)
    wait_step(job, SAVE_EVERY - 1)
    sent = 0
    while sent < SIGUSR1_BURST or f"event=checkpoint_saved rank=0 step={2 * SAVE_EVERY} " not in job.text():
        assert job.proc.poll() is None and sent < 50 * SIGUSR1_BURST, job.text()[-3000:]
        rank0.send_signal(signal.SIGUSR1)
        sent += 1
        time.sleep(0.02)
    wait_for(lambda: job.text().count("Stack dump of process") >= 1, JOB_TIMEOUT, "a stack dump")
    signalled_at = wait_step(job, k)
    job.proc.send_signal(signal.SIGTERM)
    job.wait(JOB_TIMEOUT)  # torchrun itself exits 1 (SignalException) even when every worker exits 0
    stopped = [int(s) for s in re.findall(r"event=stopped rank=0 step=(\d+)", job.text())]
    assert len(stopped) == 1, job.text()[-3000:]
    second = module_torchrun.run(args, timeout=JOB_TIMEOUT)
    return StoppedRun(root, job, stopped[0], signalled_at, second)


class TestSignals:
    def test_sigterm_saves_the_current_step_and_workers_exit_0(self, stopped_async) -> None:
        """SIGTERM to torchrun: all ranks stop at one step, a complete checkpoint of that step exists, exit 0."""
        run = stopped_async
        assert set(run.first.rank_exit_codes().values()) == {0}, run.first.text()[-3000:]
        assert run.stop_step >= run.signalled_at and run.stop_step == current_step(run.first)
        ckpt = run.root / step_dir_name(run.stop_step)
        assert verify(ckpt).complete
        assert json.loads((ckpt / MANIFEST_NAME).read_text())["step"] == run.stop_step
        assert f"event=resuming rank=0 path={ckpt} " in run.second.text()
        assert_ok(run.second)

    def test_sigusr1_dumps_stacks_and_training_goes_on(self, stopped_async) -> None:
        """SIGUSR1, again and again through async saves, prints every thread's stack by name and does not stop
        training (the run's checkpoints are the reference's: TestAsyncSave; nothing crashed: rank exit codes)."""
        text = stopped_async.first.text()
        dump_at = text.index("Stack dump of process")
        assert "event=train rank=0 step=" in text[dump_at:]
        assert '"MainThread"' in text and '"trainer-stack-dump"' in text
        writer = r'^Thread 0x\w+ "[^"]+" tid \d+ \(most recent call last\):\n(  .*\n)*.*concurrent/futures/thread\.py'
        assert re.search(writer, text, re.MULTILINE), "the async save's writer thread is named"
        assert "Fatal Python error" not in text and "Segmentation fault" not in text


class TestAsyncSave:
    def test_async_checkpoints_equal_sync_ones(self, stopped_async, reference) -> None:
        """Every step saved by the async (stopped and resumed) run has the reference's exact weights."""
        done = complete_steps(stopped_async.root)
        common = sorted(set(done) & set(complete_steps(reference.root)))
        assert STEPS in common and len(common) >= 3, common
        for step in common:
            assert_same_weights(done[step], reference.root / step_dir_name(step), f"async step={step}")


def logged_loss(job: Job, step: int) -> float:
    return float(re.search(rf"event=train rank=0 step={step} loss=(\S+)", job.text()).group(1))  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def planted(reference, module_torchrun: Launcher, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Job]:
    """One process resuming (auto) a root holding the reference's steps 8 and 16, a torn step 20 and a
    complete-looking temp dir of step 24."""
    root = tmp_path_factory.mktemp("planted") / "ckpts"
    root.mkdir()
    for step in (8, 16):
        shutil.copytree(reference.root / step_dir_name(step), root / step_dir_name(step))
    torn = shutil.copytree(reference.root / step_dir_name(20), root / step_dir_name(20))
    next(torn.glob("*.distcp")).unlink()
    shutil.copytree(reference.root / step_dir_name(24), root / f"{TMP_PREFIX}{step_dir_name(24)}-dead")
    return root, module_torchrun.run([*BASE, "--checkpoint-dir", root], nproc=None, timeout=JOB_TIMEOUT)


class TestResumeChoice:
    def test_auto_ignores_temporary_and_torn_dirs(self, planted) -> None:
        """`--resume auto` picks step 16, not the torn step 20 nor the temp dir of step 24."""
        root, job = planted
        assert f"event=resuming rank=0 path={root / step_dir_name(16)} " in job.text(), job.text()[-2000:]

    def test_torn_final_dir_is_replaced_by_the_new_save(self, planted) -> None:
        """Saving step 20 again sets the torn dir aside and commits a complete one in its place."""
        root, _ = planted
        assert verify(root / step_dir_name(20)).complete
        assert [p for p in root.iterdir() if p.name.startswith(f"{TMP_PREFIX}{step_dir_name(20)}-incomplete-")]

    def test_resume_at_steps_exits_0_without_training(self, reference, torchrun, tmp_path) -> None:
        """Resuming at --steps exits 0 at once: no step trained, nothing written."""
        root = tmp_path / "ckpts"
        job = torchrun.run([*BASE, "--checkpoint-dir", root, "--resume", reference.root / step_dir_name(STEPS)],
                           nproc=None, timeout=JOB_TIMEOUT)
        assert job.proc.returncode == 0 and "event=already_done" in job.text(), job.text()[-2000:]
        assert "event=train " not in job.text() and list(root.iterdir()) == []


class TestWorldSizeChange:
    def test_one_rank_resumes_a_two_rank_checkpoint(self, planted, reference) -> None:
        """DCP reshards onto one rank: training continues at the saved step, with a loss close to the reference's."""
        root, job = planted
        assert job.proc.returncode == 0, job.text()[-3000:]
        assert "event=rng_not_restored" in job.text() and logged_steps(job.text()) == list(range(17, STEPS + 1))
        manifest = json.loads((root / step_dir_name(STEPS) / MANIFEST_NAME).read_text())
        assert manifest["world_size"] == 1 and manifest["step"] == STEPS
        # Half the global batch per step: close to, not equal to, the two-rank loss.
        assert abs(logged_loss(job, 17) - logged_loss(reference.job, 17)) < 0.3


class TestHeartbeat:
    def test_final_heartbeat_matches_the_last_checkpoint(self, reference) -> None:
        """The heartbeat file ends at the final step, in the save phase, with the checkpoint's loss."""
        beat = json.loads(reference.heartbeat.read_text())
        manifest = json.loads((reference.root / step_dir_name(STEPS) / MANIFEST_NAME).read_text())
        assert set(beat) == {"step", "time", "phase", "loss", "checks_loads"}  # its loads check the checksums
        assert beat["checks_loads"] is True and beat["step"] == STEPS and beat["phase"] == "save"
        assert beat["loss"] == manifest["loss"]
        assert abs(beat["time"] - manifest["time"]) < 600


class TestExport:
    def test_export_loads_with_weights_only_into_a_plain_model(self, reference, tmp_path) -> None:
        """The exported file is a flat name->tensor dict that a plain TinyLM loads strictly."""
        import torch

        from trainer.export import main
        from trainer.model import ModelConfig, TinyLM

        out = tmp_path / "model.pt"
        assert main([str(reference.root / step_dir_name(STEPS)), str(out)]) == 0
        loaded = torch.load(out, weights_only=True)
        model = TinyLM(ModelConfig())
        model.load_state_dict(loaded, strict=True)
        assert all(torch.equal(loaded[k], v) for k, v in weights(reference.root / step_dir_name(STEPS)).items())

    def test_fsdp1_and_fsdp2_exports_have_the_same_names(self, reference, fsdp1_mid_save) -> None:
        """No FSDP wrapper prefix leaks into the exported names."""
        fsdp1 = weights(fsdp1_mid_save.root / step_dir_name(STEPS))
        assert fsdp1.keys() == weights(reference.root / step_dir_name(STEPS)).keys()

    def test_export_refuses_an_incomplete_checkpoint(self, reference, tmp_path, capsys) -> None:
        """A temp-named copy is not complete: exit 2 with one line, no output file."""
        from trainer.export import main

        tmp = shutil.copytree(reference.root / step_dir_name(4), tmp_path / f"{TMP_PREFIX}{step_dir_name(4)}-x")
        assert main([str(tmp), str(tmp_path / "out.pt")]) == 2
        assert not (tmp_path / "out.pt").exists()
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
