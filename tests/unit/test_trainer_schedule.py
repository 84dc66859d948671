"""Unit tests of trainer.schedule: the lr multiplier as a table of (step -> value)."""
from __future__ import annotations

import math

import pytest

from trainer.schedule import lr_factor

# warmup 4, 14 steps in all, floor 0.1: steps 0-3 ramp up, 4..14 follow a half cosine from 1.0 to 0.1.
TABLE = [
    (0, 0.25),
    (1, 0.5),
    (3, 1.0),
    (4, 1.0),
    (9, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))),
    (14, 0.1),
    (20, 0.1),
]


class TestLrFactor:
    @pytest.mark.parametrize(("step", "expected"), TABLE)
    def test_table(self, step: int, expected: float) -> None:
        """Warmup is linear from 1/warmup, then cosine decay to min_ratio, then flat."""
        assert lr_factor(step, warmup_steps=4, total_steps=14, min_ratio=0.1) == pytest.approx(expected)

    def test_no_warmup_starts_at_peak(self) -> None:
        """With zero warmup steps the first step uses the peak lr."""
        assert lr_factor(0, warmup_steps=0, total_steps=10, min_ratio=0.0) == 1.0

    def test_decay_is_monotonic(self) -> None:
        """After warmup the multiplier never rises."""
        values = [lr_factor(s, warmup_steps=3, total_steps=50, min_ratio=0.2) for s in range(3, 60)]
        assert all(a >= b for a, b in zip(values, values[1:]))
