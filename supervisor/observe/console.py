"""What `run` prints to its terminal (or to nohup.out, a pipe, CI): short event lines and a progress line.

What is shown where: docs/operations.md, 'What happens when things go wrong' ("What `run` prints"). Live rows
and a vanished terminal: docs/design.md, 'Notes for maintainers'.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import threading
import time
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from supervisor.observe.humanize import human_bytes
from supervisor.observe.sanitize import visible
from supervisor.policy.state import State, Status, output_beyond

__all__ = ["Console", "render_event", "progress_text", "Progress", "SUMMARY_EVERY_S", "TICK_S", "NOT_ECHOED",
           "shown_path"]

TICK_S = 1.0  # how often the progress is looked at (the live row is redrawn; a summary may be due)
SUMMARY_EVERY_S = 10.0  # not a terminal: at most one progress line this often
NOT_ECHOED = ("note not a terminal: the job's output is not echoed here (each attempt's is in {logs}/, "
              "`fsdp-supervisor logs --job -f` follows it); progress every {every:g} s, a failure's last output lines")
_ROWS = ("job", "progress")  # live rows, top to bottom
_GONE = (errno.EIO, errno.EPIPE, errno.ENXIO, errno.EBADF, errno.ENODEV, errno.ECONNRESET)
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]|[\x00-\x1f\x7f]")
_PLAIN = re.compile(r"[\w.,:/@%+=~^-]+")

# The fields worth a terminal line, in order; other events show their first few fields (never the noisy ones).
_FIELDS: dict[str, tuple[str, ...]] = {
    "job_started": ("attempt", "pid", "resumed_from"),
    "job_exited": ("attempt", "reason", "code", "signal", "detail"),
    "checkpoint_committed": ("step", "path", "size_bytes"),
    "retention_deleted": ("path", "reason", "size_bytes"),
    "backoff": ("delay_s", "reason", "restarts"),
    "stopping": ("signal",),
    "stopped": ("reason",),
    "hang_detected": ("attempt", "step", "phase", "idle_s"),
    "stack_dump_requested": ("workers", "log"),
    "prewarm_handoff": ("pid", "note"),
    "python_warning": ("category", "where", "message"),
}
_OFF_TTY: dict[str, tuple[str, ...]] = {"job_started": ("log",)}  # where the output the echo would show is
_NEVER = frozenset({"run_dir", "argv", "env", "ts", "level", "event", "timestamp", "logger", "exc_info", "exception",
                    "stack"})
_MAX_FIELDS = 4
_MAX_VALUE = 100
# Never cut: why it gave up, the root cause (both bounded where they are made), and paths (a cut one opens nothing)
_WHOLE = frozenset({"reason", "detail"})


def _is_path(key: str) -> bool:
    return key in ("path", "log", "resumed_from") or key.endswith("_path")


def shown_path(path: str, cwd: str | None = None) -> str:
    """A path as the console shows it: relative when it is under the current directory, else as it is."""
    cwd = cwd or os.getcwd()
    return os.path.relpath(path, cwd) if path.startswith(cwd + os.sep) else path


def _value(key: str, v: Any, cwd: str) -> str:
    if key.endswith("_bytes") and isinstance(v, int):
        return human_bytes(v).replace(" ", "")
    if isinstance(v, str) and _is_path(key):
        v = shown_path(v, cwd)
    if isinstance(v, float):
        v = round(v, 3)
    text = v if isinstance(v, str) and _PLAIN.fullmatch(v) else json.dumps(v, default=str, ensure_ascii=False)
    text = _ESCAPES.sub("", text)
    return text if len(text) <= _MAX_VALUE or key in _WHOLE or _is_path(key) else text[:_MAX_VALUE - 1] + "…"


def _label(key: str) -> str:
    return key[:-6] if key.endswith("_bytes") else key  # the value says its unit: size=2.0MiB


def _clock(ts: Any, tty: bool) -> str:
    try:
        when = datetime.fromisoformat(str(ts).replace("Z", "+00:00")).astimezone()
    except ValueError:
        when = datetime.now().astimezone()
    return when.strftime("%H:%M:%S" if tty else "%Y-%m-%d %H:%M:%S")


def render_event(event: Mapping[str, Any], *, tty: bool, cwd: str | None = None) -> str:
    """One short line for a structlog event dict: `HH:MM:SS [WARN] event key=value ...` (2-4 fields)."""
    cwd = cwd or os.getcwd()
    name = str(event.get("event", ""))
    level = str(event.get("level", "info"))
    keys = _FIELDS.get(name) or tuple(k for k in event if k not in _NEVER)
    keys += () if tty else _OFF_TTY.get(name, ())
    fields = [f"{_label(k)}={_value(k, event[k], cwd)}" for k in keys if event.get(k) is not None][:_MAX_FIELDS]
    tag = {"warning": "WARN ", "error": "ERROR ", "critical": "ERROR "}.get(level, "")
    if tty and tag and not os.environ.get("NO_COLOR"):
        tag = ("\x1b[33m" if level == "warning" else "\x1b[31m") + tag.strip() + "\x1b[0m "
    line = " ".join([_clock(event.get("ts"), tty), f"{tag}{name}", *fields]).rstrip()
    output, detail = event.get("last_output"), event.get("detail")
    if name == "job_exited" and not tty and isinstance(output, list):  # nothing echoed the job: its last words
        shown = output_beyond(detail if isinstance(detail, str) else None, [str(x) for x in output])
        line += "".join(f"\n  [job] {visible(text, colors=False)}" for text in shown)
    return line


def progress_text(st: Status) -> str | None:
    """`progress step=120 loss=1.83 rate=11.2/s ckpt=step_00000100 restarts=0`; None before the first step."""
    if st.step is None and st.state is State.RUNNING:
        return None
    parts = ["progress"]
    if st.state is not State.RUNNING:
        parts.append(f"state={st.state.value}")
    if st.step is not None:
        parts.append(f"step={st.step}")
    if st.loss is not None:
        parts.append(f"loss={st.loss:.4g}")
    if st.val_loss is not None:
        parts.append(f"val_loss={st.val_loss:.4g}")
    if st.rate_steps_per_s:
        parts.append(f"rate={st.rate_steps_per_s:.3g}/s")
    ck = st.latest_checkpoint
    parts.append(f"ckpt={Path(str(ck['path'])).name if ck and ck.get('path') else 'none'}")
    parts.append(f"restarts={st.restarts}")
    return " ".join(parts)


def _fit(text: str, width: int) -> str:
    """Control characters out, then cut to `width` terminal columns (wide characters count two)."""
    text = _ESCAPES.sub("", text)
    cols = 0
    for i, ch in enumerate(text):
        cols += 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1
        if cols > width:
            return text[:i]
    return text


class Console:
    """Writes lines (and, on a terminal, live rows) to one file descriptor; never raises for a dead one."""

    def __init__(self, fd: int, *, tty: bool | None = None, detach_std: bool = False) -> None:
        self.fd = fd
        self.tty = os.isatty(fd) if tty is None else tty
        self.dead = False
        self._rows: dict[str, str | None] = dict.fromkeys(_ROWS)
        self._drawn = 0  # live rows on screen now
        self._lock = threading.Lock()  # housekeeping and metrics threads log too
        self._std = _same_file_fds(fd) if detach_std else []

    @classmethod
    def for_stderr(cls) -> Console:
        return cls(2, detach_std=True)

    def show(self, lines: Sequence[str] = (), **rows: str | None) -> None:
        """Print `lines`, then redraw the live rows (`rows` replaces those named: job=..., progress=...)."""
        with self._lock:
            if self.dead:
                return
            changed = False
            for name, text in rows.items():
                changed = changed or self._rows.get(name) != text
                self._rows[name] = text
            if not self.tty:
                if lines:
                    self._write("".join(f"{line}\n" for line in lines))
                return
            if not lines and not changed:
                return
            live = [r for r in (self._rows[n] for n in _ROWS) if r]
            width = max(10, _columns(self.fd) - 1)  # never the last column: some terminals wrap there
            out = self._erase() + "".join(f"{line}\n" for line in lines) + "\n".join(_fit(r, width) for r in live)
            self._drawn = len(live)
            self._write(out)

    def note(self, text: str) -> None:
        """One line of our own, dated like the events."""
        self.show([f"{_clock(None, self.tty)} {text}"])

    def close(self) -> None:
        """Leave the live rows on screen as ordinary lines (the cursor goes below them)."""
        with self._lock:
            if self.tty and self._drawn and not self.dead:
                self._write("\n")
            self._drawn = 0

    def _erase(self) -> str:
        if not self._drawn:
            return ""
        up = f"\x1b[{self._drawn - 1}A" if self._drawn > 1 else ""
        return f"\r{up}\x1b[J"

    def _write(self, text: str) -> None:
        data = text.encode("utf-8", "replace")
        try:
            while data:
                data = data[os.write(self.fd, data):]
        except BlockingIOError:
            pass  # someone made the terminal non-blocking and it is full: drop the rest, never wait
        except OSError as exc:
            if exc.errno in _GONE:
                self._gone()
            # else (a full disk under nohup.out, ...): this line is lost, the next one may make it

    def _gone(self) -> None:
        self.dead, self._drawn = True, 0
        try:
            null = os.open(os.devnull, os.O_RDWR)
        except OSError:
            return
        for fd in self._std:
            with contextlib.suppress(OSError):
                os.dup2(null, fd)
        os.close(null)


def _same_file_fds(fd: int) -> list[int]:
    """Which of stdin/stdout/stderr are the same terminal or pipe as `fd` (they die with it)."""
    ref = _identity(fd)
    return [] if ref is None else [std for std in (0, 1, 2) if _identity(std) == ref]


def _identity(fd: int) -> tuple[int, int, int] | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_rdev


def _columns(fd: int) -> int:
    try:
        return os.get_terminal_size(fd).columns or 80
    except OSError:
        return 80


def _news(text: str | None) -> str | None:
    return text and re.sub(r" state=\S+", "", text)


class Progress:
    """The progress line from `core.status`: a live row on a terminal, a summary line every 10 s elsewhere."""

    def __init__(self, console: Console, status: Callable[[], Status], *, clock: Callable[[], float] = time.time,
                 every_s: float = SUMMARY_EVERY_S) -> None:
        self.console, self.status, self.clock, self.every_s = console, status, clock, every_s
        self._printed: str | None = None  # the last summary printed (not a terminal)
        self._printed_at: float | None = None

    def tick(self) -> None:
        """From the event loop's ticks: redraw the live row, or print a summary when one is due and news."""
        text = progress_text(self.status())
        now = self.clock()
        if self.console.tty:
            stamp = datetime.fromtimestamp(now).strftime("%H:%M:%S")
            self.console.show(progress=f"{stamp} {text}" if text else None)
            return
        due = self._printed_at is None or now - self._printed_at >= self.every_s
        if text and due and text != self._printed:
            self._print(text, now)

    def finish(self) -> None:
        """At exit: the last progress as an ordinary line, unless that is what was printed last."""
        text = progress_text(self.status())
        now = self.clock()
        if self.console.tty:
            self.console.show(progress=None)
        if text and _news(text) != _news(self._printed):  # a new state alone is in the events already
            self._print(text, now)
        self.console.close()

    def _print(self, text: str, now: float) -> None:
        fmt = "%H:%M:%S" if self.console.tty else "%Y-%m-%d %H:%M:%S"
        self.console.show([f"{datetime.fromtimestamp(now).strftime(fmt)} {text}"])
        self._printed, self._printed_at = text, now
