"""structlog set-up: JSON lines in run_dir/supervisor.log (size-rotated), short lines on the console.

`fsdp-supervisor logs` pretty-prints the JSON with `render_line`; the console gets `console.render_event`'s short
form. Where the store's events go: docs/design.md, 'Notes for maintainers'.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import logging.handlers
import os
import sys
import warnings
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from supervisor.host.regularfile import open_regular
from supervisor.observe.console import Console, render_event
from supervisor.observe.redact import scrub

__all__ = ["configure", "configure_cli", "get_logger", "render_line", "reopen_file", "LOG_FILE"]

LOG_FILE = "supervisor.log"
_NAME = "supervisor"  # the package's name: the store's module loggers propagate to it


class _ConsoleHandler(logging.Handler):
    """Hands each event to the `Console` as one short line; a failure here must never reach the daemon."""

    def __init__(self, console: Console) -> None:
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):  # any: handleError would print to the very terminal that failed
            self.console.show([self.format(record)])


class _OwnerOnlyFile(logging.handlers.RotatingFileHandler):
    """supervisor.log and its rotations are created 0600, whatever the umask: the run dir is owner-only."""

    def _open(self) -> io.TextIOWrapper:
        # Never a FIFO (the loop logs) and never through a symlink.
        fd = open_regular(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT, follow_symlinks=False)
        return io.TextIOWrapper(io.FileIO(fd, "a"), encoding=self.encoding, errors=self.errors, write_through=True)


def configure(run_dir: Path, *, max_bytes: int, backups: int, console: Console | None = None,
              secrets: Sequence[str] = ()) -> None:
    """Route structlog through stdlib logging: one JSON file handler plus, if given, the console.

    Tracebacks carry no frame locals (structlog's default shows them: the job's env and argv), and `secrets`
    (`redact.secret_values`) are masked in every event, an exception's message and traceback included."""
    no_locals = structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
    masked: list[Any] = [structlog.processors.ExceptionRenderer(no_locals), lambda _l, _m, event: scrub(event, secrets)]
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    logger = logging.getLogger(_NAME)
    logger.handlers.clear()
    logger.setLevel(logging.INFO)
    logger.propagate = False
    file_handler = _OwnerOnlyFile(run_dir / LOG_FILE, maxBytes=max_bytes, backupCount=backups)
    file_handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *masked,
                        structlog.processors.JSONRenderer(sort_keys=False)],
        )
    )
    logger.addHandler(file_handler)
    warnings.showwarning = _warning_event
    if console is not None:
        handler = _ConsoleHandler(console)
        handler.setFormatter(structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *masked,
                        lambda _l, _m, event: render_event(event, tty=console.tty)]))
        logger.addHandler(handler)


def reopen_file() -> None:
    """Log into a new supervisor.log from the next event on: the run dir was removed and made again."""
    for handler in logging.getLogger(_NAME).handlers:
        if isinstance(handler, logging.FileHandler):
            handler.close()  # FileHandler opens its file again (append) at the next record


def _warning_event(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                   file: Any = None, line: str | None = None) -> None:
    """Python warnings (a library's, from any thread) become events instead of raw text over the console."""
    get_logger().warning("python_warning", category=category.__name__, message=str(message)[:500],
                         where=f"{os.path.basename(filename)}:{lineno}")


def _warning_line(_logger: Any, method: str, event: MutableMapping[str, Any]) -> str:
    fields = " ".join(f"{k}={v}" for k, v in event.items() if k != "event" and v is not None)
    return f"{method}: {event.get('event', '')} {fields}".rstrip()


def configure_cli() -> None:
    """For every command but `run`: drop info events, print warnings and errors as one line on stderr."""
    structlog.configure(
        processors=[_warning_line],
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        # sys.stderr is looked up per event: a test's redirected stderr, or a replaced one, is honoured
        logger_factory=lambda *_: structlog.PrintLogger(sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger() -> Any:
    return structlog.get_logger(_NAME)


def render_line(line: str) -> str:
    """One JSON log line as `ts level event key=value ...`; anything else is returned unchanged."""
    try:
        d = json.loads(line)
    except (ValueError, RecursionError):
        return line.rstrip("\n")
    if not isinstance(d, dict):
        return line.rstrip("\n")
    ts, level, event = d.pop("ts", ""), d.pop("level", ""), d.pop("event", "")
    fields = " ".join(f"{k}={json.dumps(v) if not isinstance(v, str) or ' ' in v else v}"
                      for k, v in d.items() if v is not None)
    return f"{ts} {level:<7} {event:<22} {fields}".rstrip()
