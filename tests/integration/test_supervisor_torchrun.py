"""The supervisor driving the real reference trainer under torchrun (2 CPU ranks): the faults it exists for.

Every scenario ends with the job finished by the supervisor (exit 0), and, where the world size and seed are
unchanged, exported weights bit-identical to one uninterrupted run.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from supervisor.checkpoints import newest_complete, scan
from tests.helpers import HOOKED_ENTRY
from tests.jobs.hooked_trainer import HOLD_TRAIN_STEP_ENV, HOLD_TRAIN_UNTIL_ENV
from tests.mounts import flip_on_device, loop_ext4  # noqa: F401
from tests.supervise import Supervisors, cli, stop, supervisors, wait_for, write_config  # noqa: F401

STEPS, SAVE_EVERY, SEED = 40, 5, 3
TRAIN = ["-m", "trainer", "--checkpoint-dir", "ckpts", "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
         "--seed", str(SEED), "--log-every", "5"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0"]
FAST = "\n[restart]\nbackoff_initial_s = 0.2\nbackoff_max_s = 1\n[health]\nstop_timeout_s = 20\n"
TIMEOUT = 300


def state(tmp_path: Path) -> dict:
    try:
        return json.loads((tmp_path / ".fsdp-supervisor" / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def latest_step(tmp_path: Path) -> int:
    return ((state(tmp_path).get("latest_checkpoint") or {}).get("step")) or 0


def export(ckpt: Path, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "trainer.export", str(ckpt), str(out)], check=True, timeout=120,
                   capture_output=True)
    import torch

    return torch.load(out, weights_only=True)


def assert_same(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Weights of one uninterrupted supervised run (same seed, same world size)."""
    tmp = tmp_path_factory.mktemp("reference")
    s = Supervisors()
    try:
        p = s.start(write_config(tmp, TORCHRUN + TRAIN, FAST))
        out, _ = p.communicate(timeout=TIMEOUT)
        assert p.returncode == 0, out[-3000:]
    finally:
        s.cleanup()
    final = newest_complete(tmp / "ckpts")
    assert final is not None and final.step == STEPS
    return export(final.path, tmp / "ref.pt")


def job_workers(tmp_path: Path) -> list[psutil.Process]:
    pid = state(tmp_path).get("job_pid")
    try:
        return psutil.Process(pid).children() if pid else []
    except psutil.Error:
        return []


def attempts(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / ".fsdp-supervisor" / "logs").glob("attempt-*.log"))


def finish_and_compare(tmp_path: Path, p, reference: dict) -> None:  # type: ignore[no-untyped-def]
    out, _ = p.communicate(timeout=TIMEOUT)
    assert p.returncode == 0, out[-3000:]
    st = state(tmp_path)
    assert st["state"] == "completed", st
    final = newest_complete(tmp_path / "ckpts")
    assert final is not None and final.step == STEPS
    assert_same(export(final.path, tmp_path / "out.pt"), reference)


class TestCrashRecovery:
    def test_sigkill_worker_then_agent_relaunch_from_newest_complete(self, tmp_path: Path, supervisors: Supervisors,
                                                                       reference: dict) -> None:
        """SIGKILL a worker, later the torchrun agent: each time a relaunch from the newest complete checkpoint,
        the agent's orphaned workers are swept, and the run ends bit-identical to an uninterrupted one."""
        p = supervisors.start(write_config(tmp_path, TORCHRUN + TRAIN, FAST))
        wait_for(lambda: latest_step(tmp_path) >= 10, TIMEOUT, "a checkpoint at step >= 10")
        victim = wait_for(lambda: job_workers(tmp_path), 30, "workers")[-1]
        resumable = newest_complete(tmp_path / "ckpts")
        victim.kill()
        wait_for(lambda: state(tmp_path).get("attempt") == 2 and state(tmp_path).get("state") == "running", 120,
                 "attempt 2")
        st = state(tmp_path)
        assert st["last_exit"]["reason"] == "signal" and "SIGKILL" in (st["last_exit"]["detail"] or "")
        assert st["resumed_from"] is not None and Path(st["resumed_from"]).name >= resumable.path.name

        resumed_step = int(Path(st["resumed_from"]).name.split("_")[1])
        wait_for(lambda: latest_step(tmp_path) > resumed_step, TIMEOUT, "a checkpoint committed by attempt 2")
        workers = wait_for(lambda: job_workers(tmp_path), 30, "workers")
        psutil.Process(state(tmp_path)["job_pid"]).kill()
        _, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive, "the dead agent's workers were not swept"
        finish_and_compare(tmp_path, p, reference)
        assert len(attempts(tmp_path)) == 3


class TestStopAndResume:
    def test_sigint_emergency_checkpoint_then_next_run_resumes(self, tmp_path: Path, supervisors: Supervisors,
                                                                reference: dict) -> None:
        """SIGINT: the job saves the current step, the supervisor exits 0 'stopped'; the next run resumes there."""
        # The job holds after step 8 until the stop is under way: on a quiet machine the remaining steps take about
        # a second, and the SIGINT landed after the last one (nothing left to stop).
        held, go = 8, tmp_path / "go"
        cfg = write_config(tmp_path, [*TORCHRUN, str(HOOKED_ENTRY), *TRAIN[2:]], FAST)
        cfg.write_text(cfg.read_text().replace('env = { OMP_NUM_THREADS = "1" }', (
            f'env = {{ OMP_NUM_THREADS = "1", {HOLD_TRAIN_STEP_ENV} = "{held}", '
            f'{HOLD_TRAIN_UNTIL_ENV} = {json.dumps(str(go))} }}')))
        p = supervisors.start(cfg)
        wait_for(lambda: (state(tmp_path).get("step") or 0) >= 1 and state(tmp_path).get("phase") == "train",
                 TIMEOUT, "training")  # the heartbeat is throttled to once a second: held at 8, it may say 1
        p.send_signal(signal.SIGINT)
        log_path = tmp_path / ".fsdp-supervisor" / "supervisor.log"
        wait_for(lambda: '"stopping"' in log_path.read_text(), 60, "the stop")
        go.with_name(f"go.{held}").touch()
        out, _ = p.communicate(timeout=120)
        rc = p.returncode
        assert rc == 0, out[-3000:]
        st = state(tmp_path)
        assert st["state"] == "stopped" and st["restarts"] == 0
        saved = newest_complete(tmp_path / "ckpts")
        log = (tmp_path / ".fsdp-supervisor" / "logs" / "attempt-0001.log").read_text()
        stopped = re.findall(r"event=stopped rank=0 step=(\d+)", log)
        # The step it stopped at is saved (an emergency save, or the periodic one when the stop fell on it).
        assert stopped and saved is not None and saved.step == int(stopped[-1]), (saved, log[-3000:])
        p2 = supervisors.start(cfg)
        finish_and_compare(tmp_path, p2, reference)
        assert state(tmp_path)["resumed_from"] == str(saved.path)
        assert attempts(tmp_path) == ["attempt-0001.log", "attempt-0002.log"]  # numbering continues across runs

    def test_sigstopped_worker_is_a_hang(self, tmp_path: Path, supervisors: Supervisors, reference: dict) -> None:
        """SIGSTOP of rank 1: hang detected, rank 1 named, stacks kept, the job killed after hang_kill_grace_s
        (stop_timeout_s = 600 is for a requested stop, and is not waited), relaunched, the run finishes.

        The stop may land while rank 0 says `save` (a save every 5 steps, and state.json's phase lags): the save
        allowance is shortened too, or a stop there waits out the 1800 s default."""
        extra = FAST.replace("stop_timeout_s = 20", "stop_timeout_s = 600\nhang_timeout_s = 4\nsave_timeout_s = 8\n"
                                                    "stack_dump_wait_s = 2\nhang_kill_grace_s = 1")
        p = supervisors.start(write_config(tmp_path, TORCHRUN + TRAIN, extra))
        wait_for(lambda: latest_step(tmp_path) >= 5 and state(tmp_path).get("phase") == "train", TIMEOUT, "training")
        victim = wait_for(lambda: [w for w in job_workers(tmp_path) if w.environ().get("RANK") == "1"], 30,
                          "rank 1")[0]
        victim.suspend()
        try:
            wait_for(lambda: state(tmp_path).get("attempt") == 2, 120, "attempt 2 (without waiting stop_timeout_s)")
        finally:
            with contextlib.suppress(psutil.Error):
                victim.resume()
        st = state(tmp_path)
        assert st["last_exit"]["reason"] == "hang"
        assert st["last_hang"]["ranks"] == [{"rank": 1, "why": "stopped (SIGSTOP or SIGTSTP)"}]
        stacks = Path(st["last_hang"]["stacks"])
        dumps = stacks.read_bytes()
        assert dumps.count(b"Current thread 0x") == 1, dumps  # rank 0's dump (rank 1 cannot dump while stopped)
        assert b'"MainThread"' in dumps and b"Stack dump of process" in dumps  # trainer/stackdump.py's, by name
        log = (tmp_path / ".fsdp-supervisor" / "supervisor.log").read_text()
        assert "hang_detected" in log and "stack_dump_requested" in log
        killed = [json.loads(line) for line in log.splitlines() if '"event": "job_killed"' in line]
        # rank 0's dump landed (rank 1 is stopped and not waited for): the kill does not wait hang_kill_grace_s
        assert [(k["reason"], k["after_s"]) for k in killed] == [("hang", 0.0)]
        finish_and_compare(tmp_path, p, reference)
        report = json.loads(cli("report", "-c", str(tmp_path / "job.toml"), "--json").stdout)
        assert report["losses"][0]["hung_ranks"] == [1] and report["exit_reasons"]["hang"] == 1


class TestQuarantine:
    def test_poisoned_newest_checkpoint_is_quarantined(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """A newest checkpoint that looks complete but crashes the job on load is quarantined; the one before is used."""
        first = ["--steps", "10"]
        cfg = write_config(tmp_path, TORCHRUN + TRAIN + first, FAST)
        p = supervisors.start(cfg)
        out, _ = p.communicate(timeout=TIMEOUT)
        assert p.returncode == 0, out[-3000:]
        newest = newest_complete(tmp_path / "ckpts")
        assert newest is not None and newest.step == 10
        for shard in newest.path.glob("*.distcp"):  # same size, garbage bytes: complete by every file check
            shard.write_bytes(b"\0" * shard.stat().st_size)
        cfg2 = write_config(tmp_path, TORCHRUN + TRAIN + ["--steps", "15"], FAST)  # quarantine_after = 2 (default)
        p = supervisors.start(cfg2)
        out, _ = p.communicate(timeout=TIMEOUT)
        assert p.returncode == 0, out[-3000:]
        st = state(tmp_path)
        assert st["quarantined"] == st["corrupt"] == [str(newest.path)]
        # A new `run` has not yet seen this job say `checks_loads` (its heartbeat): the pass before its first launch
        # reads the resume point against the manifest's checksums, quarantines it as corrupt and launches from the
        # one before: no attempt is spent on it (attempt 1 was the first run's; numbering continues).
        assert (st["resumed_from"] == str(tmp_path / "ckpts" / "step_00000005")
                and (st["attempt"], st["restarts"]) == (2, 0)), (st["attempt"], st["restarts"])
        infos = {c.name: c for c in scan(tmp_path / "ckpts")}
        assert infos[newest.path.name].state == "corrupt" and infos["step_00000015"].complete
        listed = cli("checkpoints", "list", "-c", str(cfg2)).stdout
        row = next(line for line in listed.splitlines() if line.startswith(newest.path.name))
        assert " corrupt " in row and "distcp bytes " in row, listed

    @pytest.mark.parametrize("rot", ["write", "device"])
    def test_a_rotten_bit_is_caught_on_load_and_the_run_ends_bit_identical(
            self, tmp_path: Path, supervisors: Supervisors, reference: dict, rot: str,
            request: pytest.FixtureRequest) -> None:
        """One bit flipped in the newest checkpoint's tensor data, with size, mtime and ctime unchanged (`device`:
        on the loop device below an ext4 root, caches dropped, as media rot does; `write`: through the file with
        its times put back): the supervisor does not read it before the relaunch (the trainer library's load checks
        what it reads: one read, not two); that load fails (`corrupt`), the supervisor quarantines it at once (the
        `quarantined` event names the file and range) and the job goes on from the one before without a backoff,
        ending bit-identical to an uninterrupted run. (A sealed checkpoint, which no load checks, is read by the pass
        before the launch: tests/unit/test_seals.py.)"""
        if rot == "device":
            where, device = request.getfixturevalue("loop_ext4")
            (where / "ckpts").mkdir()
            (tmp_path / "ckpts").symlink_to(where / "ckpts")
        held, go = 15, tmp_path / "go"
        cfg = write_config(tmp_path, [*TORCHRUN, str(HOOKED_ENTRY), *TRAIN[2:]], FAST)
        cfg.write_text(cfg.read_text().replace('env = { OMP_NUM_THREADS = "1" }', (
            f'env = {{ OMP_NUM_THREADS = "1", {HOLD_TRAIN_STEP_ENV} = "{held}", '
            f'{HOLD_TRAIN_UNTIL_ENV} = {json.dumps(str(go))} }}')))
        p = supervisors.start(cfg)
        wait_for(lambda: latest_step(tmp_path) >= held, TIMEOUT, f"the checkpoint of step {held}")
        rotten = (tmp_path / "ckpts").resolve() / f"step_{held:08d}"
        manifest = json.loads((rotten / "manifest.json").read_text())
        name, ranges = max(((n, r) for n, r in manifest["checksums"]["files"].items() if n.endswith(".distcp")),
                           key=lambda kv: max(r[1] for r in kv[1]))
        off, size, _ = max(ranges, key=lambda r: r[1])
        shard = rotten / name
        before, data = shard.stat(), shard.read_bytes()
        if rot == "device":
            flip_on_device(device, shard, off + size // 2)
        else:
            with open(shard, "r+b") as f:
                f.seek(off + size // 2)
                f.write(bytes([data[off + size // 2] ^ 0x04]))
            os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
        after = shard.stat()
        assert shard.read_bytes() != data and after.st_size == before.st_size
        assert after.st_mtime_ns == before.st_mtime_ns and (rot != "device" or after.st_ctime_ns == before.st_ctime_ns)
        wait_for(lambda: job_workers(tmp_path), 30, "workers")[-1].kill()
        go.with_name(f"go.{held}").touch()
        finish_and_compare(tmp_path, p, reference)
        assert state(tmp_path)["attempt"] == 3
        events = [json.loads(line) for line in (tmp_path / ".fsdp-supervisor" / "supervisor.log").read_text().splitlines()]
        exits = [e for e in events if e.get("event") == "job_exited"]
        assert [e["reason"] for e in exits] == ["signal", "corrupt", "completed"], exits
        assert [e["delay_s"] for e in events if e.get("event") == "backoff"][1:] == [0], "the corrupt load: at once"
        assert [e["resumed_from"] for e in events if e.get("event") == "job_started"][1:] == [
            str(rotten), str(rotten.with_name(f"step_{held - 5:08d}"))]
        assert not [e for e in events if e.get("event") == "checkpoint_corrupt"]  # not read before the launch
        corrupt = [e for e in events if e.get("event") == "quarantined"]
        assert len(corrupt) == 1 and f"{shard} bytes {off}-{off + size} do not match" in corrupt[0]["reason"], corrupt
        marker = json.loads((rotten / ".quarantined").read_text()) if (rotten / ".quarantined").exists() else None
        assert marker is None or (marker["reason"].startswith("corrupt: ")  # retention may have pruned it
                                  and f"{shard} bytes {off}-{off + size} do not match" in marker["reason"])


class TestUserScript:
    def test_plain_dcp_script_with_resume_from(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """A tutorial-style FSDP1 script saving epoch_<N>/ and taking --resume-from is supervisable as is."""
        script = Path(__file__).parents[1] / "jobs" / "user_dcp_script.py"
        record = tmp_path / "record.txt"
        cmd = TORCHRUN + [str(script), "--ckpt-dir", str(tmp_path / "ckpts"), "--epochs", "6", "--save-every", "2",
                          "--crash-at-epoch", "3", "--record", str(record)]
        text = write_config(tmp_path, cmd, FAST).read_text().replace('"--resume"', '"--resume-from"')
        (tmp_path / "job.toml").write_text(text)
        p = supervisors.start(tmp_path / "job.toml")
        out, _ = p.communicate(timeout=TIMEOUT)
        assert p.returncode == 0, out[-3000:]
        first, *later = record.read_text().strip().splitlines()
        assert first == f"start=3 resume={tmp_path / 'ckpts' / 'epoch_2'} attempt=2"
        # Now and then (2 runs in 15, on b733b05 too) a rank of this FSDP1/gloo script aborts in torch's teardown
        # after its record is written ("terminate called without an active exception", SIGABRT): one more attempt,
        # which must resume from the newest checkpoint, never from scratch.
        for n, line in enumerate(later, start=3):
            assert line == f"start=5 resume={tmp_path / 'ckpts' / 'epoch_4'} attempt={n}", record.read_text()
        assert state(tmp_path)["last_exit"]["reason"] == "completed"


@pytest.fixture(scope="module")
def killed_then_stopped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A supervised run whose worker is SIGKILLed after a checkpoint, relaunched, and stopped once it trains
    again; returns its config (the history is in its run dir)."""
    tmp = tmp_path_factory.mktemp("history")
    cfg = write_config(tmp, TORCHRUN + TRAIN + ["--steps", "1000"], FAST)
    s = Supervisors()
    try:
        p = s.start(cfg)
        # Long enough for a few heartbeat samples (the trainer beats once a second) on each side of the restart.
        wait_for(lambda: latest_step(tmp) >= 20 and (state(tmp).get("step") or 0) >= 23, TIMEOUT, "steps past a checkpoint")
        wait_for(lambda: job_workers(tmp), 30, "workers")[-1].kill()
        wait_for(lambda: state(tmp).get("attempt") == 2 and state(tmp).get("restart_latency_s"), 120, "attempt 2 training")
        resumed = int(Path(state(tmp)["resumed_from"]).name.split("_")[1])
        wait_for(lambda: (state(tmp).get("step") or 0) >= resumed + 12, 120, "attempt 2 twelve steps on")
        rc, out = stop(p, signal.SIGINT, timeout=120)
        assert rc == 0, out[-3000:]
    finally:
        s.cleanup()
    return cfg


class TestHistory:
    def test_report_json_after_a_killed_worker_and_a_stop(self, killed_then_stopped: Path) -> None:
        """2 attempts, 1 failure, one restart latency, one steps-lost value, goodput strictly between 0 and 1."""
        r = cli("report", "-c", str(killed_then_stopped), "--json")
        assert r.returncode == 0, r.stderr
        s = json.loads(r.stdout)
        # The failure's name depends on which rank torchrun saw fail first (the killed one, or one it then stopped).
        assert (s["attempts"], s["failures"], s["exit_reasons"].pop("stopped")) == (2, 1, 1)
        assert list(s["exit_reasons"].values()) == [1] and set(s["exit_reasons"]) <= {"signal", "crash"}
        assert len(s["restart_latency_s"]) == 1 and 0 < s["restart_latency_s"][0] < 120
        assert len(s["steps_lost"]) == 1 and s["steps_lost"][0] >= 0
        assert 0 < s["goodput"] < 1 and s["checkpoint_overhead_s"] > 0

    def test_report_page_shows_the_restart_in_chromium(self, killed_then_stopped: Path, tmp_path: Path) -> None:
        """The page has both attempts on the timeline, a commit, the restart and the loss on both sides of it, and
        renders in headless Chromium (skipped only without Chromium)."""
        from tests.history_demo import chromium, screenshot
        from tests.integration.test_report_browser import assert_rendered
        from tests.unit.test_report import marks

        page = tmp_path / "report.html"
        r = cli("report", "-c", str(killed_then_stopped), "-o", str(page))
        assert r.returncode == 0, r.stderr
        failed = next(r for r in json.loads(cli("report", "-c", str(killed_then_stopped), "--json").stdout)["exit_reasons"]
                      if r != "stopped")
        m = marks(page.read_text())
        assert m.classes["attempt"] == 2 and m.classes[f"reason-{failed}"] == 1 and m.classes["reason-stopped"] == 1
        assert m.classes["commit"] >= 1 and m.classes["restart"] >= 2 and m.classes["loss"] >= 2
        if chromium() is None:
            pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
        screenshot(page, tmp_path / "report.png")
        assert_rendered(page, tmp_path / "report.png", [failed, "stopped"])
