"""deploy/slurm/local-cluster.sh with stand-in daemons: it stops exactly what it started, also when `up` fails.

The real cluster is the opt-in tier (tests/slurm, `make test-slurm`); here munged, slurmctld and slurmd are stand-ins
that daemonize as the real ones do (fork, pid file where the config says, the config's path in their argv), so that
`up` and `down` run as they would, in a second, on any machine (as root: the script insists on it).
"""
from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.helpers import REPO, TAG_ENV, assert_no_orphans

SCRIPT = REPO / "deploy" / "slurm" / "local-cluster.sh"
DAEMONS = ("munged", "slurmctld", "slurmd-n1", "slurmd-n2")

# One stand-in for the three daemons (by the name it is called as); SHIM_FAIL names the one that fails to start.
_DAEMON = """#!{python}
import os, re, sys
name, args = os.path.basename(sys.argv[0]), sys.argv[1:]
def conf_value(key):
    conf = open(args[args.index("-f") + 1]).read()
    return re.search("^" + key + "=(.*)$", conf, re.M).group(1)
if name == "munged":
    pidfile = next(a.split("=", 1)[1] for a in args if a.startswith("--pid-file="))
elif name == "slurmctld":
    pidfile = conf_value("SlurmctldPidFile")
else:
    node = args[args.index("-N") + 1]
    name, pidfile = "slurmd-" + node, conf_value("SlurmdPidFile").replace("%n", node)
if name == os.environ.get("SHIM_FAIL"):
    sys.exit(1)
if os.fork():
    sys.exit(0)
os.setsid()
open(pidfile, "w").write(str(os.getpid()))
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", name, *args])
"""
_TOOLS = {  # what `up` and `down` ask the cluster: both nodes idle, no jobs
    "sinfo": "#!/bin/sh\nprintf 'idle\\nidle\\n'\n",
    "squeue": "#!/bin/sh\nexit 0\n",
    "scancel": "#!/bin/sh\nexit 0\n",
}

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="local-cluster.sh runs as root only")


@pytest.fixture
def tag() -> Iterator[str]:
    t = uuid.uuid4().hex
    yield t
    assert_no_orphans(t)


def cluster(tmp_path: Path, tag: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        for name in ("munged", "slurmctld", "slurmd"):
            (bin_dir / name).write_text(_DAEMON.format(python=sys.executable))
        for name, text in _TOOLS.items():
            (bin_dir / name).write_text(text)
        for f in bin_dir.iterdir():
            f.chmod(0o755)
    full = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", TAG_ENV: tag, **env}
    return subprocess.run(["bash", str(SCRIPT), *args], env=full, capture_output=True, text=True, timeout=120)


def running(d: Path) -> list[str]:
    """The stand-in daemons of cluster dir `d` still running (by their argv, not by pid files)."""
    return sorted({p.info["cmdline"][3] for p in psutil.process_iter(["cmdline"])
                   if (p.info["cmdline"] or [])[1:2] == ["-c"] and any(str(d) in a for a in p.info["cmdline"])})


def test_up_then_down_stops_every_daemon(tmp_path: Path, tag: str) -> None:
    d = tmp_path / "c"
    r = cluster(tmp_path, tag, "up", str(d))
    assert r.returncode == 0 and f"export SLURM_CONF={d}/slurm.conf" in r.stdout, r.stderr
    assert running(d) == sorted(DAEMONS)
    assert cluster(tmp_path, tag, "down", str(d)).returncode == 0
    assert running(d) == []


def test_an_up_that_fails_stops_what_it_had_started(tmp_path: Path, tag: str) -> None:
    """slurmd for n2 does not start: `up` exits 2 naming it, and munged, slurmctld and n1's slurmd are stopped
    again (a harness whose `up` failed never calls `down`; neither does a person who reads the error)."""
    d = tmp_path / "c"
    r = cluster(tmp_path, tag, "up", str(d), SHIM_FAIL="slurmd-n2")
    assert r.returncode == 2 and "slurmd -N n2 did not start" in r.stderr, r.stderr
    assert running(d) == [], "daemons of a failed `up` left running"


def test_down_never_signals_a_stranger_behind_a_stale_pid_file(tmp_path: Path, tag: str) -> None:
    """A pid file left by a daemon long gone, its pid reused by another process: `down` leaves that process alone."""
    d = tmp_path / "c"
    d.mkdir()
    stranger = subprocess.Popen(["sleep", "600"], env={**os.environ, TAG_ENV: tag})
    try:
        for name in DAEMONS:
            (d / f"{name}.pid").write_text(str(stranger.pid))
        assert cluster(tmp_path, tag, "down", str(d)).returncode == 0
        assert stranger.poll() is None, "down killed a process it had not started"
    finally:
        stranger.kill()
        stranger.wait()
