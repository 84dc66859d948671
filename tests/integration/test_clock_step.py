"""A +1 h step of the wall clock (issue 35 item 8), under libfaketime (Debian's `faketime`) with the real CLI.

libfaketime moves the clock a process reads (time(), clock_gettime); a real step also moves the boot time the
kernel reports (/proc/stat `btime`: the wall clock minus the uptime), which psutil's process start times are
made of. `stepped` does both for one command: libfaketime, and in a private mount namespace a /proc/stat whose
btime is an hour later. File mtimes stay the kernel's. Skipped, saying why, without faketime (or, for the
btime part, without the right to mount: root).
"""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_checkpoints_cli import fsup
from tests.jobs.dcp_files import write_checkpoint
from tests.supervise import (  # noqa: F401
    FAKEJOB,
    REPO,
    TAG_ENV,
    Supervisors,
    kill_tree,
    launches,
    stop,
    supervisors,
    wait_for,
    write_config,
)

LIBFAKETIME = next(iter(sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))), None)
pytestmark = pytest.mark.skipif(LIBFAKETIME is None, reason="libfaketime missing (apt-get install faketime)")
# In a private mount namespace: /proc/stat with `btime` an hour later, then the command under faketime +1h.
_STEP = ('set -e; t=$(mktemp); awk \'$1=="btime"{$2=$2+3600} {print}\' /proc/stat > "$t"; '
         'mount --bind "$t" /proc/stat; exec "$@"')


def faked(offset: str) -> dict[str, str]:
    """The environment of a process (and its children) whose clock reads `offset` later (`faketime -f`, but the
    process is the command itself, not a child of `faketime`: signals reach it)."""
    assert LIBFAKETIME is not None
    return {**os.environ, "LD_PRELOAD": LIBFAKETIME, "FAKETIME": offset}


def stepped(argv: list[str]) -> list[str]:
    """`argv` as run an hour after a +1 h wall-clock step: its clock and the kernel's boot time both moved."""
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", _STEP, "-", "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot move /proc/stat's btime here (needs root): {probe.stderr.strip()}")
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", _STEP, "-", *argv]


def run_stepped(config: Path, tag: str) -> tuple[int | None, str]:
    """`fsdp-supervisor run -c config` after the step: its exit status (None: still running after 30 s), output."""
    p = subprocess.Popen(stepped([sys.executable, "-m", "supervisor", "run", "-c", str(config)]), cwd=REPO, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                         env={**faked("+1h"), TAG_ENV: tag})
    try:
        out, _ = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        kill_tree(p.pid)
        out, _ = p.communicate(timeout=30)
        return None, out
    return p.returncode, out


def test_a_second_config_cannot_take_over_a_live_supervisors_claim(tmp_path: Path, supervisors: Supervisors) -> None:
    """Config B on A's checkpoint root, started after the step: A is still the same process (its start ticks since
    boot did not move), so B is refused (exit 2 naming A) instead of taking the root over."""
    marker = tmp_path / "launches"
    job = [sys.executable, str(FAKEJOB), "--sleep", "60", "--marker", str(marker)]
    a = write_config(tmp_path, job, '[supervisor]\nrun_dir = "run-a"\n', name="a.toml")
    b = write_config(tmp_path, job, '[supervisor]\nrun_dir = "run-b"\n', name="b.toml")
    first = supervisors.start(a)
    wait_for(lambda: launches(marker), 20, "job A")
    rc, out = run_stepped(b, supervisors.tag)
    assert rc == 2 and f"supervisor pid {first.pid}" in out and "held by another job" in out, out
    assert "killed" not in out and len(launches(marker)) == 1  # not "A was killed, its job runs on": A runs
    rc, out = stop(first)
    assert rc == 0, out


def test_the_run_lock_holds_across_the_step(tmp_path: Path, supervisors: Supervisors) -> None:
    """The same config again after the step: refused by the run dir's lock, naming the running supervisor."""
    marker = tmp_path / "launches"
    a = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--sleep", "60", "--marker", str(marker)])
    first = supervisors.start(a)
    wait_for(lambda: launches(marker), 20, "job A")
    rc, out = run_stepped(a, supervisors.tag)
    assert rc == 2 and f"pid {first.pid}" in out, out
    assert first.poll() is None and len(launches(marker)) == 1
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=60)


def test_retention_does_not_take_a_save_in_flight_for_an_idle_one(tmp_path: Path) -> None:
    """A partial save written a moment ago, pruned by a process whose clock reads an hour later (libfaketime):
    idle 0 s by the clock that stamped its files, so kept; the same save really idle for 2 h goes."""
    root = tmp_path / "ckpts"
    for step in (10, 20):
        write_checkpoint(root, step)
    partial = write_checkpoint(root, 30)
    (partial / ".metadata").unlink()
    argv = [sys.executable, "-m", "supervisor", "checkpoints", "prune", "--dir", str(root), "--keep-last", "1"]
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60, env=faked("+2h"))
    assert r.returncode == 0, r.stderr
    assert partial.is_dir() and "step_00000030" not in r.stdout and "deleted step_00000010" in r.stdout, r.stdout
    old = time.time() - 7200
    for f in [*partial.rglob("*"), partial]:
        os.utime(f, (old, old))
    r = fsup("checkpoints", "prune", "--dir", root, "--keep-last", "1")
    assert r.returncode == 0 and not partial.exists() and "idle" in r.stdout, r.stdout


def test_the_daemons_retention_keeps_a_save_in_flight(tmp_path: Path, supervisors: Supervisors) -> None:
    """The same under `run`: a supervisor (and its job) under libfaketime +2 h deletes the old complete checkpoint
    (keep_last = 1) at its first pass but keeps the partial save written a moment ago."""
    root = tmp_path / "ckpts"
    for step in (10, 20):
        write_checkpoint(root, step)
    partial = write_checkpoint(root, 30)
    (partial / ".metadata").unlink()
    marker = tmp_path / "launches"
    cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--sleep", "60", "--marker", str(marker)],
                       '[supervisor]\nrun_dir = "run"\n')
    cfg.write_text(cfg.read_text().replace('dir = "ckpts"\n', 'dir = "ckpts"\nkeep_last = 1\n'))
    p = supervisors.start(cfg, env=faked("+2h"))
    wait_for(lambda: launches(marker) and not (root / "step_00000010").exists(), 30, "the first retention pass")
    assert partial.is_dir() and (root / "step_00000020").is_dir()
    rc, out = stop(p)
    assert rc == 0, out
