"""Security review, one test per finding: no shell, file modes, loopback metrics, secrets, deletions stay in the root.

Real supervisors here run the torch-free fake job (tests/jobs/fakejob.py) or a bare `python -c`, so the whole
module takes seconds. Decisions recorded in docs/reliability.md: argv secrets are masked in logs but kept in
the owner-only state.json (it identifies an orphaned job); nothing the supervisor or its job creates is
world-writable, whatever umask it inherited.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import psutil

from supervisor.observe.metrics import is_loopback
from supervisor.observe.redact import MASK
from tests.helpers import REPO, TAG_ENV
from tests.jobs.dcp_files import write_checkpoint
from tests.supervise import FAKEJOB, Supervisors, cli, stop, supervisors, wait_for, write_config  # noqa: F401
from tests.unit.test_security import TRAPS, _plant, _snapshot

FAST = "\n[restart]\nbackoff_initial_s = 0.05\nbackoff_max_s = 0.2\n"


def _state(base: Path) -> dict:
    try:
        return json.loads((base / ".fsdp-supervisor" / "state.json").read_text())
    except (OSError, ValueError):
        return {}


class TestNoShell:
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

    def test_run_dir_is_owner_only_even_when_made_wider(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """A run dir made 0750 (logs/ 0755) beforehand (a `mkdir` of the user's): afterwards every folder is 0700 and every
        file the supervisor wrote 0600 (the job's heartbeat is the job's own, inside the owner-only run dir)."""
        cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--steps", "3", "--exit", "1"],
                           FAST + "max_no_progress_restarts = 1\n")
        run_dir = tmp_path / ".fsdp-supervisor"
        (run_dir / "logs").mkdir(parents=True)
        run_dir.chmod(0o750)
        (run_dir / "logs").chmod(0o755)
        p = supervisors.start(cfg)
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 3, out  # gave up after two crashes: errors/ and two attempt logs exist
        made = [run_dir, *run_dir.rglob("*")]
        assert {"state.json", "supervisor.log", "supervisor.lock", "errors", "logs", "attempt-0001.log",
                "attempt-0002.log", "history.jsonl", "job.token"} <= {m.name for m in made}
        loose = [f"{m.relative_to(tmp_path)} {stat.filemode(m.stat().st_mode)}" for m in made
                 if m.name != "heartbeat.json" and stat.S_IMODE(m.stat().st_mode) & 0o077]
        assert loose == []


# ---- metrics listener --------------------------------------------------------------------------------------------
def _listening(pid: int) -> list[str]:
    return [c.laddr.ip for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]


class TestMetricsListener:
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


class TestDeletionStaysInsideRoot:
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
