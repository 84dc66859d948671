"""The `fsdp-supervisor` command line: argparse and the commands, nothing else. Nothing imports this package.

`main` is the console entry point (`supervisor.cli:main`, as every release has had it); it is loaded on first use,
so importing one command module does not build the whole parser.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from supervisor.cli.app import main

__all__ = ["main"]


def __getattr__(name: str) -> Any:
    if name == "main":
        from supervisor.cli.app import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
