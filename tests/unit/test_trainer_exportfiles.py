"""Tests for trainer.exportfiles: what an export may replace or delete (only what it can prove it made)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from supervisor.errors import ExportConflictError, UsageError
from supervisor.host.atomic import temporaries
from trainer import exportfiles as files
from trainer.args import build_parser, validate

HUB = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json")


def fake_export(out: Path, names: tuple[str, ...]) -> None:
    """Files under `names` beside `out`, recorded as an export of ours wrote them."""
    for name in names:
        (out.parent / name).write_bytes(b"ours " + name.encode())
    files.write_record(out, [i for i in (files.identify(out.parent / n) for n in names) if i is not None], "0badf00d")


class TestRecord:
    def test_recorded_files_are_ours_until_replaced(self, tmp_path) -> None:
        """A recorded shard is ours while it keeps its identity; a file written over it is not."""
        out = tmp_path / "model.safetensors"
        fake_export(out, HUB)
        record = files.read_record(out)
        assert [p.name for p in record.present()] == sorted(HUB)
        files.refuse_foreign(record)
        (tmp_path / HUB[0]).unlink()
        (tmp_path / HUB[0]).write_bytes(b"downloaded later")
        assert [p.name for p in files.read_record(out).present()] == sorted(HUB[1:])
        with pytest.raises(ExportConflictError, match=HUB[0]):
            files.refuse_foreign(files.read_record(out))

    def test_unrecorded_derived_names_are_refused(self, tmp_path) -> None:
        """A hub model's shards and index (no record) make an export refuse, naming one; other files do not count."""
        out = tmp_path / "model.safetensors"
        (tmp_path / "config.json").write_text("{}")
        assert files.conflict(out) is None
        (tmp_path / HUB[2]).write_text("{}")
        problem = files.conflict(out)
        assert problem is not None and HUB[2] in problem and "not written by an export of ours" in problem
        assert files.conflict(tmp_path / "other.safetensors") is None  # another name's family is not in the way

    @pytest.mark.parametrize("edit", [
        lambda r: {**r, "files": [{**r["files"][0], "name": "config.json"}]},  # a name no export writes
        lambda r: {**r, "files": [{**r["files"][0], "name": "../model-00001-of-00002.safetensors"}]},
        lambda r: {**r, "output": "other.safetensors"},
        lambda r: {**r, "format": 2},
        lambda r: {**r, "files": [{**r["files"][0], "ino": "1"}]},
        lambda r: [],
    ])
    def test_a_record_not_ours_is_refused_and_kept(self, tmp_path, edit) -> None:
        """A file under the record's name that is not a record we write never makes anything ours, nor is replaced."""
        out = tmp_path / "model.safetensors"
        fake_export(out, HUB)
        path = files.record_name(out)
        path.write_text(json.dumps(edit(json.loads(path.read_text()))))
        before = path.read_bytes()
        with pytest.raises(ExportConflictError, match="not an export record of ours"):
            files.read_record(out)
        assert files.conflict(out) is not None and path.read_bytes() == before

    def test_a_symlinked_record_is_refused(self, tmp_path) -> None:
        """The record is never read through a symlink."""
        out = tmp_path / "model.safetensors"
        fake_export(out, HUB)
        real = tmp_path / "elsewhere.json"
        files.record_name(out).rename(real)
        files.record_name(out).symlink_to(real)
        with pytest.raises(ExportConflictError, match="symlink"):
            files.read_record(out)


class TestLeftovers:
    def stage(self, out: Path, pid: int, *names: str) -> Path:
        stage = out.with_name(f".{out.name}.export-{pid}-0badf00d.tmp")
        stage.mkdir()
        for name in names:
            (stage / name).write_bytes(b"x")
        return stage

    def test_only_our_patterns_go(self, tmp_path) -> None:
        """A dead writer's staging folder (our names inside) and `replacing`'s temporaries go; another program's
        `.tmpAb12Cd`, a `.model.safetensors.backup.tmp` and a live writer's staging folder stay."""
        out = tmp_path / "model.safetensors"
        dead = self.stage(out, os.getpid(), "model.safetensors", "model-00001-of-00002.safetensors", ".tmpXy12Zw")
        live = self.stage(out, os.getppid(), "model.safetensors")
        ours = tmp_path / ".model.safetensors.12345678.tmp"
        theirs = [tmp_path / n for n in (".tmpAb12Cd", ".model.safetensors.backup.tmp", "notes.txt")]
        for path in [ours, *theirs]:
            path.write_bytes(b"x")
        assert sorted(files.remove_leftovers(out)) == sorted([dead, ours])
        assert sorted(tmp_path.iterdir()) == sorted([live, *theirs])

    def test_a_staging_folder_holding_anything_else_is_kept(self, tmp_path) -> None:
        """A folder under our staging name with a file we never put there stays, with that file."""
        out = tmp_path / "model.safetensors"
        stage = self.stage(out, os.getpid(), "model.safetensors", "notes.txt")
        assert files.remove_leftovers(out) == []
        assert sorted(p.name for p in stage.iterdir()) == ["notes.txt"]

    def test_a_symlink_under_our_staging_name_is_not_followed(self, tmp_path) -> None:
        """A symlink named like a staging folder is never followed into."""
        out = tmp_path / "model.safetensors"
        target = tmp_path / "target"
        target.mkdir()
        (target / "model.safetensors").write_bytes(b"keep")
        (tmp_path / f".model.safetensors.export-{os.getpid()}-0badf00d.tmp").symlink_to(target)
        assert files.remove_leftovers(out) == [] and (target / "model.safetensors").read_bytes() == b"keep"

    def test_temporaries_match_only_the_token_pattern(self, tmp_path) -> None:
        """`replacing`'s temporaries are `.<name>.<8 hex>.tmp`; nothing looser is taken for one."""
        for name in (".state.json.0badf00d.tmp", ".state.json.backup.tmp", ".state.json.0BADF00D.tmp", ".state.json..tmp"):
            (tmp_path / name).write_bytes(b"x")
        assert [p.name for p in temporaries(tmp_path / "state.json")] == [".state.json.0badf00d.tmp"]


def test_export_best_refuses_a_folder_holding_another_models_shards(tmp_path) -> None:
    """`--export-best DIR` where DIR holds a hub model's index: exit 2 at start-up, naming the file."""
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / HUB[2]).write_text("{}")
    args = build_parser().parse_args(["--checkpoint-dir", str(tmp_path / "c"), "--eval-every", "5",
                                      "--export-best", str(tmp_path / "best")])
    with pytest.raises(UsageError, match=f"--export-best .*{HUB[2]}"):
        validate(args)
