"""The CLI's conventions (issue 22, item 7): the default config, a bare command, status's exit codes, the
torchrun --max-restarts warning, and `checkpoints list`'s metric column and export row."""
from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest

from supervisor.cli import app
from supervisor.cli.argtypes import CONFIG_ENV, default_config
from supervisor.daemon.preflight import command_warnings
from supervisor.daemon.statefile import write_status
from supervisor.errors import UsageError
from supervisor.policy.state import State, Status
from tests.jobs.dcp_files import write_checkpoint

CONFIG = ('[job]\ncommand = ["true"]\n[checkpoints]\ndir = "ckpts"\n'
          'keep_best = { metric = "val_loss", mode = "min", k = 1 }\n')


def _main(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = app.main(list(argv))
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(("env", "exists", "want"), [
    ({CONFIG_ENV: "/srv/a.toml"}, True, "/srv/a.toml"),   # the variable wins over ./job.toml
    ({CONFIG_ENV: "/srv/a.toml"}, False, "/srv/a.toml"),
    ({}, True, "job.toml"),
    ({CONFIG_ENV: ""}, True, "job.toml"),                 # an empty variable is unset
])
def test_default_config_table(env: dict[str, str], exists: bool, want: str) -> None:
    assert default_config(env, exists=lambda p: exists) == want


def test_default_config_neither_is_a_usage_error_naming_both() -> None:
    with pytest.raises(UsageError, match=rf"-c CONFIG.*{CONFIG_ENV}.*job\.toml"):
        default_config({}, exists=lambda p: False)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "job.toml").write_text(CONFIG)
    (tmp_path / ".fsdp-supervisor").mkdir()
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    return tmp_path


@pytest.mark.parametrize("how", ["cwd", "env"])
def test_commands_find_the_config_without_c(project: Path, how: str, monkeypatch: pytest.MonkeyPatch,
                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    write_status(project / ".fsdp-supervisor", Status(pid=1, attempt=1, step=7))
    if how == "cwd":
        monkeypatch.chdir(project)
    else:
        monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
        monkeypatch.setenv(CONFIG_ENV, str(project / "job.toml"))
    rc, out, err = _main("status", "--json")
    assert json.loads(out)["step"] == 7, (out, err)
    write_checkpoint(project / "ckpts", 10)
    rc, out, err = _main("checkpoints", "list", "--json")
    assert rc == 0 and [c["step"] for c in json.loads(out)] == [10], err


def test_no_config_anywhere_is_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    rc, out, err = _main("status")
    assert rc == 2 and "no config" in err and "\n" == err[-1] and err.count("\n") == 1


def test_bare_command_lists_the_commands() -> None:
    rc, out, err = _main()
    assert rc == 2
    assert all(name in out for name in ("run", "status", "logs", "stop", "checkpoints", "systemd-unit", "report"))


@pytest.mark.parametrize(("state", "lock_held", "want"), [
    (State.COMPLETED, False, 3), (State.STOPPED, False, 3), (State.FAILED, False, 3),
    (State.RUNNING, False, 3),   # a killed supervisor's last word: not running
    (None, False, 3),            # never ran here
    (State.RUNNING, True, 0),
])
def test_status_exit_codes_follow_systemctl(project: Path, monkeypatch: pytest.MonkeyPatch,
                                           state: State | None, lock_held: bool, want: int) -> None:
    from supervisor.cli import commands

    run_dir = project / ".fsdp-supervisor"
    if state is not None:
        write_status(run_dir, Status(pid=os.getpid(), attempt=1, state=state))
    monkeypatch.setattr(commands.RunLock, "holder", staticmethod(lambda d: os.getpid() if lock_held else None))
    for flags in ((), ("--json",)):
        rc, out, err = _main("status", "-c", str(project / "job.toml"), *flags)
        assert rc == want, (flags, out, err)
        if flags and state is not None:
            assert json.loads(out)["state"] == state.value


@pytest.mark.parametrize(("command", "warns"), [
    (["torchrun", "--standalone", "--nproc-per-node=2", "train.py"], True),
    (["/venv/bin/torchrun", "--nproc-per-node", "2", "train.py"], True),
    (["python", "-m", "torch.distributed.run", "train.py"], True),
    (["torchrun", "--max-restarts=0", "train.py"], False),
    (["torchrun", "--max-restarts", "3", "train.py"], False),
    (["torchrun", "--max_restarts=0", "train.py"], False),
    (["python", "train.py"], False),
    (["accelerate", "launch", "train.py"], False),
])
def test_max_restarts_warning_table(command: list[str], warns: bool) -> None:
    got = command_warnings(command)
    assert bool(got) is warns and all("--max-restarts" in w for w in got)


def test_list_shows_the_keep_best_metric_and_the_export_as_export(project: Path) -> None:
    root = project / "ckpts"
    write_checkpoint(root, 10, metrics={"val_loss": 1.25})
    write_checkpoint(root, 20)
    best = root / "best"
    best.mkdir()
    (best / "best.json").write_text('{"step": 10, "val_loss": 1.25, "checkpoint": "x"}')
    (best / "model.safetensors").write_bytes(b"x")
    rc, out, err = _main("checkpoints", "list", "-c", str(project / "job.toml"))
    assert rc == 0, err
    header, *rows = out.splitlines()
    assert header.split()[:4] == ["NAME", "STEP", "STATE", "VAL_LOSS"]
    by_name = {r.split()[0]: r.split() for r in rows}
    assert by_name["step_00000010"][3] == "1.25" and by_name["step_00000020"][3] == "-"
    assert by_name["best"][2] == "export" and "never touched" in out
    rc, out, err = _main("checkpoints", "list", "--dir", str(root))  # no rules: no metric column
    assert out.splitlines()[0].split()[:4] == ["NAME", "STEP", "STATE", "SIZE"]
    rc, out, err = _main("checkpoints", "list", "--json", "--dir", str(root))
    assert {c["name"]: c["state"] for c in json.loads(out)}["best"] == "foreign"  # the JSON's vocabulary stays


def test_status_json_masks_the_running_jobs_secrets(project: Path) -> None:
    """Issue 35 item 7: `status --json` printed the running job's argv (state.json keeps it exactly, owner-only, to
    find an orphan) with its `--api-key` value and a `[job] env` token passed on the command line."""
    cfg = project / "job.toml"
    cfg.write_text(CONFIG.replace('command = ["true"]', 'command = ["true"]\nenv = { HF_TOKEN = "hf_tOkEn_123456" }'))
    argv = ["train.py", "--api-key", "sk-aPiKeY-0a1b", "--password=pw7hunter2x", "--hf", "hf_tOkEn_123456"]
    write_status(project / ".fsdp-supervisor", Status(pid=1, attempt=1, job_pid=2, job_cmdline=argv))
    rc, out, err = _main("status", "--json", "-c", str(cfg))
    shown = json.loads(out)["job_cmdline"]
    assert shown == ["train.py", "--api-key", "***", "--password=***", "--hf", "***"], (shown, err)
