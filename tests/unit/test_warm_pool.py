"""Which ranks a warm worker may take: exactly the command and environment it was prepared for, nothing else."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from supervisor.host.spares import VOLATILE_ENV
from trainer.warm_pool import PER_RANK_ENV, WarmPool, WorkerPlan, stable_env

ENV = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1", "FSDP_SUPERVISOR_ATTEMPT": "2"}
RANK_ENV = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x",
            "TORCHELASTIC_ERROR_FILE": "/e", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def _pool(tmp_path: Path) -> WarmPool:
    plan = WorkerPlan(sys.executable, ("-u", "-m", "trainer"), str(tmp_path), 2, dict(ENV))
    return WarmPool(plan, str(tmp_path), [], VOLATILE_ENV, lambda line: None)


@pytest.fixture
def in_tmp(tmp_path: Path) -> Path:
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(cwd)


class TestStableEnv:
    def test_per_rank_and_per_attempt_variables_are_left_out(self) -> None:
        """torchrun's per-rank variables and the supervisor's per-attempt ones never decide; everything else does."""
        assert stable_env({**ENV, **RANK_ENV}, VOLATILE_ENV) == {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1"}
        assert {"RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"} <= PER_RANK_ENV
        assert "CUDA_VISIBLE_DEVICES" not in PER_RANK_ENV  # a per-rank device list starts cold


class TestMatches:
    def test_the_predicted_command_matches(self, in_tmp: Path) -> None:
        """The same interpreter, `-u -m trainer`, directory and environment (but per-rank values): warm."""
        args = (sys.executable, "-u", "-m", "trainer", "--steps", "5")
        assert _pool(in_tmp)._matches(args, {**ENV, **RANK_ENV, "FSDP_SUPERVISOR_ATTEMPT": "3"})

    @pytest.mark.parametrize("change", [
        {"args": ("/usr/bin/python3", "-u", "-m", "trainer")},  # PYTHON_EXEC: another interpreter
        {"args": ("numactl", "--cpunodebind=0", sys.executable, "-u", "-m", "trainer")},  # a wrapper
        {"args": (sys.executable, "-u", "-m", "other")},  # another module
        {"args": (sys.executable, "-u", "train.py")},  # a script instead
        {"env": {"OMP_NUM_THREADS": "4"}},  # the environment changed
        {"env": {"CUDA_VISIBLE_DEVICES": "1"}},  # a per-rank device list (--virtual-local-rank)
        {"env": {"PYTHONHASHSEED": "0"}},  # read by the interpreter at start-up
    ])
    def test_anything_else_starts_cold(self, in_tmp: Path, change: dict) -> None:
        """Another interpreter, a wrapper, another entry, or any other environment: the rank starts cold."""
        args = change.get("args", (sys.executable, "-u", "-m", "trainer", "--steps", "5"))
        env = {**ENV, **RANK_ENV, **change.get("env", {})}
        assert not _pool(in_tmp)._matches(args, env)

    def test_another_directory_starts_cold(self, in_tmp: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
        """A worker prepared in one directory never runs a rank in another (its sys.path[0] would be wrong)."""
        other = tmp_path_factory.mktemp("other")
        plan = WorkerPlan(sys.executable, ("-u", "-m", "trainer"), str(other), 2, dict(ENV))
        pool = WarmPool(plan, str(other), [], VOLATILE_ENV, lambda line: None)
        assert not pool._matches((sys.executable, "-u", "-m", "trainer", "x"), {**ENV, **RANK_ENV})

    def test_after_release_nothing_is_taken(self, in_tmp: Path) -> None:
        """torchrun's first round is over: later rounds (an in-agent restart) start cold."""
        pool = _pool(in_tmp)
        pool.release()
        assert pool.take((sys.executable, "-u", "-m", "trainer", "x"), {**ENV, **RANK_ENV}, (0, 1, 2)) is None
