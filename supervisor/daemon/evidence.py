"""What a job leaves behind, read defensively: torchrun's error file, the tail of its output, the heartbeat
file and the per-rank heartbeat folder, the stack dumps in its output, and the cgroup's OOM-kill counter. Files
the job controls are opened without ever blocking (a FIFO or a device planted under the name is refused) and
read within a bound; the parsing is `supervisor.policy.exits`' and `supervisor.contract`'s.
"""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.contract import (
    MAX_HEARTBEAT_BYTES,
    MAX_RANK_BEAT_BYTES,
    MAX_RANK_FILES,
    Beat,
    parse_heartbeat,
    rank_of_heartbeat,
)
from supervisor.host.regularfile import open_regular, read_json
from supervisor.policy.exits import RootCause, scan_job_output

__all__ = ["root_cause", "read_oom_kills", "read_beat", "read_rank_beats", "RankBeats", "count_dumps", "read_span",
           "DUMP_MARK"]

_TAIL_BYTES = 256 * 1024  # torchrun's footer is ~2 KiB; this leaves room for other ranks' noise after a failure
_ERROR_FILE_BYTES = 1024 * 1024  # `record` writes the message plus one call stack: kilobytes


def _read_tail(path: Path, limit: int) -> str | None:
    """The text of the file's last `limit` bytes, or None (a FIFO, a device or a directory: refused, never waited on)."""
    try:
        with open(open_regular(path), "rb") as f:
            start = max(0, os.fstat(f.fileno()).st_size - limit)
            f.seek(start)
            data = f.read(limit)
    except (OSError, ValueError):
        return None
    if start > 0:  # began mid-line: drop the fragment
        data = data[data.find(b"\n") + 1:]
    return data.decode("utf-8", "replace")


def _error_file_message(error_file: Path) -> str | None:
    try:
        doc = read_json(error_file, _ERROR_FILE_BYTES)
    except (OSError, ValueError):  # missing, planted, too big, or garbage
        return None
    msg = doc.get("message") if isinstance(doc, dict) else None
    msg = msg.get("message") if isinstance(msg, dict) else msg
    return msg if isinstance(msg, str) else None


def root_cause(error_file: Path | None, job_log: Path | None) -> RootCause:
    """The failing worker from torchrun's error file and the tail of the job's output; tolerates garbage."""
    found = RootCause(None, None, None)
    if job_log is not None:
        text = _read_tail(job_log, _TAIL_BYTES)
        if text:
            found = scan_job_output(text.splitlines())
    if found.exitcode is not None and found.exitcode < 0:
        return found  # a worker killed by a signal recorded nothing: an error file is a peer's reaction to it
    message = _error_file_message(error_file) if error_file is not None else None
    if message and message.strip():  # what the worker itself recorded beats what we parse from its output
        found.message = message
    return found


def read_oom_kills(cgroup_root: Path = Path("/sys/fs/cgroup"), proc_self: Path = Path("/proc/self/cgroup")) -> int | None:
    """The `oom_kill` counter of our cgroup (v2), or None when it is not readable here."""
    try:
        rel = next(line.split(":", 2)[2] for line in proc_self.read_text().splitlines() if line.startswith("0::"))
        events = (cgroup_root / rel.strip().lstrip("/") / "memory.events").read_text()
    except (OSError, StopIteration, IndexError):
        return None
    for line in events.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def read_beat(path: Path) -> tuple[Beat | None, list[str]]:
    """The heartbeat file's beat and its problems; (None, []) if it is gone or not a regular file."""
    try:
        with open(open_regular(path, follow_symlinks=False, mine=True), "rb") as f:  # nor a FIFO, a device, a foreign file
            data = f.read(MAX_HEARTBEAT_BYTES + 1)
    except OSError:
        return None, []  # gone between the event and the read (the next beat will do), or not a file
    return parse_heartbeat(data)


@dataclass
class RankBeats:
    """One look at the per-rank heartbeat folder."""

    beats: dict[int, Beat] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # the first few, for one warning per attempt
    dropped: int = 0  # rank files beyond MAX_RANK_FILES, or entries beyond the scan bound, not read


_SCAN_ENTRIES = 4 * MAX_RANK_FILES  # directory entries looked at, whatever they are (a hostile job makes thousands)


def read_rank_beats(folder: Path) -> RankBeats:
    """Every `rank-<N>.json` beat in `folder`, in bounded time and memory (supervisor/contract.py's bounds).

    The job rewrites these in place, so a read can race a write and see half of each: a record that is not
    valid JSON is read once more before it counts as a problem.
    """
    out = RankBeats()
    try:
        entries = os.scandir(folder)
    except OSError:
        return out  # no folder (the job writes none, or it was removed): nothing to say
    with entries:
        for seen, entry in enumerate(entries):
            if seen >= _SCAN_ENTRIES:
                out.dropped += 1  # at least one more: the exact count would cost the scan we are bounding
                break
            rank = rank_of_heartbeat(entry.name)
            if rank is None:
                continue
            if len(out.beats) >= MAX_RANK_FILES:
                out.dropped += 1
                continue
            beat = _rank_beat(Path(entry.path), rank, out.problems)
            if beat is not None:
                out.beats[rank] = beat
    return out


def _rank_beat(path: Path, rank: int, problems: list[str]) -> Beat | None:
    found: list[str] = []
    beat: Beat | None = None
    for _ in range(2):  # a torn read of an in-place rewrite, once
        try:
            with open(open_regular(path, follow_symlinks=False, mine=True), "rb") as f:
                data = f.read(MAX_RANK_BEAT_BYTES + 1)
        except FileNotFoundError:
            return None  # gone since the scan (the job rewrote it by rename, or ended)
        except OSError as exc:  # a symlink, a FIFO, a device: never read, but said (a beat that never counts)
            strange = exc.errno in (errno.ELOOP, errno.EINVAL, errno.ENXIO)
            found = ["not a regular file" if strange else f"unreadable ({exc.strerror or exc})"]
            break
        beat, found = parse_heartbeat(data) if len(data) <= MAX_RANK_BEAT_BYTES else (None, ["over the size bound"])
        if beat is not None or found != ["heartbeat is not JSON"]:
            break
    if found and len(problems) < 3:
        problems.append(f"rank {rank}: {found[0]}")
    return beat


DUMP_MARK = b"Current thread 0x"  # one per process: faulthandler's, or trainer/stackdump.py's dump thread's
_DUMP_READ = 1024 * 1024  # stack dumps of a few processes are tens of KB


def read_span(path: Path | None, start: int, limit: int = _DUMP_READ) -> bytes:
    """Up to `limit` bytes of `path` from offset `start` (what the job wrote since), b"" when unreadable."""
    if path is None:
        return b""
    try:
        with open(open_regular(path), "rb") as f:
            if os.fstat(f.fileno()).st_size < start:  # rotated (supervisor/host/joblog.py) since: from the top
                start = 0
            f.seek(start)
            return f.read(limit)
    except OSError:
        return b""


def count_dumps(path: Path | None, start: int) -> int:
    """How many processes dumped their stacks into `path` since offset `start`."""
    return read_span(path, start).count(DUMP_MARK)
