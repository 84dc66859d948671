"""`fsdp-supervisor` entry point: one argparse tree, each command group registered by its own module.

Every failure a user can cause is one line on stderr and an exit code (supervisor.errors), never a traceback;
a closed stdout ends a command quietly with 141 (docs/operations.md, 'Exit codes'): the status a shell reports
for SIGPIPE, as `cat` would, so `set -o pipefail` sees what it sees with any tool and it is none of ours (0-3).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Sequence

from supervisor import __version__
from supervisor.cli.argtypes import default_config
from supervisor.errors import EXIT_BROKEN_PIPE, EXIT_USAGE, SupervisorError
from supervisor.observe.eventlog import configure_cli

__all__ = ["main", "build_parser"]

# Each module has `register(subparsers)`, which adds its sub-command(s) and sets `func(args) -> int`.
COMMAND_MODULES = [
    "supervisor.cli.commands",
    "supervisor.cli.checkpoints",
    "supervisor.cli.systemd",
    "supervisor.cli.report",
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
    configure_cli()  # `run` replaces this with its log file and console once its run dir exists
    try:
        parser = build_parser()
        if not (sys.argv[1:] if argv is None else argv):  # a bare `fsdp-supervisor`: what it can do
            parser.print_help()
            return EXIT_USAGE
        args = parser.parse_args(argv)  # --help and --version print here
        if getattr(args, "config", "") is None and getattr(args, "dir", None) is None:
            args.config = default_config(os.environ)  # -c not given: $FSDP_SUPERVISOR_CONFIG, else ./job.toml
        return int(args.func(args))
    except SupervisorError as exc:
        print(f"fsdp-supervisor: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        _discard_stdout()
        return EXIT_BROKEN_PIPE


def _discard_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail on the closed pipe again."""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # not a real file (a test's StringIO): no flush
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
