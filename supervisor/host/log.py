"""The one shape of the logger that the daemon's parts are handed (structlog's, or a test's recording one)."""
from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Log"]


class Log(Protocol):
    """Events with fields, never sentences: `log.warning("frozen", frozen_s=12.5)`."""

    def debug(self, event: str, **fields: Any) -> Any: ...
    def info(self, event: str, **fields: Any) -> Any: ...
    def warning(self, event: str, **fields: Any) -> Any: ...
    def error(self, event: str, **fields: Any) -> Any: ...
