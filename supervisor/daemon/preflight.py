"""Before `run` creates or launches anything: can the directories and the program a config names be used?

`load_config` checks what a config says; this module checks it against the filesystem (the directories, the
program and its `#!` interpreter, a `-m trainer` that resolves to another distribution's package, a root set one
level too high). Each problem is a ConfigError line naming the key, raised before the first directory is
created, so a mistyped path leaves no trace behind; `make_dirs`'s failures are config errors too.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Sequence
from pathlib import Path

from supervisor import torchrun_args
from supervisor.checkpoints.sidecars import sidecar_problem
from supervisor.config import Config, local_tier_nodes_error
from supervisor.contract import HEARTBEAT_FILE, RANK_HEARTBEAT_DIR
from supervisor.daemon.statefile import STATE_FILE
from supervisor.errors import CheckpointError, ConfigError
from supervisor.history.records import HISTORY_FILE
from supervisor.host.identity import TOKEN_FILE
from supervisor.host.regularfile import open_regular
from supervisor.host.runlock import LOCK_FILE
from supervisor.observe.eventlog import LOG_FILE

__all__ = ["check_setup", "command_warnings", "job_program", "make_dirs", "rendezvous_key", "trainer_module",
           "trainer_problem", "writable_above"]

DIST = "fsdp-supervisor"
# The first line of trainer/__init__.py's docstring says this (tests/unit/test_preflight_trainer.py checks it).
TRAINER_MARK = "Reference FSDP trainer for fsdp-supervisor"
_PROBE_TIMEOUT_S = 10
# Run by the job's Python in the job's cwd and environment: where `trainer` resolves, who installed it.
_PROBE = """
import importlib.metadata, importlib.util, json, sys
spec = importlib.util.find_spec(sys.argv[1])
origin = spec.origin if spec is not None and spec.origin and spec.origin.endswith(".py") else None
head = ""
if origin:
    with open(origin, errors="replace") as f:
        head = f.read(4096)
owners = importlib.metadata.packages_distributions().get(sys.argv[1], [])
print(json.dumps({"origin": origin, "owners": owners, "head": head}))
"""


def _dir_problem(path: Path) -> str | None:
    """Why `path` cannot be used (or created) as a writable directory, or None."""
    probe = path
    while True:  # up to the nearest entry that exists: `path` itself, or where its creation would start
        try:
            st = os.stat(probe)
            break
        except (FileNotFoundError, NotADirectoryError):
            if probe.parent == probe:
                return f"{probe} does not exist"
            probe = probe.parent
        except OSError as exc:  # ELOOP, EACCES on the way
            return f"cannot use {probe}: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{probe} is {'a file' if stat.S_ISREG(st.st_mode) else 'not a directory'}" + (
            "" if probe == path else f", so {path} cannot be created")
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable" + ("" if probe == path else f", so {path} cannot be created")
    return None


def job_program(cfg: Config) -> str | None:
    """The executable `[job] command` names, found like the job's exec will find it (a bare name on the job's
    `PATH`, else ours, as the shell does); None when it cannot run. `systemd-unit` finds it the same way."""
    prog = cfg.job.command[0]
    if os.sep in prog:
        candidate = str(cfg.job_cwd / prog)
        return candidate if os.path.isfile(candidate) and os.access(candidate, os.X_OK) else None
    return shutil.which(prog, path=cfg.job.env.get("PATH", os.environ.get("PATH")))


def _interpreter_problem(program: str) -> str | None:
    """Why the `#!` interpreter of a script cannot run, or None (not a script, or one the kernel can start).

    exec reports a missing interpreter as ENOENT for the script itself, which reads as "no such file" for a
    file that is there. Only an absolute interpreter is checked: that is the one the kernel runs as is.
    """
    words = _shebang(program)
    interpreter = words[0] if words else ""
    if not os.path.isabs(interpreter):
        return None
    if os.path.isfile(interpreter) and os.access(interpreter, os.X_OK):
        return None
    return f"its #! interpreter {interpreter} is missing, not a file or not executable"


def rendezvous_key(command: Sequence[str]) -> str | None:
    """The multi-node job a torchrun command joins (its rendezvous), or None for a single-node job (pure).

    The supervisors of one multi-node job (one per node) share the checkpoint root's claim: their commands
    name the same rendezvous (`--rdzv-endpoint` and `--rdzv-id`, or `--master-addr` and `--master-port`).
    A command with `--nnodes` 1 (or none), or not torchrun at all, is a job of its own.
    """
    if not torchrun_args.spans_nodes(torchrun_args.nnodes(command, {})):
        return None
    args = torchrun_args.launcher_args(command)
    endpoint, rdzv_id = torchrun_args.flag(args, "--rdzv-endpoint"), torchrun_args.flag(args, "--rdzv-id")
    if endpoint or (rdzv_id and rdzv_id != "none"):
        return f"rdzv {endpoint or ''} {rdzv_id or 'none'}"
    addr, port = torchrun_args.flag(args, "--master-addr"), torchrun_args.flag(args, "--master-port")
    return f"master {addr or '127.0.0.1'}:{port or '29500'}"


def command_warnings(command: Sequence[str]) -> list[str]:
    """What `run` warns about once at start-up in a command that will run (pure).

    torchrun's own restarts (`--max-restarts`, default 0 in today's torch but not in every release or wrapper)
    would restart the workers behind the supervisor's back, from no checkpoint the supervisor chose: the
    README says to always pass it; a command without it gets one warning.
    """
    if not torchrun_args.is_torchrun(command):
        return []
    flags = {a.split("=", 1)[0] for a in command[1:]}
    if flags & {"--max-restarts", "--max_restarts"}:
        return []
    return [("torchrun without --max-restarts: pass it explicitly (--max-restarts=0 lets the supervisor decide "
             "every restart)")]


def trainer_module(command: Sequence[str]) -> str | None:
    """The top-level module after `-m`/`--module` when it is `trainer` (python's `-m trainer`, torchrun's
    `-m trainer`), else None (pure)."""
    for flag, word in zip(command, command[1:]):
        if flag in ("-m", "--module") and word.split(".")[0] == "trainer":
            return "trainer"
    return None


def trainer_problem(python: str, origin: str | None, owners: Sequence[str], head: str) -> str | None:
    """Why the `trainer` that `python` imports is not our reference trainer, or None (pure).

    `origin`: its `__init__.py` (None: not importable, which the job itself reports); `owners`: the
    distributions that installed it; `head`: the start of that file.
    """
    others = sorted({o for o in owners if re.sub(r"[-_.]+", "-", o).lower() != DIST})
    fix = "run the job from a venv without it (README, Install)"
    if others:
        return (f"-m trainer: {python} imports `trainer` from the distribution {', '.join(others)} ({origin}), "
                f"not fsdp-supervisor's reference trainer; {fix}")
    if origin is not None and TRAINER_MARK not in head:
        return f"-m trainer: {python} imports `trainer` from {origin}, not fsdp-supervisor's reference trainer; {fix}"
    return None


def _shebang(program: str) -> list[str]:
    """The words of a script's `#!` line (interpreter first); [] for no script, or one that cannot be read."""
    try:
        with open(open_regular(program), "rb") as f:
            head = f.read(256)
    except OSError:
        return []
    return [os.fsdecode(w) for w in head[2:].split(b"\n", 1)[0].split()] if head.startswith(b"#!") else []


def _job_python(cfg: Config, program: str) -> str | None:
    """The Python that will import the job's `-m` module: the program itself, or its `#!` interpreter (torchrun)."""
    if os.path.basename(program).startswith("python"):
        return program
    words = _shebang(program)
    if len(words) >= 2 and os.path.basename(words[0]) == "env":  # #!/usr/bin/env python3
        return shutil.which(words[1], path=cfg.job.env.get("PATH", os.environ.get("PATH")))
    return words[0] if words and os.path.basename(words[0]).startswith("python") else None


def _check_trainer(cfg: Config, program: str) -> None:
    """A `-m trainer` job: the job's Python must import our trainer, not Coqui's (one short subprocess)."""
    module = trainer_module(cfg.job.command)
    python = _job_python(cfg, program) if module else None
    if module is None or python is None:
        return
    try:
        out = subprocess.run([python, "-c", _PROBE, module], capture_output=True, text=True, cwd=cfg.job_cwd,
                             env={**os.environ, **cfg.job.env}, timeout=_PROBE_TIMEOUT_S, check=True)
        found = json.loads(out.stdout)
        problem = trainer_problem(python, found["origin"], list(found["owners"]), str(found["head"]))
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, TypeError):
        return  # could not tell: the job's own start-up will say what is wrong
    if problem:
        raise ConfigError(f"{cfg.path}: [job.command] {problem}")


def _check_root_layout(cfg: Config) -> None:
    """The store's judgement of the root itself: a root holding a checkpoint *directory* is set too high."""
    from supervisor.checkpoints import check_root  # here: the store's ranking is not needed before this

    try:
        check_root(cfg.checkpoints.dir)
    except CheckpointError as exc:
        raise ConfigError(f"{cfg.path}: [checkpoints.dir] {exc}") from None
    except OSError as exc:  # a root we may not list
        raise ConfigError(
            f"{cfg.path}: [checkpoints.dir] cannot read {cfg.checkpoints.dir}: {exc.strerror or exc}") from None


def check_setup(cfg: Config) -> None:
    """Raise ConfigError naming the key when `run` could not set up or launch; creates nothing."""
    cwd = cfg.job_cwd
    if not cwd.is_dir():
        raise ConfigError(f"{cfg.path}: [job.cwd] {cwd} is not a directory")
    program = job_program(cfg)
    prog = cfg.job.command[0]
    if program is None:
        raise ConfigError(f"{cfg.path}: [job.command] program {prog!r} not found, not a file or not executable")
    problem = _interpreter_problem(program)
    if problem:
        raise ConfigError(f"{cfg.path}: [job.command] program {prog!r}: {problem}")
    _check_trainer(cfg, program)
    if cfg.run_dir.is_dir():  # "belongs to uid 0" (made by sudo) says more than "not writable"
        _check_run_dir(cfg)
    for key, path in _dirs(cfg):
        # A local tier that cannot be written is an optimisation lost (`run` warns: tier_problem), never a refusal;
        # one under a folder anyone may write to is (a swapped link would take our writes).
        problem = (None if key == "checkpoints.local_dir" else _dir_problem(path)) or writable_above(path, str(path))
        if problem:
            raise ConfigError(f"{cfg.path}: [{key}] {problem}")
    _check_run_dir(cfg)
    problem = local_tier_nodes_error(cfg, {**os.environ, **cfg.job.env})
    if problem:
        raise ConfigError(f"{cfg.path}: {problem}")
    if cfg.checkpoints.dir.is_dir():
        _check_root_layout(cfg)


def _check_run_dir(cfg: Config) -> None:
    problem = run_dir_problem(cfg.run_dir)
    if problem:
        raise ConfigError(f"{cfg.path}: [supervisor.run_dir] {problem}; refusing to use it. Remove it (or give it to "
                          "the user that runs the supervisor, folders mode 0700; a folder above: chmod +t), or set "
                          "run_dir to a folder of its own")


def run_dir_problem(run_dir: Path) -> str | None:
    """Why the run dir, a folder of it or a file the daemon writes or reads there is not ours to use, or None: a
    symlink, another user's, a folder writable by others without the sticky bit (issue 35: a planted
    `supervisor.lock -> ~victim/notes.txt` truncated the victim's file, a foreign beat got a job killed as hung)."""
    folders = ("", "logs", RANK_HEARTBEAT_DIR, "errors")
    for name in (*folders, LOCK_FILE, LOG_FILE, HISTORY_FILE, STATE_FILE, TOKEN_FILE, HEARTBEAT_FILE):
        try:
            st = os.lstat(run_dir / name)
        except OSError:
            continue  # not there (yet): made ours by whoever makes it
        problem = sidecar_problem(run_dir / name, st, {os.geteuid()}, folder=name in folders,  # only beats
                                  sticky_ok=name == RANK_HEARTBEAT_DIR)  # are read by owner: a sticky /tmp is not ours
        if problem:
            return problem
    return writable_above(run_dir, "the run dir")


def writable_above(path: Path, what: str) -> str | None:
    """A folder above `path` that others may write without the sticky bit, said, or None: anyone may rename `path`
    away and put a link to their own folder there (logs, error files, checkpoints the job resumes from)."""
    for above in Path(os.path.abspath(path)).parents:
        try:
            mode = os.stat(above).st_mode
        except OSError:
            continue
        if mode & 0o002 and not mode & stat.S_ISVTX:
            return (f"{above}, above {what}, is writable by others without the sticky bit (mode {mode & 0o7777:04o}): "
                    "anyone may put their own folder in its place; chmod +t it, or use a folder elsewhere")
    return None


def tier_problem(cfg: Config) -> str | None:
    """Why the node-local tier cannot be written (the job then saves to the durable root only), or None."""
    return _dir_problem(cfg.checkpoints.local_dir) if cfg.checkpoints.local_dir is not None else None


def _dirs(cfg: Config) -> list[tuple[str, Path]]:
    """The directories `run` needs, by config key: the run dir and the checkpoint root(s)."""
    local = cfg.checkpoints.local_dir
    return [("supervisor.run_dir", cfg.run_dir), ("checkpoints.dir", cfg.checkpoints.dir),
            *([("checkpoints.local_dir", local)] if local is not None else [])]


def _missing(path: Path) -> list[Path]:
    """`path` and its ancestors that do not exist yet, outermost first."""
    out: list[Path] = []
    while not os.path.lexists(path) and path.parent != path:
        out.append(path)
        path = path.parent
    return out[::-1]


def _owner_only(d: Path) -> None:
    """Take group and other access off a run-dir folder of ours made wider (the user's `mkdir` under umask 022)."""
    with contextlib.suppress(OSError):  # missing (errors/ before the first attempt), or not ours to change
        st = os.lstat(d)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077:
            os.chmod(d, stat.S_IMODE(st.st_mode) & 0o700)


def make_dirs(cfg: Config) -> None:
    """Create the run dir and logs/ (owner-only) and the checkpoint root (not world-writable); ConfigError naming the key.

    On failure the directories this call created are removed again: a failed start leaves nothing behind.
    """
    created: list[Path] = []
    try:
        roots = [(key, path, 0o750) for key, path in _dirs(cfg)[1:]]
        for key, path, mode in (("supervisor.run_dir", cfg.run_dir, 0o700),
                                ("supervisor.run_dir", cfg.run_dir / "logs", 0o700), *roots):
            try:
                for d in _missing(path):
                    try:
                        d.mkdir(mode=mode if d == path else 0o750)
                    except FileExistsError:
                        continue
                    except OSError as exc:
                        raise ConfigError(f"{cfg.path}: [{key}] cannot create {d}: {exc.strerror or exc}") from None
                    created.append(d)
                if not path.is_dir():
                    raise ConfigError(f"{cfg.path}: [{key}] {path} is not a directory")
            except ConfigError:
                if key != "checkpoints.local_dir":  # the local tier is an optimisation: `run` warns (tier_problem)
                    raise
        for d in (cfg.run_dir, cfg.run_dir / "logs", cfg.run_dir / "errors"):
            _owner_only(d)
        _check_run_dir(cfg)  # again, now that nobody else may write in it: made (or planted) since the check
    except ConfigError:
        for d in reversed(created):
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
