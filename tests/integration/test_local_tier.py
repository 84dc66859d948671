"""The node-local tier under the real supervisor and trainer: the newest step of either root is resumed (the local
copy when it is the newest), a torn local copy falls back to the durable root, the result is bit-exact, and a
multi-node config is refused."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.checkpoints import scan
from tests.helpers import Launcher, logged_steps, module_torchrun  # noqa: F401
from tests.integration.test_trainer_runs import (
    JOB_TIMEOUT,
    assert_same_rng_and_progress,
    assert_same_weights,
    complete_steps,
)
from tests.integration.test_warm_workers import HOOKED, TORCHRUN, _job_workers, _run_dir
from tests.jobs.hooked_trainer import HOLD_TRAIN_STEP_ENV, HOLD_TRAIN_UNTIL_ENV
from tests.supervise import FAKEJOB, REPO, Supervisors, cli, launches, stop, supervisors, wait_for  # noqa: F401

STEPS, SAVE_EVERY, LOCAL_EVERY = 24, 8, 2
ARGS = ["--steps", STEPS, "--save-every", SAVE_EVERY, "--local-save-every", LOCAL_EVERY, "--log-every", 1, "--seed", 7]


def _config(tmp_path: Path, command: list[str], env: dict[str, str], extra: str = "") -> Path:
    table = ", ".join(f"{k} = {json.dumps(v)}" for k, v in {"OMP_NUM_THREADS": "1", **env}.items())
    cfg = tmp_path / "job.toml"
    cfg.write_text(f"[job]\ncommand = {json.dumps(command)}\ncwd = {json.dumps(str(REPO))}\nenv = {{ {table} }}\n\n"
                   f"[checkpoints]\ndir = \"ckpts\"\nlocal_dir = \"shm/ckpts\"\nkeep_last = 10\n\n"
                   f"[restart]\nhealthy_restart_delay_s = 3\n[health]\nstop_timeout_s = 20\n{extra}")
    return cfg


@pytest.fixture(scope="module")
def reference(module_torchrun: Launcher, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same job uninterrupted, without the local tier, saving every step it will be compared at."""
    root = tmp_path_factory.mktemp("reference") / "ckpts"
    args = ["--steps", STEPS, "--save-every", LOCAL_EVERY, "--log-every", 1, "--seed", 7, "--checkpoint-dir", root]
    job = module_torchrun.run(args, timeout=JOB_TIMEOUT)
    assert job.proc.returncode == 0, job.text()[-3000:]
    return root


def _started(tmp_path: Path) -> dict[int, str | None]:
    lines = (_run_dir(tmp_path) / "supervisor.log").read_text().splitlines()
    return {e["attempt"]: e["resumed_from"] for e in map(json.loads, lines) if e.get("event") == "job_started"}


def _kill_rank1_holding(tmp_path: Path, attempt: int, step: int) -> None:
    log = _run_dir(tmp_path) / "logs" / f"attempt-{attempt:04d}.log"
    wait_for(lambda: log.exists() and step in logged_steps(log.read_text()), 180, f"attempt {attempt} at step {step}")
    victim = next(w for w in _job_workers(tmp_path) if _rank(w, log) == 1)
    victim.kill()


def _rank(worker, log: Path) -> int | None:  # type: ignore[no-untyped-def]
    rank = worker.environ().get("RANK")
    if rank is None:  # a warm worker: the agent's hand-off line says which rank it runs
        for line in log.read_text().splitlines():
            if f"event=warm_handoff pid={worker.pid} " in line:
                rank = line.rsplit("rank=", 1)[1]
    return None if rank is None else int(rank)


class TestResumeAcrossTiers:
    def test_the_newest_tier_is_resumed_a_torn_local_one_is_not_and_the_end_is_bit_exact(
            self, tmp_path: Path, supervisors: Supervisors, reference: Path) -> None:
        """Killed at 13 (durable 8, local 12): attempt 2 resumes the local 12. Killed at 19 (durable 16, local 18)
        with the local 18 torn before the relaunch: attempt 3 resumes the durable 16. The run ends with the
        uninterrupted run's weights, RNG and progress; the local tier kept its newest and the durable root every save."""
        go = tmp_path / "go"
        durable, local = tmp_path / "ckpts", tmp_path / "shm" / "ckpts"
        command = [*TORCHRUN, str(HOOKED), *map(str, ARGS), "--checkpoint-dir", str(durable)]
        p = supervisors.start(_config(tmp_path, command, {HOLD_TRAIN_STEP_ENV: "13,19", HOLD_TRAIN_UNTIL_ENV: str(go)}))
        _kill_rank1_holding(tmp_path, 1, 13)
        go.with_name("go.13").touch()
        _kill_rank1_holding(tmp_path, 2, 19)
        shard = next((local / "step_00000018").glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:8])  # torn: the shard is shorter than .metadata says
        go.with_name("go.19").touch()
        assert p.wait(timeout=JOB_TIMEOUT) == 0, supervisors.print_logs()
        started = _started(tmp_path)
        assert started[2] == str(local / "step_00000012") and started[3] == str(durable / "step_00000016"), started
        ours, theirs = complete_steps(durable), complete_steps(reference)
        assert sorted(ours) == [8, 16, 24]  # the durable root: --save-every and the last step, never the local ones
        for step in ours:
            assert_same_weights(ours[step], theirs[step], f"step {step}")
        assert_same_rng_and_progress(ours[24], theirs[24], "final")
        kept = [c.name for c in scan(local) if c.complete]
        assert kept == ["step_00000022"], kept  # local_keep = 1 (the last step itself goes to the durable root)


class TestMultiNode:
    def test_run_refuses_the_local_tier_for_several_nodes(self, tmp_path: Path) -> None:
        """`run` with torchrun --nnodes=2 and local_dir: exit 2, one line saying why, nothing started."""
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "-m", "trainer"]
        r = cli("run", "-c", str(_config(tmp_path, command, {})))
        assert r.returncode == 2 and "single-node" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not (tmp_path / "ckpts").exists() and not (tmp_path / "shm").exists()


class TestCheapResumeChoice:
    def test_the_choice_across_tiers_imports_no_pydantic(self, tmp_path: Path) -> None:
        """Every rank's `--resume auto` runs newest_across before training: it stays on the store's light modules
        (retention's pydantic models would cost each rank ~0.2 s of a recovery)."""
        code = ("import sys\nfrom supervisor.checkpoints import newest_across\n"
                f"newest_across({str(tmp_path)!r}, {str(tmp_path / 'local')!r})\nprint('pydantic' in sys.modules)")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


class TestOneJobPerLocalTier:
    def test_a_second_config_on_the_same_local_tier_is_refused(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """Two configs with their own durable roots but one local_dir: the second `run` exits 2 naming the holder
        (they would prune and resume each other's local checkpoints), and nothing of it is launched."""
        marker = tmp_path / "launches"
        job = [sys.executable, str(FAKEJOB), "--sleep", "60", "--marker", str(marker)]
        configs = []
        for name in ("a", "b"):
            cfg = tmp_path / f"{name}.toml"
            cfg.write_text(f"[job]\ncommand = {json.dumps(job)}\n\n[checkpoints]\ndir = \"ckpts-{name}\"\n"
                           f"local_dir = \"shm/ckpts\"\n\n[supervisor]\nrun_dir = \"run-{name}\"\n")
            configs.append(cfg)
        first = supervisors.start(configs[0])
        wait_for(lambda: launches(marker), 30, "job A")
        second = supervisors.start(configs[1])
        out, _ = second.communicate(timeout=60)
        assert second.returncode == 2 and "held by another job" in out and str(tmp_path / "shm" / "ckpts") in out, out
        assert f"config {configs[0]}" in out and len(launches(marker)) == 1
        assert stop(first)[0] == 0


class TestDurableNeverOnlyLocal:
    def test_a_run_that_ends_on_a_local_step_saves_it_to_the_durable_root(self, tmp_path: Path) -> None:
        """Killed after local saves 4 and 8 (no durable save yet), then run to --steps 8: the resume is the local
        step 8, and before the run ends as done that step is saved to the durable root with the same weights."""
        durable, local, go = tmp_path / "ckpts", tmp_path / "shm", tmp_path / "go"
        args = ["--checkpoint-dir", str(durable), "--local-checkpoint-dir", str(local), "--save-every", "100",
                "--local-save-every", "4", "--log-every", "1", "--seed", "3"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", HOLD_TRAIN_STEP_ENV: "9", HOLD_TRAIN_UNTIL_ENV: str(go)}
        log = tmp_path / "a.log"
        with open(log, "wb") as out:
            first = subprocess.Popen([sys.executable, str(HOOKED), *args, "--steps", "20"], stdout=out,
                                     stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            wait_for(lambda: 9 in logged_steps(log.read_text()), 180, "step 9 held")
        finally:
            first.kill()
            first.wait(60)
        assert sorted(p.name for p in local.iterdir() if p.name.startswith("step_")) == ["step_00000004",
                                                                                            "step_00000008"]
        assert not any(durable.glob("step_*"))
        done = subprocess.run([sys.executable, "-m", "trainer", *args, "--steps", "8"], capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO, timeout=180)
        assert done.returncode == 0 and "event=already_done" in done.stdout + done.stderr, done.stderr[-3000:]
        assert f"path={local / 'step_00000008'}" in done.stdout + done.stderr  # resumed from the local tier
        assert sorted(complete_steps(durable)) == [8]
        assert_same_weights(durable / "step_00000008", local / "step_00000008", "durable copy of the local step")


class TestAnotherRunsLocalTier:
    def test_a_stale_local_checkpoint_of_a_run_started_over_is_never_resumed(
            self, tmp_path: Path, supervisors: Supervisors) -> None:
        """Outside attack (issue 34): run 1 (seed 7) leaves its local step 10 on the tier; the user starts over as
        the README says (`rm -rf` of the root and the run dir) with seed 8. Run 2 is killed at step 9: the stale local
        step 10 is newer than run 2's durable step 8, but of another lineage: reported, never resumed; step 8 is."""
        import shutil

        durable, local = tmp_path / "ckpts", tmp_path / "shm" / "ckpts"
        args = ["--steps", 12, "--save-every", SAVE_EVERY, "--local-save-every", LOCAL_EVERY, "--log-every", 1]
        command = [*TORCHRUN, str(HOOKED), *map(str, args), "--checkpoint-dir", str(durable)]
        assert supervisors.start(_config(tmp_path, [*command, "--seed", "7"], {})).wait(timeout=JOB_TIMEOUT) == 0
        stale = local / "step_00000010"
        assert stale.is_dir(), sorted(p.name for p in local.iterdir())
        shutil.rmtree(durable)
        shutil.rmtree(_run_dir(tmp_path))
        go = tmp_path / "go"
        p = supervisors.start(_config(tmp_path, [*command, "--seed", "8"],
                                      {HOLD_TRAIN_STEP_ENV: "9", HOLD_TRAIN_UNTIL_ENV: str(go)}))
        _kill_rank1_holding(tmp_path, 1, 9)
        go.with_name("go.9").touch()
        assert p.wait(timeout=JOB_TIMEOUT) == 0, supervisors.print_logs()
        started = _started(tmp_path)
        assert started[1] is None and started[2] == str(durable / "step_00000008"), started
        lines = (_run_dir(tmp_path) / "supervisor.log").read_text().splitlines()
        assert any(e.get("event") == "local_tier_foreign" and str(stale) in json.dumps(e) for e in map(json.loads, lines))
        assert stale.is_dir()  # another run's: never deleted by this one's retention
