"""Tests for supervisor.checkpoints.manifest: strict parsing of the trainer's manifest.json."""
from __future__ import annotations

import json

import pytest

from supervisor.checkpoints.manifest import parse_manifest, read_manifest
from supervisor.errors import ManifestError
from supervisor.layout import MANIFEST_FORMAT, MANIFEST_NAME


def _body(**over):
    body = {"format": MANIFEST_FORMAT, "step": 5, "world_size": 2, "time": 1.0, "loss": 0.5,
            "torch_version": "2.13.0", "metrics": {"loss": 0.5}, "files": {".metadata": 10, "__0_0.distcp": 20}}
    body.update(over)
    return json.dumps(body).encode()


class TestParseManifest:
    def test_valid_manifest_round_trips(self):
        """Every documented field is read with its type."""
        m = parse_manifest(_body(sha256={".metadata": "ab"}))
        assert (m.step, m.world_size, m.loss, m.metrics, m.files, m.sha256) == (
            5, 2, 0.5, {"loss": 0.5}, {".metadata": 10, "__0_0.distcp": 20}, {".metadata": "ab"})

    @pytest.mark.parametrize("over,match", [
        ({"format": "other/9"}, "format"),
        ({"step": -1}, "step"),
        ({"step": "5"}, "step"),
        ({"step": True}, "step"),
        ({"world_size": 0}, "world_size"),
        ({"files": {"a": -1}}, "files"),
        ({"files": ["a"]}, "files"),
        ({"metrics": [1]}, "metrics"),
    ])
    def test_bad_fields_are_named(self, over, match):
        """A wrong format, step, world size, files map or metrics is a ManifestError naming the field."""
        with pytest.raises(ManifestError, match=match):
            parse_manifest(_body(**over))

    def test_non_numeric_and_nan_metrics_are_dropped(self):
        """A null or NaN metric (a diverged step) is left out rather than failing the checkpoint."""
        m = parse_manifest(_body(metrics={"loss": float("nan"), "acc": None, "ppl": 3}))
        assert m.metrics == {"ppl": 3.0}

    def test_not_json_is_an_error(self):
        """Bytes that are not JSON are a ManifestError."""
        with pytest.raises(ManifestError, match="not JSON"):
            parse_manifest(b"\xff{")


class TestReadManifest:
    def test_absent_manifest_is_none(self, tmp_path):
        """A plain DCP dir has no manifest, which is fine."""
        assert read_manifest(tmp_path) is None

    def test_symlinked_manifest_is_refused(self, tmp_path):
        """A manifest that is a symlink is not followed."""
        (tmp_path / "real.json").write_bytes(_body())
        (tmp_path / MANIFEST_NAME).symlink_to(tmp_path / "real.json")
        with pytest.raises(ManifestError, match="symlink"):
            read_manifest(tmp_path)
