"""What the fake jobs share: appending one JSON line to a marker file that tests poll."""
from __future__ import annotations

import json
import os


def append_mark(path: str, record: dict) -> None:
    """One `write` per line: a reader sees the whole line or none of it (tests/supervise.launches)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)
