"""Job output as a terminal shows it, in bounded memory and time: the echo, `logs --job` and `logs -f` use it.

A job's output is untrusted and can be huge without a single newline (tqdm redraws its bar with `\\r`), so
every reader here is linear in what it reads and keeps at most one capped line: a line is shown as its last
non-empty `\\r` frame (what a terminal leaves on screen), and a line longer than `MAX_LINE` is cut with a
marker. The raw bytes stay untouched in the log file.
"""
from __future__ import annotations

from typing import BinaryIO

__all__ = ["MAX_LINE", "CUT_MARK", "last_frame", "LineSplitter", "tail_lines"]

MAX_LINE = 64 * 1024
CUT_MARK = b" [... line cut at 64 KiB]"
_BLOCK = 64 * 1024


def last_frame(line: bytes) -> bytes:
    """What a terminal leaves on screen for `line`: its last non-empty `\\r` frame."""
    line = line.rstrip(b"\r")
    cr = line.rfind(b"\r")
    return line if cr < 0 else line[cr + 1:]


def _cut(line: bytes) -> bytes:
    return line if len(line) <= MAX_LINE else line[:MAX_LINE] + CUT_MARK


class LineSplitter:
    """Feed bytes, get whole display lines back; what is left is at most one frame of `MAX_LINE` bytes."""

    def __init__(self) -> None:
        self.partial = b""  # the unfinished line, already reduced to its last frame
        self._skipping = False  # a line was cut: drop the rest of it until its newline

    def feed(self, data: bytes) -> list[bytes]:
        parts = (self.partial + data).split(b"\n")
        tail = parts.pop()
        out = []
        for part in parts:
            if self._skipping:
                self._skipping = False
                continue
            out.append(_cut(last_frame(part)))
        if self._skipping:
            self.partial = b""
            return out
        # Keep the last frame whole (a redraw may still be on its way): from its `\r` on.
        stripped = tail.rstrip(b"\r")
        cr = stripped.rfind(b"\r")
        self.partial = tail if cr < 0 else tail[cr:]
        if len(last_frame(self.partial)) > MAX_LINE:
            out.append(_cut(last_frame(self.partial)))
            self.partial, self._skipping = b"", True
        return out

    @property
    def frame(self) -> bytes:
        """The unfinished line as a terminal shows it now (b"" when there is none)."""
        return last_frame(self.partial)


def tail_lines(f: BinaryIO, n: int, end: int | None = None) -> list[bytes]:
    """The last `n` display lines of a seekable file, reading at most about `(n + 1) * MAX_LINE` bytes from its end.

    `end`: the offset to treat as the end (a follower that goes on from there sees every byte exactly once);
    default: the file's size now. A line that starts before what was read is shown from where reading began,
    marked with "...".
    """
    if n <= 0:
        return []
    pos = end = f.seek(0, 2) if end is None else end
    budget = (n + 1) * MAX_LINE + _BLOCK
    blocks: list[bytes] = []
    newlines = 0
    while pos > 0 and newlines <= n and end - pos < budget:
        step = min(pos, _BLOCK)
        pos -= step
        f.seek(pos)
        block = f.read(step)
        blocks.append(block)
        newlines += block.count(b"\n")
    data = b"".join(reversed(blocks))
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    first_partial = pos > 0  # the window begins inside a line
    keep = lines[-n:]
    shown = [_cut(last_frame(line)) for line in keep]
    if first_partial and len(keep) == len(lines) and shown:
        shown[0] = b"... " + shown[0]
    return shown
