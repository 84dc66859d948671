"""`fsdp-supervisor systemd-unit` and the shipped template unit, checked by `systemd-analyze verify`."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from supervisor.cli.systemd import STOP_MARGIN_S, UnitOptions, render_unit, supervisor_command, unit_notes, unit_paths
from supervisor.config import load_config
from supervisor.errors import UsageError
from tests.supervise import REPO, write_config

TEMPLATE = REPO / "deploy" / "systemd" / "fsdp-supervisor@.service"


def keys(unit: str) -> dict[str, list[str]]:
    """Every `Key=value` of a unit file, values in order of appearance."""
    out: dict[str, list[str]] = {}
    for line in unit.splitlines():
        m = re.match(r"^([A-Za-z]+)=(.*)$", line)
        if m:
            out.setdefault(m.group(1), []).append(m.group(2))
    return out


@pytest.fixture
def config(tmp_path: Path) -> Path:
    return write_config(tmp_path, ["torchrun", "--standalone", "-m", "trainer"], "\n[health]\nstop_timeout_s = 200\n")


class TestSupervisorCommand:
    def test_prefers_the_script_we_run_as(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """Started as an installed `fsdp-supervisor` script: that absolute path is the ExecStart binary."""
        script = tmp_path / "bin" / "fsdp-supervisor"
        script.parent.mkdir()
        script.write_text("#!/bin/sh\n")
        script.chmod(0o755)
        monkeypatch.chdir(tmp_path)
        assert supervisor_command("bin/fsdp-supervisor", "/nonexistent/python") == [str(script)]

    def test_script_next_to_the_interpreter(self, tmp_path: Path) -> None:
        """Run as `python -m supervisor` from a venv: the venv's own fsdp-supervisor script is used."""
        (tmp_path / "fsdp-supervisor").write_text("#!/bin/sh\n")
        (tmp_path / "fsdp-supervisor").chmod(0o755)
        assert supervisor_command("x/__main__.py", str(tmp_path / "python")) == [str(tmp_path / "fsdp-supervisor")]

    def test_falls_back_to_python_m(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """No installed script anywhere: `<python> -m supervisor`, with the interpreter path kept unresolved."""
        monkeypatch.setenv("PATH", str(tmp_path))
        assert supervisor_command("x/__main__.py", str(tmp_path / "python")) == [
            str(tmp_path / "python"), "-m", "supervisor"]


class TestRenderUnit:
    def test_required_keys(self, config: Path) -> None:
        """The unit has the keys the issue asks for, with values derived from the config."""
        cfg = load_config(config)
        k = keys(render_unit(cfg, ["/opt/venv/bin/fsdp-supervisor"], UnitOptions(name="job", user="alice")))
        assert k["Type"] == ["notify"] and k["NotifyAccess"] == ["main"] and k["KillMode"] == ["mixed"]
        assert k["ExecStart"] == [f"/opt/venv/bin/fsdp-supervisor run -c {config}"]
        assert k["WorkingDirectory"] == [str(config.parent)] and k["User"] == ["alice"]
        assert k["Restart"] == ["on-failure"] and "3" in k["RestartPreventExitStatus"][0].split()
        assert int(k["TimeoutStopSec"][0]) >= 200 + STOP_MARGIN_S
        assert int(k["WatchdogSec"][0]) > 0 and int(k["RestartSec"][0]) > 0
        assert k["StartLimitIntervalSec"] and k["StartLimitBurst"]
        assert k["NoNewPrivileges"] == ["yes"] and k["PrivateTmp"] == ["yes"] and k["ProtectSystem"] == ["strict"]
        assert k["ReadWritePaths"][0].split() == [str(config.parent / "ckpts"), str(config.parent / ".fsdp-supervisor")]
        assert k["OOMPolicy"] == ["continue"]

    def test_paths_with_blanks_and_specifiers_are_escaped(self, tmp_path: Path) -> None:
        """Under 'my runs/100%$x': quoted, `%` doubled everywhere, `$` doubled only where systemd expands it."""
        d = tmp_path / "my runs" / "100%$x"
        d.mkdir(parents=True)
        cfg = load_config(write_config(d, ["true"]))
        k = keys(render_unit(cfg, ["/x/fsdp-supervisor"], UnitOptions(name="job")))
        escaped = str(d).replace("%", "%%")
        assert k["ExecStart"] == [f'/x/fsdp-supervisor run -c "{escaped.replace("$", "$$")}/job.toml"']
        assert k["ReadWritePaths"] == k["RequiresMountsFor"] == [f'"{escaped}/ckpts" "{escaped}/.fsdp-supervisor"']
        assert k["WorkingDirectory"] == [escaped]

    def test_backslash_in_path_refused(self, tmp_path: Path) -> None:
        """A path with a backslash (unescaped differently by different keys) is refused, naming it."""
        d = tmp_path / "a\\b"
        d.mkdir()
        with pytest.raises(UsageError, match="backslash"):
            render_unit(load_config(write_config(d, ["true"])), ["/x"], UnitOptions(name="job"))

    # Only this nesting: a run dir inside the checkpoint root is a config error (supervisor/config.py).
    @pytest.mark.parametrize(("ckpts", "run_dir"), [("state/ckpts", "state")])
    def test_nested_paths_listed_once(self, tmp_path: Path, ckpts: str, run_dir: str) -> None:
        """When the run dir contains the checkpoint root, only the outer one is listed."""
        path = write_config(tmp_path, ["true"], f'\n[supervisor]\nrun_dir = "{run_dir}"\n')
        path.write_text(path.read_text().replace('dir = "ckpts"', f'dir = "{ckpts}"'))
        outer = min(ckpts, run_dir, key=len)
        assert unit_paths(load_config(path)) == [tmp_path / outer]

    def test_no_user_line_without_user(self, config: Path) -> None:
        """Without --user the unit has no User= (root, or the per-user manager)."""
        assert "User" not in keys(render_unit(load_config(config), ["/x"], UnitOptions(name="job")))

    @pytest.mark.parametrize("name", ["", "a b", "../x", "-x", "x" * 65])
    def test_bad_name_rejected(self, name: str) -> None:
        """A name that cannot be a directory or a journal identifier is a usage error naming --name."""
        with pytest.raises(UsageError, match="--name"):
            UnitOptions(name=name)

    @pytest.mark.parametrize("user", ["", "a b", "x\nExecStartPre=/bin/sh", "-root"])
    def test_bad_user_rejected(self, user: str) -> None:
        """A --user that is not a plain user name or uid cannot smuggle lines into the unit."""
        with pytest.raises(UsageError, match="--user"):
            UnitOptions(name="job", user=user)


class TestCommand:
    def test_notes_on_what_would_fail_at_start(self, tmp_path: Path) -> None:
        """Missing ReadWritePaths dirs and paths hidden by PrivateTmp are named; existing dirs elsewhere are not."""
        cfg = load_config(write_config(tmp_path, ["true"]))
        notes = unit_notes(cfg)
        assert any("mkdir -p" in n and str(cfg.checkpoints.dir) in n for n in notes)
        assert any("PrivateTmp" in n and str(cfg.path) in n for n in notes) == (Path("/tmp") in tmp_path.parents)
        cfg.checkpoints.dir.mkdir()
        cfg.run_dir.mkdir()
        assert not any("mkdir" in n for n in unit_notes(cfg))

    def test_template_keys_match_generator(self, config: Path) -> None:
        """The template sets the same service keys as a generated unit, apart from the per-config ones."""
        generated = keys(render_unit(load_config(config), ["/x"], UnitOptions(name="job")))
        template = keys(TEMPLATE.read_text())
        per_config = {"Description", "ExecStart", "WorkingDirectory", "SyslogIdentifier", "CacheDirectory",
                      "Environment", "ReadWritePaths", "RequiresMountsFor", "TimeoutStartSec", "TimeoutStopSec"}
        for key, values in generated.items():
            if key not in per_config:
                assert template.get(key) == values, key
