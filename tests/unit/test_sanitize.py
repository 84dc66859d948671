"""observe/sanitize: a job's control sequences are shown, never executed; its colors only on a terminal."""
from __future__ import annotations

import pytest

from supervisor.observe.sanitize import SGR_RESET, visible

CASES = [
    # (what the job printed, on a terminal, elsewhere)
    ("plain text", "plain text", "plain text"),
    ("tab\tkept", "tab\tkept", "tab\tkept"),
    ("\x1b]0;owned\x07title", "^[]0;owned^Gtitle", "^[]0;owned^Gtitle"),  # OSC 0: window title
    ("\x1b]52;c;aGk=\x07", "^[]52;c;aGk=^G", "^[]52;c;aGk=^G"),  # OSC 52: clipboard write
    ("\x1b]52;c;aGk=\x1b\\", "^[]52;c;aGk=^[\\", "^[]52;c;aGk=^[\\"),  # OSC ended by ST
    ("\x1b[2Jcleared", "^[[2Jcleared", "^[[2Jcleared"),  # CSI 2J: clear screen
    ("\x1b[10;5Hmoved\x1b[3A", "^[[10;5Hmoved^[[3A", "^[[10;5Hmoved^[[3A"),  # cursor moves
    ("ding\x07", "ding^G", "ding^G"),  # BEL
    ("back\bspace\x7f", "back^Hspace^?", "back^Hspace^?"),
    ("\x9b2J", "\\x9b2J", "\\x9b2J"),  # C1 CSI, one byte
    ("abc\u202edef", "abc\\u202edef", "abc\\u202edef"),  # right-to-left override
    ("10%\r50%\r100%", "100%", "100%"),  # a progress bar: its last frame
    ("done\r", "done", "done"),
    ("\x1b[31mred\x1b[0m ok", f"\x1b[31mred\x1b[0m ok{SGR_RESET}", "red ok"),  # SGR colors
    ("\x1b[1;38;5;196mbold", f"\x1b[1;38;5;196mbold{SGR_RESET}", "bold"),
    ("\x1b[31;2Jx", "^[[31;2Jx", "^[[31;2Jx"),  # not SGR although it starts like one
]


class TestVisible:
    @pytest.mark.parametrize(("raw", "tty", "plain"), CASES)
    def test_table(self, raw: str, tty: str, plain: str) -> None:
        """Each sequence renders as the table says, with and without colors."""
        assert visible(raw, colors=True) == tty
        assert visible(raw, colors=False) == plain

    @pytest.mark.parametrize("colors", [True, False])
    def test_no_escape_survives_but_sgr(self, colors: bool) -> None:
        """Whatever the input, the only ESC left starts an SGR sequence, and only with colors."""
        raw = "".join(chr(c) for c in range(0xA0)) + "\x1b[32mg\x1b]2;t\x07\x1b[H"
        out = visible(raw, colors=colors).replace("\x1b[32m", "").replace(SGR_RESET, "")
        assert not any((ord(ch) < 0x20 and ch != "\t") or 0x7F <= ord(ch) < 0xA0 for ch in out), out
