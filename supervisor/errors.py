"""The small error vocabulary of the supervisor and the exit codes users and scripts rely on."""
from __future__ import annotations

__all__ = [
    "EXIT_OK",
    "EXIT_NOT_OK",
    "EXIT_USAGE",
    "EXIT_GAVE_UP",
    "EXIT_SUPERVISOR_FAILED",
    "EXIT_BROKEN_PIPE",
    "SupervisorError",
    "ConfigError",
    "UsageError",
    "CheckpointError",
    "LockedError",
]

EXIT_OK = 0  # job completed, or stopped gracefully by a signal
EXIT_NOT_OK = 1  # a query answered "no" (e.g. `checkpoints verify` of an incomplete dir)
EXIT_USAGE = 2  # usage or config error: nothing was launched, nothing was deleted
EXIT_GAVE_UP = 3  # the supervisor gave up (budget, crash loop, policy "never"); do not restart/requeue
EXIT_SUPERVISOR_FAILED = 1  # `run`: the supervisor itself failed (a bug); unlike 2 and 3, systemd restarts it
EXIT_BROKEN_PIPE = 141  # stdout was closed (`status | head`): 128 + SIGPIPE, what a shell reports for `cat`


class SupervisorError(Exception):
    """Base of every error the CLI turns into one line on stderr and an exit code."""

    exit_code = EXIT_USAGE


class ConfigError(SupervisorError):
    """The config file is missing, unparseable or has a bad key; the message names the key."""


class UsageError(SupervisorError):
    """A command-line argument or a path given on it cannot be used; the message names it."""


class CheckpointError(SupervisorError):
    """A checkpoint root or directory cannot be read or acted on; the message names the path."""


class LockedError(SupervisorError):
    """Another supervisor already owns the run dir; the message names its pid."""
