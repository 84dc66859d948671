"""fsdp_supervisor_entry: the console script refuses an import name that another distribution owns or shadows."""
from __future__ import annotations

from pathlib import Path

import pytest

import fsdp_supervisor_entry as entry
from tests.helpers import REPO

SITE = Path("/venv/lib/python3.11/site-packages")


@pytest.mark.parametrize(("owners", "package_dir", "ours", "expect"), [
    (["fsdp-supervisor"], SITE / "supervisor", SITE / "supervisor", None),
    (["fsdp_supervisor"], SITE / "supervisor", SITE / "supervisor", None),  # names compare canonicalised
    ([], REPO / "supervisor", None, None),  # a checkout on sys.path, no metadata: nothing to compare against
    (["fsdp-supervisor", "supervisor"], SITE / "supervisor", SITE / "supervisor", "distribution supervisor"),
    (["supervisor"], Path("/elsewhere/supervisor"), SITE / "supervisor", "distribution supervisor"),
    (["fsdp-supervisor"], Path("/elsewhere/supervisor"), SITE / "supervisor", "shadows ours"),
    (["fsdp-supervisor"], None, None, "missing or incomplete"),
])
def test_clash(owners: list[str], package_dir: Path | None, ours: Path | None, expect: str | None) -> None:
    """Which owners and locations are a clash, and each message ends with the fix."""
    got = entry.clash("supervisor", owners, package_dir, ours)
    if expect is None:
        assert got is None
    else:
        assert got is not None and expect in got and "'supervisor'" in got and got.endswith(entry.FIX)


def test_check_names_the_distribution_of_a_clashing_trainer() -> None:
    """`check` on this interpreter (this checkout's packages): with the owners a Coqui install adds, it names it."""
    owners = {"supervisor": ["fsdp-supervisor"], "trainer": ["fsdp-supervisor", "trainer"]}
    got = entry.check(owners, home=REPO)
    assert got is not None and "'trainer'" in got and "distribution trainer" in got
    assert entry.check({"supervisor": ["fsdp-supervisor"], "trainer": ["fsdp-supervisor"]}, home=REPO) is None
