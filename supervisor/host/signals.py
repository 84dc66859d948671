"""The signals a running supervisor answers, named once for the event loop, the core and `stop`.

What each does: docs/operations.md, 'What happens when things go wrong' (Ctrl+C, `stop`). The invariant: a
graceful stop (the emergency checkpoint, possibly minutes) is never cut short by anything that merely asks
again; only FORCE_STOP_SIGNAL (`stop --force`, used for nothing else) or a second Ctrl+C typed in the
supervisor's own terminal (SIGINT while it is the foreground process group: someone is at the keyboard) is.
"""
from __future__ import annotations

import signal

__all__ = ["STOP_SIGNALS", "FORCE_STOP_SIGNAL", "HANDLED"]

# Graceful; repeats wait for the stop in progress. SIGHUP (the terminal closed) is one too: a job is never left
# running without its supervisor, and nothing is lost.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
FORCE_STOP_SIGNAL = signal.SIGUSR2  # `fsdp-supervisor stop --force`: kill the job now, then exit 0
# What the event loop always traps; it traps SIGHUP too unless whoever started us ignored it (`nohup`).
HANDLED = (signal.SIGINT, signal.SIGTERM, FORCE_STOP_SIGNAL, signal.SIGCHLD)
