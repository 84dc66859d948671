"""`fsdp-supervisor` entry point: one argparse tree, each command group registered by its own module."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from supervisor import __version__
from supervisor.errors import EXIT_USAGE, SupervisorError

__all__ = ["main", "build_parser"]

# Each module has `register(subparsers)`, which adds its sub-command(s) and sets `func(args) -> int`.
COMMAND_MODULES = [
    "supervisor.commands",
    "supervisor.checkpoint_commands",
    "supervisor.systemd",
    "supervisor.report_commands",
]


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on bad usage already; keep its one-line message, drop the full usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fsdp-supervisor",
        description="Keep a torchrun FSDP job alive: relaunch it from the newest complete DCP checkpoint, "
        "stop it gracefully, keep disk use bounded.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # Nothing we create (run dir, logs, .trash, markers), nor anything the job creates, is world-writable,
    # whatever umask we inherited: a world-writable run or checkpoint dir lets any local user poison it.
    os.umask(os.umask(0) | 0o002)
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except SupervisorError as exc:
        print(f"fsdp-supervisor: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `report --json | head`: the reader left; no traceback, and none at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # as if killed by SIGPIPE, like other tools in a pipeline


if __name__ == "__main__":
    sys.exit(main())
