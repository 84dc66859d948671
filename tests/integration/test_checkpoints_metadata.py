"""Tests for supervisor.checkpoints.metadata.reader: the allowlisting, torch-free, bounded-cost DCP metadata reader."""
from __future__ import annotations

import json
import os
import pickle
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoints_dcp_writer import run_writer

import supervisor.checkpoints
from supervisor.checkpoints.metadata import reader as md
from tests.jobs.dcp_files import write_checkpoint
from tests.unit.test_checkpoints_metadata import (
    EXPECTED,
    FIXTURES,
    _Evil,
    global_pickle,
    metadata_dir,
    summary,
)


@pytest.fixture(scope="module")
def torch_written(tmp_path_factory) -> dict:
    """Checkpoints written by the installed torch: dcp.save, async_save, FSDP2 and FSDP1 (2 ranks)."""
    out = tmp_path_factory.mktemp("torch-written")
    single = run_writer("single", out / "single")
    fsdp = run_writer("fsdp", out / "fsdp")
    return {
        "dirs": [Path(d) for d in single["dirs"] + fsdp["dirs"]],
        "globals": {tuple(g) for g in single["globals"] + fsdp["globals"]},
        "dtypes": set(single["dtypes"]),
    }


class TestTorchFree:
    def test_importing_every_store_module_does_not_import_torch(self):
        """Importing each module of supervisor.checkpoints in a fresh interpreter leaves torch unimported."""
        names = [m.name for m in pkgutil.iter_modules(supervisor.checkpoints.__path__, "supervisor.checkpoints.")]
        code = f"import importlib, sys\nfor n in {names!r}: importlib.import_module(n)\nprint('torch' in sys.modules)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
        assert len(names) >= 6
        assert out.stdout.strip() == "False"


class TestAllowlistAgainstInstalledTorch:
    def test_recorded_globals_are_all_allowed(self, torch_written):
        """Every global the real unpickler resolves in torch-written metadata is on the allowlist."""
        missing = torch_written["globals"] - set(md.ALLOWED_GLOBALS)
        assert not missing, f"torch pickles globals the store refuses: {sorted(missing)}"

    def test_recording_saw_the_dcp_classes(self, torch_written):
        """The recording is real: it saw DCP's Metadata and the filesystem _StorageInfo."""
        assert ("torch.distributed.checkpoint.metadata", "Metadata") in torch_written["globals"]
        assert ("torch.distributed.checkpoint.filesystem", "_StorageInfo") in torch_written["globals"]

    def test_every_installed_dtype_is_allowed(self, torch_written):
        """Every dtype of the installed torch can appear in metadata, so each must be allowlisted."""
        assert torch_written["dtypes"] and torch_written["dtypes"] <= md.DTYPE_NAMES

    def test_torch_written_metadata_parses_with_its_shards(self, torch_written):
        """Each torch-written .metadata parses and references shard files that exist with enough bytes."""
        assert len(torch_written["dirs"]) == 4
        for d in torch_written["dirs"]:
            meta = md.read_metadata(d / ".metadata")
            assert meta.entries > 0 and meta.storage
            for ref in meta.storage:
                assert (d / ref.relative_path).stat().st_size >= ref.min_size > 0

    def test_torch_written_checkpoints_verify_complete(self, torch_written):
        """verify() calls every torch-written checkpoint (single, async, FSDP2, FSDP1 epoch_N) complete."""
        verdicts = {d.name: supervisor.checkpoints.verify(d) for d in torch_written["dirs"]}
        assert {n: v.state for n, v in verdicts.items()} == {
            "step_00000010": "complete", "step_00000020": "complete", "step_00000003": "complete", "epoch_2": "complete",
        }


class TestVerdictKinds:
    def _dir(self, tmp_path: Path, data: bytes) -> Path:
        return metadata_dir(tmp_path, data)

    def test_list_shows_both_reasons(self, tmp_path):
        """`checkpoints list` prints the unsafe and the unknown-class reasons differently."""
        from tests.supervise import cli

        self._dir(tmp_path / "a", pickle.dumps(_Evil(os.system, "true")))
        d = write_checkpoint(tmp_path / "a", 7, shards=1)
        (d / ".metadata").write_bytes(global_pickle("torch", "NewThing"))
        r = cli("checkpoints", "list", "--dir", str(tmp_path / "a"), "--json")
        reasons = {c["name"]: c["reason"] for c in json.loads(r.stdout)}
        assert reasons["step_00000005"] == "unsafe .metadata: refuses posix.system (could run code)"
        assert reasons["step_00000007"].startswith("unknown class torch.NewThing in .metadata")


class TestHostileBytes:
    @pytest.mark.parametrize("protocol", [2, 3, 5])
    def test_other_protocols_parse(self, tmp_path, protocol):
        """Real torch metadata re-pickled at protocol 2 (BINPUT, text GLOBAL), 3 and 5 gives the same summary."""
        name = "py3.11.2-torch2.13.0-fsdp2.metadata"
        out = tmp_path / "again"
        subprocess.run([sys.executable, str(FIXTURES / "generate.py"), "reprotocol", str(FIXTURES / name),
                        str(protocol), str(out)], check=True, timeout=60)
        data = out.read_bytes()
        assert data[:2] == bytes([0x80, protocol])
        assert (b"ctorch\nSize\n" in data) == (protocol < 4)
        assert summary(md.parse_metadata(data)) == EXPECTED[name]


class TestSyntheticGenerator:
    def test_tiny_model_on_4_ranks_matches_torchs_own_load(self, tmp_path):
        """bench.synthetic writes a DCP dir whose storage refs (by our reader) equal torch's pickle.load of it."""
        from tests.helpers import REPO

        out = tmp_path / "ckpt"
        script = ("import json, sys; from pathlib import Path; from bench.synthetic import write_checkpoint; "
                  f"sys.path.insert(0, {str(FIXTURES)!r}); import generate; "
                  "info = write_checkpoint(Path(sys.argv[1]), 'tiny', 4); "
                  "print(json.dumps({'info': info, 'torch': generate.expected(Path(sys.argv[1]) / '.metadata')}))")
        run = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, timeout=180,
                             cwd=REPO, check=True)
        both = json.loads(run.stdout)
        meta = md.read_metadata(out / ".metadata")
        assert summary(meta) == both["torch"]
        assert both["info"]["ranks"] == 4 and both["info"]["entries"] == meta.entries and len(meta.storage) == 4
        assert supervisor.checkpoints.verify(out).state == "complete"  # sparse shards of exactly the claimed sizes
        assert sorted(p.name for p in out.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
