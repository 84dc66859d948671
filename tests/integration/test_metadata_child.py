"""The daemon's child-process `.metadata` parse: same verdicts as in-process, isolated, never left behind."""
from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.checkpoints.metadata import reader as md
from tests.helpers import REPO
from tests.jobs.dcp_files import dcp_metadata_bytes
from tests.unit.test_checkpoints_metadata import global_pickle, summary


class TestIsolatedParse:
    @pytest.fixture
    def isolated(self):  # type: ignore[no-untyped-def]
        from supervisor.checkpoints.metadata import child as metadata_child
        metadata_child.isolate(0)
        try:
            yield metadata_child
        finally:
            metadata_child.isolate(None)

    def test_a_child_gives_the_same_verdicts(self, isolated, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
        """The daemon's child parse answers exactly what an in-process parse does: a summary, or the refusal."""
        good = tmp_path / "good.metadata"
        good.write_bytes(dcp_metadata_bytes({"a": 10, "b": 6}, shards=2)[0])
        bad = tmp_path / "bad.metadata"
        bad.write_bytes(global_pickle("os", "system"))
        with open(good, "rb") as f:
            answer = isolated.parse_in_child(f, good.stat().st_size)
        assert answer is not None and "summary" in answer  # it really ran in a child
        isolated.isolate(None)
        here = [summary(md.read_metadata(good, cached=False))]
        with pytest.raises(md.MetadataError) as in_process:
            md.read_metadata(bad, cached=False)
        isolated.isolate(0)
        md._cache.clear()
        assert [summary(md.read_metadata(good, root=tmp_path.parent))] == here
        with pytest.raises(md.MetadataError) as in_child:
            md.read_metadata(bad, root=tmp_path.parent)
        assert (type(in_child.value), str(in_child.value)) == (type(in_process.value), str(in_process.value))

    def test_a_child_that_gives_no_answer_means_a_parse_here(self, isolated, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
        """Killed, crashed or garbage: the verdict comes from an in-process parse, never from the failure."""
        good = tmp_path / "good.metadata"
        good.write_bytes(dcp_metadata_bytes()[0])
        monkeypatch.setattr(isolated.sys, "executable", "/bin/false")
        with open(good, "rb") as f:
            assert isolated.parse_in_child(f, good.stat().st_size) is None
        md._cache.clear()
        assert md.read_metadata(good, root=tmp_path.parent).entries > 0

    def test_a_supervisor_package_in_the_cwd_or_pythonpath_cannot_answer(  # type: ignore[no-untyped-def]
            self, isolated, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """The child runs our own module, whatever the daemon's cwd, PYTHONPATH or PYTHON* settings are."""
        good = tmp_path / "good.metadata"
        good.write_bytes(dcp_metadata_bytes({"a": 10}, shards=1)[0])
        shadow = tmp_path / "shadow" / "supervisor" / "checkpoints"
        shadow.mkdir(parents=True)
        for init in (shadow.parent / "__init__.py", shadow / "__init__.py"):
            init.write_text("")
        (shadow / "metadata_child.py").write_text(
            "print('{\"error\": {\"kind\": \"unsafe\", \"message\": \"forged\", \"global\": \"x.y\"}}')\n")
        monkeypatch.chdir(shadow.parent.parent)
        with open(good, "rb") as f:
            assert isolated.parse_in_child(f, good.stat().st_size) == {"summary": md._summary_json(
                md.read_metadata(good, cached=False))}
        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("PYTHONPATH", str(shadow.parent.parent))
        monkeypatch.setenv("PYTHONINSPECT", "1")
        with open(good, "rb") as f:
            answer = isolated.parse_in_child(f, good.stat().st_size)
        assert answer is not None and "summary" in answer

    def test_a_child_that_dies_mid_read_leaves_the_file_at_its_start(  # type: ignore[no-untyped-def]
            self, isolated, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """The child shares the file's offset: the parse here after a child that read part of it starts at 0."""
        good = tmp_path / "good.metadata"
        good.write_bytes(dcp_metadata_bytes({f"w{i}": 64 for i in range(400)}, shards=4)[0])
        assert good.stat().st_size > 8192
        here = summary(md.read_metadata(good, cached=False))
        partial = tmp_path / "partial-python"
        partial.write_text("#!/bin/sh\ndd bs=4096 count=1 of=/dev/null 2>/dev/null\n")
        partial.chmod(0o755)
        monkeypatch.setattr(isolated.sys, "executable", str(partial))
        md._cache.clear()
        assert summary(md.read_metadata(good, root=tmp_path.parent)) == here

    def test_a_wrapper_for_python_that_forks_still_answers(  # type: ignore[no-untyped-def]
            self, isolated, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """sys.executable may be a script that runs python as its own child: the child is then no orphan."""
        good = tmp_path / "good.metadata"
        good.write_bytes(dcp_metadata_bytes({"a": 10}, shards=1)[0])
        wrapper = tmp_path / "python-wrapper"
        wrapper.write_text(f'#!/bin/sh\n"{sys.executable}" "$@"\n')
        wrapper.chmod(0o755)
        monkeypatch.setattr(isolated.sys, "executable", str(wrapper))
        with open(good, "rb") as f:
            answer = isolated.parse_in_child(f, good.stat().st_size)
        assert answer == {"summary": md._summary_json(md.read_metadata(good, cached=False))}

    def test_the_child_parses_the_size_that_was_stated(self, isolated, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
        """A file that grows after its stat: the child parses the same first `size` bytes as a parse here."""
        data = dcp_metadata_bytes({"a": 10}, shards=1)[0]
        growing = tmp_path / "growing.metadata"
        growing.write_bytes(data[:len(data) // 2])
        size = growing.stat().st_size
        with open(growing, "rb") as f:
            with open(growing, "ab") as grow:
                grow.write(data[len(data) // 2:])
            in_child = isolated.parse_in_child(f, size)
            f.seek(0)
            with pytest.raises(md.MetadataError) as here:
                md._parse(f, size)
        assert in_child == {"error": md._error_json(here.value)}

    def test_a_child_dies_with_the_supervisor(self, tmp_path: Path) -> None:
        """A supervisor that exits mid-parse leaves no child behind to finish a parse nobody waits for."""

        import psutil

        from tests.unit import test_metadata_bombs

        slow = tmp_path / "slow.metadata"
        slow.write_bytes(test_metadata_bombs.BOMBS["dict grown by SETITEMS"]())
        parent = subprocess.Popen([sys.executable, "-c", f"""
import os, sys, threading, time
from supervisor.checkpoints.metadata import child as mc
mc.isolate(0)
f = open({str(slow)!r}, "rb")
threading.Thread(target=mc.parse_in_child, args=(f, os.fstat(f.fileno()).st_size), daemon=True).start()
while not mc.running_pids():
    time.sleep(0.01)
print(*mc.running_pids(), flush=True)
os._exit(0)
"""], stdout=subprocess.PIPE, text=True, cwd=REPO)
        out, _ = parent.communicate(timeout=60)
        try:
            child = psutil.Process(int(out))
        except psutil.NoSuchProcess:
            return  # already gone and reaped: what the test wants
        try:
            gone, alive = psutil.wait_procs([child], timeout=0.5)
            assert not alive or child.status() == psutil.STATUS_ZOMBIE
        finally:
            with contextlib.suppress(psutil.Error):
                child.kill()

    def test_a_hung_child_is_killed_after_a_time_sized_to_the_file(  # type: ignore[no-untyped-def]
            self, isolated, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """A launch waits for the pass: a hung child is given up on (and killed) long before 15 minutes."""
        import psutil

        assert isolated.timeout_s(1 << 20) <= 60 and isolated.timeout_s(100 << 20) <= 180
        assert isolated.timeout_s(1 << 30) >= 600  # the cap, 1 GiB, still has a 20x margin over ~40 MB/s
        good = tmp_path / "good.metadata"
        good.write_bytes(dcp_metadata_bytes({"a": 10}, shards=1)[0])
        hung = tmp_path / "hung-python"
        hung.write_text("#!/bin/sh\nexec sleep 60\n")
        hung.chmod(0o755)
        monkeypatch.setattr(isolated.sys, "executable", str(hung))
        monkeypatch.setattr(isolated, "_TIMEOUT_FLOOR_S", 0.3)
        md._cache.clear()
        assert md.read_metadata(good, root=tmp_path.parent).entries > 0
        assert not isolated.running_pids()
        assert not [p for p in psutil.Process().children() if p.status() != psutil.STATUS_ZOMBIE]
