"""`fsdp-supervisor systemd-unit`, checked by `systemd-analyze verify`."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from supervisor.cli.systemd import (
    SERVICE_PATH,
    STOP_MARGIN_S,
    UnitOptions,
    default_name,
    private_tmp_paths,
    render_unit,
    supervisor_command,
    unit_notes,
    unit_path,
    unit_paths,
    write_paths,
)
from supervisor.config import Config, load_config
from supervisor.errors import UsageError
from tests.supervise import write_config


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


class TestStopTimeoutBounds:
    """Issue 35 item 2: no stop_timeout_s that loads can make a TimeoutStopSec systemd cannot parse."""

    @pytest.mark.parametrize("seconds", ["1", "2592000", "2591999.5"])
    def test_the_range_renders_whole_seconds(self, tmp_path: Path, seconds: str) -> None:
        """Both ends of the range give plain whole seconds (1e300 gave 1e+300 + margin, which systemd rejects)."""
        cfg = load_config(write_config(tmp_path, ["torchrun", "-m", "trainer"], f"\n[health]\nstop_timeout_s = {seconds}\n"))
        value = keys(render_unit(cfg, ["/x/fsdp-supervisor"], UnitOptions(name="job", user="alice")))["TimeoutStopSec"][0]
        assert value.isdigit() and int(value) >= math.ceil(float(seconds)) + STOP_MARGIN_S, value

    def test_past_the_range_is_a_config_error(self, tmp_path: Path) -> None:
        with pytest.raises(Exception, match=r"\[health.stop_timeout_s\] = 1e\+300 is out of range \[1, 2592000\]"):
            load_config(write_config(tmp_path, ["torchrun", "-m", "trainer"], "\n[health]\nstop_timeout_s = 1e300\n"))


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
        assert k["NoNewPrivileges"] == ["yes"] and k["ProtectSystem"] == ["strict"]
        assert k["PrivateTmp"] == ["no" if Path("/tmp") in config.parents else "yes"]  # TestPrivateTmp
        assert k["RequiresMountsFor"][0].split() == [str(config.parent / "ckpts"), str(config.parent / ".fsdp-supervisor")]
        assert k["ReadWritePaths"][0].split() == [str(p) for p in write_paths(cfg)]  # TestWritePaths
        assert k["OOMPolicy"] == ["continue"]
        assert k["SyslogIdentifier"] == ["job"]

    def test_path_has_the_programs_dir_first(self, config: Path) -> None:
        """systemd's environment has no venv on PATH: the unit's PATH starts with the job's program's directory,
        then the usual system directories."""
        k = keys(render_unit(load_config(config), ["/x"], UnitOptions(name="job", program_dir="/opt/train/bin")))
        assert [e for e in k["Environment"] if "PATH=" in e] == [f"PATH=/opt/train/bin:{SERVICE_PATH}"]

    def test_warnings_are_comments_before_the_unit(self, config: Path) -> None:
        """Warnings go into the unit as `# warning:` comments (so `| sudo tee` keeps them), before `[Unit]`."""
        unit = render_unit(load_config(config), ["/x"], UnitOptions(name="job", warnings=("mkdir -p /a", "b")))
        head = unit[:unit.index("[Unit]")].splitlines()
        assert [line for line in head if line.startswith("# warning:")] == ["# warning: mkdir -p /a", "# warning: b"]

    def test_warning_with_a_newline_refused(self, config: Path) -> None:
        """A warning cannot smuggle a line into the unit."""
        with pytest.raises(UsageError, match="newline"):
            render_unit(load_config(config), ["/x"], UnitOptions(name="job", warnings=("a\nExecStartPre=/bin/sh",)))

    def test_paths_with_blanks_and_specifiers_are_escaped(self, tmp_path: Path) -> None:
        """Under 'my runs/100%$x': quoted, `%` doubled everywhere, `$` doubled only where systemd expands it."""
        d = tmp_path / "my runs" / "100%$x"
        d.mkdir(parents=True)
        cfg = load_config(write_config(d, ["true"]))
        k = keys(render_unit(cfg, ["/x/fsdp-supervisor"], UnitOptions(name="job")))
        escaped = str(d).replace("%", "%%")
        assert k["ExecStart"] == [f'/x/fsdp-supervisor run -c "{escaped.replace("$", "$$")}/job.toml"']
        assert k["RequiresMountsFor"] == [f'"{escaped}/ckpts" "{escaped}/.fsdp-supervisor"']
        under_tmp = Path("/tmp") in d.parents  # then /tmp itself is writable (TestWritePaths)
        assert k["ReadWritePaths"] == ["/tmp /var/tmp" if under_tmp else f'"{escaped}"']
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


class TestUnitPath:
    @pytest.mark.parametrize(("program_dir", "expected"), [
        (None, SERVICE_PATH),
        ("/opt/train/bin", "/opt/train/bin:" + SERVICE_PATH),
        ("/usr/bin", "/usr/bin:" + SERVICE_PATH.replace(":/usr/bin", "")),  # moved first, not repeated
    ])
    def test_table(self, program_dir: str | None, expected: str) -> None:
        """The program's directory first, then systemd's own default PATH, each directory once."""
        assert unit_path(program_dir) == expected

    def test_colon_refused(self) -> None:
        """A directory with ':' cannot be one entry of PATH: a usage error, not a broken PATH."""
        with pytest.raises(UsageError, match="':'"):
            unit_path("/opt/a:b/bin")


class TestDefaultName:
    @pytest.mark.parametrize(("config", "name"), [
        ("/srv/llm/job.toml", "llm"),       # the generic name: its directory says which job it is
        ("/srv/llm/demo.toml", "demo"),
        ("/srv/my runs/job.toml", "job"),   # a directory name that cannot be a unit name
        ("/job.toml", "job"),
    ])
    def test_table(self, config: str, name: str) -> None:
        """SyslogIdentifier= and CacheDirectory= without --name: not `job` for every job.toml."""
        assert default_name(Path(config)) == name


class TestWritePaths:
    """ReadWritePaths=: what the sandbox of ProtectSystem=strict leaves writable. The supervisor parks deletions,
    and keeps its claim and in-use markers, next to the checkpoint root: with only the root writable (a bind mount
    of its own) retention failed every rename with EXDEV and deleted nothing."""

    @staticmethod
    def placed(tmp_path: Path, ckpts: str, run_dir: str) -> Config:
        """A config at /srv/llm/job.toml with these (absolute) paths, which need not exist: render_unit is pure."""
        cfg = load_config(write_config(tmp_path, ["true"]))
        return cfg.model_copy(update={
            "path": Path("/srv/llm/job.toml"),
            "checkpoints": cfg.checkpoints.model_copy(update={"dir": Path(ckpts)}),
            "supervisor": cfg.supervisor.model_copy(update={"run_dir": Path(run_dir)}),
        })

    @pytest.mark.parametrize(("ckpts", "run_dir", "expected"), [
        ("/srv/llm/ckpts", "/srv/llm/.fsdp-supervisor", ["/srv/llm"]),          # the usual layout: one folder
        ("/shared/ckpts/llm", "/srv/llm/run", ["/shared/ckpts", "/srv/llm/run"]),
        ("/ckpts", "/srv/run", ["/ckpts", "/srv/run"]),                          # never ReadWritePaths=/
        ("/tmp/x/ckpts", "/srv/run", ["/tmp", "/var/tmp", "/srv/run"]),           # PrivateTmp=no: /tmp writable
    ])
    def test_table(self, tmp_path: Path, ckpts: str, run_dir: str, expected: list[str]) -> None:
        """The checkpoint root's folder and the run dir, each once; /tmp and /var/tmp when they are not private."""
        cfg = self.placed(tmp_path, ckpts, run_dir)
        got = [str(p) for p in write_paths(cfg)]
        assert sorted(got) == sorted(expected)
        unit = render_unit(cfg, ["/x"], UnitOptions(name="job"))
        assert keys(unit)["ReadWritePaths"] == [" ".join(got)]
        assert keys(unit)["RequiresMountsFor"] == [f"{ckpts} {run_dir}"]  # the mounts are the root's, not its folder's

    def test_the_local_tier_is_writable_and_mounted_too(self, tmp_path: Path) -> None:
        """[checkpoints] local_dir on a local NVMe: its folder is writable (its trash, markers and claim go there)
        and the unit waits for its mount, as for the durable root."""
        cfg = self.placed(tmp_path, "/srv/llm/ckpts", "/srv/llm/run")
        cfg = cfg.model_copy(update={"checkpoints": cfg.checkpoints.model_copy(update={"local_dir": Path("/nvme/llm")})})
        assert write_paths(cfg) == [Path("/srv/llm"), Path("/nvme")]
        assert keys(render_unit(cfg, ["/x"], UnitOptions(name="job")))["RequiresMountsFor"] == [
            "/srv/llm/ckpts /nvme/llm /srv/llm/run"]

    def test_a_symlinked_root_writes_next_to_its_target(self, tmp_path: Path) -> None:
        """The sidecars go next to the resolved root: its folder is the one made writable."""
        cfg = self.placed(tmp_path, "/srv/llm/ckpts", "/srv/llm/run")
        assert write_paths(cfg, Path("/scratch/alice/ckpts")) == [Path("/scratch/alice"), Path("/srv/llm/run")]


class TestPrivateTmp:
    @pytest.mark.parametrize(("paths", "hidden"), [
        (["/srv/llm/job.toml", "/srv/llm/ckpts"], []),
        (["/tmp/x/job.toml", "/srv/ckpts"], ["/tmp/x/job.toml"]),
        (["/srv/job.toml", "/var/tmp/ckpts"], ["/var/tmp/ckpts"]),
        (["/tmpfoo/job.toml", "/tmp"], []),  # only what is inside /tmp
    ])
    def test_table(self, paths: list[str], hidden: list[str]) -> None:
        """The paths PrivateTmp=yes would hide from the service."""
        assert private_tmp_paths([Path(p) for p in paths]) == hidden

    def test_unit_under_tmp_says_private_tmp_no(self, tmp_path: Path) -> None:
        """A config under /tmp gets PrivateTmp=no (and a comment why), not a unit that cannot see its config."""
        if Path("/tmp") not in tmp_path.parents:
            pytest.skip("pytest's tmp_path is not under /tmp here")
        unit = render_unit(load_config(write_config(tmp_path, ["true"])), ["/x"], UnitOptions(name="job"))
        assert keys(unit)["PrivateTmp"] == ["no"] and f"must see {tmp_path}/job.toml" in unit


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

    def test_notes_for_a_user(self, tmp_path: Path) -> None:
        """With --user: the dirs to create are chowned to it, and a user this machine lacks is named (217/USER)."""
        cfg = load_config(write_config(tmp_path, ["true"]))
        notes = unit_notes(cfg, user="no-such-user-fsdp")
        assert any("chown no-such-user-fsdp" in n for n in notes)
        assert any("User=no-such-user-fsdp does not exist" in n for n in notes)
        assert not any("does not exist" in n for n in unit_notes(cfg, user="root"))
