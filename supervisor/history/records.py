"""The run's durable record, `run_dir/history.jsonl`: its schema, its reader and its thinning rule (stdlib only).

The daemon's write side is `supervisor.daemon.recorder`; this module only defines and reads the format. The
schema, the durability rules and the thinning rule are in docs/history.md, 'The file'. Readers trust nothing:
only a regular file is opened, at most `MAX_READ_BYTES` are read, an over-long line is skipped without being
held, and a `t` outside 0..`MAX_T` is invalid.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any, TypeGuard

from supervisor.host.regularfile import open_regular
from supervisor.policy.state import ExitReason

__all__ = [
    "HISTORY_FILE",
    "VERSION",
    "KINDS",
    "EVENT_KINDS",
    "SAMPLE_S",
    "SAMPLES_PER_DOUBLING",
    "COMPACT_BYTES",
    "MAX_READ_BYTES",
    "MAX_LINE",
    "MAX_T",
    "FAILURE_REASONS_EXCLUDED",
    "is_failure",
    "is_time",
    "read_history",
    "iter_file_records",
    "iter_records",
    "parse_lines",
    "thin",
    "compact_lines",
    "bucket_width",
]

HISTORY_FILE = "history.jsonl"
VERSION = 1
EVENT_KINDS = (
    "supervisor_start", "attempt_start", "first_beat", "first_step", "hang", "straggler", "attempt_exit",
    "checkpoint_committed", "quarantined", "retention_deleted", "supervisor_end", "alert", "diverged", "rolled_back",
    "folded",
)
KINDS = (*EVENT_KINDS, "beat")
SAMPLE_S = 1.0  # at most one heartbeat sample a second is written
SAMPLES_PER_DOUBLING = 256  # thinning keeps about this many samples per attempt for each doubling of age
COMPACT_BYTES = 4 * 2**20  # the file is thinned when it grows past this (or twice its size after the last thinning)
MAX_READ_BYTES = 256 * 2**20  # a reader stops here: a history is a few MB, anything larger is not ours
MAX_LINE = 64 * 1024  # longer than any record the recorder writes (an exit's detail is cut to 1,000 characters)
MAX_T = 1e11  # unix seconds (year 5138): a record time beyond it (or before 1970) is not one a clock wrote
FAILURE_REASONS_EXCLUDED = frozenset({ExitReason.COMPLETED.value, ExitReason.STOPPED.value})


def is_failure(reason: object) -> bool:
    """An attempt that ended in a failure: anything but a completion or a stop the supervisor asked for."""
    return isinstance(reason, str) and reason not in FAILURE_REASONS_EXCLUDED


def is_time(v: object) -> TypeGuard[int | float]:
    """A plausible unix time (int or float within 0..MAX_T): what the charts and durations can take."""
    return type(v) in (int, float) and 0 <= v <= MAX_T  # type: ignore[operator]


def _valid(rec: object) -> bool:
    if not isinstance(rec, dict):
        return False
    v, kind = rec.get("v"), rec.get("kind")
    return type(v) is int and v >= 1 and is_time(rec.get("t")) and isinstance(kind, str)


def _record(line: bytes | None) -> dict[str, Any] | None:
    """The record of one line (without its newline), or None; None for a line too long to be one."""
    if line is None or len(line) > MAX_LINE:
        return None
    try:
        rec = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return rec if _valid(rec) else None


def iter_records(data: bytes) -> Iterator[dict[str, Any] | None]:
    """Each whole line's record, or None for a line that is not one; a last line without newline is torn."""
    lines = data.split(b"\n")
    lines.pop()  # the text after the last newline: empty, or a line torn mid-write
    for line in lines:
        if line.strip():
            yield _record(line)


def _lines(f: IO[bytes], limit: int) -> Iterator[bytes | None]:
    """Whole lines of the first `limit` bytes of `f`, without their newline; None for a line longer than MAX_LINE
    (skipped in pieces, never held whole). A last line without newline (torn, or cut by `limit`) is not yielded."""
    left = limit
    while left > 0:
        line = f.readline(min(MAX_LINE + 2, left))
        left -= len(line)
        if line.endswith(b"\n"):
            yield line[:-1]
            continue
        if len(line) < MAX_LINE + 2:  # end of file (a torn line) or of `limit`
            return
        while left > 0 and not line.endswith(b"\n"):  # an overlong line: skip to its end
            line = f.readline(min(MAX_LINE, left))
            left -= len(line)
            if not line:
                return
        if line.endswith(b"\n"):
            yield None


def iter_file_records(f: IO[bytes], limit: int | None = None) -> Iterator[dict[str, Any] | None]:
    """`iter_records` over an open file, one line at a time (memory: one line), up to `limit` (MAX_READ_BYTES)."""
    for line in _lines(f, MAX_READ_BYTES if limit is None else limit):
        if line is None or line.strip():
            yield _record(line)


def _collect(records: Iterable[dict[str, Any] | None]) -> tuple[list[dict[str, Any]], int]:
    out: list[dict[str, Any]] = []
    skipped = 0
    for rec in records:
        if rec is None:
            skipped += 1
        else:
            out.append(rec)
    return out, skipped


def parse_lines(data: bytes) -> tuple[list[dict[str, Any]], int]:
    """(records, lines skipped): whole, valid JSON lines only."""
    return _collect(iter_records(data))


def read_history(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The records of a history file and how many lines were skipped; OSError when it cannot be read."""
    with open(open_regular(path), "rb") as f:
        return _collect(iter_file_records(f))


def bucket_width(age_s: float) -> float:
    """Seconds of history one kept sample stands for at this age: SAMPLE_S while young, doubling with age.

    Widths are powers of two (times SAMPLE_S), so a bucket at one thinning nests inside the wider bucket of a
    later one and samples thin out monotonically.
    """
    level = math.floor(math.log2(max(age_s, 1.0) / (SAMPLES_PER_DOUBLING * SAMPLE_S)))
    return SAMPLE_S * 2.0 ** max(0, level)


def _keep(entries: list[tuple[bool, Any, bool, float]], now: float) -> list[bool]:
    """The thinning rule over (is_beat, attempt, carries val_loss, t) in file order: which entries stay."""
    last_beat = {attempt: i for i, (beat, attempt, _, _) in enumerate(entries) if beat}
    keep_last = set(last_beat.values())
    seen: set[tuple[Any, bool, float, int]] = set()  # (attempt, val, width, bucket: an int from math.floor)
    keep = []
    for i, (beat, attempt, val, t) in enumerate(entries):
        if beat and i not in keep_last:
            width = bucket_width(now - t)
            key = (attempt, val, width, math.floor(t / width))
            if key in seen:
                keep.append(False)
                continue
            seen.add(key)
        keep.append(True)
    return keep


def thin(records: Iterable[dict[str, Any]], now: float) -> list[dict[str, Any]]:
    """The records to keep when compacting: every event; per attempt, the first beat in each age bucket.

    Beats carrying a new `val_loss` are thinned as their own series (an evaluation is rare and worth more
    than a training sample), and each attempt's last beat is always kept (where it stood when it ended).
    """
    records = list(records)
    entries = [(r.get("kind") == "beat", r.get("attempt"), "val_loss" in r, r["t"]) for r in records]
    return [r for r, keep in zip(records, _keep(entries, now)) if keep]


# The recorder writes beats as `{"v":1,"t":T,"kind":"beat","attempt":N,...}`: compaction reads that prefix
# instead of parsing every line (a month-long file has tens of thousands), and copies kept lines byte for byte.
_BEAT = re.compile(rb'\{"v":\d+,"t":([0-9.eE+-]+),"kind":"beat","attempt":(-?\d+|null),')


def _beat_time(m: re.Match[bytes]) -> float | None:
    try:
        t = float(m.group(1))
    except ValueError:
        return None
    return t if is_time(t) else None


def _entry(line: bytes) -> tuple[bool, Any, bool, float] | None:
    """The thinning entry of one line, or None for a line readers would skip (compaction drops it)."""
    if len(line) > MAX_LINE:
        return None
    m = _BEAT.match(line)
    t = None if m is None else _beat_time(m)
    if m is not None and t is not None:
        return True, m.group(2), b'"val_loss":' in line, t
    if m is None and line.startswith(b'{"v":') and line.endswith(b"}") and b'"kind":"beat"' not in line:
        return False, None, False, 0.0  # an event, as the recorder wrote it: kept as is
    r = _record(line)
    if r is None:
        return None
    return r["kind"] == "beat", str(r.get("attempt")).encode(), "val_loss" in r, r["t"]


def compact_lines(data: bytes, now: float) -> bytes:
    """`thin` over a file's bytes: whole lines kept verbatim, torn or unreadable lines dropped."""
    lines, entries = [], []
    for line in data.split(b"\n")[:-1]:
        entry = _entry(line)
        if entry is not None:
            lines.append(line)
            entries.append(entry)
    return b"".join(line + b"\n" for line, keep in zip(lines, _keep(entries, now)) if keep)
