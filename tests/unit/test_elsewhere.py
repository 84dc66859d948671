"""daemon/elsewhere.py: complete checkpoints outside the root, found bounded; the idle root's one warning (issue 35
item 1)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from supervisor.contract import Beat, Phase
from supervisor.daemon import elsewhere
from supervisor.daemon.elsewhere import Elsewhere, find_checkpoints, named_dirs
from tests.jobs.dcp_files import write_checkpoint


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def error(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))


class TestFind:
    def test_complete_ones_outside_the_roots_since_the_start(self, tmp_path: Path) -> None:
        """Complete DCP dirs anywhere below (not in the roots, the trash next to them, nor older than the run)."""
        mine = write_checkpoint(tmp_path / "ckpts" / "run1", 4, name="epoch_4")
        write_checkpoint(tmp_path / "checkpoints", 2)  # the root itself
        write_checkpoint(tmp_path / ".checkpoints.fsdp-trash", 1)  # retention's parked deletions
        old = write_checkpoint(tmp_path / "old", 1)
        os.utime(old / ".metadata", (1000, 1000))
        torn = write_checkpoint(tmp_path / "torn", 3)
        next(p for p in torn.iterdir() if p.name.endswith(".distcp")).unlink()
        found = find_checkpoints([tmp_path], exclude=[tmp_path / "checkpoints"], since=2000)
        assert found == [mine]

    def test_bounded_by_depth_and_entries(self, tmp_path: Path, monkeypatch: Any) -> None:
        """Deeper than MAX_DEPTH, or past MAX_ENTRIES entries, is not looked at."""
        deep = write_checkpoint(tmp_path / "a" / "b" / "c" / "d" / "e", 1)
        assert find_checkpoints([tmp_path], exclude=[], since=0) == []
        monkeypatch.setattr(elsewhere, "MAX_DEPTH", 6)
        assert find_checkpoints([tmp_path], exclude=[], since=0) == [deep]
        monkeypatch.setattr(elsewhere, "MAX_ENTRIES", 3)
        assert find_checkpoints([tmp_path], exclude=[], since=0) == []

    def test_the_directories_argv_names(self, tmp_path: Path) -> None:
        (tmp_path / "ckpts").mkdir()
        (tmp_path / "out").mkdir()
        argv = ["torchrun", "train.py", "--ckpt-dir", "ckpts", "--out=out", "--lr", "0.1", "missing"]
        assert named_dirs(tmp_path, argv) == [tmp_path / "ckpts", tmp_path / "out", tmp_path]

    @pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
    def test_another_users_checkpoints_and_symlinks_are_not_ours(self, tmp_path: Path) -> None:
        """A dir argv names may be shared (`--tmp /tmp`): a complete checkpoint another user planted there made the
        job's relaunch exit 3 (a denial of service); their symlink is not followed either."""
        planted = write_checkpoint(tmp_path / "shared" / "fake", 1)
        os.chown(planted / ".metadata", 65534, 65534)
        (tmp_path / "mine").mkdir()
        write_checkpoint(tmp_path / "private", 2)
        (tmp_path / "shared" / "link").symlink_to(tmp_path / "private")
        os.chown(tmp_path / "shared" / "link", 65534, 65534, follow_symlinks=False)
        assert find_checkpoints([tmp_path / "shared"], exclude=[], since=0) == []
        os.chown(planted / ".metadata", os.geteuid(), os.getegid())
        assert find_checkpoints([tmp_path / "shared"], exclude=[], since=0) == [planted]

    def test_files_beside_cost_no_budget(self, tmp_path: Path) -> None:
        """More files in the working directory than the budget (a data dir, logs) neither hide `ckpts/` below it nor
        the dir argv names (the bound is on directories looked into: it spent 20,000 entries on files and stopped)."""
        for i in range(elsewhere.MAX_ENTRIES + 5_000):
            (tmp_path / f"sample-{i:05d}.txt").touch()
        mine = write_checkpoint(tmp_path / "ckpts", 2, name="epoch_2")
        assert find_checkpoints(named_dirs(tmp_path, ["torchrun", "train.py"]), exclude=[], since=0) == [mine]
        argv = ["torchrun", "train.py", "--ckpt-dir=ckpts"]
        assert find_checkpoints(named_dirs(tmp_path, argv), exclude=[], since=0) == [mine]

    def test_a_symlinked_dir_is_followed_the_root_through_one_is_not_elsewhere(self, tmp_path: Path) -> None:
        """`./ckpts -> /scratch/ckpts` (the script hard-codes ./ckpts): found, by its target; a root reached
        through a symlink stays excluded, and a symlink loop ends."""
        (tmp_path / "cwd").mkdir()
        mine = write_checkpoint(tmp_path / "scratch" / "ckpts", 2, name="epoch_2")
        write_checkpoint(tmp_path / "data" / "root", 1)
        (tmp_path / "cwd" / "ckpts").symlink_to(tmp_path / "scratch" / "ckpts")
        (tmp_path / "cwd" / "root").symlink_to(tmp_path / "data" / "root")
        (tmp_path / "cwd" / "loop").symlink_to(tmp_path / "cwd")
        found = find_checkpoints([tmp_path / "cwd"], exclude=[tmp_path / "data" / "root"], since=0)
        assert found == [mine]


class TestRefusal:
    def test_names_the_directory_and_the_key(self, tmp_path: Path) -> None:
        a = write_checkpoint(tmp_path / "ckpts", 2, name="epoch_2")
        b = write_checkpoint(tmp_path / "ckpts", 4, name="epoch_4")
        log, e = Log(), Elsewhere(tmp_path, ["x"], [tmp_path / "checkpoints"], since=0)
        reason = e.refusal([a, b], log)
        assert reason is not None and reason.startswith(f"checkpoints_elsewhere: {tmp_path / 'ckpts'} holds 2 complete")
        assert f'set [checkpoints] dir = "{tmp_path / "ckpts"}"' in reason
        assert log.events[0][0] == "checkpoints_elsewhere" and log.events[0][1]["dir"] == str(tmp_path / "ckpts")
        assert e.refusal([], log) is None

    def test_looks_once_per_relaunch_never_before_the_first(self, tmp_path: Path) -> None:
        e = Elsewhere(tmp_path, ["x"], [tmp_path], since=0)
        assert [e.must_look(0), e.must_look(1), e.must_look(1), e.must_look(2)] == [False, True, False, True]


class TestIdleRoot:
    def test_three_saves_without_a_commit_warn_once(self, tmp_path: Path) -> None:
        e = Elsewhere(tmp_path, ["x"], [tmp_path / "checkpoints"], since=0)
        e.started(0)
        prev = None
        warnings = []
        for step in (5, 10, 15, 20):
            for phase in (Phase.TRAIN, Phase.SAVE):
                beat = Beat(step=step, phase=phase)
                e.beat(prev, beat)
                prev = beat
                warnings.append(e.idle(1.0, beats=True))
        shown = [w for w in warnings if w]
        assert len(shown) == 1 and "said `save` 3 times" in shown[0] and str(tmp_path / "checkpoints") in shown[0]

    def test_a_commit_resets_the_count(self, tmp_path: Path) -> None:
        e = Elsewhere(tmp_path, ["x"], [tmp_path], since=0)
        e.started(0)
        for step in (5, 10):
            e.beat(Beat(step=step - 1, phase=Phase.TRAIN), Beat(step=step, phase=Phase.SAVE))
        e.committed(5)
        e.beat(Beat(step=14, phase=Phase.TRAIN), Beat(step=15, phase=Phase.SAVE))
        assert e.idle(6, beats=True) is None

    def test_without_beats_thirty_minutes(self, tmp_path: Path) -> None:
        e = Elsewhere(tmp_path, ["x"], [tmp_path], since=0)
        e.started(100)
        assert e.idle(100 + 1799, beats=False) is None and e.idle(100 + 1800, beats=True) is None
        assert "no heartbeat) ran 30 minutes" in (e.idle(100 + 1800, beats=False) or "")
