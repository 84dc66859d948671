"""Security review, one test per finding: no shell, file modes, loopback metrics, secrets, deletions stay in the root.

Real supervisors here run the torch-free fake job (tests/jobs/fakejob.py) or a bare `python -c`, so the whole
module takes seconds. Decisions recorded in docs/reliability.md: argv secrets are masked in logs but kept in
the owner-only state.json (it identifies an orphaned job); nothing the supervisor or its job creates is
world-writable, whatever umask it inherited.
"""
from __future__ import annotations

import ast
import hashlib
import os
import stat
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.checkpoints import DiskUsage, RetentionRules, clear_trash, execute_retention, plan_retention, scan
from supervisor.errors import CheckpointError, ConfigError
from supervisor.observe.metrics import is_loopback, parse_listen
from supervisor.observe.redact import MASK, redact_argv
from tests.helpers import REPO
from tests.jobs.dcp_files import write_checkpoint

PACKAGES = [REPO / "supervisor", REPO / "trainer"]


# ---- no shell ---------------------------------------------------------------------------------------------------
_SHELL_CALLS = {("os", "system"), ("os", "popen"), ("subprocess", "getoutput"), ("subprocess", "getstatusoutput"),
                ("pty", "spawn"), ("asyncio", "create_subprocess_shell")}


def _findings(path: Path) -> list[str]:
    """Shell use and code-from-strings in one source file, as `file:line: what`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = (f.value.id, f.attr) if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
        if name in _SHELL_CALLS or (name and name[0] == "os" and name[1].startswith(("spawn", "exec"))):
            found.append(f"{path.name}:{node.lineno}: {name[0]}.{name[1]}")
        if isinstance(f, ast.Name) and f.id in ("eval", "exec"):
            found.append(f"{path.name}:{node.lineno}: {f.id}()")
        for kw in node.keywords:
            if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                found.append(f"{path.name}:{node.lineno}: shell=")
        if name in (("pickle", "load"), ("pickle", "loads"), ("marshal", "loads")) and "supervisor" in path.parts:
            found.append(f"{path.name}:{node.lineno}: {name[0]}.{name[1]} (unrestricted unpickling)")
    return found


# The one exec(): a warm worker (trainer/warm.py) runs the job's own script file, compiled from that file in the
# job's interpreter after the hand-off, as `python script.py` would; never a string, never in the supervisor. The one
# os.exec*: a warm process whose loaded files changed on disk becomes the cold command (an argv list, no shell).
_ALLOWED = {("warm.py", "exec()"), ("warm.py", "os.execvpe")}


class TestNoShell:
    def test_packages_never_use_a_shell_or_run_strings_as_code(self) -> None:
        """No shell=, os.system/popen/exec*/spawn*, getoutput, eval/exec or plain unpickling in the packages."""
        files = [p for pkg in PACKAGES for p in pkg.rglob("*.py")]
        assert len(files) > 20
        found = [f for p in files for f in _findings(p)]
        assert [f for f in found if (f.split(":")[0], f.split(": ", 1)[1]) not in _ALLOWED] == []

    def test_the_scanner_finds_what_it_looks_for(self, tmp_path: Path) -> None:
        """The AST scan flags each forbidden form (so an empty result above means something)."""
        bad = tmp_path / "supervisor" / "bad.py"
        bad.parent.mkdir()
        bad.write_text("import os, subprocess, pickle\nos.system('x')\nsubprocess.run('x', shell=True)\n"
                       "subprocess.run(['x'], shell=flag)\nos.execvp('sh', ['sh'])\neval('1')\npickle.loads(b'')\n")
        assert len(_findings(bad)) == 6


class TestMetricsListener:
    @pytest.mark.parametrize("listen", ["9400", ":9400", "localhost:9400", " 127.0.0.1:9400 ", "[::1]:9400"])
    def test_unqualified_or_local_listen_is_loopback(self, listen: str) -> None:
        """A port alone, an empty host or `localhost` bind loopback; names that could resolve elsewhere are refused."""
        host, port = parse_listen(listen)
        assert is_loopback(host) and port == 9400

    @pytest.mark.parametrize("listen", ["example.com:9400", "metrics.local:1", "host:", "::1:x", "127.0.0.1:70000"])
    def test_names_and_bad_ports_are_config_errors(self, listen: str) -> None:
        """A hostname (it might resolve to a public address) or a bad port is a ConfigError, not a bind."""
        with pytest.raises(ConfigError):
            parse_listen(listen)


class TestSecrets:
    def test_redact_argv_masks_secret_flag_values(self) -> None:
        """`--token=X`, `--api-key X` and `HF_TOKEN=X` lose X; other flags and values stay readable."""
        argv = ["torchrun", "--token=abc", "--api-key", "xyz", "HF_TOKEN=q", "--steps", "3", "--password",
                "--seed", "1"]
        assert redact_argv(argv) == ["torchrun", f"--token={MASK}", "--api-key", MASK, f"HF_TOKEN={MASK}",
                                     "--steps", "3", "--password", "--seed", "1"]


# ---- deletions stay inside the checkpoint root ---------------------------------------------------------------------
def _snapshot(top: Path) -> dict[str, str]:
    """Every entry under `top` (not following symlinks) with its type and content hash or link target."""
    snap = {}
    for dirpath, dirs, files in os.walk(top):
        for name in dirs + files:
            p = Path(dirpath) / name
            st_ = os.lstat(p)
            if stat.S_ISLNK(st_.st_mode):
                snap[str(p)] = "link " + os.readlink(p)
            elif stat.S_ISDIR(st_.st_mode):
                snap[str(p)] = "dir"
            else:
                snap[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return snap


TRAPS = ["linked_ckpt_dir", "linked_trash", "link_inside_debris", "linked_shard", "link_inside_complete",
         "link_to_file", "link_in_trash", "root_is_a_link"]


def _plant(base: Path, traps: set[str]) -> tuple[Path, Path]:
    """A checkpoint root with the chosen symlink traps, all pointing into `base/outside`; returns (root, outside)."""
    outside, real = base / "outside", base / "real-root"
    write_checkpoint(outside, 1)
    (outside / "precious.txt").write_text("keep me")
    for step in (10, 20, 30):
        write_checkpoint(real, step)
    links = {"linked_ckpt_dir": ("step_00000040", outside / "step_00000001"),
             "link_to_file": ("step_00000041", outside / "precious.txt")}
    for trap, (name, target) in links.items():
        if trap in traps:
            (real / name).symlink_to(target)
    trashes = [base / ".real-root.fsdp-trash", base / ".root-link.fsdp-trash"]
    if "linked_trash" in traps:  # the trash next to the root, whichever name the root goes by
        for trash in trashes:
            trash.symlink_to(outside, target_is_directory=True)
    elif "link_in_trash" in traps:
        for trash in trashes:
            trash.mkdir()
            (trash / "left-over").symlink_to(outside)
    if "link_inside_debris" in traps:
        debris = real / ".tmp-step_00000005-dead"
        debris.mkdir()
        (debris / "escape").symlink_to(outside)
        os.utime(debris, (0, 0))
    if "linked_shard" in traps:
        bad = write_checkpoint(real, 15)
        shard = next(bad.glob("*.distcp"))
        shard.unlink()
        shard.symlink_to(next((outside / "step_00000001").glob("*.distcp")))
    if "link_inside_complete" in traps:
        (real / "step_00000010" / "escape").symlink_to(outside)
    root = real
    if "root_is_a_link" in traps:
        root = base / "root-link"
        root.symlink_to(real)
    return root, outside


class TestDeletionStaysInsideRoot:
    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(traps=st.sets(st.sampled_from(TRAPS)), keep_last=st.integers(0, 2), age=st.sampled_from([0, 3600]))
    def test_retention_never_touches_anything_outside_whatever_symlinks(
            self, tmp_path: Path, traps: set[str], keep_last: int, age: int) -> None:
        """Plan + execute retention (everything deletable goes) over planted symlinks: the outside tree is intact."""
        base = tmp_path / f"case-{time.monotonic_ns()}"
        base.mkdir()
        root, outside = _plant(base, traps)
        before = _snapshot(outside)
        policy = RetentionRules(keep_last=keep_last, min_free_gb=1e9, partial_max_age_s=age)
        try:
            plan = plan_retention(scan(root), rules=policy, disk=DiskUsage(total_bytes=1, free_bytes=0), now=time.time())
            execute_retention(root, plan)
            clear_trash(root)
        except CheckpointError:
            assert "linked_trash" in traps  # refusing to delete through a symlinked trash is the right answer
        assert _snapshot(outside) == before
        assert (root / "step_00000030").is_dir()  # the newest complete survives every policy


# ---- markers only in the root's own checkpoints ----------------------------------------------------------------
class TestMarkersOnlyOnOurCheckpoints:
    """`checkpoints pin/unpin/unquarantine` write or remove a marker only in a checkpoint of the configured root."""

    @pytest.fixture
    def project(self, tmp_path: Path) -> Path:
        """A job.toml whose root holds step 10, and a plain folder `etc/` beside it with a user's own `.pinned`."""
        (tmp_path / "job.toml").write_text('[job]\ncommand = ["true"]\n[checkpoints]\ndir = "ckpts"\n')
        write_checkpoint(tmp_path / "ckpts", 10)
        (tmp_path / "etc").mkdir()
        (tmp_path / "etc" / "passwd").write_text("root:x:0:0")
        (tmp_path / "etc" / ".pinned").write_text("the user's own")
        return tmp_path

    @pytest.mark.parametrize("verb", ["pin", "unpin", "unquarantine"])
    @pytest.mark.parametrize("root", ["./job.toml", "-c", "--dir"])
    def test_a_plain_folder_is_refused_and_untouched(self, project: Path, verb: str, root: str, capsys,
                                                     monkeypatch) -> None:
        """`pin /etc` wrote /etc/.pinned and `unpin` deleted a user's own `.pinned`: now exit 2, one line, the
        folder exactly as it was (with `--dir` its parent, which holds it, is the root)."""
        from supervisor.cli import app

        monkeypatch.chdir(project)
        monkeypatch.delenv("FSDP_SUPERVISOR_CONFIG", raising=False)
        before = _snapshot(project / "etc")
        where = {"./job.toml": [], "-c": ["-c", str(project / "job.toml")], "--dir": ["--dir", str(project)]}[root]
        assert app.main(["checkpoints", verb, *where, str(project / "etc")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(project / "etc") in err[0], err
        assert _snapshot(project / "etc") == before

    def test_the_root_is_the_configs_and_a_name_is_looked_up_there(self, project: Path, monkeypatch) -> None:
        """Run where job.toml is: `pin step_00000010` pins the root's checkpoint of that name; unpin removes it."""
        from supervisor.cli import app

        monkeypatch.chdir(project)
        monkeypatch.delenv("FSDP_SUPERVISOR_CONFIG", raising=False)
        d = project / "ckpts" / "step_00000010"
        assert app.main(["checkpoints", "pin", "step_00000010"]) == 0 and (d / ".pinned").is_file()
        assert app.main(["checkpoints", "unpin", str(d)]) == 0 and not (d / ".pinned").exists()
