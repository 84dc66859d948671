"""deploy/examples: every example loads, and each owns its checkpoint root and its run dir (issue 22, item 5).

README's Quick start (best.toml) after `make run` (demo.toml) once found demo's checkpoints in the root they
shared, resumed demo's step 802 and exited at once; a run dir shared by two examples makes the second `run` refuse.
"""
from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from supervisor.config import Config, load_config
from tests.helpers import REPO

EXAMPLES = sorted((REPO / "deploy" / "examples").glob("*.toml"))


def _dirs(cfg: Config) -> list[Path]:
    return [Path(os.path.realpath(cfg.checkpoints.dir)), Path(os.path.realpath(cfg.run_dir))]


def _overlap(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def test_there_are_examples() -> None:
    assert {"demo.toml", "best.toml"} <= {p.name for p in EXAMPLES}


@pytest.mark.parametrize(("one", "other"), list(itertools.combinations(EXAMPLES, 2)),
                         ids=lambda p: p.stem)
def test_no_two_examples_share_a_checkpoint_root_or_a_run_dir(one: Path, other: Path) -> None:
    """Neither example's checkpoint root or run dir is, holds or lies inside one of the other's."""
    for a, b in itertools.product(_dirs(load_config(one)), _dirs(load_config(other))):
        assert not _overlap(a, b), f"{one.name} and {other.name} share {a} / {b}"


@pytest.mark.parametrize("example", [p for p in EXAMPLES if p.stem in ("demo", "best")], ids=lambda p: p.stem)
def test_quick_start_examples_say_how_to_start_over(example: Path) -> None:
    """The examples that write into the checkout name the one directory that holds all they write."""
    cfg = load_config(example)
    own = example.parent / example.stem
    assert all(own in d.parents for d in _dirs(cfg)), _dirs(cfg)
    assert f"rm -rf deploy/examples/{example.stem}" in example.read_text()
