"""Every command README shows is run by a test: the quick start and "Day 2" in tests/integration/test_walkthrough.py, the
first block (`make test`, `make run`) here. A new command block in README fails this until a test runs it."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO, TAG_ENV, wait_for
from tests.supervise import Supervisors, assert_no_orphans


def test_make_run_trains_and_stops_gracefully(tmp_path: Path) -> None:
    """`make run` (the demo): the supervisor trains the reference trainer, commits a checkpoint and shows
    progress; Ctrl+C stops it gracefully (exit 0) with nothing left behind."""
    sup = Supervisors()
    demo = REPO / "deploy" / "examples"
    env = {**os.environ, TAG_ENV: sup.tag, "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    # The demo writes next to its config: run it on a copy so the repository stays clean.
    work = tmp_path / "repo"
    (work / "deploy" / "examples").mkdir(parents=True)
    (work / "deploy" / "examples" / "demo.toml").write_text((demo / "demo.toml").read_text())
    shutil.copy(REPO / "deploy" / "foreground.py", work / "deploy" / "foreground.py")
    makefile = (REPO / "Makefile").read_text().replace("$(VENV)/bin", f"{Path(sys.executable).parent}")
    (work / "Makefile").write_text(makefile.replace("run: $(STAMP)", "run:"))
    out = tmp_path / "make-run.out"
    with open(out, "w") as f:
        p = subprocess.Popen(["make", "run"], cwd=work, env=env, stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
    sup.procs.append(p)
    try:
        ckpts = work / "deploy" / "examples" / "demo" / "ckpts"
        wait_for(lambda: (p.poll() is None and any(ckpts.glob("step_*"))) or p.poll() is not None, 240,
                 "the demo's first checkpoint")
        assert p.poll() is None, out.read_text()[-3000:]
        os.killpg(p.pid, signal.SIGINT)  # Ctrl+C in the terminal reaches make and the supervisor
        # make re-raises the SIGINT once its recipe is done (-2); what matters is the supervisor's own stop.
        assert p.wait(120) in (0, -signal.SIGINT), out.read_text()[-3000:]
        text = out.read_text()
        assert "progress step=" in text and "stopped" in text, text[-3000:]
        state = (work / "deploy" / "examples" / "demo" / ".fsdp-supervisor" / "state.json").read_text()
        assert '"state": "stopped"' in state
    finally:
        sup.cleanup()
        assert_no_orphans(sup.tag)
