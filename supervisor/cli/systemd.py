"""`fsdp-supervisor systemd-unit`: render a systemd service unit for one job.toml.

What the unit says and why (`Type=notify`, `KillMode=mixed`, `PATH`, the `# warning:` comments):
docs/operations.md, 'As a systemd service'. A program that cannot be found is exit 2; it is found here as the
user's shell finds it now, since systemd starts the service with an almost empty environment.
"""
from __future__ import annotations

import argparse
import math
import os
import pwd
import re
import shlex
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from supervisor.cli.argtypes import add_config_arg
from supervisor.config import Config, load_config
from supervisor.daemon.preflight import job_program
from supervisor.errors import EXIT_OK, ConfigError, UsageError

__all__ = [
    "UnitOptions", "render_unit", "supervisor_command", "unit_paths", "unit_notes", "register", "cmd_systemd_unit",
    "SERVICE_PATH", "unit_path", "default_name", "private_tmp_paths", "write_paths",
]

# systemd SIGKILLs the whole cgroup after TimeoutStopSec; the supervisor needs stop_timeout_s for the
# job's emergency save, then a little for its own SIGKILL of the job tree, the survivor sweep and state.json.
STOP_MARGIN_S = 30
# Start-up may first stop a job orphaned by a SIGKILLed supervisor (up to stop_timeout_s) before READY=1.
START_MARGIN_S = 60
DEFAULT_WATCHDOG_S = 60
DEFAULT_RESTART_S = 30
_PRIVATE_TMP = (Path("/tmp"), Path("/var/tmp"))
# After the job's program's directory: what a login shell has on any distribution (systemd's own default).
SERVICE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The name also becomes a directory (CacheDirectory=) and a journal identifier: keep it plain.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
_USER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}|[0-9]+")  # what systemd accepts in User=


@dataclass(frozen=True)
class UnitOptions:
    """What the command line (and this machine) adds to the config: unit name, account, watchdog period, the
    directory of the job's program (first in the unit's PATH), and the warnings to write into the unit."""

    name: str
    user: str | None = None
    watchdog_s: int = DEFAULT_WATCHDOG_S
    restart_s: int = DEFAULT_RESTART_S
    program_dir: str | None = None
    warnings: tuple[str, ...] = ()
    root: Path | None = None  # the checkpoint root as resolved here (a symlink's target); None: as configured
    local_root: Path | None = None  # likewise the node-local tier ([checkpoints] local_dir), if any

    def __post_init__(self) -> None:
        if not _NAME_RE.fullmatch(self.name):
            raise UsageError(f"--name {self.name!r}: letters, digits and _.@- only, at most 64, not starting with _.@-")
        if self.user is not None and not _USER_RE.fullmatch(self.user):
            raise UsageError(f"--user {self.user!r}: not a valid user name or uid")
        if self.watchdog_s < 0:
            raise UsageError(f"--watchdog-sec {self.watchdog_s}: must be >= 0")


def supervisor_command(argv0: str | None = None, executable: str | None = None) -> list[str]:
    """Absolute argv prefix that runs this installation's `fsdp-supervisor`.

    Prefer the script we were started as, then the one installed next to this interpreter (a venv's
    bin/), then PATH; else `python -m supervisor`. Paths are made absolute but symlinks are not
    resolved: resolving a venv's python would escape the venv and lose its packages.
    """
    argv0 = sys.argv[0] if argv0 is None else argv0
    executable = sys.executable if executable is None else executable
    candidates = []
    if os.path.basename(argv0) == "fsdp-supervisor":
        candidates.append(argv0)
    if executable:
        candidates.append(os.path.join(os.path.dirname(executable), "fsdp-supervisor"))
    found = shutil.which("fsdp-supervisor")
    if found:
        candidates.append(found)
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return [os.path.abspath(c)]
    return [os.path.abspath(executable), "-m", "supervisor"]


def _plain(value: str, what: str) -> str:
    """A whole-line value (WorkingDirectory=, Description=): only `%` specifiers need escaping."""
    if any(c in value for c in "\n\r\0"):
        raise UsageError(f"{what} {value!r}: contains a newline or NUL, cannot go in a unit file")
    return value.replace("%", "%%")


def _escape(word: str, what: str, *, exec_line: bool = False) -> str:
    """One word of a list (ExecStart=, ReadWritePaths=): quoted if it has blanks; `$` expands in ExecStart only."""
    if "\\" in word or '"' in word:  # ExecStart= and ReadWritePaths= unescape differently: refuse both
        raise UsageError(f"{what} {word!r}: contains a backslash or double quote, cannot go in a unit file")
    word = _plain(word, what)
    if exec_line:
        word = word.replace("$", "$$")
    return f'"{word}"' if any(c.isspace() or c in "';" for c in word) else word


def unit_path(program_dir: str | None) -> str:
    """The unit's PATH: the job's program's directory first, then SERVICE_PATH (pure)."""
    if program_dir is None:
        return SERVICE_PATH
    if ":" in program_dir:
        raise UsageError(f"program directory {program_dir!r}: contains ':', cannot go in PATH")
    rest = [d for d in SERVICE_PATH.split(":") if d != program_dir]
    return ":".join([program_dir, *rest])


def private_tmp_paths(paths: Sequence[Path]) -> list[str]:
    """Those of `paths` under /tmp or /var/tmp, which PrivateTmp=yes would hide from the service (pure)."""
    return [str(p) for p in paths if any(t in p.parents for t in _PRIVATE_TMP)]


def _outermost(paths: Sequence[Path]) -> list[Path]:
    """`paths` in order, each once, without those inside another one (pure)."""
    out: list[Path] = []
    for p in paths:
        if not any(p == q or q in p.parents for q in out):
            out = [q for q in out if p not in q.parents] + [p]
    return out


def unit_paths(cfg: Config) -> list[Path]:
    """The checkpoint root(s) and the run dir (no nested duplicates): what must be mounted, and exist, at start."""
    local = cfg.checkpoints.local_dir
    return _outermost([cfg.checkpoints.dir, *([local] if local is not None else []), cfg.run_dir])


def write_paths(cfg: Config, root: Path | None = None, local_root: Path | None = None) -> list[Path]:
    """What the service may write (ReadWritePaths=; pure): the folder holding the checkpoint root (and the one
    holding the node-local tier, if any), the run dir, and /tmp and /var/tmp when the unit says PrivateTmp=no.

    Why the folder and not the root, and why /tmp: docs/operations.md, 'As a systemd service' (the hardening row).
    `root` is the root as resolved here, since the sidecars go next to a symlink's target.
    """
    root = cfg.checkpoints.dir if root is None else root
    local = cfg.checkpoints.local_dir if local_root is None else local_root
    homes = [r.parent if r.parent != r.parent.parent else r for r in (root, *([local] if local else []))]  # never /
    tmp = list(_PRIVATE_TMP) if private_tmp_paths([cfg.path, *unit_paths(cfg)]) else []  # as render_unit
    return _outermost([*homes, cfg.run_dir, *tmp])


def render_unit(cfg: Config, exec_prefix: Sequence[str], opts: UnitOptions) -> str:
    """The unit file text for `cfg` (pure: no file system access)."""
    stop_s = math.ceil(cfg.health.stop_timeout_s) + STOP_MARGIN_S
    start_s = math.ceil(cfg.health.stop_timeout_s) + START_MARGIN_S
    exec_start = " ".join(_escape(a, "ExecStart", exec_line=True) for a in [*exec_prefix, "run", "-c", str(cfg.path)])
    mounts = " ".join(_escape(str(p), "RequiresMountsFor") for p in unit_paths(cfg))
    rw = " ".join(_escape(str(p), "ReadWritePaths") for p in write_paths(cfg, opts.root, opts.local_root))
    name = opts.name
    hidden = private_tmp_paths([cfg.path, *unit_paths(cfg)])
    lines = [
        "# Generated by `fsdp-supervisor systemd-unit`; regenerate after changing stop_timeout_s, paths or the job's venv.",
        *(f"# warning: {_plain(w, 'warning')}" for w in opts.warnings),
        "[Unit]",
        f"Description=fsdp-supervisor {name} ({_plain(str(cfg.path), 'config')})",
        "After=network-online.target remote-fs.target",
        "Wants=network-online.target",
        "# Checkpoints on shared storage: start only once it is mounted.",
        f"RequiresMountsFor={mounts}",
        "# A supervisor that dies at once five times in ten minutes is broken, not unlucky.",
        "StartLimitIntervalSec=600",
        "StartLimitBurst=5",
        "",
        "[Service]",
        "Type=notify",
        "NotifyAccess=main",
        f"ExecStart={exec_start}",
        f"WorkingDirectory={_plain(str(cfg.path.parent), 'WorkingDirectory')}",
    ]
    if opts.user:
        lines.append(f"User={opts.user}")
    lines += [
        f"SyslogIdentifier={name}",
        "# systemd's environment is nearly empty: the job's program is found in its directory, first here.",
        f"Environment={_escape('PATH=' + unit_path(opts.program_dir), 'PATH')}",
        "Environment=PYTHONUNBUFFERED=1",
        "# The job runs in this sandbox too: give caches (triton, HF, pip) a writable home.",
        f"CacheDirectory=fsdp-supervisor/{name}",
        f"Environment=XDG_CACHE_HOME=%C/fsdp-supervisor/{name} TRITON_CACHE_DIR=%C/fsdp-supervisor/{name}/triton",
        "# Exit 3 = gave up (crash loop, budget) and 2 = bad config: a restart cannot help either.",
        "Restart=on-failure",
        "RestartPreventExitStatus=2 3",
        f"RestartSec={opts.restart_s}",
        "# SIGTERM to the supervisor only; it stops the job gracefully, systemd SIGKILLs leftovers later.",
        "KillMode=mixed",
        "KillSignal=SIGTERM",
        f"TimeoutStartSec={start_s}",
        f"TimeoutStopSec={stop_s}",
        f"WatchdogSec={opts.watchdog_s}",
        "# A rank killed by the OOM killer is the supervisor's to handle; the default policy stops the unit.",
        "OOMPolicy=continue",
        "# Many ranks x threads x data workers; NCCL/InfiniBand pin memory; DCP opens many files.",
        "TasksMax=infinity",
        "LimitNOFILE=1048576",
        "LimitMEMLOCK=infinity",
        "# Hardening that leaves GPUs (/dev), shared memory (/dev/shm) and JIT (W+X pages) alone.",
        "NoNewPrivileges=yes",
        *(["# PrivateTmp=no: the service must see " + _plain(", ".join(hidden), "path") + " (move them off /tmp)",
           "PrivateTmp=no"] if hidden else ["PrivateTmp=yes"]),
        "ProtectSystem=strict",
        "ProtectHome=read-only",
        "# The folder holding the checkpoint root (the supervisor's trash, claim and in-use markers live next to it),",
        "# the run dir, and /tmp when it is not private.",
        f"ReadWritePaths={rw}",
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectControlGroups=yes",
        "RestrictSUIDSGID=yes",
        "RestrictRealtime=yes",
        "LockPersonality=yes",
        "UMask=0027",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ]
    return "\n".join(lines)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("systemd-unit", help="print a systemd service unit for this config")
    add_config_arg(p)
    p.add_argument("--name", default=None,
                   help="unit description and log identifier (default: the config file's stem, or its directory's "
                        "name for a job.toml)")
    p.add_argument("--user", default=None, help="run as this user (default: none, i.e. root or the user manager)")
    p.add_argument("--watchdog-sec", type=int, default=DEFAULT_WATCHDOG_S, metavar="S",
                   help=f"WatchdogSec= (default {DEFAULT_WATCHDOG_S}; 0 = off)")
    p.set_defaults(func=cmd_systemd_unit)


def default_name(config: Path) -> str:
    """The unit's name without --name: the config's stem, or for the generic `job.toml` its directory's name (pure)."""
    stem, parent = config.stem, config.parent.name
    return parent if stem == "job" and _NAME_RE.fullmatch(parent) else stem


def cmd_systemd_unit(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    base = UnitOptions(name=args.name or default_name(cfg.path), user=args.user, watchdog_s=args.watchdog_sec)
    program = job_program(cfg)
    if program is None:
        raise ConfigError(f"{cfg.path}: [job.command] program {cfg.job.command[0]!r} not found on this PATH: "
                          "activate the job's venv (or name the program by its path) and run systemd-unit again")
    notes = tuple(unit_notes(cfg, user=base.user))
    opts = replace(base, program_dir=os.path.dirname(os.path.abspath(program)), warnings=notes,
                   root=Path(os.path.realpath(cfg.checkpoints.dir)),
                   local_root=Path(os.path.realpath(cfg.checkpoints.local_dir)) if cfg.checkpoints.local_dir else None)
    sys.stdout.write(render_unit(cfg, supervisor_command(), opts))
    sys.stdout.flush()
    for note in notes:  # also in the unit, as `# warning:` lines: `| sudo tee` keeps them
        print(f"fsdp-supervisor: warning: {note}", file=sys.stderr)
    return EXIT_OK


def unit_notes(cfg: Config, user: str | None = None) -> list[str]:
    """Things that would make the rendered unit fail at start, for the user to fix on this machine."""
    notes = []
    # systemd cannot set up ReadWritePaths= for a path that does not exist: the unit would fail to start.
    missing = [str(p) for p in unit_paths(cfg) if not p.exists()]
    if missing:
        notes.append(f"create these before starting the unit: mkdir -p {' '.join(map(shlex.quote, missing))}"
                     + (f" && chown {user} {' '.join(map(shlex.quote, missing))}" if user else ""))
    private = private_tmp_paths([cfg.path, *unit_paths(cfg)])
    if private:
        hidden = ", ".join(private)
        notes.append(f"{hidden} under /tmp: PrivateTmp=yes would give the service its own /tmp and hide them, "
                     "so the unit says PrivateTmp=no (and /tmp may be emptied at boot: better move them)")
    if user is not None and not user.isdigit():
        try:
            pwd.getpwnam(user)
        except KeyError:
            notes.append(f"User={user} does not exist on this machine: the unit fails to start (217/USER) here")
    return notes
