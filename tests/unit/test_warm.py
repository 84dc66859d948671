"""A warm process knows what it runs from disk, and notices when that changed before it becomes a job."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.warm import _script_moved, first_change, loaded_files, shadowed


def _module(tmp_path: Path) -> Path:
    path = tmp_path / "prewarmed.py"
    path.write_text("VERSION = 1\n")
    return path


def _edit(path: Path) -> None:
    path.write_text("VERSION = 2\n")  # the same size, the same inode: only mtime_ns says it
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a coarse clock may not have ticked


def _replace(path: Path) -> None:  # what pip does: a new file under the old name
    tmp = path.with_name("new.py")
    tmp.write_text(path.read_text())
    os.replace(tmp, path)


def _grow(path: Path) -> None:
    with open(path, "a") as f:
        f.write("# more\n")


class TestFirstChange:
    def test_nothing_changed(self, tmp_path: Path) -> None:
        """What was loaded is what is on disk: None."""
        path = _module(tmp_path)
        assert first_change([(str(path), *_stat(path))]) is None

    @pytest.mark.parametrize("change", [_edit, _replace, _grow, Path.unlink])
    def test_an_edit_a_replacement_or_a_removal_is_named(self, tmp_path: Path, change: object) -> None:
        """Edited in place (mtime), replaced (inode), grown (size) or gone: the file is named."""
        path = _module(tmp_path)
        other = tmp_path / "other.py"
        other.write_text("x = 1\n")
        files = [(str(other), *_stat(other)), (str(path), *_stat(path))]
        change(path)  # type: ignore[operator]
        assert first_change(files) == str(path)


def _stat(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino


class TestLoadedFiles:
    def test_the_interpreter_modules_and_mapped_libraries(self, tmp_path: Path) -> None:
        """A fresh interpreter that imported a module records itself, that module's file and libraries it maps, not
        its own __main__; and an edit of that module is then its first change."""
        path = _module(tmp_path)
        code = ("import json, sys, prewarmed, _json\nfrom trainer.warm import loaded_files\n"
                "print(json.dumps(loaded_files()))")
        out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONPATH": str(tmp_path)}).stdout
        files = [tuple(f) for f in json.loads(out)]
        paths = [f[0] for f in files]
        assert paths[0] == sys.executable and str(path) in paths
        assert any(p.endswith(".so") or ".so." in p for p in paths)  # _json's extension, libc: /proc/self/maps
        assert all(os.path.isabs(p) for p in paths) and len(set(paths)) == len(paths)
        _edit(path)
        assert first_change(files) == str(path)  # type: ignore[arg-type]

    def test_this_process(self) -> None:
        """Everything loaded here is recorded once and unchanged."""
        files = loaded_files()
        assert first_change(files) is None and len({f[0] for f in files}) == len(files) > 100


class TestShadowed:
    def test_a_module_added_ahead_on_sys_path_is_named(self, tmp_path: Path) -> None:
        """`tinypkg.py` added next to the script (sys.path[0]) after a warm worker imported tinypkg from further down
        the path: a cold start would import the new file, so it is named; before that, and here, nothing is."""
        first, later = tmp_path / "first", tmp_path / "later"
        for d in (first, later):
            d.mkdir()
        (later / "tinypkg.py").write_text("VERSION = 1\n")
        code = ("import sys, tinypkg\nfrom trainer.warm import shadowed\nprint(shadowed())\n"
                "open(sys.argv[1], 'w').write('VERSION = 2')\nprint(shadowed())")
        out = subprocess.run([sys.executable, "-c", code, str(first / "tinypkg.py")], capture_output=True, text=True,
                             check=True, env={**os.environ, "PYTHONPATH": f"{first}:{later}"}).stdout.split()
        assert out == ["None", str(first / "tinypkg.py")]
        assert shadowed() is None


class TestScriptMoved:
    def test_a_repointed_symlink_moves_sys_path_0(self, tmp_path: Path) -> None:
        """`ln -sfn versions/v2/train.py train.py`: a cold rank's sys.path[0] is v2 now, the worker's v1."""
        for v in ("v1", "v2"):
            (tmp_path / "versions" / v).mkdir(parents=True)
            (tmp_path / "versions" / v / "train.py").write_text("")
        link = tmp_path / "train.py"
        link.symlink_to("versions/v1/train.py")
        path0 = str(tmp_path / "versions" / "v1")
        assert _script_moved(["-u", str(link), "--x"], path0) is None
        link.unlink()
        link.symlink_to("versions/v2/train.py")
        assert _script_moved(["-u", str(link), "--x"], path0) == str(link)

    def test_a_module_entry_is_left_to_the_agent(self, tmp_path: Path) -> None:
        """For -m the directory is sys.path[0], and the agent hands over only in the workers' own directory."""
        assert _script_moved(["-u", "-m", "trainer"], "/elsewhere") is None
