"""tests/unit: no torch, no subprocess, fast (tests/conftest.py marks the tiers by folder)."""
from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _no_torch_in_process() -> Iterator[None]:
    """A unit test that imports torch (even lazily, through the code it calls) fails: it belongs in tests/integration/.
    Only seen where nothing imported torch before (`make unit`, the venv without torch); test_torch_free.py checks
    the imports statically everywhere."""
    before = "torch" in sys.modules
    yield
    if not before and "torch" in sys.modules:
        pytest.fail("this test imported torch: tests/unit runs without it, move the test to tests/integration/")


@pytest.fixture(autouse=True)
def _background_reads_end_with_their_test() -> Iterator[None]:
    """A seal or scrub a test's Core started on a daemon thread ends before the next test: left running, it would call
    the next test's monkeypatched `integrity.seal` on this test's root (seen: a flaky test_seals)."""
    yield
    from supervisor.daemon.integrity import seals_idle

    assert seals_idle(60), "a background seal or scrub still runs 60 s after its test"


@pytest.fixture
def dcp_template() -> None:
    """tests/conftest.py's template is written by torch in a subprocess: never in this tier (make pythons runs it
    without torch). Write checkpoints with tests/jobs/dcp_files.py instead."""
    pytest.fail("tests/unit cannot use dcp_template (torch in a subprocess): use tests/jobs/dcp_files.write_checkpoint")
