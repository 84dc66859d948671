"""Security review, one test per finding: no shell, file modes, loopback metrics, secrets, deletions stay in the root.

Real supervisors here run the torch-free fake job (tests/jobs/fakejob.py) or a bare `python -c`, so the whole
module takes seconds. Decisions recorded in docs/reliability.md: argv secrets are masked in logs but kept in
the owner-only state.json (it identifies an orphaned job); nothing the supervisor or its job creates is
world-writable, whatever umask it inherited.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.checkpoints import DiskUsage, RetentionRules, clear_trash, execute_retention, plan_retention, scan
from supervisor.layout import LEGACY_TRASH_DIR
from supervisor.checkpoints.testing import write_checkpoint
from supervisor.errors import CheckpointError, ConfigError
from supervisor.observe.metrics import is_loopback, parse_listen
from supervisor.observe.redact import MASK, redact_argv
from tests.helpers import REPO, TAG_ENV
from tests.supervise import FAKEJOB, Supervisors, cli, stop, supervisors, wait_for, write_config  # noqa: F401

PACKAGES = [REPO / "supervisor", REPO / "trainer"]
FAST = "\n[restart]\nbackoff_initial_s = 0.05\nbackoff_max_s = 0.2\n"


def _state(base: Path) -> dict:
    try:
        return json.loads((base / ".fsdp-supervisor" / "state.json").read_text())
    except (OSError, ValueError):
        return {}


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


class TestNoShell:
    def test_packages_never_use_a_shell_or_run_strings_as_code(self) -> None:
        """No shell=, os.system/popen/exec*/spawn*, getoutput, eval/exec or plain unpickling in the packages."""
        files = [p for pkg in PACKAGES for p in pkg.rglob("*.py")]
        assert len(files) > 20
        assert [f for p in files for f in _findings(p)] == []

    def test_the_scanner_finds_what_it_looks_for(self, tmp_path: Path) -> None:
        """The AST scan flags each forbidden form (so an empty result above means something)."""
        bad = tmp_path / "supervisor" / "bad.py"
        bad.parent.mkdir()
        bad.write_text("import os, subprocess, pickle\nos.system('x')\nsubprocess.run('x', shell=True)\n"
                       "subprocess.run(['x'], shell=flag)\nos.execvp('sh', ['sh'])\neval('1')\npickle.loads(b'')\n")
        assert len(_findings(bad)) == 6

    @pytest.mark.integration
    def test_shell_metacharacters_reach_the_job_verbatim(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """argv and the {checkpoint} path full of shell syntax arrive as the exact same strings; nothing runs."""
        pwned = tmp_path / "pwned"
        nasty = [f"; touch {pwned}-1 #", f"$(touch {pwned}-2)", f"`touch {pwned}-3`", f"| touch {pwned}-4",
                 f"&& touch {pwned}-5", "*", "a b", "'\"", "\n", "", "~", "$HOME"]
        root = tmp_path / "ck $(touch pwned-6) ;|&"  # relative: it would land in the job's cwd, tmp_path
        ckpt = write_checkpoint(root, 7, name="step_$(touch pwned-7)`id`_7")
        marker = tmp_path / "argv.json"
        record = "import json, sys; open(sys.argv[1], 'w').write(json.dumps(sys.argv[2:]))"
        cfg = write_config(tmp_path, [sys.executable, "-c", record, str(marker), *nasty], FAST)
        cfg.write_text(cfg.read_text().replace('dir = "ckpts"', f"dir = {json.dumps(str(root))}"))
        p = supervisors.start(cfg)
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, out
        assert json.loads(marker.read_text()) == [*nasty, "--resume", str(ckpt)]
        assert not list(tmp_path.glob("pwned*")) and not list(REPO.glob("pwned*"))


# ---- file modes --------------------------------------------------------------------------------------------------
@pytest.mark.integration
class TestFileModes:
    def test_nothing_created_is_world_writable_even_under_umask_0(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """Under an inherited umask of 0: run dir, state, logs, lock, errors, checkpoint root and job files stay o-w."""
        cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--steps", "3", "--exit", "1"],
                           FAST + "max_no_progress_restarts = 1\n")
        code = "import os, runpy, sys; os.umask(0); sys.argv[0] = 'fsdp-supervisor'; " \
               "runpy.run_module('supervisor', run_name='__main__')"
        p = subprocess.Popen([sys.executable, "-c", code, "run", "-c", str(cfg)], cwd=REPO, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, TAG_ENV: supervisors.tag})
        supervisors.procs.append(p)
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 3, out  # gave up after two crashes: errors/ and two attempt logs exist
        run_dir = tmp_path / ".fsdp-supervisor"
        made = [run_dir, tmp_path / "ckpts", *run_dir.rglob("*")]
        assert {"state.json", "supervisor.log", "supervisor.lock", "errors", "attempt-0001.log",
                "heartbeat.json"} <= {m.name for m in made}
        loose = [f"{m.relative_to(tmp_path)} {stat.filemode(m.stat().st_mode)}" for m in made
                 if m.stat().st_mode & stat.S_IWOTH]
        assert loose == []
        assert stat.S_IMODE((run_dir / "state.json").stat().st_mode) & 0o077 == 0  # owner only: it holds argv
        assert stat.S_IMODE(run_dir.stat().st_mode) & 0o007 == 0


# ---- metrics listener --------------------------------------------------------------------------------------------
def _listening(pid: int) -> list[str]:
    return [c.laddr.ip for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]


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

    @pytest.mark.integration
    def test_real_supervisor_binds_only_loopback_and_nothing_unless_configured(
            self, tmp_path: Path, supervisors: Supervisors) -> None:
        """With `listen = "0"` the only listening socket is on loopback; without [metrics] there is none."""
        job = [sys.executable, str(FAKEJOB), "--sleep", "60", "--trap-term", str(tmp_path / "term")]
        for name, extra in (("on", '[metrics]\nlisten = "0"\n'), ("off", "")):
            base = tmp_path / name
            base.mkdir()
            p = supervisors.start(write_config(base, job, FAST + extra))
            wait_for(lambda: _state(base).get("state") == "running", 60, "running")  # noqa: B023
            addrs = _listening(p.pid)
            rc, out = stop(p)
            assert rc == 0, out
            if name == "on":
                assert addrs and all(is_loopback(a) for a in addrs), addrs
            else:
                assert addrs == []


# ---- secrets -------------------------------------------------------------------------------------------------------
SECRETS = {"HF_TOKEN": "s3cr3t-env-token", "WANDB_API_KEY": "s3cr3t-env-key", "DB_PASSWORD": "s3cr3t-env-pw"}


class TestSecrets:
    def test_redact_argv_masks_secret_flag_values(self) -> None:
        """`--token=X`, `--api-key X` and `HF_TOKEN=X` lose X; other flags and values stay readable."""
        argv = ["torchrun", "--token=abc", "--api-key", "xyz", "HF_TOKEN=q", "--steps", "3", "--password",
                "--seed", "1"]
        assert redact_argv(argv) == ["torchrun", f"--token={MASK}", "--api-key", MASK, f"HF_TOKEN={MASK}",
                                     "--steps", "3", "--password", "--seed", "1"]

    @pytest.mark.integration
    def test_secret_env_and_argv_values_never_reach_logs_or_status(self, tmp_path: Path,
                                                                   supervisors: Supervisors) -> None:
        """Secret-named env values and --token style argv values appear in no log, no status, no state after the run."""
        argv_secrets = ["s3cr3t-argv-token", "s3cr3t-argv-key"]
        job = [sys.executable, "-c", "import time; time.sleep(1)", f"--hf-token={argv_secrets[0]}",
               "--api-key", argv_secrets[1]]
        cfg = write_config(tmp_path, job, FAST)
        env = ", ".join(f"{k} = {json.dumps(v)}" for k, v in SECRETS.items())
        cfg.write_text(cfg.read_text().replace('env = { OMP_NUM_THREADS = "1" }', f"env = {{ {env} }}"))
        p = supervisors.start(cfg)
        wait_for(lambda: _state(tmp_path).get("state") == "running", 60, "running")
        seen = [cli("status", "-c", str(cfg)).stdout]
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, out
        seen += [out, cli("status", "-c", str(cfg)).stdout, cli("status", "--json", "-c", str(cfg)).stdout,
                 cli("logs", "-c", str(cfg), "-n", "1000").stdout]
        seen += [f.read_text(errors="replace") for f in (tmp_path / ".fsdp-supervisor").rglob("*") if f.is_file()]
        leaked = [s for s in [*SECRETS.values(), *argv_secrets] if any(s in text for text in seen)]
        assert leaked == []
        started = [json.loads(line) for line in (tmp_path / ".fsdp-supervisor" / "supervisor.log").read_text()
                   .splitlines() if '"job_started"' in line][0]
        assert started["env"] == {k: MASK for k in SECRETS} and MASK in started["argv"]


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
    trashes = [base / ".real-root.fsdp-trash", base / ".root-link.fsdp-trash", real / LEGACY_TRASH_DIR]
    if "linked_trash" in traps:  # the trash next to the root (whichever name the root goes by) and the legacy one
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

    @pytest.mark.integration
    def test_prune_cli_and_daemon_leave_the_outside_alone(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """`checkpoints prune` and a supervisor's retention over every trap at once delete nothing outside."""
        for name in ("cli", "daemon"):
            base = tmp_path / name
            base.mkdir()
            root, outside = _plant(base, set(TRAPS) - {"linked_trash"})
            before = _snapshot(outside)
            if name == "cli":
                out = cli("checkpoints", "prune", "--dir", str(root), "--keep-last", "1", "--min-free-gb", "1e9")
                assert out.returncode == 0, out.stderr
            else:
                cfg = write_config(base, [sys.executable, str(FAKEJOB), "--steps", "2"],
                                   "keep_last = 1\nmin_free_gb = 1e9\npartial_max_age_s = 0\n" + FAST)
                cfg.write_text(cfg.read_text().replace('dir = "ckpts"', f"dir = {json.dumps(str(root))}"))
                p = supervisors.start(cfg)
                out_text, _ = p.communicate(timeout=60)
                assert p.returncode == 0, out_text
                assert "retention_deleted" in (base / ".fsdp-supervisor" / "supervisor.log").read_text()
            assert _snapshot(outside) == before, name
            assert not (root / "step_00000010").exists() and (root / "step_00000030").is_dir()
