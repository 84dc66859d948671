"""Package-wide promises: the supervisor never imports torch, and the README's config reference is current."""
from __future__ import annotations

import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import supervisor
from supervisor.cli.configdoc import render_reference

REPO = Path(__file__).resolve().parent.parent


class TestTorchFree:
    def test_no_supervisor_module_imports_torch(self) -> None:
        """Importing every supervisor module (and building the CLI) leaves torch out of sys.modules."""
        names = sorted(m.name for m in pkgutil.walk_packages(supervisor.__path__, "supervisor.")
                       if not m.name.endswith("__main__"))
        assert "supervisor.daemon.core" in names and "supervisor.cli.checkpoints" in names
        code = (f"import importlib, sys\nfor n in {names!r}: importlib.import_module(n)\n"
                "from supervisor.cli.main import build_parser; build_parser()\nprint('torch' in sys.modules)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
        assert out.stdout.strip() == "False"


class TestDocs:
    def test_config_reference_matches_the_models(self) -> None:
        """docs/configuration.md's reference is exactly what `python -m supervisor.cli.configdoc` renders."""
        text = (REPO / "docs" / "configuration.md").read_text()
        start, end = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"
        assert start in text and end in text, "docs/configuration.md lacks the config-reference markers"
        embedded = text.split(start, 1)[1].split(end, 1)[0]
        assert embedded == render_reference(), "config reference is stale: paste `python -m supervisor.cli.configdoc`"

    def test_module_map_matches_the_tree(self) -> None:
        """docs/design.md's module map names every module of supervisor/ and trainer/, and nothing else."""
        text = (REPO / "docs" / "design.md").read_text()
        section = text[text.index("## Module map"):]
        mapped = set(re.findall(r"^\| `((?:supervisor|trainer)/[\w/]+\.py)` \|", section, re.M))
        tracked = subprocess.run(["git", "ls-files", "supervisor", "trainer"], cwd=REPO, capture_output=True,
                                 text=True, check=True).stdout.split()
        on_disk = {p for p in tracked if p.endswith(".py")} or {
            str(p.relative_to(REPO)) for d in ("supervisor", "trainer") for p in (REPO / d).rglob("*.py")}
        assert mapped == on_disk, f"missing from the map: {sorted(on_disk - mapped)}; not in the tree: {sorted(mapped - on_disk)}"

    def test_every_doc_link_resolves(self) -> None:
        """Relative links in README and docs/ point at files that exist."""
        for doc in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
            for target in re.findall(r"\]\(((?!https?:|#)[^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
                assert (doc.parent / target).exists(), f"{doc.name}: broken link {target}"


class TestReadme:
    def test_readme_is_a_door_not_the_house(self) -> None:
        """README stays short: the two commands, what it does, a quick start, your own script, day 2, links."""
        assert len((REPO / "README.md").read_text().splitlines()) <= 250

    def test_readme_gives_the_two_commands_first(self) -> None:
        """The first commands a reader meets are `make test` and `make run`, and CI calls `make test`."""
        text = (REPO / "README.md").read_text()
        first_block = text.split("```", 2)[1]
        assert "make test" in first_block and "make run" in first_block
        assert "make test" in (REPO / ".ci" / "run").read_text()
