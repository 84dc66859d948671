"""Fold torchrun's own SignalException traceback into one line for the console echo (pure).

On a graceful stop torchrun's agent forwards SIGTERM to the workers, waits for them, then raises
`SignalException` and prints its 27-line traceback: the console would show a stop as a crash. The echo holds a
traceback's lines until its exception line; torchrun's SignalException becomes one line saying what happened,
anything else is shown as it came. The attempt log keeps every line (`logs --job`).
"""
from __future__ import annotations

__all__ = ["TracebackFold", "MAX_HELD"]

MAX_HELD = 400  # lines held while waiting for an exception line; beyond that they are shown as they came
_TRACEBACK = "Traceback (most recent call last):"
_SIGNAL_EXCEPTION = "torch.distributed.elastic.multiprocessing.api.SignalException:"


class TracebackFold:
    def __init__(self) -> None:
        self.held: list[str] = []

    def feed(self, lines: list[str]) -> list[str]:
        """The lines to show now, in order; a traceback's lines wait for its end."""
        out: list[str] = []
        for line in lines:
            if not self.held:
                (self.held if line.rstrip("\r") == _TRACEBACK else out).append(line)
                continue
            self.held.append(line)
            text = line.rstrip("\r")
            if not text or text[0].isspace() or text == _TRACEBACK:  # a frame, a caret line, a chained one
                if len(self.held) > MAX_HELD:
                    out += self.flush()
                continue
            if text.startswith(_SIGNAL_EXCEPTION):
                sig = text.rsplit(":", 1)[-1].strip()
                self.held = []
                out.append(f"torchrun stopped its workers on signal {sig} (its SignalException traceback: logs --job)")
            else:
                out += self.flush()
        return out

    def flush(self) -> list[str]:
        """What is held, as it came (the stream ended, or the traceback is not torchrun's SignalException)."""
        held, self.held = self.held, []
        return held
