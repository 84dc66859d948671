"""The console echo folds torchrun's SignalException traceback (a graceful stop) into one line, nothing else."""
from __future__ import annotations

from pathlib import Path

from supervisor.observe.tracefold import MAX_HELD, TracebackFold

STOPPED = (Path(__file__).parents[1] / "data" / "torchrun_stopped.log").read_text().splitlines()
CRASH = ["Traceback (most recent call last):", '  File "train.py", line 3, in <module>', "    boom()",
         "ValueError: boom"]


def _feed_in_pieces(lines: list[str], size: int) -> list[str]:
    fold, out = TracebackFold(), []
    for i in range(0, len(lines), size):
        out += fold.feed(lines[i:i + size])
    return out + fold.flush()


def test_signal_exception_traceback_is_one_line_however_it_arrives() -> None:
    for size in (1, 3, len(STOPPED)):
        out = _feed_in_pieces(STOPPED, size)
        assert not any(line.startswith(("Traceback", "  File")) for line in out), out
        assert out[-1].startswith("torchrun stopped its workers on signal 15")
        assert "rank 0: stopping" in out and len(out) == STOPPED.index("Traceback (most recent call last):") + 1


def test_other_tracebacks_are_shown_whole_and_in_order() -> None:
    lines = ["before", *CRASH, "after"]
    assert _feed_in_pieces(lines, 2) == lines
    chained = [*CRASH[:-1], "ValueError: a", "", "During handling of the above exception, another exception occurred:",
               "", *CRASH]
    assert _feed_in_pieces(chained, 1) == chained


def test_a_traceback_cut_short_is_shown_at_the_end_and_a_runaway_one_is_not_held() -> None:
    fold = TracebackFold()
    assert fold.feed(CRASH[:2]) == [] and fold.flush() == CRASH[:2]
    frames = ["Traceback (most recent call last):", *(["  frame"] * (MAX_HELD + 5))]
    assert len(TracebackFold().feed(frames)) > MAX_HELD - 5
