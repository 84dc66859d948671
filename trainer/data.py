"""Deterministic byte-level data: sample `i` is a pure function of (seed, i), whatever the world size.

The trainer checkpoints one number, the global sample index of the next step. Step `s` of rank `r` reads
samples `index + r * batch .. index + (r + 1) * batch - 1`, so a resumed run (even at another world size)
reads the same global sequence of samples.
"""
from __future__ import annotations

import os

import numpy as np

__all__ = ["MarkovData", "FileData", "rank_batch", "VOCAB_SIZE"]

VOCAB_SIZE = 256  # bytes
_TABLE, _SAMPLE = 1, 0  # seed-sequence tags keep the chain's table apart from the per-sample streams


class MarkovData:
    """A fixed random Markov chain over bytes: every byte has a few likely successors, so loss can fall."""

    PROBS = np.array([0.55, 0.25, 0.12, 0.08])  # entropy ~1.1 nats, far below uniform's log(256) ~ 5.5

    def __init__(self, seed: int, seq_len: int) -> None:
        self.seed, self.seq_len = seed, seq_len
        rng = np.random.default_rng([seed, _TABLE])
        self.successors = rng.integers(0, VOCAB_SIZE, size=(VOCAB_SIZE, len(self.PROBS)))
        self._cum = np.cumsum(self.PROBS)

    def sample(self, index: int) -> np.ndarray:
        """`seq_len + 1` bytes (inputs plus shifted targets) of sample `index`, as int64."""
        rng = np.random.default_rng([self.seed, _SAMPLE, index])
        branch = np.minimum(np.searchsorted(self._cum, rng.random(self.seq_len)), len(self.PROBS) - 1)
        out = np.empty(self.seq_len + 1, dtype=np.int64)
        out[0] = rng.integers(0, VOCAB_SIZE)
        for t in range(self.seq_len):
            out[t + 1] = self.successors[out[t], branch[t]]
        return out


class FileData:
    """Random windows of a byte file; the window of sample `index` depends only on (seed, index)."""

    def __init__(self, path: str | os.PathLike, seed: int, seq_len: int) -> None:
        self.seed, self.seq_len = seed, seq_len
        self.bytes = np.fromfile(path, dtype=np.uint8)
        if len(self.bytes) < seq_len + 2:
            raise ValueError(f"{path}: shorter than seq_len + 2 bytes")

    def sample(self, index: int) -> np.ndarray:
        """`seq_len + 1` consecutive bytes starting at a position drawn from (seed, index)."""
        rng = np.random.default_rng([self.seed, _SAMPLE, index])
        start = int(rng.integers(0, len(self.bytes) - self.seq_len))
        return self.bytes[start : start + self.seq_len + 1].astype(np.int64)


def rank_batch(data: MarkovData | FileData, sample_index: int, rank: int, batch_size: int) -> np.ndarray:
    """The `(batch_size, seq_len + 1)` block of rank `rank` for the step starting at global `sample_index`."""
    first = sample_index + rank * batch_size
    return np.stack([data.sample(first + j) for j in range(batch_size)])
