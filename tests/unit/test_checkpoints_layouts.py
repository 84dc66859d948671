"""The layouts the store knows, on crafted files: names and steps (naming.py) and foreign folders (shapes.py).

Real DCP layouts (a real `dcp.save`, the Accelerate reproduction): tests/integration/test_checkpoints_layouts.py.
"""
from __future__ import annotations

import pytest

import supervisor.checkpoints.ranking as ranking
import supervisor.checkpoints.shapes as shapes
from supervisor.checkpoints import (
    identify,
    newest_complete,
    scan,
)
from supervisor.checkpoints.naming import is_checkpoint_name, name_ordinal, name_step
from tests.jobs.dcp_files import write_checkpoint


class TestNames:
    @pytest.mark.parametrize("name,step", [
        ("step-10", 10), ("step_10", 10), ("step_00000010", 10),
        ("epoch=3-step=1200.ckpt", 1200), ("epoch=3-step=1200-v1.ckpt", 1200), ("step=7.ckpt", 7),
        ("checkpoint_3", None), ("checkpoint-500", 500),
    ])
    def test_step_of_each_layout(self, name, step):
        """torchtitan's step-N, the trainer's step_N, Lightning's epoch=E-step=S.ckpt (S, not E); checkpoint_N has none."""
        assert name_step(name) == step

    @pytest.mark.parametrize("name,ordinal", [("checkpoint_3", 3), ("checkpoint_12", 12), ("checkpoint-3", None),
                                              ("step_3", None), ("my_checkpoint_3", None)])
    def test_accelerates_checkpoint_n_is_a_save_ordinal(self, name, ordinal):
        """Only Accelerate's automatic `checkpoint_<N>` is an ordinal."""
        assert name_ordinal(name) == ordinal

    @pytest.mark.parametrize("name,expected", [
        ("step-10", True), ("checkpoint_3", True), ("epoch_2", True), ("epoch=1-step=5.ckpt", True),
        ("pytorch_model_fsdp_0", False), ("optimizer_0", False), ("tb", False), ("best", False),
    ])
    def test_checkpoint_names_exclude_accelerates_members(self, name, expected):
        """The names that make a folder a checkpoint *directory* do not include Accelerate's member dirs."""
        assert is_checkpoint_name(name) is expected


class TestForeign:
    def test_never_selected_nor_walked(self, tmp_path, monkeypatch):
        """newest_complete passes over foreign dirs; scan never sizes them, however deep they go."""
        root = tmp_path / "ckpts"
        write_checkpoint(root, 1)
        deep = root / "logs"
        for i in range(6):
            deep = deep / f"level{i}"
        deep.mkdir(parents=True)
        write_checkpoint(deep, 99)  # a DCP dir deeper than two levels is not the root's business
        walked: list[str] = []
        real = ranking._usage
        monkeypatch.setattr(ranking, "_usage", lambda d: walked.append(d.name) or real(d))
        assert [(c.name, c.state) for c in scan(root)] == [("step_00000001", "complete"), ("logs", "foreign")]
        assert walked == ["step_00000001"] and newest_complete(root).name == "step_00000001"

    def test_looking_is_bounded(self, tmp_path, monkeypatch):
        """A folder with more entries than the budget is foreign after reading only the budget."""
        monkeypatch.setattr(shapes, "MAX_ENTRIES", 16)
        big = tmp_path / "ckpts" / "dump"
        big.mkdir(parents=True)
        for i in range(40):
            (big / f"f{i:03d}.bin").write_bytes(b"")
        shape = identify(big)
        assert shape.kind == "foreign" and "more than 16 entries" in shape.reason

    def test_empty_dir_with_a_checkpoint_name_is_an_unstarted_save(self, tmp_path):
        """`step-30/` or `checkpoint_4/pytorch_model_fsdp_0/` with no file yet: a save that only made its dirs."""
        root = tmp_path / "ckpts"
        (root / "step-30").mkdir(parents=True)
        (root / "checkpoint_4" / "pytorch_model_fsdp_0").mkdir(parents=True)
        (root / "notes").mkdir()
        assert {c.name: c.state for c in scan(root)} == {"step-30": "partial", "checkpoint_4": "partial",
                                                        "notes": "foreign"}
