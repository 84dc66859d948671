"""Tests for tests.jobs.dcp_files: torch-free checkpoints that real torch also accepts."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.jobs.dcp_files import dcp_metadata_bytes

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


_TORCH_SAVE_AND_LOAD = """
import json, sys
import torch
if sys.argv[1] == "save":  # what Lightning's sharded save puts in meta.pt, tensors included
    state = {"best_k_models": {sys.argv[3] + "/epoch=0-step=10.ckpt": torch.tensor(1.5)},
             "best_model_path": sys.argv[3] + "/epoch=0-step=10.ckpt", "best_model_score": torch.tensor(1.5)}
    torch.save({"global_step": 40, "epoch": 1, "callbacks": {"ModelCheckpoint{'monitor': 'train_loss'}": state}},
               sys.argv[2])
else:
    meta = torch.load(sys.argv[2], weights_only=False)
    cb = next(iter(meta["callbacks"].values()))
    print(json.dumps({"global_step": meta["global_step"], "top_k": sorted(cb["best_k_models"])}))
"""


class TestTorchSaveFidelity:
    def _torch(self, *args: str) -> str:
        return subprocess.run([sys.executable, "-c", _TORCH_SAVE_AND_LOAD, *args], capture_output=True, text=True,
                              timeout=120, check=True).stdout

    def test_the_reader_walks_a_real_torch_save(self, tmp_path):
        """A meta.pt written by torch.save (tensors as persistent storages): whole, and its step and top-k read."""
        from supervisor.checkpoints import lightning, torchzip

        ckpt = tmp_path / "epoch=1-step=40.ckpt"
        ckpt.mkdir()
        self._torch("save", str(ckpt / "meta.pt"), str(tmp_path))
        assert torchzip.zip_problem(ckpt / "meta.pt") is None
        assert lightning.meta_step(ckpt) == 40
        assert lightning.held_by_lightning(tmp_path, ckpt) == ({"epoch=0-step=10.ckpt"}, None)

    def test_real_torch_loads_the_synthetic_meta_pt(self, tmp_path):
        """torch.load reads tests.jobs.dcp_files's meta.pt as the dict it stands for."""
        from tests.jobs.dcp_files import lightning_meta, write_torch_file

        path = write_torch_file(tmp_path / "meta.pt", lightning_meta(40, dirpath=tmp_path, top_k=["a.ckpt"]))
        assert json.loads(self._torch("load", str(path))) == {"global_step": 40, "top_k": [str(tmp_path / "a.ckpt")]}
