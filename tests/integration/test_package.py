"""Package-wide promises: the supervisor never imports torch, and the README's config reference is current."""
from __future__ import annotations

import pkgutil
import re
import subprocess
import sys

import supervisor
from tests.unit.test_package import REPO


class TestTorchFree:
    def test_no_supervisor_module_imports_torch(self) -> None:
        """Importing every supervisor module (and building the CLI) leaves torch out of sys.modules."""
        names = sorted(m.name for m in pkgutil.walk_packages(supervisor.__path__, "supervisor.")
                       if not m.name.endswith("__main__"))
        assert "supervisor.daemon.core" in names and "supervisor.cli.checkpoints" in names
        code = (f"import importlib, sys\nfor n in {names!r}: importlib.import_module(n)\n"
                "from supervisor.cli.app import build_parser; build_parser()\nprint('torch' in sys.modules)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
        assert out.stdout.strip() == "False"


class TestDocs:
    def test_module_map_matches_the_tree(self) -> None:
        """docs/design.md's module map names every module of supervisor/ and trainer/, and nothing else."""
        text = (REPO / "docs" / "design.md").read_text()
        section = text[text.index("## Module map"):]
        mapped = set(re.findall(r"^\| `((?:supervisor|trainer)/[\w/]+\.py)` \|", section, re.M))
        tracked = subprocess.run(["git", "ls-files", "supervisor", "trainer"], cwd=REPO, capture_output=True,
                                 text=True, check=True).stdout.split()
        on_disk = {p for p in tracked if p.endswith(".py")} or {
            str(p.relative_to(REPO)) for d in ("supervisor", "trainer") for p in (REPO / d).rglob("*.py")}
        assert mapped == on_disk, (f"missing from the map: {sorted(on_disk - mapped)}; "
                                   f"not in the tree: {sorted(mapped - on_disk)}")
