"""Before `run` creates or launches anything: can the directories and the program a config names be used?

`load_config` checks what a config says; this module checks it against the filesystem. A run dir or
checkpoint root that is a file, under a missing or unwritable parent, or on a read-only filesystem; a job
directory that does not exist; a program that is missing, a directory or not executable, or a script
whose `#!` interpreter is; a checkpoint root that holds a whole checkpoint directory (set one level too
high) — each is a ConfigError line naming the key, raised before the first directory is created, so a
mistyped path leaves no trace behind. The directories are then created by `make_dirs`, whose failures (a
race, a full or read-only disk seen only now) are config errors too.
"""
from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Sequence
from pathlib import Path

from supervisor.config import Config
from supervisor.errors import CheckpointError, ConfigError
from supervisor.host.regularfile import open_regular

__all__ = ["check_setup", "make_dirs", "command_warnings"]


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


def _program(cfg: Config) -> str | None:
    """The executable `[job] command` names, found like the job's exec will find it; None when it cannot run."""
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
    try:
        with open_regular(program) as f:
            head = f.read(256)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split(b"\n", 1)[0].split()
    interpreter = os.fsdecode(words[0]) if words else ""
    if not os.path.isabs(interpreter):
        return None
    if os.path.isfile(interpreter) and os.access(interpreter, os.X_OK):
        return None
    return f"its #! interpreter {interpreter} is missing, not a file or not executable"


def _is_torchrun(command: Sequence[str]) -> bool:
    """`torchrun ...`, or `python -m torch.distributed.run ...` (pure)."""
    if not command:
        return False
    if os.path.basename(command[0]) == "torchrun":
        return True
    return any(a == "-m" and b == "torch.distributed.run" for a, b in zip(command, command[1:]))


def command_warnings(command: Sequence[str]) -> list[str]:
    """What `run` warns about once at start-up in a command that will run (pure).

    torchrun's own restarts (`--max-restarts`, default 0 in today's torch but not in every release or wrapper)
    would restart the workers behind the supervisor's back, from no checkpoint the supervisor chose: the
    README says to always pass it; a command without it gets one warning.
    """
    if not _is_torchrun(command):
        return []
    flags = {a.split("=", 1)[0] for a in command[1:]}
    if flags & {"--max-restarts", "--max_restarts"}:
        return []
    return [("torchrun without --max-restarts: pass it explicitly (--max-restarts=0 lets the supervisor decide "
             "every restart)")]


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
    program = _program(cfg)
    prog = cfg.job.command[0]
    if program is None:
        raise ConfigError(f"{cfg.path}: [job.command] program {prog!r} not found, not a file or not executable")
    problem = _interpreter_problem(program)
    if problem:
        raise ConfigError(f"{cfg.path}: [job.command] program {prog!r}: {problem}")
    for key, path in (("supervisor.run_dir", cfg.run_dir), ("checkpoints.dir", cfg.checkpoints.dir)):
        problem = _dir_problem(path)
        if problem:
            raise ConfigError(f"{cfg.path}: [{key}] {problem}")
    if cfg.checkpoints.dir.is_dir():
        _check_root_layout(cfg)


def _missing(path: Path) -> list[Path]:
    """`path` and its ancestors that do not exist yet, outermost first."""
    out: list[Path] = []
    while not os.path.lexists(path) and path.parent != path:
        out.append(path)
        path = path.parent
    return out[::-1]


def _owner_only(d: Path) -> None:
    """Take group and other access off a run-dir folder of ours that an earlier version made 0750/0755."""
    try:
        st = os.lstat(d)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077:
            os.chmod(d, stat.S_IMODE(st.st_mode) & 0o700)
    except OSError:
        pass  # missing (errors/ before the first attempt), or not ours to change: nothing to tighten


def make_dirs(cfg: Config) -> None:
    """Create the run dir and logs/ (owner-only) and the checkpoint root (not world-writable); ConfigError naming the key.

    On failure the directories this call created are removed again: a failed start leaves nothing behind.
    """
    created: list[Path] = []
    try:
        for key, path, mode in (("supervisor.run_dir", cfg.run_dir, 0o700),
                                ("supervisor.run_dir", cfg.run_dir / "logs", 0o700),
                                ("checkpoints.dir", cfg.checkpoints.dir, 0o750)):
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
        for d in (cfg.run_dir, cfg.run_dir / "logs", cfg.run_dir / "errors"):
            _owner_only(d)
    except ConfigError:
        for d in reversed(created):
            try:
                d.rmdir()
            except OSError:
                pass
        raise
