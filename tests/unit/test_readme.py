"""Every command README shows is run by a test: the quick start and "Day 2" in tests/integration/test_walkthrough.py, the
first block (`make test`, `make run`) here, the install section's in tests/integration/test_package.py
(TestDaemonOnlyInstall). A new command block in README fails this until a test runs it."""
from __future__ import annotations

import re

from tests.helpers import REPO
from tests.integration.test_walkthrough import DAY2, SECTION

FIRST = "make test   # creates .venv"
INSTALL = "## Install"  # tests/integration/test_package.py: the wheel into a fresh venv, the full install


def sections_with_blocks() -> list[tuple[str, str]]:
    """(section title, code) of every `sh` block in README, in order; the first block's section is ''."""
    text = (REPO / "README.md").read_text()
    out, title = [], ""
    for part in re.split(r"^(## .*)$", text, flags=re.M):
        if part.startswith("## "):
            title = part
            continue
        out += [(title, code) for code in re.findall(r"```sh\n(.*?)```", part, re.S)]
    return out


def test_every_command_block_is_run_by_a_test() -> None:
    """README's `sh` blocks are the two commands, the quick start's, the install's and Day 2's (the tests that run
    them)."""
    blocks = sections_with_blocks()
    assert blocks[0][0] == "" and blocks[0][1].startswith(FIRST), "the first block must be `make test`/`make run`"
    assert {title for title, _ in blocks[1:]} <= {SECTION, INSTALL, DAY2}, [t for t, _ in blocks[1:]]
    assert "make test" in (REPO / ".ci" / "run").read_text(), "CI must call the README's `make test`"
