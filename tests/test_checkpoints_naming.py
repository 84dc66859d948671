"""Tests for supervisor.checkpoints.naming: steps and temporary names from dir names."""
from __future__ import annotations

import pytest

from supervisor.layout import step_dir_name, tmp_dir_name
from supervisor.checkpoints.naming import is_temporary, name_step


class TestNameStep:
    @pytest.mark.parametrize("name,step", [
        ("step_120", 120), ("step-120", 120), ("epoch_12", 12), ("ckpt_000120", 120), ("global_step120", 120),
        (step_dir_name(7), 7), (tmp_dir_name(42, "123abc"), 42), (tmp_dir_name(42, "999"), 42),
        ("best", None), ("step_12_backup", None), ("", None),
    ])
    def test_trailing_integer_is_the_step(self, name, step):
        """The trailing integer of a name is its step; a temp name's nonce is ignored."""
        assert name_step(name) == step


class TestIsTemporary:
    def test_only_the_tmp_prefix_is_temporary(self):
        """`.tmp-...` names are temporary, final names are not."""
        assert is_temporary(tmp_dir_name(1, "x")) and not is_temporary(step_dir_name(1))
