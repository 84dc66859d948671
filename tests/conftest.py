"""Shared fixtures, and the tiers. The supervisor's tests never import torch in-process: real DCP files come from a
subprocess.

A test's tier is its folder: everything under tests/unit/ (no torch, no subprocess, fast: runs in a venv without
torch) is unmarked, everything under tests/integration/ is marked `integration` here; tests/clients/ and tests/slurm/
are the opt-in tiers (`make test-clients`, `make test-slurm`) and keep their own marks. A test file anywhere else
fails collection.
"""
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

TESTS = Path(__file__).resolve().parent
UNIT, INTEGRATION, CLIENTS, SLURM = TESTS / "unit", TESTS / "integration", TESTS / "clients", TESTS / "slurm"


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark everything under tests/integration/ `integration`; refuse a test outside the tiers or marked against its
    folder (a test under tests/unit/ that says `integration` belongs in tests/integration/)."""
    wrong = []
    opted_in = "clients" in (config.getoption("markexpr", "") or "")
    for item in items:
        path = Path(item.path).resolve()
        if path.is_relative_to(CLIENTS) and item.get_closest_marker("clients") is not None and not opted_in:
            item.add_marker(pytest.mark.skip(reason="real-client tier: run `make test-clients`"))
        if path.is_relative_to(INTEGRATION):
            item.add_marker(pytest.mark.integration)
            if item.get_closest_marker("integration") is None:
                wrong.append(f"{item.nodeid}: under tests/integration/ but not marked integration")
        elif path.is_relative_to(UNIT):
            if item.get_closest_marker("integration") is not None:
                wrong.append(f"{item.nodeid}: marked integration under tests/unit/ (move it to tests/integration/)")
        elif not (path.is_relative_to(CLIENTS) or path.is_relative_to(SLURM)):
            wrong.append(f"{item.nodeid}: outside tests/unit/ and tests/integration/ (a test's folder is its tier)")
    if wrong:
        raise pytest.UsageError("tests in the wrong tier:\n  " + "\n  ".join(wrong))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """Keep each phase's report on the item (`item.rep_call`): a fixture's teardown can tell the test failed."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


def pytest_collection_finish(session: pytest.Session) -> None:
    """A session of tests/unit alone must not have imported torch (tests/unit runs in a venv without it)."""
    if session.items and all(Path(i.path).resolve().is_relative_to(UNIT) for i in session.items) and "torch" in sys.modules:
        raise pytest.UsageError("collecting tests/unit imported torch: a test module there, or a module it imports, "
                                "imports torch (tests/unit/test_torch_free.py names it)")


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
