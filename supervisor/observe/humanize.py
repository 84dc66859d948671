"""Sizes and durations for people: `status`, `checkpoints list` and the logs all say them the same way."""
from __future__ import annotations

__all__ = ["human_bytes", "human_age", "printable", "checkpoint_label"]


def human_bytes(n: int | None) -> str:
    """1536 -> "1.5 KiB" (binary units, as `df -h` and the *_gb settings count); None -> "?"."""
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{n} B"


def human_age(seconds: float | None) -> str:
    """A duration at the precision that matters: 45s, 5m07s, 3h05m, 4d07h; None -> "?"."""
    if seconds is None:
        return "?"
    s = max(0, int(seconds))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 172800:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def printable(text: str) -> str:
    """`text` with control characters and undecodable bytes escaped (`\\n`, `\\x1b`, `\\udcff`).

    Names and reasons come from disk (a checkpoint dir called `a\\nb`, an exception message with terminal
    escapes): escaped, a row stays one row, a terminal is not reprogrammed and a strict UTF-8 stdout cannot
    crash on a surrogate.
    """
    return text if text.isprintable() else "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def checkpoint_label(step: object, path: object) -> str:
    """`step 40`, or the checkpoint's dir name when its step is not known (never `step None`)."""
    if isinstance(step, int):
        return f"step {step}"
    return str(path).rstrip("/").rsplit("/", 1)[-1] if path else "?"
