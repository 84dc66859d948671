"""A torchtitan config registry for the real-client tier: llama3's debug model cut to 2 layers.

torchtitan's `--module` takes a dotted module path besides its short names (torchtitan.config.manager
.ConfigManager._load_config) and `--config` a function in it that returns a `Trainer.Config`: this is
torchtitan's own extension point, not a patch. Only the depth changes (6 -> 2 layers; dim, heads, vocab
and everything else stay those of `llama3_debugmodel`): eager FlexAttention on CPU costs ~0.6 s per layer
and step, and the tier runs a few hundred steps in all.
"""
from __future__ import annotations

from typing import Any

__all__ = ["debugmodel_2layers"]


def debugmodel_2layers() -> Any:
    """`llama3_debugmodel` with its first two transformer blocks only."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.model_spec.model.layers = config.model_spec.model.layers[:2]
    return config
