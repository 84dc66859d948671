"""Checksums written while the trainer library saves, and checked while it loads (trainer/checksums.py, reader.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402

from supervisor.checkpoints.integrity import covering  # noqa: E402
from supervisor.checkpoints.manifest import read_manifest  # noqa: E402
from supervisor.errors import CheckpointCorruptError  # noqa: E402
from trainer.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    # "big" is over trainer.checksums' _OVERLAP_BYTES: hashed on the hasher thread while it is written.
    return {"model": {"w": torch.randn(256, 64, generator=g), "b": torch.randn(7, dtype=torch.float64, generator=g),
                      "big": torch.randn(600, 1024, generator=g)},
            "train": {"step": 3, "note": "x"}}


def _blank() -> dict:
    return {"model": {"w": torch.zeros(256, 64), "b": torch.zeros(7, dtype=torch.float64), "big": torch.zeros(600, 1024)},
            "train": {"step": 0, "note": ""}}


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    return save_checkpoint(tmp_path / "root", 5, _state())


def test_manifest_records_ranges_that_tile_every_file(saved: Path) -> None:
    """Every byte of every DCP file and of `.metadata` is covered by a range hashed while it was written."""
    manifest = read_manifest(saved)
    assert manifest is not None and manifest.checksums is not None
    assert set(manifest.checksums) == set(manifest.files)  # the manifest covers every file it lists
    for name, size in manifest.files.items():
        covering(manifest.checksums, name, 0, size)  # raises unless the ranges tile [0, size)
    shard = next(n for n in manifest.files if n.endswith(".distcp"))
    assert len(manifest.checksums[shard]) >= 3  # one range per item, not one per file


def test_clean_load_round_trips(saved: Path) -> None:
    target = _blank()
    load_checkpoint(saved, target)
    assert all(torch.equal(target["model"][k], v) for k, v in _state()["model"].items())
    assert target["train"]["step"] == 3


def _ranges(saved: Path) -> list[tuple[str, int, int]]:
    manifest = read_manifest(saved)
    assert manifest is not None and manifest.checksums is not None
    return [(n, off, size) for n, segs in manifest.checksums.items() for off, size, _ in segs]


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_a_flipped_bit_anywhere_fails_the_load_naming_file_and_range(saved: Path, where: str) -> None:
    """One bit flipped in any item (record header, tensor data, zip directory) or in `.metadata`: the load raises
    CheckpointCorruptError naming the file and the item's byte range; size, mtime and ctime play no part."""
    for name, off, size in _ranges(saved):
        at = {"start": off, "middle": off + size // 2, "end": off + size - 1}[where]
        _flip(saved / name, at)
        with pytest.raises(CheckpointCorruptError) as err:
            load_checkpoint(saved, _blank())
        assert f"{saved}/{name} bytes {off}-{off + size} do not match" in str(err.value)
        _flip(saved / name, at)  # put it back: the next range starts from a clean checkpoint
    load_checkpoint(saved, _blank())


def test_dcp_path_verifies_too(saved: Path) -> None:
    """A destination of another dtype is read through DCP's path (as a resharded load is): checked as well."""
    name, off, size = min(_ranges(saved), key=lambda r: abs(r[2] - 256 * 64 * 4))  # "w"'s record
    target = _blank()
    target["model"]["w"] = torch.zeros(256, 64, dtype=torch.float64)
    load_checkpoint(saved, target)
    _flip(saved / name, off + size // 2)
    target["model"]["w"] = torch.zeros(256, 64, dtype=torch.float64)
    with pytest.raises(CheckpointCorruptError, match=f"{name} bytes {off}-{off + size}"):
        load_checkpoint(saved, target)


def test_a_range_with_no_checksum_is_corrupt(saved: Path) -> None:
    """Checksums edited out of the manifest for one file: its bytes are not trusted."""
    raw = json.loads((saved / "manifest.json").read_text())
    shard = next(n for n in raw["checksums"]["files"] if n.endswith(".distcp"))
    raw["checksums"]["files"][shard] = raw["checksums"]["files"][shard][:1]
    (saved / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointCorruptError, match="no checksum recorded"):
        load_checkpoint(saved, _blank())


def test_checkpoints_without_checksums_still_load(tmp_path: Path) -> None:
    """A plain DCP dir (no manifest) and an older manifest without checksums load as before."""
    dcp.save(_state(), checkpoint_id=os.fspath(tmp_path / "plain"))
    load_checkpoint(tmp_path / "plain", _blank())
    saved = save_checkpoint(tmp_path / "root", 5, _state())
    raw = json.loads((saved / "manifest.json").read_text())
    del raw["checksums"]
    (saved / "manifest.json").write_text(json.dumps(raw))
    _flip(saved / "__0_0.distcp", 5000)
    load_checkpoint(saved, _blank())  # nothing to check against: loads (the old behaviour)


def test_verify_deep_reads_the_ranges_too(saved: Path) -> None:
    """`checkpoints verify --deep` checks the checksums written at save (size and times cannot tell)."""
    from supervisor.checkpoints import verify

    name, off, size = max(_ranges(saved), key=lambda r: r[2])
    assert verify(saved, deep=True).complete
    _flip(saved / name, off + size // 2)
    assert verify(saved).complete  # structure only
    deep = verify(saved, deep=True)
    assert deep.state == "torn" and f"{saved / name} bytes {off}-{off + size} do not match" in (deep.reason or "")
