"""Unit tests of trainer.data: samples are pure functions of (seed, global index)."""
from __future__ import annotations

import numpy as np
import pytest

from trainer.data import VOCAB_SIZE, FileData, MarkovData, datasets, rank_batch, split_point


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


class TestHeldOut:
    def test_markov_validation_is_a_separate_stream_of_the_same_chain(self) -> None:
        """Held-out samples follow the same chain but are other samples than training's, index for index."""
        train, val = datasets(3, 32, held_out=True)
        assert val is not None and np.array_equal(train.successors, val.successors)
        assert all(not np.array_equal(train.sample(i), val.sample(i)) for i in range(20))
        assert np.array_equal(val.sample(5), datasets(3, 32, held_out=True)[1].sample(5))  # deterministic

    def test_without_evaluation_training_data_is_unchanged(self, tmp_path) -> None:
        """Eval off holds nothing out: the same windows (file) and samples (synthetic) as ever."""
        path = tmp_path / "data.bin"
        path.write_bytes(bytes(np.random.default_rng(1).integers(0, 256, 3000, dtype=np.uint8)))
        train, val = datasets(5, 16, path)
        assert val is None and all(np.array_equal(train.sample(i), FileData(path, 5, 16).sample(i)) for i in range(30))
        assert datasets(5, 16)[1] is None
        assert np.array_equal(datasets(5, 16)[0].sample(4), MarkovData(5, 16).sample(4))

    def test_file_training_windows_never_touch_the_held_out_region(self, tmp_path) -> None:
        """Bytes before the split are 1, after it 2: training sees only 1s, validation only 2s."""
        n, seq = 2000, 16
        split = split_point(n, seq)
        path = tmp_path / "data.bin"
        path.write_bytes(b"\x01" * split + b"\x02" * (n - split))
        train, val = datasets(0, seq, path, held_out=True)
        assert split == n - n // 10
        assert all(set(train.sample(i).tolist()) == {1} for i in range(500))
        assert all(set(val.sample(i).tolist()) == {2} for i in range(200))

    def test_a_small_file_holds_out_at_least_one_sample(self) -> None:
        """The held-out region is a tenth of the file, never shorter than a sample."""
        assert split_point(100, 16) == 100 - 18
        assert split_point(10_000, 16) == 9_000
