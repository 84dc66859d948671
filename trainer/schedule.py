"""Learning-rate schedule: a pure function of the step, so resuming needs nothing but the step."""
from __future__ import annotations

import math

__all__ = ["lr_factor"]


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based): linear warmup, then cosine to `min_ratio`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
