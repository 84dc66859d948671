"""Why did an attempt end? Exit code, signal, OOM, and the failing worker's rank and exception, in one `ExitInfo`.

Which source gives what (torchrun's error file, its "Root Cause" block, the worker's traceback, the last error-like
line) and why only a bounded tail is read: docs/design.md, 'Notes for maintainers'.
"""
from __future__ import annotations

import re
import signal as _signal
from collections import deque
from collections.abc import Iterable, Sequence

from supervisor.policy.state import ExitInfo, ExitReason

__all__ = ["classify_exit", "signal_name", "RootCause", "scan_job_output"]

_ROOT_CAUSE = "Root Cause (first observed failure):"
_TRACEBACK = "Traceback (most recent call last):"
_AGENT_EXCEPTION = "ChildFailedError"  # torchrun's own footer: names no worker's error
# torchrun's agent re-raises a SIGTERM/SIGINT it received (after forwarding it to the workers) as this, and exits 1
AGENT_SIGNAL_EXCEPTION = "SignalException"
CORRUPT_EXCEPTION = "CheckpointCorruptError:"  # a load that found bytes failing their checksums (trainer library)
_MAX_PREFIX = 80  # `[<role><rank>]:`; torchrun's roles are short names
_MAX_DETAIL = 300
LAST_OUTPUT_LINES = 5  # the job's last lines kept with a failure (console, status, the log's job_exited)
_MAX_OUTPUT_LINE = 240
# torch's own log lines (`E1204 20:40:03.630000 14460 torch/distributed/...] failed (exitcode: 2) ...`): the agent's
_TORCH_LOG = re.compile(r"[DIWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ torch/")
# A rank's exception that says only that a peer vanished: the consequence of a peer's death, never its cause.
_PEER_LOST = re.compile(r"by peer|broken pipe|connection (reset|closed|refused)|remote (worker|process)|"
                        r"communicator was aborted|DistBackendError", re.I)
_ERROR_WORDS = re.compile(r"error|exception|fail|can't|cannot|not found|no such|denied|abort|fatal|killed|"
                          r"segmentation|refused|timed? ?out|invalid", re.I)


def signal_name(signum: int) -> str:
    try:
        return _signal.Signals(signum).name
    except ValueError:
        return f"SIG{signum}"


class RootCause:
    """The first failing worker: rank, its exit code, its exception message (error file or job output), and the
    job's last output lines (torchrun's own left out)."""

    def __init__(self, rank: int | None, exitcode: int | None, message: str | None,
                 last_output: Sequence[str] = ()) -> None:
        self.rank, self.exitcode, self.message = rank, exitcode, message
        self.last_output = list(last_output)

    def describe(self) -> str | None:
        parts = []
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
        if self.exitcode is not None:
            parts.append(f"exitcode {self.exitcode}" + (f" ({signal_name(-self.exitcode)})" if self.exitcode < 0 else ""))
        lines = self.message.strip().splitlines() if self.message else []
        # No exception: the last output line that reads like an error, if one does; never for a worker killed by a
        # signal, whose last lines are its peers' reaction to its death ("Connection reset by peer").
        if not lines and not (self.exitcode is not None and self.exitcode < 0):
            lines = [line for line in self.last_output if _ERROR_WORDS.search(line)]
        if lines:
            parts.append(lines[-1].strip()[:_MAX_DETAIL])
        return ": ".join(parts) if parts else None


def _strip_prefix(line: str) -> tuple[str, str] | None:
    """(`rank1`, rest) for a line starting with `[rank1]:` (one space after it dropped), else None."""
    if line.startswith("["):
        end = line.find("]:", 1, _MAX_PREFIX + 2)
        if end > 1:
            rest = line[end + 2:]
            return line[1:end], rest[1:] if rest.startswith(" ") else rest
    return None


def _split_prefix(line: str) -> tuple[str, int | None, str]:
    """(source, its rank, the rest); ("", None, line) for lines nobody prefixed.

    torchrun's tee writes `[default1]:` (or `[<role><n>]:`); torch itself prints a worker's uncaught exception
    as `[rank1]: ...`; the two can stack. The outermost prefix names the source.
    """
    first = _strip_prefix(line)
    if first is None:
        return "", None, line
    source, body = first
    inner = _strip_prefix(body)
    if inner is not None:
        body = inner[1]
    digits = len(source) - len(source.rstrip("0123456789"))
    rank = int(source[len(source) - digits:]) if 0 < digits <= 9 else None
    return source, rank, body


def _exception_line(body: str) -> str | None:
    """`pkg.Error: message` or `KeyboardInterrupt` as Python prints it after a traceback, else None."""
    if not body or body[0].isspace():
        return None
    name, sep, message = body.partition(":")
    if not all(part.isidentifier() for part in name.split(".")):
        return None
    short = name.rsplit(".", 1)[-1]
    return f"{short}: {message.strip()}" if sep and message.strip() else short


def _field(line: str, key: str) -> int | None:
    """The integer of a Root Cause field line such as `  exitcode  : 1 (pid: 3723)`."""
    name, sep, value = line.partition(":")
    words = value.split(maxsplit=1)
    if not sep or name.strip() != key or not words:
        return None
    try:
        return int(words[0])
    except ValueError:
        return None


def _local_rank(line: str) -> int | None:
    """The `local_rank` of `  rank      : 9 (local_rank: 1)`: what torchrun's default line prefix numbers."""
    _, sep, rest = line.partition("(local_rank:")
    return _field("local_rank:" + rest.split(")", 1)[0], "local_rank") if sep else None


class _OutputScan:
    """What one pass over the job's output found: the Root Cause block, each source's last exception, and the
    job's last lines.

    An unprefixed traceback may be a worker's (torchrun without --tee lets workers write to its own output) or the
    agent's `ChildFailedError`, which begins its failure report: its lines are held until its exception line says
    whose it is. torchrun's log lines and its report (to the end of its Root Cause block) are never the job's.
    """

    def __init__(self) -> None:
        self.rank: int | None = None
        self.local_rank: int | None = None
        self.exitcode: int | None = None
        self.exceptions: dict[str, str] = {}  # source -> its last exception line (insertion = first failure order)
        self.ranks: dict[str, int | None] = {}
        self.tail: deque[str] = deque(maxlen=LAST_OUTPUT_LINES)  # the job's last non-blank lines
        self._held: deque[str] = deque(maxlen=LAST_OUTPUT_LINES)  # an unprefixed traceback's, until its end
        self._in_root = False
        self._report = False  # inside torchrun's failure report, before its Root Cause block
        self._open: set[str] = set()  # sources inside a traceback, waiting for its exception line
        self.others: list[tuple[int | None, int | None, int | None]] = []  # the report's other failures

    def feed(self, line: str) -> None:
        line = line.rstrip("\r")
        if line.strip() == _ROOT_CAUSE:
            self.rank = self.local_rank = self.exitcode = None
            self._in_root, self._report = True, False
            return
        if self._in_root:
            self._root_cause_line(line)
        elif self._report:
            self._report_line(line)
        elif not _TORCH_LOG.match(line):
            self._output_line(line)

    def _root_cause_line(self, line: str) -> None:
        if line.startswith("==="):
            self._in_root = False
        elif self.rank is None and (rank := _field(line, "rank")) is not None:
            self.rank, self.local_rank = rank, _local_rank(line)
        elif self.exitcode is None and (code := _field(line, "exitcode")) is not None:
            self.exitcode = code

    def _report_line(self, line: str) -> None:
        """A line of torchrun's failure report before its Root Cause block: the other failures it lists."""
        if (rank := _field(line, "rank")) is not None:
            self.others.append((rank, _local_rank(line), None))
        elif self.others and self.others[-1][2] is None and (code := _field(line, "exitcode")) is not None:
            self.others[-1] = (*self.others[-1][:2], code)

    def _output_line(self, line: str) -> None:
        """A line of the job's own output (not torchrun's log nor its report)."""
        source, rank, body = _split_prefix(line)
        if body == _TRACEBACK:
            self._open.add(source)
            if not source:
                self._held.clear()
        if body.strip():
            (self._held if not source and "" in self._open else self.tail).append(line.rstrip()[:_MAX_OUTPUT_LINE])
        if body == _TRACEBACK or source not in self._open:
            return
        exc = _exception_line(body)
        if exc is None:  # a frame, a caret line, or another process's line in between
            return
        self._open.discard(source)
        agent = exc.split(":", 1)[0] == _AGENT_EXCEPTION
        if not source:  # whose the held traceback was is known now
            if agent:
                self._report = True
            else:
                self.tail.extend(self._held)
            self._held.clear()
        if agent:
            return
        self.ranks.setdefault(source, rank)
        self.exceptions[source] = exc

    def last_output(self) -> list[str]:
        """The job's last lines; a traceback cut off by the end of the output counts as the job's."""
        return [*self.tail, *self._held][-LAST_OUTPUT_LINES:]

    def worker_exception(self) -> str | None:
        """The root-cause worker's last exception, else the first failing source's last one.

        torchrun's default prefix numbers the local rank (`[default1]:`); a `${rank}` template, the global one.
        When torchrun named a root-cause rank that raised nothing (a worker SIGKILLed by the OOM killer, a
        segfault), another rank's exception is a consequence (its collective saw the peer vanish), not the
        cause: only output no rank is named in (torchrun without --tee) may still be the root cause's.
        """
        for wanted in (self.local_rank, self.rank):
            for source, number in self.ranks.items():
                if wanted is not None and number == wanted:
                    return self.exceptions[source]
        if self.rank is not None:
            return next((self.exceptions[s] for s, number in self.ranks.items() if number is None), None)
        return next(iter(self.exceptions.values()), None)


def scan_job_output(lines: Iterable[str]) -> RootCause:
    """Rank and exit code from torchrun's Root Cause block and the worker's exception, in one linear pass."""
    scan = _OutputScan()
    for line in lines:
        scan.feed(line)
    message = scan.worker_exception()
    killed = _killed_peer(scan, message)
    if killed is not None:
        return RootCause(killed[0], killed[2], None, scan.last_output())
    return RootCause(scan.rank, scan.exitcode, message, scan.last_output())


def _killed_peer(scan: _OutputScan, message: str | None) -> tuple[int | None, int | None, int | None] | None:
    """A rank of the report's other failures killed by a signal, when torchrun's root cause is a rank whose only
    error is that its peer vanished. torchrun names as root cause the failure with the earliest time, and a raising
    rank's error file is dated when it raised, a killed one's when the agent saw it: the rank SIGKILLed first can
    come second (a real sample: tests/data/torchrun_peer_reset_first.log)."""
    if scan.exitcode is None or scan.exitcode < 0 or not (message and _PEER_LOST.search(message)):
        return None
    return next((f for f in scan.others if f[2] is not None and f[2] < 0), None)


def _agent_relayed_stop(returncode: int, cause: RootCause | None) -> bool:
    """torchrun's exit 1 after a signal it received and forwarded: no worker failed (no Root Cause block)."""
    return (returncode == 1 and cause is not None and cause.rank is None and cause.exitcode is None
            and (cause.message or "").split(":", 1)[0] == AGENT_SIGNAL_EXCEPTION)


def classify_exit(
    returncode: int,
    *,
    at: float,
    we_stopped: bool = False,
    hang: bool = False,
    oom_before: int | None = None,
    oom_after: int | None = None,
    cause: RootCause | None = None,
) -> ExitInfo:
    """Turn a Popen returncode plus what the supervisor knows into the reason shown in logs and status."""
    code = returncode if returncode >= 0 else None
    sig = signal_name(-returncode) if returncode < 0 else None
    worker_sig = cause.exitcode if cause and cause.exitcode is not None and cause.exitcode < 0 else None
    killed = returncode == -_signal.SIGKILL or worker_sig == -_signal.SIGKILL
    if we_stopped and not hang and _agent_relayed_stop(returncode, cause):
        # The stop we asked for, as torchrun ends it: its agent forwarded our SIGTERM to the workers, waited for
        # them (their emergency checkpoint), then raised SignalException and exited 1. Not a failure code.
        return ExitInfo(code=None, signal=None, reason=ExitReason.STOPPED, at=at, detail=None)
    if hang:
        reason = ExitReason.HANG
    elif we_stopped:
        reason = ExitReason.STOPPED
    elif returncode == 0:
        reason = ExitReason.COMPLETED
    elif killed and oom_before is not None and oom_after is not None and oom_after > oom_before:
        reason = ExitReason.OOM
    elif returncode < 0 or worker_sig is not None:
        reason = ExitReason.SIGNAL
    elif cause is not None and (cause.message or "").startswith(CORRUPT_EXCEPTION):
        reason = ExitReason.CORRUPT  # the trainer library's load found rotten bytes (supervisor.errors)
    else:
        reason = ExitReason.CRASH
    detail = cause.describe() if cause else None
    shown = cause.last_output if cause and reason not in (ExitReason.COMPLETED, ExitReason.STOPPED) else []
    return ExitInfo(code=code, signal=sig, reason=reason, at=at, detail=detail, last_output=shown or None)
