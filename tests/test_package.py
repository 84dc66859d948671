"""Package-wide promises: the supervisor never imports torch, and the README's config reference is current."""
from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import supervisor
from supervisor.configdoc import render_reference

REPO = Path(__file__).resolve().parent.parent


class TestTorchFree:
    def test_no_supervisor_module_imports_torch(self) -> None:
        """Importing every supervisor module (and building the CLI) leaves torch out of sys.modules."""
        names = sorted(m.name for m in pkgutil.walk_packages(supervisor.__path__, "supervisor.")
                       if not m.name.endswith("__main__"))
        assert "supervisor.core" in names and "supervisor.checkpoint_commands" in names
        code = (f"import importlib, sys\nfor n in {names!r}: importlib.import_module(n)\n"
                "from supervisor.cli import build_parser; build_parser()\nprint('torch' in sys.modules)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
        assert out.stdout.strip() == "False"


class TestReadme:
    def test_config_reference_matches_the_models(self) -> None:
        """README's configuration reference is exactly what `python -m supervisor.configdoc` renders."""
        text = (REPO / "README.md").read_text()
        start, end = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"
        assert start in text and end in text, "README lacks the config-reference markers"
        embedded = text.split(start, 1)[1].split(end, 1)[0]
        assert embedded == render_reference(), "README config reference is stale: paste `python -m supervisor.configdoc`"

    def test_readme_gives_the_two_commands_first(self) -> None:
        """The first commands a reader meets are `make test` and `make run`, and CI calls `make test`."""
        text = (REPO / "README.md").read_text()
        first_block = text.split("```", 2)[1]
        assert "make test" in first_block and "make run" in first_block
        assert "make test" in (REPO / ".ci" / "run").read_text()
