"""Event logs of the trainer: one `key=value` line per event on stderr, structlog-style."""
from __future__ import annotations

import sys
from typing import Any

import structlog

__all__ = ["configure", "get_logger"]


def configure(rank: int, stream: Any = None) -> None:
    """Render `event=... rank=... key=value` lines; every process of the job logs with its rank bound."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%Y-%m-%dT%H:%M:%S", utc=False),
            structlog.processors.LogfmtRenderer(key_order=["timestamp", "level", "event", "rank"], drop_missing=True),
        ],
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(rank=rank)


def get_logger(name: str = "trainer") -> Any:
    """A structlog logger; fields are passed as keyword arguments."""
    return structlog.get_logger(name)
