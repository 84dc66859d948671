"""checkpoints/metadata/child.py boots its child from our own package root, wherever the package is."""
from __future__ import annotations

from pathlib import Path

import supervisor
from supervisor.checkpoints.metadata import child


class TestChildRoot:
    def test_the_root_is_the_directory_our_package_is_in(self) -> None:
        """The child puts _ROOT first on sys.path: it must hold *this* `supervisor`, not another or none.

        It was `parents[2]` of the module's file, which the move into checkpoints/metadata/ made point inside
        the package: the child then failed to import (the parse quietly fell back in-process) or found another
        installed `supervisor`.
        """
        assert (Path(child._ROOT) / "supervisor" / "__init__.py").resolve() == Path(supervisor.__file__).resolve()

    def test_the_boot_line_imports_the_module_that_is_running(self) -> None:
        """The boot line names this module's import path (a rename would break the child silently)."""
        assert f"from {child.__name__} import main" in child._BOOT
