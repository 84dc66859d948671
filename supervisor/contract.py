"""The job contract: everything the supervisor and a supervised job tell each other (stdlib only).

What crosses the process boundary, each way: docs/design.md, 'The job contract'. Both sides import the names and
the validation from here, so a key or a phase can never be spelled two ways; why every heartbeat field is
validated: docs/design.md, 'Notes for maintainers'.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from supervisor.errors import ManifestError
from supervisor.vocabulary import Vocabulary

__all__ = [
    "ENV_HEARTBEAT",
    "ENV_HEARTBEAT_DIR",
    "ENV_ATTEMPT",
    "ENV_RUN_DIR",
    "ENV_ERROR_FILE",
    "ENV_RUN_TOKEN",
    "ENV_LOCAL_DIR",
    "ENV_SKIP_STEPS",
    "SKIP_STEPS_PLACEHOLDER",
    "SET_BY_SUPERVISOR",
    "DIVERGED",
    "HEARTBEAT_FILE",
    "RANK_HEARTBEAT_DIR",
    "MAX_RANK_FILES",
    "MAX_RANK_BEAT_BYTES",
    "rank_heartbeat_name",
    "rank_of_heartbeat",
    "PHASES",
    "Phase",
    "SLOW_PHASES",
    "MAX_HEARTBEAT_BYTES",
    "MAX_STEP",
    "Beat",
    "parse_heartbeat",
    "heartbeat_record",
    "MANIFEST_FORMAT",
    "MAX_MANIFEST_BYTES",
    "Manifest",
    "CHECKSUM_ALGORITHM",
    "parse_manifest",
    "manifest_record",
]

# ---- environment of the job ----------------------------------------------------------------------------
ENV_HEARTBEAT = "FSDP_SUPERVISOR_HEARTBEAT"  # file the job may rewrite with a heartbeat record
# A folder where every rank may keep its own heartbeat, `rank-<RANK>.json` (global rank), same record: the
# supervisor then names a hung rank, sees stragglers and judges a hang by the slowest rank.
ENV_HEARTBEAT_DIR = "FSDP_SUPERVISOR_HEARTBEAT_DIR"
ENV_ATTEMPT = "FSDP_SUPERVISOR_ATTEMPT"  # 1, 2, ...: which launch this is (continues across supervisor runs)
ENV_RUN_DIR = "FSDP_SUPERVISOR_RUN_DIR"  # the supervisor's run dir (state.json, logs)
ENV_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"  # torchrun's own: where `@record` writes the root-cause error
# The run dir's random token (supervisor/host/identity.py): every process of the job inherits it, so a supervisor
# recognises a job its killed predecessor left running whatever argv the kernel shows for it.
ENV_RUN_TOKEN = "FSDP_SUPERVISOR_RUN_TOKEN"
# `[checkpoints] local_dir`, when set: the node-local tier the job may save to between durable saves (the reference
# trainer's --local-checkpoint-dir defaults to it).
ENV_LOCAL_DIR = "FSDP_SUPERVISOR_LOCAL_DIR"
# Data steps (of the global batch) the job skips after loading: `(onset - resume step) + skip_after_onset` on a
# launch that rolls back a divergence (supervisor/policy/divergence.py), "0" on any other; also `{skip_steps}`.
ENV_SKIP_STEPS = "FSDP_SUPERVISOR_SKIP_STEPS"
SKIP_STEPS_PLACEHOLDER = "{skip_steps}"
# The variables above, set for each attempt after `[job] env` (which may therefore not name them: config.py says so).
SET_BY_SUPERVISOR = frozenset({ENV_HEARTBEAT, ENV_HEARTBEAT_DIR, ENV_ATTEMPT, ENV_RUN_DIR, ENV_ERROR_FILE, ENV_RUN_TOKEN,
                               ENV_LOCAL_DIR, ENV_SKIP_STEPS})
DIVERGED = "diverged: "  # how the reason of a quarantined save of a diverged run begins: a later save of its step wins

# ---- heartbeat ----------------------------------------------------------------------------------------
HEARTBEAT_FILE = "heartbeat.json"  # inside the run dir
RANK_HEARTBEAT_DIR = "heartbeats"  # inside the run dir: one `rank-<RANK>.json` per rank of this node
# A node runs a few dozen ranks at most: beyond this many files (a job gone wrong, or a hostile one creating
# thousands) the rest is ignored, so one look at the folder costs bounded time and memory.
MAX_RANK_FILES = 256
MAX_RANK_BEAT_BYTES = 1024  # a rank's beat is ~80 bytes
_RANK_NAME = re.compile(r"rank-(0|[1-9]\d{0,6})\.json")  # one name per rank: `rank-01.json` is not rank 1


def rank_heartbeat_name(rank: int) -> str:
    """The file name of `rank`'s heartbeat inside the per-rank folder."""
    return f"rank-{int(rank)}.json"


def rank_of_heartbeat(name: str) -> int | None:
    """The rank a per-rank heartbeat file name stands for, or None for any other name."""
    m = _RANK_NAME.fullmatch(name)
    return int(m[1]) if m else None


class Phase(Vocabulary):
    """What the job is doing, as its heartbeat says (the `phase` field)."""

    LOAD = "load"
    TRAIN = "train"
    EVAL = "eval"
    SAVE = "save"


PHASES = tuple(p.value for p in Phase)  # the words on the wire, for writers that hold plain strings
SLOW_PHASES = frozenset({Phase.LOAD, Phase.SAVE})  # judged by save_timeout_s rather than hang_timeout_s
MAX_HEARTBEAT_BYTES = 64 * 1024  # a beat is ~100 bytes; anything larger is not one
MAX_STEP = 2**53 - 1  # every JSON reader keeps integers up to here exact
_MAX_LOSS = 1e30  # finite and still meaningful in a plot; beyond is a diverged or garbage value
_MAX_STEP_S = 1e7  # seconds: a step longer than ~4 months is not one


@dataclass(frozen=True)
class Beat:
    """One validated heartbeat: only fields that passed validation are set."""

    step: int
    time: float | None = None
    phase: Phase | None = None
    loss: float | None = None
    val_loss: float | None = None
    step_s: float | None = None  # a rank's own time for its last step (its work, not its wait for the others)
    loss_bad: str | None = None  # "nan" or "inf": the loss was not a finite number (`loss` is then None)
    local_tier: str | None = None  # why the job's node-local tier fails now (its last local save, or at start)
    checks_loads: bool = False  # the job loads with the trainer library's checked load (daemon/integrity.py)


def _finite(value: Any, limit: float) -> float | None:
    if type(value) is int:  # compared as an int: a 400-digit one overflows any float conversion
        return float(value) if abs(value) <= limit else None
    if type(value) is not float or not math.isfinite(value) or abs(value) > limit:
        return None
    return value


def parse_heartbeat(data: bytes) -> tuple[Beat | None, list[str]]:
    """Validate heartbeat bytes: (the beat or None, what was wrong with it, for one warning).

    No usable `step` (missing, negative, not an integer, beyond MAX_STEP) rejects the whole beat; any other
    bad field is dropped. Unknown keys are ignored (newer jobs may send more).
    """
    if len(data) > MAX_HEARTBEAT_BYTES:
        return None, [f"heartbeat is {len(data)} bytes, over {MAX_HEARTBEAT_BYTES}"]
    try:
        raw = json.loads(data)  # Python's reader takes NaN/Infinity: they are dropped below
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None, ["heartbeat is not JSON"]
    if not isinstance(raw, dict):
        return None, ["heartbeat is not a JSON object"]
    step = raw.get("step")
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        return None, [f"step {_show(step)} is not an integer in [0, {MAX_STEP}]"]
    problems: list[str] = []
    when = raw.get("time")
    time_ = _finite(when, 1e12)
    if when is not None and (time_ is None or time_ < 0):
        problems.append(f"time {_show(when)} dropped")
        time_ = None
    phase = raw.get("phase")
    if phase is not None and phase not in PHASES:
        problems.append(f"phase {_show(phase)} dropped (not one of {', '.join(PHASES)})")
        phase = None
    elif phase is not None:
        phase = Phase(phase)
    losses: dict[str, float | None] = {}
    for key in ("loss", "val_loss"):
        value = raw.get(key)
        losses[key] = _finite(value, _MAX_LOSS)
        if value is not None and losses[key] is None and (key == "val_loss" or _nonfinite(value) is None):
            problems.append(f"{key} {_show(value)} dropped (not a finite number)")
    raw_step_s = raw.get("step_s")
    step_s = _finite(raw_step_s, _MAX_STEP_S)
    if raw_step_s is not None and (step_s is None or step_s < 0):
        problems.append(f"step_s {_show(raw_step_s)} dropped (not a number of seconds)")
        step_s = None
    loss_bad = _nonfinite(raw.get("loss")) if losses["loss"] is None else None
    tier = t[:200] if isinstance(t := raw.get("local_tier"), str) and t.isprintable() and t else None  # for status
    return Beat(step, time_, phase, losses["loss"], losses["val_loss"], step_s, loss_bad, tier,
                raw.get("checks_loads") is True), problems


def _nonfinite(value: Any) -> str | None:
    """"nan"/"inf" for a diverged loss: the words (JSON has none), Python's NaN/Infinity, a number over _MAX_LOSS."""
    if isinstance(value, str):  # also "Infinity" (JavaScript's word) and "1e999" (a number over the float range)
        try:
            value = float(value)
        except ValueError:
            return None
    if type(value) is int:
        value = math.inf if abs(value) > _MAX_LOSS else None
    if type(value) is not float or (math.isfinite(value) and abs(value) <= _MAX_LOSS):
        return None
    return "nan" if math.isnan(value) else "inf"


def _show(value: Any) -> str:
    """A short, safe rendering of an untrusted JSON value for a log line (never a deep repr)."""
    if isinstance(value, (dict, list)):
        return type(value).__name__
    text = str(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def heartbeat_record(step: int, phase: str, *, time: float, loss: float | None = None,
                     val_loss: float | None = None, local_tier: str | None = None,
                     checks_loads: bool = False) -> dict[str, Any]:
    """The JSON object a job writes (the writer's side of `parse_heartbeat`): a non-finite loss becomes the string
    "nan" or "inf" (a diverged run, which the supervisor watches for), a non-finite val_loss null."""
    if phase not in PHASES:
        raise ValueError(f"heartbeat phase must be one of {PHASES}, got {phase!r}")
    finite = _finite(loss, _MAX_LOSS) if loss is not None else None
    record: dict[str, Any] = {"step": int(step), "time": time, "phase": phase,
                              "loss": finite if finite is not None or loss is None else _nonfinite(float(loss))}
    if val_loss is not None:
        record["val_loss"] = _finite(val_loss, _MAX_LOSS)
    if local_tier:
        record["local_tier"] = local_tier
    return {**record, "checks_loads": True} if checks_loads else record


# ---- checkpoint manifest (the reference trainer's; optional for other jobs) ------------------------------
MANIFEST_FORMAT = "fsdp-supervisor/1"
MAX_MANIFEST_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class Manifest:
    """What the trainer recorded about one checkpoint."""

    step: int
    world_size: int | None = None
    time: float | None = None
    loss: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)  # relative name -> size in bytes
    sha256: dict[str, str] = field(default_factory=dict)
    torch_version: str | None = None
    # file name -> [(offset, length, xxh3_64 hex)], written while saving (supervisor.checkpoints.integrity)
    checksums: dict[str, list[tuple[int, int, str]]] | None = None
    lineage: str | None = None  # the run that wrote it (supervisor.checkpoints.lineage)


def _is_int(v: Any) -> TypeGuard[int]:
    return type(v) is int


def _str_map(raw: Any, key: str, check: Any, what: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(k, str) and check(v) for k, v in raw.items()):
        raise ManifestError(f"manifest {key!r} must map file names to {what}")
    return dict(raw)


def parse_manifest(data: bytes) -> Manifest:
    """Validate manifest bytes; raise ManifestError naming the bad field."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ManifestError(f"manifest is not JSON: {str(exc)[:80]}") from None
    if not isinstance(raw, dict):
        raise ManifestError("manifest is not a JSON object")
    if raw.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f"manifest format is {_show(raw.get('format'))}, expected {MANIFEST_FORMAT!r}")
    step = raw.get("step")
    if not _is_int(step) or not 0 <= step <= MAX_STEP:
        raise ManifestError(f"manifest step {_show(step)} is not a non-negative integer")
    world = raw.get("world_size")
    if world is not None and (not _is_int(world) or world < 1):
        raise ManifestError(f"manifest world_size {_show(world)} is not a positive integer")
    metrics_raw = raw.get("metrics") or {}
    if not isinstance(metrics_raw, dict):
        raise ManifestError("manifest 'metrics' is not an object")
    # A metric that is null or NaN (a diverged step) is simply not a usable value: drop it.
    metrics = {str(k): v for k, v in ((k, _finite(v, math.inf)) for k, v in metrics_raw.items()) if v is not None}
    version = raw.get("torch_version")
    return Manifest(
        step=step,
        world_size=world,
        time=_finite(raw.get("time"), math.inf),
        loss=_finite(raw.get("loss"), math.inf),
        metrics=metrics,
        files=_str_map(raw.get("files"), "files", lambda v: _is_int(v) and v >= 0, "sizes"),
        sha256=_str_map(raw.get("sha256"), "sha256", lambda v: isinstance(v, str), "hex digests"),
        torch_version=version if isinstance(version, str) else None,
        checksums=_checksums(raw.get("checksums")),
        lineage=raw["lineage"] if isinstance(raw.get("lineage"), str) else None,
    )


CHECKSUM_ALGORITHM = "xxh3_64"


def _checksums(raw: Any) -> dict[str, list[tuple[int, int, str]]] | None:
    if raw is None:
        return None
    files = raw.get("files") if isinstance(raw, dict) and raw.get("algorithm") == CHECKSUM_ALGORITHM else None
    if not isinstance(files, dict) or not all(isinstance(segs, list) and all(
            isinstance(s, list) and len(s) == 3 and _is_int(s[0]) and _is_int(s[1]) and s[0] >= 0 and s[1] >= 0
            and isinstance(s[2], str) and len(s[2]) == 16 for s in segs) for segs in files.values()):
        raise ManifestError(f"manifest 'checksums' must be {{'algorithm': {CHECKSUM_ALGORITHM!r}, 'files': "
                            "{name: [[offset, length, hex], ...]}}")
    return {str(name): [(s[0], s[1], s[2]) for s in segs] for name, segs in files.items()}


def manifest_record(*, step: int, world_size: int, time: float, torch_version: str,
                    metrics: Mapping[str, float | None], files: Mapping[str, int],
                    sha256: Mapping[str, str] | None = None,
                    checksums: Mapping[str, Any] | None = None, lineage: str | None = None) -> dict[str, Any]:
    """The JSON object of a manifest (the writer's side of `parse_manifest`); non-finite metrics become null."""
    clean = {str(k): (_finite(v, math.inf) if v is not None else None) for k, v in metrics.items()}
    record: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "step": int(step),
        "world_size": int(world_size),
        "time": time,
        "loss": clean.get("loss"),
        "torch_version": torch_version,
        "metrics": clean,
        "files": dict(files),
    }
    if sha256 is not None:
        record["sha256"] = dict(sha256)
    if lineage is not None:
        record["lineage"] = lineage
    if checksums is not None:
        record["checksums"] = {"algorithm": CHECKSUM_ALGORITHM,
                               "files": {n: sorted([list(s) for s in segs]) for n, segs in checksums.items()}}
    return record
