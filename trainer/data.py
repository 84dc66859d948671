"""Deterministic byte-level data: sample `i` is a pure function of (seed, i), whatever the world size.

The trainer checkpoints one number, the global sample index of the next step. Step `s` of rank `r` reads
samples `index + r * batch .. index + (r + 1) * batch - 1`, so a resumed run (even at another world size)
reads the same global sequence of samples.

Validation data is held out, and never touches what training reads:
- synthetic Markov data: the same chain, but samples drawn from a separate stream (seed-sequence tag
  `_EVAL` instead of `_SAMPLE`), so no validation sample is ever a training sample by construction;
- `--data FILE`: the last tenth of the file (at least one sample long, `split_point`) is the held-out
  region; training windows are drawn from the bytes before it and never reach into it.
Without evaluation nothing is held out: the training data is exactly what it was before validation existed.
"""
from __future__ import annotations

import os

import numpy as np

__all__ = ["MarkovData", "FileData", "Data", "datasets", "split_point", "rank_batch", "VOCAB_SIZE"]

VOCAB_SIZE = 256  # bytes
# Seed-sequence tags keep the chain's table apart from the per-sample streams (training and held-out).
_TABLE, _SAMPLE, _EVAL = 1, 0, 2
HELD_OUT_FRACTION = 10  # --data FILE: the last 1/10 of the file is the validation region


class MarkovData:
    """A fixed random Markov chain over bytes: every byte has a few likely successors, so loss can fall."""

    PROBS = np.array([0.55, 0.25, 0.12, 0.08])  # entropy ~1.1 nats, far below uniform's log(256) ~ 5.5

    def __init__(self, seed: int, seq_len: int, *, stream: int = _SAMPLE) -> None:
        self.seed, self.seq_len, self.stream = seed, seq_len, stream
        rng = np.random.default_rng([seed, _TABLE])  # one chain for every stream: validation measures the same task
        self.successors = rng.integers(0, VOCAB_SIZE, size=(VOCAB_SIZE, len(self.PROBS)))
        self._cum = np.cumsum(self.PROBS)

    def sample(self, index: int) -> np.ndarray:
        """`seq_len + 1` bytes (inputs plus shifted targets) of sample `index`, as int64."""
        rng = np.random.default_rng([self.seed, self.stream, index])
        branch = np.minimum(np.searchsorted(self._cum, rng.random(self.seq_len)), len(self.PROBS) - 1)
        out = np.empty(self.seq_len + 1, dtype=np.int64)
        out[0] = rng.integers(0, VOCAB_SIZE)
        for t in range(self.seq_len):
            out[t + 1] = self.successors[out[t], branch[t]]
        return out


class FileData:
    """Random windows of `bytes[start:stop]` of a file; the window of sample `index` depends only on (seed, index)."""

    def __init__(self, path: str | os.PathLike[str], seed: int, seq_len: int, *, start: int = 0, stop: int | None = None,
                 stream: int = _SAMPLE) -> None:
        self.seed, self.seq_len, self.stream = seed, seq_len, stream
        self.bytes = np.fromfile(path, dtype=np.uint8)[start:stop]
        if len(self.bytes) < seq_len + 2:
            raise ValueError(f"{path}: shorter than seq_len + 2 bytes")

    def sample(self, index: int) -> np.ndarray:
        """`seq_len + 1` consecutive bytes starting at a position drawn from (seed, index)."""
        rng = np.random.default_rng([self.seed, self.stream, index])
        start = int(rng.integers(0, len(self.bytes) - self.seq_len))
        return self.bytes[start : start + self.seq_len + 1].astype(np.int64)


Data = MarkovData | FileData


def split_point(n_bytes: int, seq_len: int) -> int:
    """Where a file's held-out region starts: the last tenth, but at least `seq_len + 2` bytes.

    The caller checks that the training part before it still holds a sample (`seq_len + 2` bytes).
    """
    return n_bytes - max(n_bytes // HELD_OUT_FRACTION, seq_len + 2)


def datasets(seed: int, seq_len: int, path: str | os.PathLike[str] | None = None, *,
             held_out: bool = False) -> tuple[Data, Data | None]:
    """(training data, validation data or None); with `held_out` False the training data holds everything."""
    if path is None:
        return MarkovData(seed, seq_len), (MarkovData(seed, seq_len, stream=_EVAL) if held_out else None)
    if not held_out:
        return FileData(path, seed, seq_len), None
    split = split_point(os.path.getsize(path), seq_len)
    return (FileData(path, seed, seq_len, stop=split),
            FileData(path, seed, seq_len, start=split, stream=_EVAL))


def rank_batch(data: Data, sample_index: int, rank: int, batch_size: int) -> np.ndarray:
    """The `(batch_size, seq_len + 1)` block of rank `rank` for the step starting at global `sample_index`."""
    first = sample_index + rank * batch_size
    return np.stack([data.sample(first + j) for j in range(batch_size)])
