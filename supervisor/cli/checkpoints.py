"""`fsdp-supervisor checkpoints list|verify|prune|pin|unpin|unquarantine`.

Exit codes: docs/operations.md, 'Exit codes' (0 ok, 1 `verify` found the dir not complete, 2 anything else: one
line on stderr, nothing deleted). What `pin`, `unpin` and `unquarantine` accept: docs/checkpoints.md, 'pin, unpin,
unquarantine'. What `prune` protects: docs/design.md, 'Notes for maintainers'.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.checkpoints.completeness import FOREIGN
from supervisor.checkpoints.inuse import in_use
from supervisor.checkpoints.markers import checkpoint_in_root, pin, quarantine_reason, unpin, unquarantine
from supervisor.checkpoints.metadata.reader import fresh
from supervisor.checkpoints.pruning import disk_usage, execute_retention
from supervisor.checkpoints.ranking import CheckpointInfo, checkpoint_step, judge, scan
from supervisor.checkpoints.retention import RetentionPlan, RetentionRules, plan_retention
from supervisor.checkpoints.shapes import EXPORT_REASON
from supervisor.checkpoints.sidecars import resolved
from supervisor.checkpoints.tiers import local_rules, scan_local, scan_tiers
from supervisor.cli.argtypes import at_most, non_negative_int
from supervisor.config import MAX_GB
from supervisor.errors import EXIT_NOT_OK, EXIT_OK, CheckpointError
from supervisor.host.boot import wall_now
from supervisor.observe.humanize import human_age, human_bytes, printable
from supervisor.policy.divergence import last_good

__all__ = ["register", "info_json"]


def _root_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("-c", "--config", metavar="CONFIG",
                   help="job.toml: use its [checkpoints] dir and retention rules (default without --dir: "
                        "$FSDP_SUPERVISOR_CONFIG, else ./job.toml)")
    g.add_argument("--dir", type=Path, metavar="DIR", help="checkpoint root")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    top = sub.add_parser("checkpoints", help="list, verify, prune, pin and unpin checkpoints")
    cmds = top.add_subparsers(dest="checkpoints_command", metavar="ACTION")
    cmds.required = True

    p = cmds.add_parser("list", help="every checkpoint under the root, newest first")
    _root_args(p)
    p.add_argument("--json", action="store_true", help="a JSON array instead of a table")
    p.set_defaults(func=cmd_list)

    p = cmds.add_parser("verify", help="exit 0 when PATH is a complete checkpoint, 1 when not")
    p.add_argument("path", type=Path, metavar="PATH")
    p.add_argument("--deep", action="store_true", help="also compare the manifest's sha256 checksums")
    p.add_argument("--no-cache", action="store_true",
                   help="parse every .metadata again, ignoring the metadata cache (and refresh its entries)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a line")
    p.set_defaults(func=cmd_verify)

    p = cmds.add_parser(
        "prune", help="apply retention now and print each deletion with its reason",
        epilog="exit codes: 0 done (or nothing to delete); 2 usage or config error, a root that cannot be read or "
        "is set too high, nowhere to park a deletion, or a trash or in-use folder next to the root that is not "
        "yours (another user's, a symlink, writable by group or others): nothing was deleted")
    _root_args(p)
    p.add_argument("--keep-last", type=non_negative_int, metavar="N", help="keep the N newest complete")
    p.add_argument("--keep-every", type=non_negative_int, metavar="K", help="keep steps divisible by K")
    p.add_argument("--min-free-gb", type=at_most(MAX_GB), metavar="G", help="free GiB to reach")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted, delete nothing")
    p.set_defaults(func=cmd_prune)

    for name, func, text in (("pin", cmd_pin, "never let retention delete PATH"),
                             ("unpin", cmd_unpin, "remove the pin from PATH"),
                             ("unquarantine", cmd_unquarantine, "allow resuming from PATH again")):
        p = cmds.add_parser(name, help=f"{text} (a checkpoint of the root: -c's [checkpoints] dir, or --dir)")
        _root_args(p)
        p.add_argument("path", type=Path, metavar="PATH",
                       help="a checkpoint dir directly under the root, or its NAME as `list` shows it")
        p.set_defaults(func=func)


# ---- rendering ----------------------------------------------------------------------------------


def info_json(c: CheckpointInfo) -> dict[str, Any]:
    """The fixed `list --json` object; its fields: docs/checkpoints.md, 'States' (`list --json`)."""
    return {
        "name": c.name, "path": str(c.path), "step": c.step, "complete": c.complete,
        "reason": None if c.complete else (c.reason or c.state), "size_bytes": c.size_bytes, "mtime": c.mtime,
        "pinned": c.pinned, "quarantined": c.quarantined, "state": c.state, "metrics": c.metrics,
        "ordinal": c.ordinal, "tier": c.tier, "alias_of": c.alias_of, "kept_by": c.hold,
    }



def _step_text(c: CheckpointInfo) -> str:
    if c.step is not None:
        return str(c.step)
    return f"save #{c.ordinal}" if c.ordinal is not None else "-"


def _metric_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def _table(infos: list[CheckpointInfo], now: float, metrics: tuple[str, ...] = (), tiers: bool = False) -> str:
    """The `list` table; `metrics`: the manifest metrics the retention rules rank by, one column each; `tiers`: a
    TIER column (a config with a node-local tier)."""
    rows = [(*(("TIER",) if tiers else ()), "NAME", "STEP", "STATE", *(printable(m).upper() for m in metrics), "SIZE",
             "AGE", "FLAGS", "REASON")]
    for c in infos:
        flags = ("P" if c.pinned else "") + ("Q" if c.quarantined else "") + ("K" if c.hold else "")
        reason = c.reason or (f"alias of {c.alias_of}" if c.alias_of else "")
        if c.quarantined:  # why it is skipped for resume is what an operator needs to see
            reason = "; ".join(filter(None, [reason, f"quarantined: {quarantine_reason(c.path) or 'no reason recorded'}"]))
        state = "export" if c.state == FOREIGN and reason == EXPORT_REASON else str(c.state)
        size = "-" if c.state == FOREIGN else human_bytes(c.size_bytes)
        values = (_metric_text(c.metrics.get(m)) for m in metrics)
        rows.append((*((str(c.tier),) if tiers else ()), printable(c.name), _step_text(c), state, *values, size,
                     human_age(now - c.mtime), flags or "-", printable(reason)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[-1] for r in rows)


# ---- handlers -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Target:
    root: Path
    rules: RetentionRules
    protect: tuple[Path, ...] = ()
    run_dir: Path | None = None  # where the trash may go when the root's parent cannot hold it
    local: Path | None = None  # the config's node-local tier
    local_keep: int = 1
    diverged_since: int | None = None  # an open divergence (daemon/divergence.py): its saves from this step on


def _target(args: argparse.Namespace) -> _Target:
    if args.dir is not None:  # the root's one identity (sidecars.py): what a daemon on it resolved too
        return _Target(resolved(args.dir), RetentionRules())
    from supervisor.config import load_config  # here: only -c needs it
    from supervisor.daemon.statefile import read_status

    cfg = load_config(args.config)
    status = read_status(cfg.run_dir)
    # A running supervisor's job resumed from this one: a manual prune must not pull it from under it.
    protect = (Path(status.resumed_from),) if status and status.resumed_from else ()
    ck = cfg.checkpoints
    local = resolved(ck.local_dir) if ck.local_dir is not None else None
    return _Target(resolved(ck.dir), ck, protect, cfg.run_dir, local, ck.local_keep, _diverged_since(cfg.run_dir))


def _diverged_since(run_dir: Path) -> int | None:
    from supervisor.daemon.divergence import read_open

    try:
        op = read_open(run_dir)
    except (OSError, ValueError):  # not ours: the daemon says so
        return None
    return None if op is None else op.onset_step if op.since is None else op.since


def cmd_list(args: argparse.Namespace) -> int:
    target = _target(args)
    infos = scan_tiers(target.root, target.local)
    best = target.rules.keep_best
    if args.json:
        print(json.dumps([info_json(c) for c in infos], indent=2))
    elif infos:
        print(_table(infos, wall_now(), (best.metric,) if best and best.k else (), tiers=target.local is not None))
    else:
        print("no checkpoints", file=sys.stderr)
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    with fresh() if args.no_cache else contextlib.nullcontext():
        v = judge(args.path, deep=args.deep)
    path = Path(os.path.abspath(args.path))
    # lstat first: following a symlink into a folder we may not search raises PermissionError (not ignored by
    # Path.is_dir), and a symlinked dir is never a checkpoint anyway.
    real_dir = not path.is_symlink() and path.is_dir()
    reason = quarantine_reason(path) if real_dir else None
    if args.json:
        print(json.dumps({
            "name": path.name, "path": str(path), "complete": v.complete, "state": v.state, "reason": v.reason,
            "step": checkpoint_step(path, v.manifest) if real_dir else None, "checksummed": v.checksummed,
            "quarantined": reason is not None, "quarantine_reason": reason,
        }, indent=2))
    else:
        line = printable(f"{path}: {v.state}" + (f": {v.reason}" if v.reason else ""))
        if v.complete and args.deep:
            line += " (checksums match)" if v.checksummed else " (no checksums in the manifest: sizes only)"
        if reason is not None:
            line += f" [quarantined: {reason}]"
        print(line)
    return EXIT_OK if v.complete else EXIT_NOT_OK


def _rules_with_flags(rules: RetentionRules, args: argparse.Namespace) -> RetentionRules:
    flags = {"keep_last": args.keep_last, "keep_every": args.keep_every, "min_free_gb": args.min_free_gb}
    update = {k: v for k, v in flags.items() if v is not None}
    return rules.model_copy(update=update) if update else rules


def _print_plan(plan: RetentionPlan, done: set[Path] | None, tier: str = "") -> None:
    """One line per deletion; `tier` ("durable: ", "local: ") in front when a config has two roots."""
    for d in plan.deletions:
        verb = "would delete" if done is None else ("deleted" if d.path in done else "skipped")
        print(printable(f"{tier}{verb} {d.name} ({human_bytes(d.size_bytes)}): {d.reason}"))
    if not plan.deletions:
        print(f"{tier}nothing to delete")
    for f in plan.findings:
        print(f"warning: {f.kind}: {f.message}", file=sys.stderr)


def cmd_prune(args: argparse.Namespace) -> int:
    """Retention on the root (the flags override the config's rules), then on the config's local tier (its own)."""
    target = _target(args)
    tiers = target.local is not None
    _prune_root(target.root, scan(target.root), _rules_with_flags(target.rules, args), target, args.dry_run,
                "durable: " if tiers else "")
    if target.local is not None and target.local.is_dir():
        _prune_root(target.local, scan_local(target.local), local_rules(target.rules, target.local_keep), target,
                    args.dry_run, "local: ")
    return EXIT_OK


def _prune_root(root: Path, infos: list[CheckpointInfo], rules: RetentionRules, target: _Target, dry_run: bool,
                tier: str) -> None:
    protect = {*target.protect, *in_use(root)}  # jobs started by any supervisor, on any host
    if target.diverged_since is not None:  # as the daemon: the last good checkpoint and the keep_last good before it
        protect |= {c.path for c in last_good(infos, target.diverged_since, 1 + rules.keep_last)}
    plan = plan_retention(infos, rules=rules, disk=disk_usage(root), protect=protect, now=wall_now())
    if dry_run:
        _print_plan(plan, None, tier)
        return
    try:
        done = execute_retention(root, plan, fallback=target.run_dir)
    except OSError as exc:  # e.g. no permission to create the trash: nothing was deleted
        where = f" ({exc.filename})" if exc.filename else ""
        raise CheckpointError(f"checkpoint root {root}: cannot prune: {exc.strerror or exc}{where}") from None
    _print_plan(plan, {d.path for d in done}, tier)


def _checkpoint(args: argparse.Namespace) -> Path:
    """PATH as given, else (a bare NAME that is not there) the root's child of that name; CheckpointError
    (exit 2) unless it is a checkpoint directly under the root."""
    root = _target(args).root
    path = args.path
    if len(path.parts) == 1 and not os.path.lexists(path):
        path = root / path
    return checkpoint_in_root(path, root)


def cmd_pin(args: argparse.Namespace) -> int:
    print(f"pinned {pin(_checkpoint(args))}")
    return EXIT_OK


def cmd_unpin(args: argparse.Namespace) -> int:
    path = _checkpoint(args)
    print(f"unpinned {path}" if unpin(path) else f"{path} was not pinned")
    return EXIT_OK


def cmd_unquarantine(args: argparse.Namespace) -> int:
    path = _checkpoint(args)
    print(f"unquarantined {path}" if unquarantine(path) else f"{path} was not quarantined")
    return EXIT_OK
