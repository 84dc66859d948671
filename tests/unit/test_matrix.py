"""The setup matrix's design (tests/matrix.py): what its cells cover and which run in a session."""
from __future__ import annotations

import itertools

import pytest

from tests.matrix import KILLS, MATRIX_ENV, ROOTS, SAMPLE, Cell, all_pairs, matrix, session_cells


class TestTheMatrix:
    def test_every_root_kind_meets_every_fault_once(self) -> None:
        assert sorted((c.root, c.kill) for c in matrix()) == sorted(itertools.product(ROOTS, KILLS))

    def test_every_pair_of_values_of_any_two_dimensions_meets_in_some_cell(self) -> None:
        """The array behind the matrix: a cell whose pair of setups never met is a setup bug nobody ran."""
        covered = {(i, c.values()[i], j, c.values()[j]) for c in matrix() for i, j in itertools.combinations(range(5), 2)}
        assert all_pairs() - covered == set()

    def test_cell_ids_are_unique_and_name_every_value(self) -> None:
        ids = [str(c) for c in matrix()]
        assert len(set(ids)) == len(ids)
        assert str(Cell("symlink", "other_spelling", True, "both", "during_save")) == \
            "symlink-other_spelling-suspend-both-during_save"


class TestSessionCells:
    def test_a_seed_draws_the_same_sample_every_time(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv(MATRIX_ENV, raising=False)
        assert session_cells(1234) == session_cells(1234)
        assert len(session_cells(1234)) == SAMPLE
        assert len({tuple(session_cells(seed)) for seed in range(50)}) > 1  # seeds differ: coverage grows run by run

    def test_full_runs_every_cell(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(MATRIX_ENV, "full")
        assert session_cells(1234) == matrix()
