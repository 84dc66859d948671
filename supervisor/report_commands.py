"""`report`: the run's history (run_dir/history.jsonl) as a summary (--json) or one self-contained HTML page.

Exit codes: 0 done; 1 no history yet (or none of it readable): nothing to report; 2 usage or config error
(including an output path that cannot be written).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from supervisor.atomic import write_atomic
from supervisor.config import load_config
from supervisor.errors import EXIT_NOT_OK, EXIT_OK, UsageError
from supervisor.history import HISTORY_FILE, read_history
from supervisor.report import Fold
from supervisor.runlock import RunLock

__all__ = ["register", "REPORT_FILE"]

REPORT_FILE = "report.html"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("report", help="goodput, restart latency, steps lost; an HTML page of the run's history")
    p.add_argument("-c", "--config", required=True, metavar="CONFIG", help="job.toml")
    p.add_argument("-o", "--output", metavar="PATH", default=None,
                   help=f"write the HTML page here (default: RUN_DIR/{REPORT_FILE}; with --json only when given)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON (exit 1: no history yet)")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    path = cfg.run_dir / HISTORY_FILE
    try:
        records, skipped = read_history(path)
    except FileNotFoundError:
        print(f"no history in {cfg.run_dir} yet ({HISTORY_FILE} is written by `fsdp-supervisor run`)", file=sys.stderr)
        return EXIT_NOT_OK
    except OSError as exc:
        print(f"cannot read {path}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_NOT_OK
    if not records:
        print(f"{path} holds no readable record", file=sys.stderr)
        return EXIT_NOT_OK
    if skipped:
        print(f"{path}: {skipped} unreadable line(s) skipped", file=sys.stderr)
    now = time.time() if RunLock.holder(cfg.run_dir) is not None else None  # a live run: numbers as of now
    html_out = Path(args.output) if args.output else (None if args.json else cfg.run_dir / REPORT_FILE)
    fold = Fold(keep=html_out is not None).add_all(records)
    summary = fold.summary(now)
    if args.json:
        print(json.dumps(summary.to_json(), indent=2))
    if html_out is not None:
        from supervisor.report_html import render_html  # only for the page

        page = render_html(fold, summary, source=str(path), generated=time.time(), now=now)
        try:
            write_atomic(html_out, page.encode(), durable=False)
        except OSError as exc:
            raise UsageError(f"cannot write {html_out}: {exc.strerror or exc}") from None
        if not args.json:
            print(html_out)
    return EXIT_OK
