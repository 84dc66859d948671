"""`fsdp-supervisor systemd-unit` and the shipped template unit, checked by `systemd-analyze verify`."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.cli.systemd import UnitOptions, render_unit, supervisor_command
from supervisor.config import load_config
from tests.supervise import cli, write_config
from tests.unit.test_systemd import (
    TEMPLATE,
    config,  # noqa: F401  (a fixture, taken as an argument)
)

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None,
    reason="systemd-analyze not installed (apt-get install -y --no-install-recommends systemd)",
)


def verify(unit_file: Path) -> subprocess.CompletedProcess[str]:
    assert SYSTEMD_ANALYZE is not None
    # Offline verification: no running systemd needed; still loads every key and checks ExecStart exists.
    return subprocess.run([SYSTEMD_ANALYZE, "verify", str(unit_file)], capture_output=True, text=True,
                          timeout=60, cwd=unit_file.parent, env={**os.environ, "SYSTEMD_LOG_COLOR": "0"})


class TestCommand:
    def test_prints_unit_exit_0(self, config: Path) -> None:
        """The command prints the unit on stdout and notes missing ReadWritePaths dirs on stderr."""
        r = cli("systemd-unit", "-c", str(config), "--name", "llm")
        assert r.returncode == 0, r.stderr
        assert "Description=fsdp-supervisor llm" in r.stdout and "mkdir -p" in r.stderr

    def test_missing_config_exit_2(self, tmp_path: Path) -> None:
        """A missing config is one line naming the file and exit 2."""
        r = cli("systemd-unit", "-c", str(tmp_path / "nope.toml"))
        assert r.returncode == 2 and "nope.toml" in r.stderr and len(r.stderr.strip().splitlines()) == 1

    def test_bad_name_exit_2(self, config: Path) -> None:
        """A bad --name is exit 2 with one line, no traceback."""
        r = cli("systemd-unit", "-c", str(config), "--name", "a b")
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
        r = cli("systemd-unit", "-c", str(config), "--user", "root")
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

    def test_template_instance_verifies_clean(self, tmp_path: Path) -> None:
        """The shipped template, instantiated as fsdp-supervisor@demo with a real binary, verifies clean."""
        binary = supervisor_command()[0]
        text = TEMPLATE.read_text()
        assert "ExecStart=/opt/fsdp-supervisor/bin/fsdp-supervisor run -c /etc/fsdp-supervisor/%i.toml" in text
        (tmp_path / TEMPLATE.name).write_text(text.replace("/opt/fsdp-supervisor/bin/fsdp-supervisor", binary))
        v = verify(tmp_path / "fsdp-supervisor@demo.service")
        assert (v.returncode, v.stderr) == (0, ""), v.stderr
