"""Unit tests of trainer.data: samples are pure functions of (seed, global index)."""
from __future__ import annotations

import numpy as np
import pytest

from trainer.data import VOCAB_SIZE, FileData, MarkovData, rank_batch


class TestMarkovData:
    def test_same_index_gives_same_sample(self) -> None:
        """Two streams built from the same seed agree on every sample, independent of call order."""
        a, b = MarkovData(3, 32), MarkovData(3, 32)
        later_first = [b.sample(i) for i in (9, 2, 5)]
        assert all(np.array_equal(a.sample(i), s) for i, s in zip((9, 2, 5), later_first))

    def test_seed_and_index_change_the_sample(self) -> None:
        """Another seed or another index gives different bytes."""
        data = MarkovData(3, 32)
        assert not np.array_equal(data.sample(0), data.sample(1))
        assert not np.array_equal(data.sample(0), MarkovData(4, 32).sample(0))

    def test_samples_follow_the_chain(self) -> None:
        """Every transition goes to one of the byte's few successors, so the data is learnable."""
        data = MarkovData(0, 64)
        sample = data.sample(11)
        assert sample.shape == (65,) and sample.dtype == np.int64
        assert sample.min() >= 0 and sample.max() < VOCAB_SIZE
        for prev, nxt in zip(sample[:-1], sample[1:]):
            assert nxt in data.successors[prev]


class TestRankBatch:
    def test_global_order_is_independent_of_world_size(self) -> None:
        """Two ranks of batch 4 read exactly the rows one rank of batch 8 reads."""
        data = MarkovData(1, 16)
        whole = rank_batch(data, 40, 0, 8)
        halves = np.concatenate([rank_batch(data, 40, 0, 4), rank_batch(data, 40, 1, 4)])
        assert np.array_equal(whole, halves)

    def test_rows_are_samples_at_their_global_index(self) -> None:
        """Row j of rank r at sample index i is sample i + r * batch + j."""
        data = MarkovData(1, 16)
        block = rank_batch(data, 100, 2, 3)
        assert np.array_equal(block[1], data.sample(100 + 2 * 3 + 1))


class TestFileData:
    def test_windows_come_from_the_file(self, tmp_path) -> None:
        """A sample is seq_len + 1 consecutive bytes of the file, the same for the same (seed, index)."""
        text = bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8))
        path = tmp_path / "data.bin"
        path.write_bytes(text)
        sample = FileData(path, seed=5, seq_len=16).sample(7)
        assert len(sample) == 17 and bytes(sample.astype(np.uint8)) in text
        assert np.array_equal(sample, FileData(path, seed=5, seq_len=16).sample(7))

    def test_too_short_file_is_refused(self, tmp_path) -> None:
        """A file shorter than one sample is a clear error, not an index error later."""
        path = tmp_path / "tiny.txt"
        path.write_bytes(b"abc")
        with pytest.raises(ValueError, match="shorter"):
            FileData(path, seed=0, seq_len=16)
