"""Package-wide promises: the supervisor never imports torch, and the README's config reference is current."""
from __future__ import annotations

import re
from pathlib import Path

from supervisor.cli.configdoc import render_reference

REPO = Path(__file__).resolve().parents[2]


class TestDocs:
    def test_config_reference_matches_the_models(self) -> None:
        """docs/configuration.md's reference is exactly what `python -m supervisor.cli.configdoc` renders."""
        text = (REPO / "docs" / "configuration.md").read_text()
        start, end = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"
        assert start in text and end in text, "docs/configuration.md lacks the config-reference markers"
        embedded = text.split(start, 1)[1].split(end, 1)[0]
        assert embedded == render_reference(), "config reference is stale: paste `python -m supervisor.cli.configdoc`"

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
