"""`fsdp-supervisor systemd-unit` and the shipped template unit, checked by `systemd-analyze verify`, and the
generated unit's ExecStart run the way systemd runs it (an empty environment plus the unit's `Environment=`)."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.checkpoints import newest_complete
from supervisor.cli.systemd import UnitOptions, render_unit, supervisor_command
from supervisor.config import load_config
from supervisor.layout import step_dir_name
from tests.supervise import TAG_ENV, Supervisors, cli, supervisors, wait_for, write_config  # noqa: F401
from tests.unit.test_systemd import config  # noqa: F401  (a fixture, taken as an argument)

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None,
    reason="systemd-analyze not installed (apt-get install -y --no-install-recommends systemd)",
)


VENV_BIN = Path(sys.executable).parent


def activated(**extra: str) -> dict[str, str]:
    """This environment as the user's shell has it after activating the venv: its bin/ first on PATH."""
    return {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', os.defpath)}", **extra}


def _specifiers(value: str, cache: Path) -> str:
    """The unit's `%` specifiers as systemd expands them for a system service (%C: the cache root)."""
    return re.sub(r"%(.)", lambda m: {"%": "%", "C": str(cache)}[m.group(1)], value)


def service_exec(unit: str, cache: Path) -> tuple[list[str], dict[str, str], Path]:
    """ExecStart's argv, the service's whole environment (only the `Environment=` lines: no User=, so no HOME
    either) and its WorkingDirectory=, as systemd would start it; CacheDirectory= is created under `cache`."""
    argv: list[str] = []
    env: dict[str, str] = {}
    cwd = Path("/")
    for line in unit.splitlines():
        key, _, value = line.partition("=")
        if key == "ExecStart":
            argv = [_specifiers(w, cache).replace("$$", "$") for w in shlex.split(value)]
        elif key == "Environment":
            for word in shlex.split(value):
                name, _, val = _specifiers(word, cache).partition("=")
                env[name] = val
        elif key == "WorkingDirectory":
            cwd = Path(_specifiers(value, cache))
        elif key == "CacheDirectory":
            (cache / _specifiers(value, cache)).mkdir(parents=True, exist_ok=True)
    return argv, env, cwd


def sandbox_script(unit: str, cache: Path) -> str:
    """A shell script that sets up the unit's file-system sandbox in a private mount namespace, as systemd does,
    then execs "$@": every mount read-only (ProtectSystem=strict, ProtectHome=read-only), a private /tmp and
    /var/tmp unless PrivateTmp=no, and each ReadWritePaths= (and the CacheDirectory=) a writable bind mount of its
    own, so that rename() across two of them fails with EXDEV as it does under systemd."""
    rw: list[str] = []
    private_tmp = True
    for line in unit.splitlines():
        key, _, value = line.partition("=")
        if key == "ReadWritePaths":
            rw += [_specifiers(w, cache) for w in shlex.split(value)]
        elif key == "CacheDirectory":
            rw.append(str(cache / _specifiers(value, cache)))
        elif key == "PrivateTmp":
            private_tmp = value == "yes"
    with open("/proc/self/mounts") as f:
        mounts = [line.split()[1] for line in f]
    keep = ("/proc", "/sys", "/dev")
    lines = ["set -e", "mount --make-rprivate /"]
    lines += [f"mount -o remount,bind,ro {shlex.quote(m)} 2>/dev/null || true"  # what can be: an approximation
              for m in mounts if not m.startswith(keep)]
    if private_tmp:
        lines += ["mount -t tmpfs tmpfs /tmp", "mount -t tmpfs tmpfs /var/tmp"]
    for path in rw:
        q = shlex.quote(path)
        lines += [f"mount --bind {q} {q}", f"mount -o remount,bind,rw {q}"]
    return "\n".join([*lines, 'exec "$@"'])


UNSHARE = shutil.which("unshare")


def can_unshare() -> bool:
    """May this process make a private mount namespace (root, or CAP_SYS_ADMIN)?"""
    if UNSHARE is None:
        return False
    r = subprocess.run([UNSHARE, "-m", "--", "sh", "-c", "mount -t tmpfs tmpfs /mnt"], capture_output=True, timeout=30)
    return r.returncode == 0


def verify(unit_file: Path) -> subprocess.CompletedProcess[str]:
    assert SYSTEMD_ANALYZE is not None
    # Offline verification: no running systemd needed; still loads every key and checks ExecStart exists.
    return subprocess.run([SYSTEMD_ANALYZE, "verify", str(unit_file)], capture_output=True, text=True,
                          timeout=60, cwd=unit_file.parent, env={**os.environ, "SYSTEMD_LOG_COLOR": "0"})


class TestCommand:
    def test_prints_unit_exit_0(self, config: Path) -> None:
        """The command prints the unit on stdout, missing ReadWritePaths dirs noted in it as `# warning:` (what
        `| sudo tee` installs) and on stderr, and the venv's bin/, where `torchrun` is, first on its PATH."""
        r = cli("systemd-unit", "-c", str(config), "--name", "llm", env=activated())
        assert r.returncode == 0, r.stderr
        assert "Description=fsdp-supervisor llm" in r.stdout and "mkdir -p" in r.stderr
        assert any(line.startswith("# warning: create these") for line in r.stdout.splitlines()), r.stdout
        assert f"Environment=PATH={VENV_BIN}:" in r.stdout

    def test_syslog_identifier_is_the_jobs_directory_for_a_job_toml(self, tmp_path: Path) -> None:
        """Without --name, /srv/llm/job.toml logs as `llm`, not `job` like every other job.toml."""
        (tmp_path / "llm").mkdir()
        config = write_config(tmp_path / "llm", ["true"])
        r = cli("systemd-unit", "-c", str(config), env=activated())
        assert r.returncode == 0, r.stderr
        assert "SyslogIdentifier=llm" in r.stdout.splitlines()

    def test_program_not_found_exit_2(self, config: Path) -> None:
        """`torchrun` not on the shell's PATH (venv not activated): exit 2, one line naming it, no unit."""
        path = "/usr/bin:/bin"
        if shutil.which("torchrun", path=path):
            pytest.skip(f"a torchrun is installed in {path}")
        r = cli("systemd-unit", "-c", str(config), env={**os.environ, "PATH": path})
        assert (r.returncode, r.stdout) == (2, ""), r.stdout + r.stderr
        assert len(r.stderr.splitlines()) == 1 and "'torchrun' not found" in r.stderr, r.stderr

    def test_missing_config_exit_2(self, tmp_path: Path) -> None:
        """A missing config is one line naming the file and exit 2."""
        r = cli("systemd-unit", "-c", str(tmp_path / "nope.toml"))
        assert r.returncode == 2 and "nope.toml" in r.stderr and len(r.stderr.strip().splitlines()) == 1

    def test_bad_name_exit_2(self, config: Path) -> None:
        """A bad --name is exit 2 with one line, no traceback."""
        r = cli("systemd-unit", "-c", str(config), "--name", "a b", env=activated())
        assert r.returncode == 2 and "--name" in r.stderr and "Traceback" not in r.stderr


@needs_analyze
class TestSystemdAnalyze:
    def test_verify_reports_unknown_keys_here(self, tmp_path: Path) -> None:
        """Control: this systemd-analyze does flag an unknown key on stderr (so a clean run means something)."""
        unit = tmp_path / "control.service"
        unit.write_text(f"[Service]\nType=notify\nExecStart={sys.executable} -V\nNoSuchKey=1\n")
        r = verify(unit)
        assert "NoSuchKey" in r.stderr

    def test_generated_unit_verifies_clean(self, config: Path, tmp_path: Path) -> None:
        """`systemd-analyze verify` on a generated unit exits 0 and prints nothing on stderr."""
        r = cli("systemd-unit", "-c", str(config), "--user", "root", env=activated())
        assert r.returncode == 0, r.stderr
        unit = tmp_path / "fsdp-job.service"
        unit.write_text(r.stdout)
        v = verify(unit)
        assert (v.returncode, v.stderr) == (0, ""), v.stderr

    def test_unit_for_awkward_paths_verifies_clean(self, tmp_path: Path) -> None:
        """Blanks, quotes and `%` in the config's path still make a unit that verifies clean."""
        d = tmp_path / "my 'runs'" / "100%$x"
        d.mkdir(parents=True)
        cfg = load_config(write_config(d, ["true"]))
        unit = tmp_path / "awkward.service"
        unit.write_text(render_unit(cfg, supervisor_command(), UnitOptions(name="awkward")))
        v = verify(unit)
        assert (v.returncode, v.stderr) == (0, ""), v.stderr


TRAIN = ["torchrun", "--standalone", "--nproc-per-node=1", "--max-restarts=0", "-m", "trainer",
         "--checkpoint-dir", "ckpts", "--steps", "100000", "--save-every", "2", "--log-every", "1"]
FAST = "\n[restart]\nbackoff_initial_s = 0.2\nbackoff_max_s = 1\n[health]\nstop_timeout_s = 30\n"


class TestServiceEnvironment:
    """The generated unit's ExecStart under `env -i` plus the unit's own `Environment=` lines, in its
    `WorkingDirectory=`: the README's `torchrun ...` (a bare program name, found in the venv) must start there.

    Two things are added for the test's own sake, not systemd's: the orphan tag, and PYTHONPATH when the suite
    runs with one (a worktree), so that the code under test is the code that runs."""

    def unit_for(self, tmp_path: Path) -> tuple[Path, str]:
        job = tmp_path / "llm"
        job.mkdir()
        config = write_config(job, TRAIN, FAST)
        r = cli("systemd-unit", "-c", str(config), env=activated())
        assert r.returncode == 0, r.stderr
        for mkdir in re.findall(r"^# warning: create these before starting the unit: (mkdir -p .*)$", r.stdout, re.M):
            subprocess.run(mkdir, shell=True, check=True)  # what the unit's warning asks of the operator
        return config, r.stdout

    def start(self, supervisors: Supervisors, unit: str, cache: Path, *, sandbox: bool = False) -> subprocess.Popen[str]:
        argv, env, cwd = service_exec(unit, cache)
        if sandbox:  # the same exec, inside the unit's file-system sandbox
            assert UNSHARE is not None
            argv = [UNSHARE, "-m", "--", "sh", "-c", sandbox_script(unit, cache), "sh", *argv]
        env[TAG_ENV] = supervisors.tag
        if os.environ.get("PYTHONPATH"):
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        p = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        supervisors.procs.append(p)
        return p

    def test_trains_and_stops_on_sigterm_exit_0(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """Under the unit's environment the job trains (checkpoints appear), and SIGTERM to the supervisor alone
        (KillMode=mixed) stops it gracefully: exit 0."""
        config, unit = self.unit_for(tmp_path)
        supervisors.configs.append(config)
        p = self.start(supervisors, unit, tmp_path / "cache")

        def trained() -> bool:
            if p.poll() is not None:
                raise AssertionError(f"exit {p.returncode}: {p.communicate()[0][-3000:]}")
            ckpt = newest_complete(config.parent / "ckpts")
            return ckpt is not None and ckpt.step >= 4

        wait_for(trained, 240, "two checkpoints under the unit's environment", interval=0.5)
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out[-3000:]
        assert "stopped" in out, out[-3000:]

    def test_in_the_units_sandbox_it_trains_and_retention_deletes(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """Under the unit's ProtectSystem=strict + ReadWritePaths= (emulated with a private mount namespace) the job
        finds a temporary directory, trains, and retention deletes: it parks deletions next to the root, so that
        folder must be writable and one mount with the root (with only the root and the run dir writable, every
        rename failed with EXDEV and nothing was ever deleted; under /tmp, torchrun found no temporary dir)."""
        if not can_unshare():
            pytest.skip("no private mount namespace here (needs root or CAP_SYS_ADMIN, and util-linux unshare)")
        config, unit = self.unit_for(tmp_path)
        supervisors.configs.append(config)
        p = self.start(supervisors, unit, tmp_path / "cache", sandbox=True)
        ckpts = config.parent / "ckpts"

        def pruned() -> bool:  # keep_last = 3 by default: a fifth checkpoint means two were due for deletion
            if p.poll() is not None:
                raise AssertionError(f"exit {p.returncode}: {p.communicate()[0][-3000:]}")
            ckpt = newest_complete(ckpts)
            return ckpt is not None and ckpt.step >= 10

        wait_for(pruned, 240, "five checkpoints in the unit's sandbox", interval=0.5)
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out[-3000:]
        assert "retention_deleted" in out and "retention_rename_failed" not in out, out[-3000:]
        assert not (ckpts / step_dir_name(2)).exists()

    def test_without_the_units_path_the_job_cannot_start(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """Control: the same ExecStart without the unit's `Environment=PATH=` line is what systemd ran before:
        `torchrun` not found, exit 2. (So the emulation above really hides the venv.)"""
        if shutil.which("torchrun", path=os.defpath):
            pytest.skip(f"a torchrun is installed in {os.defpath}")
        _, unit = self.unit_for(tmp_path)
        without = "\n".join(line for line in unit.splitlines() if not line.startswith("Environment=PATH="))
        p = self.start(supervisors, without, tmp_path / "cache")
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 2 and "'torchrun' not found" in out, out[-3000:]
