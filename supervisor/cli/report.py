"""`report`: the run's history (run_dir/history.jsonl) as a summary (--json) or one self-contained HTML page.

Exit codes and `-o`'s rules: docs/history.md (the top). An output naming a file of the run dir other than an
.html page is refused because `-o` onto history.jsonl would replace the history with its own report.
"""
from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import time
from pathlib import Path

from supervisor.checkpoints.ranking import scan
from supervisor.cli.argtypes import add_config_arg
from supervisor.config import Config, load_config
from supervisor.errors import EXIT_NOT_OK, EXIT_OK, CheckpointError, UsageError
from supervisor.history.fold import Fold
from supervisor.history.records import HISTORY_FILE, MAX_READ_BYTES, iter_file_records
from supervisor.host.atomic import write_atomic
from supervisor.host.regularfile import open_regular
from supervisor.host.runlock import RunLock

__all__ = ["register", "REPORT_FILE"]

REPORT_FILE = "report.html"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("report", help="goodput, restart latency, steps lost; an HTML page of the run's history")
    add_config_arg(p)
    p.add_argument("-o", "--output", metavar="PATH", default=None,
                   help=f"write the HTML page here, - for stdout (default: RUN_DIR/{REPORT_FILE}; with --json only "
                        "when given)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON (exit 1: no history yet)")
    p.set_defaults(func=cmd_report)


def _fold(path: Path, keep: bool) -> tuple[Fold, int, int]:
    """(fold, records, lines skipped) of the history file, read one line at a time; OSError when unreadable."""
    fold = Fold(keep=keep)
    count = skipped = 0
    with open(open_regular(path), "rb") as f:
        for rec in iter_file_records(f):
            if rec is None:
                skipped += 1
            else:
                fold.add(rec)
                count += 1
        if f.read(1):
            print(f"{path}: only its first {MAX_READ_BYTES // 2**20} MiB read", file=sys.stderr)
    return fold, count, skipped


def _output(arg: str | None, run_dir: Path, json_too: bool) -> Path | None:
    """Where the page goes (None: nowhere; Path("-"): stdout); UsageError for a file of the run dir."""
    if arg == "-":
        if json_too:
            raise UsageError("-o - and --json would both write to stdout: choose one")
        return Path("-")
    if arg is None:
        return None if json_too else run_dir / REPORT_FILE
    target = Path(os.path.realpath(arg))  # through symlinks: `-o link` writes the file it points to
    if Path(os.path.realpath(run_dir)) in target.parents and target.suffix != ".html":
        raise UsageError(f"-o {arg}: refusing to replace {target}, a file of the run dir (name an .html page)")
    return target


def _write(out: Path, page: bytes) -> None:
    if str(out) == "-":
        sys.stdout.buffer.write(page)
        sys.stdout.flush()
        return
    try:
        special = not stat.S_ISREG(out.stat().st_mode)
    except FileNotFoundError:
        special = False
    if special:  # /dev/stdout, a FIFO: write to it (replacing a device node would be a surprise)
        with open(out, "wb") as f:
            f.write(page)
    else:
        write_atomic(out, page, durable=False)


def _on_disk(cfg: Config) -> int | None:
    """Complete checkpoints under the root now (commits minus what retention or a person deleted); None: unreadable."""
    try:
        return sum(1 for c in scan(cfg.checkpoints.dir) if c.complete)
    except (OSError, CheckpointError):  # no root (yet), or one that cannot be read: the page says commits only
        return None


def cmd_report(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    path = cfg.run_dir / HISTORY_FILE
    html_out = _output(args.output, cfg.run_dir, args.json)
    try:
        fold, count, skipped = _fold(path, keep=html_out is not None)
    except FileNotFoundError:
        print(f"no history in {cfg.run_dir} yet ({HISTORY_FILE} is written by `fsdp-supervisor run`)", file=sys.stderr)
        return EXIT_NOT_OK
    except OSError as exc:
        print(f"cannot read {path}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_NOT_OK
    if not count:
        print(f"{path} holds no readable record", file=sys.stderr)
        return EXIT_NOT_OK
    if skipped:
        print(f"{path}: {skipped} unreadable line(s) skipped", file=sys.stderr)
    now = time.time() if RunLock.holder(cfg.run_dir) is not None else None  # a live run: numbers as of now
    summary = fold.summary(now)
    on_disk = _on_disk(cfg)
    if args.json:
        print(json.dumps({**summary.to_json(), "checkpoints_on_disk": on_disk}, indent=2))
    if html_out is not None:
        from supervisor.history.html import render_html  # only for the page

        page = render_html(fold, summary, source=str(path), generated=time.time(), now=now, on_disk=on_disk)
        try:
            _write(html_out, page.encode())
        except BrokenPipeError:  # `-o - | head`: the reader left (handled by the CLI, like any command's stdout)
            raise
        except OSError as exc:
            raise UsageError(f"cannot write {args.output or html_out}: {exc.strerror or exc}") from None
        if not args.json and str(html_out) != "-":
            print(html_out)
    return EXIT_OK
