"""Tests for supervisor.checkpoints.testing: torch-free checkpoints that real torch also accepts."""
from __future__ import annotations

import json
import subprocess
import sys

from supervisor.checkpoints.testing import dcp_metadata_bytes

_LOAD_WITH_TORCH = """
import json, pickle, sys
import torch
m = pickle.load(open(sys.argv[1], "rb"))
print(json.dumps({
    "type": type(m).__module__ + "." + type(m).__name__,
    "fqns": sorted(m.state_dict_metadata),
    "dtype": str(next(iter(m.state_dict_metadata.values())).properties.dtype),
    "storage": sorted([i.fqn, s.relative_path, s.offset, s.length] for i, s in m.storage_data.items()),
}))
"""


class TestFidelityWithTorch:
    def test_real_torch_unpickles_synthetic_metadata(self, tmp_path):
        """torch's own pickle.load reads the synthetic .metadata as DCP Metadata with the same storage."""
        data, sizes = dcp_metadata_bytes({"w": 10, "b": 3}, shards=2)
        (tmp_path / "m").write_bytes(data)
        out = subprocess.run([sys.executable, "-c", _LOAD_WITH_TORCH, str(tmp_path / "m")],
                             capture_output=True, text=True, timeout=120, check=True)
        got = json.loads(out.stdout)
        assert got["type"] == "torch.distributed.checkpoint.metadata.Metadata"
        assert got["fqns"] == ["b", "w"] and got["dtype"] == "torch.float32"
        ends = {}
        for _, rel, off, length in got["storage"]:
            ends[rel] = max(ends.get(rel, 0), off + length)
        assert ends == sizes
