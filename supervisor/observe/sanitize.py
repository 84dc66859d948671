"""Job output made safe to print: control sequences are shown, never executed (`logs --job`, the tty echo).

What `visible` shows instead: docs/operations.md, 'Files the supervisor keeps'; why, and the SGR colors kept for a
terminal: docs/design.md, 'Notes for maintainers'.
"""
from __future__ import annotations

import re

__all__ = ["visible", "SGR_RESET"]

SGR_RESET = "\x1b[0m"
_SGR = re.compile(r"\x1b\[[0-9;:]{0,32}m")
_BIDI = frozenset(range(0x202A, 0x202F)) | frozenset(range(0x2066, 0x206A))
_KEEP = frozenset("\t")


def _show(ch: str) -> str:
    code = ord(ch)
    if ch in _KEEP:
        return ch
    if code < 0x20:
        return "^" + chr(code + 0x40)
    if code == 0x7F:
        return "^?"
    if 0x80 <= code < 0xA0:  # C1: `\x9b` alone is a CSI to some terminals
        return f"\\x{code:02x}"
    if code in _BIDI:  # reorders what follows on screen
        return f"\\u{code:04x}"
    return ch


def _plain(text: str) -> str:
    return "".join(_show(ch) for ch in text)


def _last_frame(line: str) -> str:
    line = line.rstrip("\r")
    return line[line.rfind("\r") + 1:]


def visible(line: str, *, colors: bool) -> str:
    """`line` (one line, no newline) as it may be printed: SGR kept only with `colors`, other controls shown."""
    line = _last_frame(line)
    out: list[str] = []
    pos, colored = 0, False
    for m in _SGR.finditer(line):
        out.append(_plain(line[pos:m.start()]))
        if colors:
            out.append(m.group())
            colored = True
        pos = m.end()
    out.append(_plain(line[pos:]))
    if colored:
        out.append(SGR_RESET)
    return "".join(out)
