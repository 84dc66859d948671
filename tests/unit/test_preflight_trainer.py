"""supervisor.daemon.preflight's pure `-m trainer` decisions: which commands run our trainer, and when the `trainer`
the job's Python imports is someone else's (Coqui's)."""
from __future__ import annotations

import pytest

from supervisor.daemon.preflight import TRAINER_MARK, trainer_module, trainer_problem
from tests.helpers import REPO

OURS = (REPO / "trainer" / "__init__.py").read_text()


@pytest.mark.parametrize(("command", "expect"), [
    (["python", "-m", "trainer", "--steps", "4"], "trainer"),
    (["torchrun", "--standalone", "--nproc-per-node=2", "-m", "trainer", "--checkpoint-dir", "c"], "trainer"),
    (["torchrun", "--module", "trainer.export", "a", "b"], "trainer"),
    (["python", "-m", "trainers"], None),
    (["python", "train.py", "--trainer", "trainer"], None),
    (["torchrun", "train.py", "-m", "x"], None),
    (["python"], None),
])
def test_trainer_module(command: list[str], expect: str | None) -> None:
    assert trainer_module(command) == expect


def test_our_trainer_carries_the_mark() -> None:
    """The mark the check looks for is in trainer/__init__.py's first line (a reworded docstring must keep it)."""
    assert TRAINER_MARK in OURS.splitlines()[0]


@pytest.mark.parametrize(("origin", "owners", "head", "expect"), [
    ("/v/site-packages/trainer/__init__.py", ["fsdp-supervisor"], OURS, None),
    ("/repo/trainer/__init__.py", [], OURS, None),  # a checkout: no metadata, the mark says it is ours
    (None, [], "", None),  # not importable: the job's own error says so
    ("/v/site-packages/trainer/__init__.py", ["trainer"], "from trainer.trainer import *\n", "distribution trainer"),
    ("/v/site-packages/trainer/__init__.py", ["fsdp_supervisor", "trainer"], OURS, "distribution trainer"),
    ("/x/trainer/__init__.py", [], "# another trainer\n", "/x/trainer/__init__.py, not fsdp-supervisor's"),
])
def test_trainer_problem(origin: str | None, owners: list[str], head: str, expect: str | None) -> None:
    got = trainer_problem("/v/bin/python", origin, owners, head)
    if expect is None:
        assert got is None
    else:
        assert got is not None and expect in got and "/v/bin/python" in got and "venv without it" in got
