"""The base of the typed vocabularies (`State`, `ExitReason`, `CheckpointState`, `Phase`, `Timer`).

A member is its string value everywhere it leaves the process (JSON, logs, state.json, the console), so the
words users and scripts read stay exactly as they were; inside, a typo is an AttributeError, not a silent
mismatch. (Python 3.11's `enum.StrEnum` does this; 3.10 is supported, so it is spelled out here.)
"""
from __future__ import annotations

import enum

__all__ = ["Vocabulary"]


class Vocabulary(str, enum.Enum):
    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)
