"""Tests for supervisor.cli.checkpoints: the `checkpoints` commands, run as a real subprocess."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from supervisor.cli import app as top_cli
from supervisor.layout import tmp_dir_name
from tests.jobs.dcp_files import lightning_meta, write_checkpoint, write_lightning_checkpoint


@pytest.fixture
def root(tmp_path) -> Path:
    """A root with complete steps 10 and 20 (loss metrics), a torn step 30 and an in-flight temp dir."""
    r = tmp_path / "ckpts"
    write_checkpoint(r, 10, metrics={"loss": 2.0})
    write_checkpoint(r, 20, metrics={"loss": 1.0})
    (write_checkpoint(r, 30) / "__1_0.distcp").unlink()
    write_checkpoint(r, 40, name=tmp_dir_name(40, "abc"))
    return r


def test_checkpoints_module_is_registered():
    """supervisor.cli.app dispatches to this module (otherwise `fsdp-supervisor checkpoints` does not exist)."""
    assert "supervisor.cli.checkpoints" in top_cli.COMMAND_MODULES


class TestVerify:
    def test_symlink_into_a_folder_we_may_not_search_is_invalid(self, root, monkeypatch, capsys):
        """verify of a symlink whose target cannot be stat()ed (another user's folder): invalid, exit 1."""
        link = root.parent / "link"
        link.symlink_to(root / "step_00000020")
        real_stat = os.stat

        def stat(path, *args, **kwargs):
            if os.fspath(path) == str(link) and kwargs.get("follow_symlinks", True):
                raise PermissionError(13, "Permission denied", str(path))
            return real_stat(path, *args, **kwargs)

        monkeypatch.setattr(os, "stat", stat)
        assert top_cli.main(["checkpoints", "verify", str(link)]) == 1
        assert "invalid: the checkpoint dir is a symlink" in capsys.readouterr().out

    def test_no_cache_bypasses_a_remembered_verdict_and_refreshes_it(self, tmp_path, monkeypatch, capsys):
        """A cached "unknown class" verdict (an older reader's, or a poisoned entry): `verify` repeats it, `verify
        --no-cache` parses again and says complete, and from then on the cache says so too."""
        from supervisor.checkpoints.metadata import cache as metadata_cache
        from supervisor.checkpoints.metadata import reader as md

        monkeypatch.setenv(metadata_cache.CACHE_ENV, str(tmp_path / "cache"))
        monkeypatch.setattr(md, "RACY_NS", 0)  # its ctime is seconds old, and cannot be set back
        md._cache.clear()
        d = write_checkpoint(tmp_path / "ckpts", 10, manifest=False)
        meta = d / ".metadata"
        unknown = {"kind": "unknown_class", "message": "unknown class torch.NewThing", "global": "torch.NewThing"}
        metadata_cache.store(meta, meta.stat(), {"error": unknown})
        assert top_cli.main(["checkpoints", "verify", str(d)]) == 1
        assert top_cli.main(["checkpoints", "verify", "--no-cache", str(d)]) == 0
        md._cache.clear()
        assert top_cli.main(["checkpoints", "verify", str(d)]) == 0
        out = capsys.readouterr().out.splitlines()
        assert "unknown class torch.NewThing" in out[0] and out[1:] == [f"{d}: complete"] * 2

    def test_json_step_is_the_one_list_shows(self, tmp_path, capsys):
        """Without the reference trainer's manifest, verify --json said step null where list said 10 and 7."""
        r = tmp_path / "ckpts"
        write_checkpoint(r, 10, name="step-10", manifest=False)
        write_checkpoint(r / "checkpoint_3", 0, name="pytorch_model_fsdp_0", manifest=False)
        (r / "checkpoint_3" / "trainer_state.json").write_text('{"global_step": 7}')
        for name, step in (("step-10", 10), ("checkpoint_3", 7)):
            assert top_cli.main(["checkpoints", "verify", str(r / name), "--json"]) == 0
            assert json.loads(capsys.readouterr().out)["step"] == step


class TestOneLinePerFact:
    """The CLI prints what it did; the store's own events are not echoed next to it (issue 13 class 10)."""

    def test_prune_that_cannot_set_up_its_trash_is_one_line(self, root, monkeypatch, capsys):
        """Any OSError from the store's delete path (here: no permission for the trash) is exit 2, one line."""
        from supervisor.cli import checkpoints as checkpoint_commands

        def denied(root_dir, plan, **_kw):
            raise PermissionError(13, "Permission denied", str(root_dir.parent / f".{root_dir.name}.fsdp-trash"))

        monkeypatch.setattr(checkpoint_commands, "execute_retention", denied)
        rc = top_cli.main(["checkpoints", "prune", "--dir", str(root), "--keep-last", "1"])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and "cannot prune: Permission denied" in err[0], err
        assert (root / "step_00000010").exists()


class TestClientsInTheListing:
    def test_lightning_last_ckpt_shows_as_an_alias_kept_by_lightning(self, tmp_path, capsys):
        """`list --json`: last.ckpt has the step it holds, `alias_of` its named save and a `kept_by`; the table
        says `alias of ...` with the K flag."""
        root = tmp_path / "ckpts"
        write_lightning_checkpoint(root, 10)
        write_lightning_checkpoint(root, 10, name="last.ckpt", meta=lightning_meta(10))
        assert top_cli.main(["checkpoints", "list", "--dir", str(root), "--json"]) == 0
        rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
        last = rows["last.ckpt"]
        assert (last["step"], last["alias_of"], last["kept_by"] is not None) == (10, "epoch=0-step=10.ckpt", True)
        assert rows["epoch=0-step=10.ckpt"]["alias_of"] is None
        assert top_cli.main(["checkpoints", "list", "--dir", str(root)]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("last.ckpt"))
        assert " K " in line and line.endswith("alias of epoch=0-step=10.ckpt")
