"""job.toml: pydantic models (the single source of truth for keys, defaults and docs) and the loader.

Unknown keys are errors; every error is one `ConfigError` line naming the file and the key. What else is checked
here, and why an empty path is an error: docs/design.md, 'Notes for maintainers'. Whether the paths exist and
are writable: `supervisor.daemon.preflight`, before `run` creates anything.
"""
from __future__ import annotations

import difflib
import json
import math
import os
import re
import sys
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from supervisor import torchrun_args
from supervisor.checkpoints import RetentionRules
from supervisor.contract import SET_BY_SUPERVISOR
from supervisor.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

__all__ = [
    "Config",
    "local_tier_nodes_error",
    "JobSection",
    "CheckpointsSection",
    "RestartSection",
    "HealthSection",
    "SupervisorSection",
    "MetricsSection",
    "DivergenceSection",
    "load_config",
    "CHECKPOINT_PLACEHOLDER",
    "STEP_PLACEHOLDER",
    "MAX_CONFIG_BYTES",
    "MAX_GB",
    "PLACEHOLDERS",
]

CHECKPOINT_PLACEHOLDER = "{checkpoint}"
STEP_PLACEHOLDER = "{step}"
MAX_CONFIG_BYTES = 1024 * 1024  # a job.toml is a few hundred bytes; anything near this is not one
MAX_GB = 1e15  # far past any disk; near 1e299 the byte arithmetic of retention overflows to inf
# Every duration and count has a range (the `configdoc` test checks that each has one): an absurd value is a config
# error, not a state.json `status` cannot read, passes run back to back or a TimeoutStopSec systemd cannot parse.
MAX_S = 30 * 86400  # 30 days: past any sane wait, within what datetime, epoll (after a split) and systemd accept
MAX_COUNT = 1_000_000
MAX_LOG_BYTES = 2**40
# What `{name}` in resume_args may be: the supervisor substitutes these (skip_steps: the divergence rollback's).
PLACEHOLDERS = ("checkpoint", "step", "skip_steps")
_PLACEHOLDER = re.compile(r"\{\s*([\w.-]*)\s*(?:![rsa])?(?::[^{}\s]*)?\}")  # {name}, { name }, {step:06d}, {x!r}
# torch's own modules that every FSDP + DCP job imports, DCP and FSDP at its start and torch._dynamo at its first
# fully_shard (together ~1.5 s per rank here, ~80 MB): none touches a GPU or reads a per-rank variable at import.
DEFAULT_PREWARM_MODULES = ("torch.distributed.checkpoint", "torch.distributed.fsdp", "torch._dynamo")
_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", re.ASCII)


def _path_text(v: Any) -> Any:
    """An empty or blank path would silently mean "the current directory"; a NUL byte cannot reach the OS."""
    if isinstance(v, str):
        if "\0" in v:
            raise ValueError("contains a NUL byte")
        if not v.strip():
            raise ValueError("is empty: name a directory (a relative path resolves against the config file's directory)")
    return v


DirPath = Annotated[Path, BeforeValidator(_path_text)]


def _no_nul(items: list[str], what: str) -> list[str]:
    for i, item in enumerate(items):
        if "\0" in item:
            raise ValueError(f"{what} {i} contains a NUL byte")
    return items


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class JobSection(_Section):
    command: list[str] = Field(
        min_length=1,
        description="argv of the job (never run through a shell), e.g. torchrun ... -m trainer ...",
    )
    resume_args: list[str] = Field(
        default_factory=lambda: ["--resume", CHECKPOINT_PLACEHOLDER],
        description="appended when a checkpoint exists; {checkpoint} becomes its absolute path and {step} its step "
        "(torchtitan: [\"--checkpoint.load_step\", \"{step}\"]; a checkpoint without a step is then an error; any other "
        "{name} is a config error); "
        "[] or no placeholder: the job picks its own checkpoint, so none is recorded as resumed from or quarantined, "
        "and a save cut short above the newest complete one is deleted before each launch (docs/clients.md)",
    )
    cwd: DirPath | None = Field(default=None, description="working directory; default: the config file's directory")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables for the job")
    prewarm: bool = Field(
        default=True,
        description="keep one spare torchrun agent with torch already imported, so that a relaunch skips the "
        "interpreter start and `import torch` (only for `torchrun ...` / `python -m torch.distributed.run ...`); "
        "the agent that takes a launch (`prewarm_handoff` in the log) shows in `ps` as `torchrun ARGS...`",
    )
    prewarm_workers: bool = Field(
        default=True,
        description="with prewarm: the spare agent also keeps one warm worker per local rank (torch and "
        "prewarm_modules imported; no accelerator, thread pool or process group touched), and the next attempt's "
        "ranks run in them when their argv, directory and environment are exactly what a cold start would use; "
        "each idle worker holds the memory of its imports (docs/performance.md)",
    )
    prewarm_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_PREWARM_MODULES),
        description="modules the warm workers import after torch (default: torch's DCP, FSDP and dynamo), e.g. add "
        "\"transformers\": only modules that touch no GPU and read no per-rank variable (RANK, LOCAL_RANK, ...) at "
        "import; your own code is never imported before the hand-off unless listed here",
    )

    @field_validator("command")
    @classmethod
    def _no_empty_args(cls, v: list[str]) -> list[str]:
        if not v[0].strip():
            raise ValueError("the program name (first element) is empty")
        return _no_nul(v, "element")

    @field_validator("prewarm_modules")
    @classmethod
    def _module_names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not _MODULE_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a module name (dotted identifiers, e.g. \"transformers\")")
        return v

    @field_validator("resume_args")
    @classmethod
    def _resume_args_text(cls, v: list[str]) -> list[str]:
        for whole, name in ((m.group(0), m.group(1)) for arg in v for m in _PLACEHOLDER.finditer(arg)):
            if name not in PLACEHOLDERS or whole != f"{{{name}}}":  # replaced as is: no spaces, spec, conversion
                near = _close(name.lower(), PLACEHOLDERS) or next((p for p in PLACEHOLDERS if _abbreviates(name, p)), None)
                raise ValueError(f"{whole} is not a placeholder" + (f" (did you mean {{{near}}}?)" if near else "")
                                 + "; known: " + ", ".join(f"{{{p}}}" for p in PLACEHOLDERS))
        return _no_nul(v, "element")

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        for name, value in v.items():
            if not name or "=" in name or "\0" in name:
                raise ValueError(f"{name!r} is not a valid variable name (empty, or contains '=' or a NUL byte)")
            if "\0" in value:
                raise ValueError(f"the value of {name} contains a NUL byte")
            if name in SET_BY_SUPERVISOR:  # set for each attempt after `[job] env`: a value here would be ignored
                raise ValueError(f"{name} is set by the supervisor for each attempt; remove it")
        return v


class CheckpointsSection(RetentionRules):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    # Field descriptions render into docs/configuration.md (supervisor.cli.configdoc); the placement rules are in
    # _placement_error, the module docstring and that page's notes.
    dir: DirPath = Field(description="checkpoint root the job writes into (shared storage for multi-node)")
    prune: bool = Field(default=True, description="run retention from this supervisor (false on all but one node)")
    allow_fresh_start: bool = Field(
        default=False,
        description="launch without resume_args although the root holds a checkpoint that cannot be resumed from "
        "(quarantined, torn, or .metadata unusable: unsafe, unreadable, from a newer torch); false: give up "
        "(exit 3) naming it. An empty root, or one with only partial saves, always starts fresh",
    )
    retention_interval_s: float = Field(default=300, ge=0.5, le=MAX_S, description="periodic retention pass, seconds")
    integrity: bool = Field(
        default=True, description="check a resume point's bytes against its checksums before every launch (a seal's: "
        "read first; the trainer library's own: its load reads them) and seal those without checksums when first seen "
        "complete; false: a complete checkpoint is resumed unread, as a store with checksums of its own "
        "(ZFS, an object store) or a checkpoint too large to read at each relaunch may want (docs/checkpoints.md)",
    )
    scrub_interval_s: float = Field(
        default=86400, ge=0, le=MAX_S,
        description="re-read every kept checkpoint against its checksums this often, seconds, on a background thread "
        "(not in a pass) at idle I/O priority and bounded bandwidth: one whose bytes fail is quarantined as "
        "corrupt before a crash needs it (docs/checkpoints.md, Good, not only complete); 0: off",
    )
    local_dir: DirPath | None = Field(
        default=None,
        description="node-local checkpoint tier (tmpfs, a local NVMe) for saves between durable ones: the job gets "
        "it as FSDP_SUPERVISOR_LOCAL_DIR (the reference trainer saves there every --local-save-every K steps); a "
        "resume takes a local checkpoint of this run only when newer than the durable root's newest. Single-node "
        "jobs only (docs/checkpoints.md, The local tier)",
    )
    local_keep: int = Field(
        default=1, ge=1, le=1000,
        description="complete checkpoints kept in local_dir (besides the one a running job resumed from, pinned ones "
        "and saves in flight)",
    )

    @model_validator(mode="after")
    def _sizes_in_range(self) -> CheckpointsSection:
        for key in ("min_free_gb", "max_total_gb"):
            if getattr(self, key) > MAX_GB:
                raise ValueError(f"{key} = {getattr(self, key):g} is more than {MAX_GB:g} GiB")
        return self


class RestartSection(_Section):
    policy: Literal["on-failure", "always", "never"] = Field(
        default="on-failure", description="on-failure | always | never"
    )
    max_restarts: int = Field(default=100, ge=0, le=MAX_COUNT, description="total restart budget")
    backoff_initial_s: float = Field(default=1, ge=0, le=MAX_S, description="delay after the first failure without progress")
    healthy_restart_delay_s: float = Field(
        default=0, ge=0, le=MAX_S,
        description="delay after a failure of an attempt that made progress (or ran reset_after_s); 0 = at once, "
        "like torchrun's own restart; multi-node jobs with torchrun --max-restarts=0 want a few seconds",
    )
    backoff_max_s: float = Field(default=300, ge=0, le=MAX_S, description="backoff cap")
    backoff_multiplier: float = Field(default=2, ge=1, le=1000, description="growth per consecutive failure")
    backoff_jitter: float = Field(default=0.1, ge=0, le=1, description="+/- fraction of random jitter")
    reset_after_s: float = Field(default=600, ge=0, le=MAX_S, description="healthy running time that resets the backoff")
    max_no_progress_restarts: int = Field(
        default=3, ge=0, le=1000, description="consecutive failed attempts with no new step and no new checkpoint"
    )
    quarantine_after: int = Field(
        default=2, ge=0, le=1000,
        description="consecutive attempts that fail loading the same checkpoint before it is quarantined, counted only "
        "on evidence that it is the checkpoint: the heartbeat said `load` when they died (a job without a heartbeat: "
        "another checkpoint loaded and trained earlier in this run); 0 = off",
    )

    @model_validator(mode="after")
    def _cap_not_below_initial(self) -> RestartSection:
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff_max_s must be >= backoff_initial_s")
        try:  # the delay grows as multiplier ** failures (at most this many) before backoff_max_s caps it
            self.backoff_initial_s * self.backoff_multiplier ** self.max_no_progress_restarts
        except OverflowError:
            raise ValueError(
                f"backoff_multiplier = {self.backoff_multiplier:g} overflows within max_no_progress_restarts = "
                f"{self.max_no_progress_restarts} failures; a smaller one reaches backoff_max_s as well") from None
        return self


class HealthSection(_Section):
    hang_timeout_s: float | Literal["auto"] = Field(
        default="auto", description='"auto": while the job beats, hung when a heartbeat has not advanced for '
        "max(hang_min_s, hang_factor x its recent p99 step time); a number: this many seconds; 0 = off")
    hang_min_s: float = Field(default=60, ge=1, le=MAX_S, description='"auto": the shortest hang allowance, seconds')
    hang_factor: float = Field(default=10, ge=1, le=1000,
                               description='"auto": allowance in multiples of the recent p99 step time')
    save_timeout_s: float = Field(
        default=1800, ge=1, le=MAX_S, description="allowance while the heartbeat says load or save (and eval with \"auto\")")
    startup_timeout_s: float = Field(
        default=0, ge=0, le=MAX_S, description="0 = off; no first heartbeat this long after launch = hang"
    )
    stop_timeout_s: float = Field(
        default=120, ge=1, le=MAX_S,
        description="grace after SIGTERM before SIGKILL when a stop is requested (Ctrl+C, systemd, Slurm): the "
                    "emergency checkpoint's time",
    )
    stack_dump_wait_s: float = Field(
        default=5, ge=0, le=MAX_S,
        description="after a hang, the longest wait for the workers' SIGUSR1 stack dumps (it ends as soon as every "
                    "worker that can run has written one)",
    )
    hang_kill_grace_s: float = Field(
        default=2, ge=0, le=MAX_S,
        description="after a hang's stack dumps: SIGTERM, then SIGKILL of the whole job this much later, at once "
                    "when the workers asked for dumps have dumped or are stopped (a rank stuck in a collective "
                    "cannot save; stop_timeout_s is not waited)",
    )
    straggler_factor: float = Field(
        default=1.5, ge=0, le=1000,
        description="0 = off; a rank whose own step time stays above this times the other ranks' median (3 looks, "
                    "a second apart) is flagged as a straggler in status, metrics and the report",
    )

    @field_validator("hang_timeout_s", mode="before")
    @classmethod
    def _hang(cls, v: Any) -> Any:
        if v == "auto":
            return v
        if type(v) not in (int, float) or not 0 <= v < math.inf:
            raise ValueError(f'must be "auto", 0 (off) or a number of seconds, not {v!r}')
        if 0 < v < 1 or v > MAX_S:
            raise ValueError(f"= {v:g} is neither 0 (off) nor in range [1, {MAX_S}]")
        return v

    @field_validator("startup_timeout_s")
    @classmethod
    def _off_or_a_second(cls, v: float) -> float:
        if 0 < v < 1:
            raise ValueError(f"= {v:g} is neither 0 (off) nor in range [1, {MAX_S}]")
        return v

    @field_validator("straggler_factor")
    @classmethod
    def _factor(cls, v: float) -> float:
        if 0 < v <= 1:
            raise ValueError("must be 0 (off) or above 1: a factor of 1 or less flags ranks that are not slower")
        return v


class SupervisorSection(_Section):
    run_dir: DirPath = Field(
        default=Path(".fsdp-supervisor"),
        description="state.json, supervisor.log, logs/attempt-NNNN.log, heartbeat and the lock",
    )
    log_max_bytes: int = Field(default=10 * 2**20, ge=2**12, le=MAX_LOG_BYTES, description="supervisor.log rotation size")
    log_backups: int = Field(default=3, ge=0, le=1000, description="rotated supervisor.log files kept")
    job_log_max_bytes: int = Field(
        default=64 * 2**20, ge=2**16, le=MAX_LOG_BYTES,
        description="cap on one attempt's output on disk: attempt-NNNN.log plus its .1 segment (the tail is kept)",
    )
    job_logs_kept: int = Field(default=20, ge=1, le=MAX_COUNT, description="attempts whose logs and error files are kept")


class MetricsSection(_Section):
    listen: str | None = Field(default=None, description='Prometheus endpoint, e.g. "127.0.0.1:9400"; off if unset')


AlertKind = Literal["gave_up", "diverged", "rolled_back", "hang_detected", "crash_loop", "disk_low", "stopped",
                    "completed"]


class NotifySection(_Section):
    command: list[str] = Field(
        default_factory=list, description="alert command, argv (no shell): gets one alert's JSON object on stdin "
        "(schema: docs/operations.md), e.g. [\"sh\", \"-c\", \"mail -s alert ops@example.com\"]")
    webhook: str | None = Field(
        default=None, pattern=r"^https?://\S+$", description="http(s) URL POSTed each alert's JSON plus a one-line "
        "`text` (a Slack or Mattermost incoming webhook); never logged: it is a secret")
    events: list[AlertKind] = Field(
        default=["gave_up", "diverged", "rolled_back", "hang_detected", "crash_loop", "disk_low", "stopped"],
        description="which events alert: gave_up, diverged, rolled_back, hang_detected, crash_loop (one failure "
        "without progress short of the give-up), disk_low, stopped (only when its emergency save failed), completed")
    min_interval_s: float = Field(default=300, ge=0, le=MAX_S, description="at most one alert of each kind this often")
    timeout_s: float = Field(default=10, gt=0, le=600, description="the command's time, and each webhook try's")


class DivergenceSection(_Section):
    # Defaults measured on the reference trainer's loss (docs/reliability.md, The divergence guard).
    action: Literal["rollback", "stop", "warn", "off"] = Field(
        default="rollback",
        description="a NaN/inf loss or a loss spike in the heartbeats: rollback = stop the job gracefully and "
        "relaunch from the last checkpoint before the onset, skipping the data past it; stop = stop gracefully and "
        "exit 3; warn = events only; off = not watched (a job whose beats carry no loss is never watched)",
    )
    spike_factor: float = Field(
        default=3.0, gt=1, le=1e6,
        description="a loss above this times the median of the recent normal losses is a spike",
    )
    spike_patience: int = Field(
        default=3, ge=1, le=10_000,
        description="beats (distinct steps) in a row above the spike level before it is a divergence; a NaN or "
        "infinite loss is one at once",
    )
    skip_after_onset: int = Field(
        default=10, ge=0, le=10**9,
        description="data steps skipped past the onset on a rollback (FSDP_SUPERVISOR_SKIP_STEPS and {skip_steps} "
        "= onset step - resume step + this)",
    )
    max_rollbacks: int = Field(
        default=3, ge=0, le=1000,
        description="rollbacks for one region (the run did not get skip_after_onset steps past the onset) before "
        "the supervisor gives up (exit 3); rollbacks use no restart budget",
    )


class Config(_Section):
    job: JobSection
    checkpoints: CheckpointsSection
    restart: RestartSection = Field(default_factory=RestartSection)
    health: HealthSection = Field(default_factory=HealthSection)
    supervisor: SupervisorSection = Field(default_factory=SupervisorSection)
    metrics: MetricsSection = Field(default_factory=MetricsSection)
    notify: NotifySection = Field(default_factory=NotifySection)
    divergence: DivergenceSection = Field(default_factory=DivergenceSection)
    path: Path = Field(description="absolute path of the config file (set by the loader)")

    @property
    def run_dir(self) -> Path:
        return self.supervisor.run_dir

    @property
    def job_cwd(self) -> Path:
        return self.job.cwd or self.path.parent


def _resolve(base: Path, p: Any) -> Any:
    if isinstance(p, str) and p.strip() and "\0" not in p:  # the rest is for the model to reject, naming the key
        p = Path(os.path.expanduser(p))
        return p if p.is_absolute() else (base / p)
    return p


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _root_error(cfg: Config, key: str, given: Path) -> str | None:
    """Why one checkpoint root overlaps what it must not, or None (paths compared with symlinks resolved)."""
    root = os.path.realpath(given)
    hint = f"give [checkpoints] {key} a folder of its own, e.g. a 'checkpoints' subfolder"
    if _inside(os.path.realpath(cfg.path), root):
        return f"[checkpoints.{key}] {given} contains this config file; {hint}"
    if _inside(os.path.realpath(cfg.job_cwd), root):
        return f"[checkpoints.{key}] {given} contains the job's working directory {cfg.job_cwd}; {hint}"
    run_dir = os.path.realpath(cfg.run_dir)
    if _inside(run_dir, root):
        where = "is" if run_dir == root else "is inside"
        return (f"[supervisor.run_dir] {cfg.run_dir} {where} the checkpoint root {given}: trainers that "
                f"list the root would see the supervisor's files; put the run dir next to it (the default "
                f"'.fsdp-supervisor' beside the config file is fine)")
    return None


def _local_tier_error(cfg: Config) -> str | None:
    """Why `[checkpoints] local_dir` cannot be used with this config, or None."""
    local = cfg.checkpoints.local_dir
    if local is None:
        return None
    durable, here = os.path.realpath(cfg.checkpoints.dir), os.path.realpath(local)
    if _inside(here, durable) or _inside(durable, here):
        return (f"[checkpoints.local_dir] {local} and [checkpoints.dir] {cfg.checkpoints.dir} overlap: each tier is a "
                "root of its own, neither inside the other")
    return local_tier_nodes_error(cfg, cfg.job.env) or _root_error(cfg, "local_dir", local)


def local_tier_nodes_error(cfg: Config, env: typing.Mapping[str, str]) -> str | None:
    """Why the local tier is refused to this job run with `env` (torchrun's flag, or PET_NNODES there), or None.

    The config alone knows `[job] env`; `run` asks again with its own environment, which the job inherits."""
    nnodes = torchrun_args.nnodes(cfg.job.command, env)
    if cfg.checkpoints.local_dir is None or not torchrun_args.spans_nodes(nnodes):
        return None
    return (f"[checkpoints.local_dir] the local tier is for single-node jobs, and this job runs torchrun with "
            f"--nnodes {nnodes}: a resume could pick a step that another node's tier lacks; remove local_dir "
            "(docs/checkpoints.md, The local tier)")


def _placement_error(cfg: Config) -> str | None:
    """Why a checkpoint root overlaps what it must not, or None (paths compared with symlinks resolved)."""
    return _root_error(cfg, "dir", cfg.checkpoints.dir) or _local_tier_error(cfg)


def _close(word: object, names: typing.Iterable[str]) -> str | None:
    """The one of `names` that `word` is most likely a misspelling of, or None."""
    found = difflib.get_close_matches(str(word), list(names), n=1, cutoff=0.6)
    return found[0] if found else None


def _abbreviates(short: str, name: str) -> bool:
    """`{ckpt}` for `{checkpoint}`: the letters of `short` appear in `name` in order."""
    letters = iter(name)
    return bool(short) and all(c in letters for c in short.lower())


def _table(loc: tuple[int | str, ...]) -> Any:
    """The model of the table at `loc` (a path of field names from the top), or None if it is not a table of ours."""
    model: Any = Config
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        kinds = typing.get_args(field.annotation) or (field.annotation,) if field is not None else ()
        model = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)), None)
    return model


def _table_keys(loc: tuple[int | str, ...]) -> list[str]:
    """The keys the table at `loc` accepts; [] if it is not a table of ours."""
    model = _table(loc)
    return [name for name in getattr(model, "model_fields", {}) if (model, name) != (Config, "path")]


def _not_a_number(raw: dict[str, Any], loc: tuple[str, ...] = ()) -> tuple[tuple[str, ...], Any] | None:
    """The first boolean or string given for a number (`keep_last = true`, `backoff_max_s = "30"`: pydantic took
    them as 1 and 30) and where, or None."""
    for key, value in raw.items():
        if isinstance(value, dict):
            if (found := _not_a_number(value, (*loc, key))) is not None:
                return found
        elif isinstance(value, (bool, str)) and (field := getattr(_table(loc), "model_fields", {}).get(key)):
            kinds = typing.get_args(field.annotation) or (field.annotation,)
            if {int, float} & set(kinds) and set(kinds) <= {int, float, type(None)}:  # not `float | "auto"`
                return (*loc, key), value
    return None


def _range(loc: tuple[int | str, ...]) -> str:
    """`[lo, hi]` of the number at `loc` (a bracket is open where the bound is exclusive), from its field."""
    field = getattr(_table(loc[:-1]), "model_fields", {}).get(loc[-1])
    bounds = {k: getattr(m, k) for m in getattr(field, "metadata", ()) for k in ("ge", "gt", "le", "lt")
              if getattr(m, k, None) is not None}
    lo = f"[{bounds['ge']:.15g}" if "ge" in bounds else f"({bounds['gt']:.15g}" if "gt" in bounds else "(-inf"
    hi = f"{bounds['le']:.15g}]" if "le" in bounds else f"{bounds['lt']:.15g})" if "lt" in bounds else "inf)"
    return f"{lo}, {hi}"


def _error_line(path: Path, exc: ValidationError) -> str:
    # An unknown key first: a misspelt one is usually why a required key is "missing" too.
    err = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")[0]
    loc = ".".join(str(x) for x in err["loc"] if not isinstance(x, int)) or "(top level)"
    msg = err["msg"]
    if err["type"] == "value_error" and "error" in err.get("ctx", {}):
        msg = str(err["ctx"]["error"])  # our own sentence, without pydantic's "Value error, " in front
    elif err["type"] == "extra_forbidden":
        near = _close(err["loc"][-1], _table_keys(err["loc"][:-1]))
        msg = "unknown key" + (f" (did you mean {near!r}?)" if near else "")
    elif err["type"] == "missing":
        msg = "required key is missing"
    elif err["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        msg = f"= {err['input']:.15g} is out of range {_range(err['loc'])}"
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    loc = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in loc)  # a key `"\n"` must not break the one line
    return f"{path}: [{loc}] {msg}{more}"


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read, validate and resolve a job.toml; raise ConfigError naming the file and key."""
    p = Path(path).expanduser()
    raw = _parse(p, _read(p))
    p = p.resolve()
    base = p.parent
    if not isinstance(raw.get("checkpoints"), dict) or not isinstance(raw.get("job"), dict):
        missing = "job" if not isinstance(raw.get("job"), dict) else "checkpoints"
        near = _close(missing, [k for k in raw if k not in Config.model_fields])
        raise ConfigError(f"{p}: [{missing}] section is missing" + (f" (is [{near}] a misspelling?)" if near else ""))
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for key in ("dir", "local_dir"):
        if key in raw["checkpoints"]:
            raw["checkpoints"][key] = _resolve(base, raw["checkpoints"][key])
    if "cwd" in raw["job"]:
        raw["job"]["cwd"] = _resolve(base, raw["job"]["cwd"])
    sup = raw.setdefault("supervisor", {})
    if isinstance(sup, dict):
        sup["run_dir"] = _resolve(base, sup.get("run_dir", ".fsdp-supervisor"))
    raw["path"] = p
    if (wrong := _not_a_number(raw)) is not None:
        raise ConfigError(f"{p}: [{'.'.join(wrong[0])}] = {json.dumps(wrong[1])} is not a number (TOML: 30, 1.5)")
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_error_line(p, exc)) from None
    problem = _placement_error(cfg)
    if problem:
        raise ConfigError(f"{p}: {problem}")
    return cfg


def _read(p: Path) -> str:
    """The config's text: at most MAX_CONFIG_BYTES of UTF-8 (read no further: a huge file costs nothing)."""
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{p}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{p}: is a directory, not a config file") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config: {exc.strerror or exc}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{p}: larger than {MAX_CONFIG_BYTES // 1024} KiB: not a job config")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start})") from None


def _parse(p: Path, text: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: invalid TOML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise ConfigError(f"{p}: invalid TOML: nested too deeply") from None
