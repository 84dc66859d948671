"""Shared fixtures. The supervisor's tests never import torch in-process: real DCP files come from a subprocess."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# CI machines are 2 busy cores: Hypothesis's timing health checks and per-example deadlines measure the
# machine, not the code (performance is shown in bench/). Every property still runs its examples.
settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")

_TEMPLATE_SCRIPT = """
import sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed.checkpoint as dcp
dcp.save({"model": {"w": torch.arange(16, dtype=torch.float32)}, "step": 1}, checkpoint_id=sys.argv[1])
"""


@pytest.fixture(scope="session", autouse=True)
def _metadata_cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """Parsed-.metadata cache entries go to a per-session tmp dir (inherited by subprocesses), never to ~/.cache."""
    before = os.environ.get("FSDP_SUPERVISOR_CACHE_DIR")
    os.environ["FSDP_SUPERVISOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("fsdp-supervisor-cache"))
    yield
    if before is None:
        os.environ.pop("FSDP_SUPERVISOR_CACHE_DIR", None)
    else:
        os.environ["FSDP_SUPERVISOR_CACHE_DIR"] = before


@pytest.fixture(scope="session")
def dcp_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real single-process DCP checkpoint written by the installed torch (copied by `make_checkpoint`)."""
    out = tmp_path_factory.mktemp("dcp-template") / "ckpt"
    subprocess.run([sys.executable, "-c", _TEMPLATE_SCRIPT, str(out)], check=True, timeout=120)
    return out


@pytest.fixture
def make_checkpoint(dcp_template: Path) -> Callable[[Path, str], Path]:
    """Copy the real DCP template to `root/name` (complete, no manifest: the step comes from the name)."""

    def make(root: Path, name: str) -> Path:
        root.mkdir(parents=True, exist_ok=True)
        dst = root / name
        shutil.copytree(dcp_template, dst)
        return dst

    return make
