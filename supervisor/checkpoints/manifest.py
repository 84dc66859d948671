"""Read the reference trainer's `manifest.json` (step, world size, metrics, file sizes, checksums).

The manifest is optional: plain DCP dirs from user scripts have none. When it is there it is checked
strictly, because it is what the trainer promises about the dir.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.checkpoints._files import open_regular
from supervisor.checkpoints.layout import MANIFEST_FORMAT, MANIFEST_NAME

__all__ = ["MAX_MANIFEST_BYTES", "ManifestError", "Manifest", "parse_manifest", "read_manifest"]

MAX_MANIFEST_BYTES = 16 * 1024 * 1024


class ManifestError(Exception):
    """`manifest.json` exists but is unreadable or malformed; the message says which field."""


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


def _is_int(v: Any) -> bool:
    return type(v) is int


def _number(v: Any) -> float | None:
    if type(v) in (int, float) and math.isfinite(v):
        return float(v)
    return None


def _str_map(raw: Any, key: str, check: Any, what: str) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(k, str) and check(v) for k, v in raw.items()):
        raise ManifestError(f"manifest {key!r} must map file names to {what}")
    return dict(raw)


def parse_manifest(data: bytes) -> Manifest:
    """Validate manifest bytes; raise ManifestError naming the bad field."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"manifest is not JSON: {str(exc)[:80]}") from None
    if not isinstance(raw, dict):
        raise ManifestError("manifest is not a JSON object")
    if raw.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f"manifest format is {str(raw.get('format'))[:40]!r}, expected {MANIFEST_FORMAT!r}")
    step = raw.get("step")
    if not _is_int(step) or step < 0:
        raise ManifestError(f"manifest step {str(step)[:40]!r} is not a non-negative integer")
    world = raw.get("world_size")
    if world is not None and (not _is_int(world) or world < 1):
        raise ManifestError(f"manifest world_size {str(world)[:40]!r} is not a positive integer")
    metrics_raw = raw.get("metrics") or {}
    if not isinstance(metrics_raw, dict):
        raise ManifestError("manifest 'metrics' is not an object")
    # A metric that is null or NaN (a diverged step) is simply not a usable value: drop it.
    metrics = {k: v for k, v in ((str(k), _number(v)) for k, v in metrics_raw.items()) if v is not None}
    return Manifest(
        step=step,
        world_size=world,
        time=_number(raw.get("time")),
        loss=_number(raw.get("loss")),
        metrics=metrics,
        files=_str_map(raw.get("files"), "files", lambda v: _is_int(v) and v >= 0, "sizes"),
        sha256=_str_map(raw.get("sha256"), "sha256", lambda v: isinstance(v, str), "hex digests"),
    )


def read_manifest(directory: Path) -> Manifest | None:
    """The manifest of `directory`, or None when it has none; never follows a symlink."""
    try:
        f, _ = open_regular(directory / MANIFEST_NAME, MAX_MANIFEST_BYTES, ManifestError)
    except FileNotFoundError:
        return None
    with f:
        return parse_manifest(f.read(MAX_MANIFEST_BYTES + 1))
