"""fsdp-supervisor: keep a torchrun FSDP job alive. This package never imports torch."""
from __future__ import annotations

__all__ = ["__version__"]
__version__ = "0.1.0"
