"""Bad input, fuzzed with hypothesis: job.toml, DCP `.metadata` and `manifest.json`, and a torn `state.json`.

Configs: whatever the file holds, loading it either works or raises one ConfigError line naming the file (the
CLI turns that into exit 2); a few go through the real CLI. Metadata: random and mutated bytes, also around
planted code-running pickles, are `invalid` (never an exception, never code run). state.json: prefixes of a real
one (a torn write), random bytes and wrongly typed JSON leave `status` answering with exit 0 or 1.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from supervisor.config import load_config
from supervisor.daemon.statefile import read_status, write_status
from supervisor.errors import ConfigError
from supervisor.policy.state import Status
from tests.supervise import cli as run_cli
from tests.unit.test_fuzz import _document, _status, configs


class TestConfigFuzz:
    @settings(max_examples=6, deadline=None)
    @given(doc=configs(), command=st.sampled_from(["run", "status", "logs", "checkpoints list -c"]))
    def test_cli_on_fuzzed_config_is_exit_2_with_one_line_or_runs(self, doc: dict[str, Any], command: str) -> None:
        """Through the real CLI: a bad config is exit 2 and one stderr line, never a traceback."""
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "job.toml"
            path.write_text(_document(doc), encoding="utf-8")
            try:
                load_config(path)
                assume(False)  # valid ones would start a job or read state: not this test's business
            except ConfigError:
                pass
            args = command.split() + ([] if command.endswith("-c") else ["-c"]) + [str(path)]
            out = run_cli(*args, timeout=60)
            assert out.returncode == 2, (out.stdout, out.stderr)
            assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


class TestStateFuzz:
    def test_writer_killed_mid_write_leaves_a_readable_state(self, tmp_path: Path) -> None:
        """SIGKILL a process rewriting state.json in a loop at ten moments: it always parses, `status` answers."""
        run_dir = tmp_path / ".fsdp-supervisor"
        run_dir.mkdir()
        config = tmp_path / "job.toml"
        config.write_text('[job]\ncommand = ["x"]\n[checkpoints]\ndir = "ckpts"\n')
        write_status(run_dir, Status(pid=1, reason="x" * 100_000))  # big writes widen the window
        loop = ("import sys; from pathlib import Path; from supervisor.daemon.statefile import Status, write_status\n"
                "for i in range(10**9): write_status(Path(sys.argv[1]), Status(pid=i, reason='x' * 100_000))")
        for delay in (0.3, 0.31, 0.33, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7, 0.8):
            p = subprocess.Popen([sys.executable, "-c", loop, str(run_dir)], start_new_session=True)
            try:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(delay)
            finally:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            assert read_status(run_dir) is not None
        rc, text = _status(config)
        assert rc == 3 and "state" in text, text  # readable; 3 like systemctl: no supervisor runs
