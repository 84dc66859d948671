"""Tests for supervisor.checkpoints.naming: steps and temporary names from dir names."""
from __future__ import annotations

import pytest

from supervisor.checkpoints.naming import is_temporary, name_step
from supervisor.layout import step_dir_name, tmp_dir_name


class TestNameStep:
    @pytest.mark.parametrize("name,step", [
        ("step_120", 120), ("step-120", 120), ("epoch_12", 12), ("ckpt_000120", 120), ("global_step120", 120),
        (step_dir_name(7), 7), (tmp_dir_name(42, "123abc"), 42), (tmp_dir_name(42, "999"), 42),
        ("best", None), ("step_12_backup", None), ("", None),
    ])
    def test_trailing_integer_is_the_step(self, name, step):
        """The trailing integer of a name is its step; a temp name's nonce is ignored."""
        assert name_step(name) == step

    @pytest.mark.parametrize("name,step", [
        ("backup-20241203", None), ("llama2-7b-chat-v2", None), ("pytorch_model_fsdp_0", None), ("export_3", None),
        ("run1_step_120", 120), ("iter_0000120", 120), ("checkpoint-500", 500), ("1500", 1500),
    ])
    def test_only_a_checkpoint_word_or_a_bare_number_gives_a_step(self, name, step):
        """A dated copy (`backup-20241203`) had step 20241203: it outranked the whole run, became the newest
        complete and keep_last=1 deleted the real newest. Its step is unknown now (it ranks below stepped dirs)."""
        assert name_step(name) == step


class TestIsTemporary:
    def test_only_the_tmp_prefix_is_temporary(self):
        """`.tmp-...` names are temporary, final names are not."""
        assert is_temporary(tmp_dir_name(1, "x")) and not is_temporary(step_dir_name(1))
