"""The small error vocabulary of the supervisor and the exit codes users and scripts rely on."""
from __future__ import annotations

from typing import ClassVar, Literal

__all__ = [
    "EXIT_OK",
    "EXIT_NOT_OK",
    "EXIT_USAGE",
    "EXIT_GAVE_UP",
    "EXIT_SUPERVISOR_FAILED",
    "EXIT_BROKEN_PIPE",
    "EXIT_NOT_RUNNING",
    "SupervisorError",
    "ConfigError",
    "UsageError",
    "CheckpointError",
    "LockedError",
    "ClaimedError",
    "SidecarError",
    "MetadataKind",
    "MetadataError",
    "RefusedGlobalError",
    "UnsafeMetadataError",
    "UnknownClassError",
    "ManifestError",
    "CheckpointIOError",
    "CheckpointCorruptError",
    "BestFileError",
    "ExportConflictError",
]

EXIT_OK = 0  # job completed, or stopped gracefully by a signal
EXIT_NOT_OK = 1  # a query answered "no" (e.g. `checkpoints verify` of an incomplete dir)
EXIT_USAGE = 2  # usage or config error: nothing was launched, nothing was deleted
EXIT_GAVE_UP = 3  # the supervisor gave up (budget, crash loop, policy "never"); do not restart/requeue
EXIT_SUPERVISOR_FAILED = 1  # `run`: the supervisor itself failed (a bug); unlike 2 and 3, systemd restarts it
EXIT_NOT_RUNNING = 3  # `status`: no supervisor is running on the run dir (systemctl status's "not running")
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


class ClaimedError(SupervisorError):
    """Another job holds the checkpoint root (its claim, supervisor/checkpoints/claim.py); the message names it."""


class SidecarError(CheckpointError):
    """A folder we keep next to the checkpoint root (trash, in-use markers, the claim) cannot be used: not
    ours, writable by others, or nowhere to put it. Retention stops; discovery and resume go on."""


# The errors below are not SupervisorErrors: each is caught where it arises and becomes something else (a verdict
# on a checkpoint, a job's exit, a file the trainer ignores), never a command's exit code.


# What kind of refusal a .metadata error is (a Verdict's `kind`, which the daemon acts on).
MetadataKind = Literal["unsafe", "unknown_class", "bad_metadata"]


class MetadataError(Exception):
    """`.metadata` could not be read or does not have DCP's shape; the message says why."""

    kind: ClassVar[MetadataKind] = "bad_metadata"


class RefusedGlobalError(MetadataError):
    """`.metadata` names a global outside the allowlist; `global_name` is the (sanitized) dotted name."""

    def __init__(self, message: str, global_name: str) -> None:
        super().__init__(message)
        self.global_name = global_name


class UnsafeMetadataError(RefusedGlobalError):
    """The refused global could run code, or is no DCP name at all: treat the file as hostile."""

    kind: ClassVar[MetadataKind] = "unsafe"


class UnknownClassError(RefusedGlobalError):
    """The refused global is a torch name we do not know: most likely written by a newer torch."""

    kind: ClassVar[MetadataKind] = "unknown_class"


class ManifestError(Exception):
    """`manifest.json` exists but is unreadable or malformed; the message says which field."""


class CheckpointIOError(RuntimeError):
    """A DCP save or load failed on some rank; the message carries every rank's error (last line: the cause)."""


class CheckpointCorruptError(RuntimeError):
    """A checkpoint's bytes do not match the checksums recorded for them; the message names the file and range.

    The supervisor classifies a job that exits with it as `corrupt` (policy/exits.py): its name is the contract."""


class BestFileError(ValueError):
    """best.json exists but cannot be trusted; the message says why (the trainer logs it and ignores the file)."""


class ExportConflictError(UsageError):
    """An export would delete, replace or mix with a file it cannot prove an earlier export of ours wrote (a
    downloaded model's shards beside OUT): refused, naming the file, before anything is written (exit 2)."""
