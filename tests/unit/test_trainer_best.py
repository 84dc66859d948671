"""trainer.best: best.json is validated (a bad one is ignored with a reason), improvements are strict and finite."""
from __future__ import annotations

import json
import math
import os
import threading

import pytest

from trainer.best import BEST_FILE, WEIGHTS_FILE, Best, improves, missed_export, read_best


def write_dir(tmp_path, text: str | bytes, weights: bool = True):
    (tmp_path / BEST_FILE).write_bytes(text if isinstance(text, bytes) else text.encode())
    if weights:
        (tmp_path / WEIGHTS_FILE).write_bytes(b"x")
    return tmp_path


class TestReadBest:
    def test_no_file_is_no_best(self, tmp_path) -> None:
        """A fresh DIR: nothing to beat, nothing to report."""
        assert read_best(tmp_path) == (None, None)

    @pytest.mark.parametrize(("text", "why"), [
        ("{not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"step": -1, "val_loss": 1.0, "checkpoint": "c"}', "step"),
        ('{"step": 3.0, "val_loss": 1.0, "checkpoint": "c"}', "step"),
        ('{"step": 3, "val_loss": NaN, "checkpoint": "c"}', "val_loss"),
        ('{"step": 3, "val_loss": "1.0", "checkpoint": "c"}', "val_loss"),
        ('{"step": 3, "val_loss": 1.0, "checkpoint": ""}', "checkpoint"),
        ('{"step": 3, "val_loss": 1.0}', "checkpoint"),
        (b"\xff\xfe", "not JSON"),
        (b" " * 70_000, "bytes"),
    ])
    def test_corrupt_file_is_ignored_with_a_reason(self, tmp_path, text, why) -> None:
        """A corrupt best.json is no best, and the reason names what is wrong (for one warning line)."""
        best, problem = read_best(write_dir(tmp_path, text))
        assert best is None and problem is not None and why in problem and BEST_FILE in problem

    def test_a_fifo_is_ignored_without_blocking(self, tmp_path) -> None:
        """best.json as a FIFO (or a link to one) would block rank 0 in open() forever, and every rank after it."""
        os.mkfifo(tmp_path / BEST_FILE)
        (tmp_path / WEIGHTS_FILE).write_bytes(b"x")
        result: list = []
        reader = threading.Thread(target=lambda: result.append(read_best(tmp_path)), daemon=True)
        reader.start()
        reader.join(30)
        if reader.is_alive():  # unblock it before failing
            os.close(os.open(tmp_path / BEST_FILE, os.O_WRONLY | os.O_NONBLOCK))
        assert result and result[0][0] is None and "regular file" in result[0][1]

    def test_missing_weights_are_no_best(self, tmp_path) -> None:
        """best.json without its model.safetensors does not stop the next improvement from exporting."""
        best, problem = read_best(write_dir(tmp_path, json.dumps({"step": 3, "val_loss": 1.0, "checkpoint": "c"}),
                                            weights=False))
        assert best is None and WEIGHTS_FILE in (problem or "")


@pytest.mark.parametrize(("best", "value", "expected"), [
    (None, 2.0, True),
    (Best(4, 2.0, "c"), 1.9, True),
    (Best(4, 2.0, "c"), 2.0, False),  # equal is not better: a replayed step never rewrites the export
    (Best(4, 2.0, "c"), 2.1, False),
    (None, math.nan, False),
    (None, math.inf, False),
    (None, None, False),
])
def test_improves(best, value, expected) -> None:
    """Strictly lower and finite."""
    assert improves(best, value) is expected


@pytest.mark.parametrize(("best", "step", "value", "every", "expected"), [
    (Best(8, 2.0, "c"), 12, 1.5, 4, True),  # died after step 12's save, before its export
    (Best(12, 1.5, "c"), 12, 1.5, 4, False),  # the export finished
    (Best(8, 2.0, "c"), 13, 1.5, 4, False),  # not an evaluated step: an emergency save's older value
    (None, 12, 1.5, 4, True),
    (None, 12, None, 4, False),
    (Best(8, 2.0, "c"), 12, 2.5, 4, False),
])
def test_missed_export(best, step, value, every, expected) -> None:
    """Only an evaluated step's own save that beats best.json means an export was cut short."""
    assert missed_export(best, step, value, every) is expected
