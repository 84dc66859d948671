"""The signals a running supervisor answers, named once for the event loop, the core and `stop`.

A graceful stop lets the job write its emergency checkpoint, which can take minutes; nothing that merely
asks again (a retried `stop`, systemd or Slurm repeating SIGTERM, a script's `kill` loop) may cut it short.
So SIGTERM and SIGINT start a graceful stop, and a repeat of either only says that the stop is still in
progress. Two things kill the job at once: `stop --force`, which sends a signal used for nothing else
(FORCE_STOP_SIGNAL), and a second Ctrl+C typed in the supervisor's own terminal (a SIGINT arriving while the
supervisor is the foreground process group of its controlling terminal: someone is at the keyboard).
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
