"""A run dir is ours or refused (issue 35 item 3): its folders and the daemon's files in it, and no write of the
daemon follows a symlink planted there (the check at start cannot see one planted later)."""
from __future__ import annotations

import errno
import json
import logging
import os
import tempfile
import threading
from pathlib import Path

import pytest

from supervisor.contract import RANK_HEARTBEAT_DIR
from supervisor.daemon.events import SupervisorStarted
from supervisor.daemon.evidence import read_beat, read_rank_beats
from supervisor.daemon.preflight import run_dir_problem
from supervisor.daemon.recorder import HistoryRecorder
from supervisor.host import joblog
from supervisor.host.runlock import RunLock
from supervisor.observe.eventlog import LOG_FILE, configure
from tests.fakes import RecordingLog

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
BEAT = json.dumps({"step": 7, "phase": "train", "time": 1.0})


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """Another user's file, which a symlink in the run dir points at."""
    home = tmp_path / "victim"
    home.mkdir()
    notes = home / "notes.txt"
    notes.write_text("precious\n")
    if os.geteuid() == 0:
        os.chown(notes, NOBODY, NOBODY)
    return notes


@pytest.mark.parametrize(("name", "plant", "problem"), [
    ("", lambda p: None, None),  # ours, 0700
    ("", lambda p: os.chown(p, NOBODY, NOBODY), "belongs to uid 65534, not to you"),
    ("logs", lambda p: (p.mkdir(), os.chown(p, NOBODY, NOBODY)), "belongs to uid 65534"),
    ("", lambda p: os.chmod(p, 0o1777), "writable by its group or by others (mode 1777)"),  # /tmp: was made 0700
    ("errors", lambda p: (p.mkdir(), os.chmod(p, 0o777)), "writable by its group or by others (mode 0777)"),
    (RANK_HEARTBEAT_DIR, lambda p: (p.mkdir(), os.chmod(p, 0o770)), "writable by its group"),
    (RANK_HEARTBEAT_DIR, lambda p: (p.mkdir(), os.chmod(p, 0o1777)), None),  # sticky: nobody renames ours
    ("logs", lambda p: p.symlink_to(p.parent.parent), "is a symlink, not a folder of ours"),
    ("supervisor.lock", lambda p: p.symlink_to("/etc/hostname"), "is a symlink, not a file of ours"),
    ("state.json", lambda p: (p.write_text("{}"), os.chown(p, NOBODY, NOBODY)), "belongs to uid 65534"),
    ("history.jsonl", lambda p: p.mkdir(), "is not a plain file"),
])
@as_root
def test_run_dir_problem(run_dir: Path, name: str, plant, problem: str | None) -> None:  # type: ignore[no-untyped-def]
    plant(run_dir / name if name else run_dir)
    found = run_dir_problem(run_dir)
    assert found is None if problem is None else (problem in (found or "") and str(run_dir / name) in (found or ""))


@pytest.mark.parametrize(("mode", "refused"), [(0o777, True), (0o1777, False), (0o775, False)])
def test_a_folder_above_that_anyone_may_write_is_refused(tmp_path: Path, mode: int, refused: bool) -> None:
    """Anyone may rename a run dir (or a folder above it) out of a world-writable folder without the sticky bit and
    put a link to their own in its place: the daemon then wrote there, and a job's error file through their link
    (seen: root's file overwritten by torchrun's error record)."""
    (tmp_path / "shared" / "team" / "run").mkdir(parents=True)
    os.chmod(tmp_path / "shared", mode)
    found = run_dir_problem(tmp_path / "shared" / "team" / "run")
    assert (found is not None) is refused and (not refused or f"{tmp_path / 'shared'}, above the run dir" in found)


def test_a_symlinked_run_dir_is_refused(tmp_path: Path, run_dir: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(run_dir)
    assert "is a symlink" in (run_dir_problem(link) or "")


class TestNoWriteFollowsASymlink:
    """Planted after the check at start (or by a job of ours): each write refuses the link, the victim is intact."""

    def test_the_lock(self, run_dir: Path, victim: Path) -> None:
        (run_dir / "supervisor.lock").symlink_to(victim)
        with pytest.raises(OSError) as exc:
            RunLock(run_dir).acquire()
        assert exc.value.errno == errno.ELOOP and victim.read_text() == "precious\n"
        assert RunLock.holder(run_dir) is None

    def test_the_log(self, run_dir: Path, victim: Path) -> None:
        (run_dir / LOG_FILE).symlink_to(victim)
        logger = logging.getLogger("supervisor")
        before = logger.handlers[:]
        try:
            with pytest.raises(OSError):
                configure(run_dir, max_bytes=2**20, backups=1, console=False)
        finally:
            for handler in logger.handlers[:]:
                if handler not in before:
                    logger.removeHandler(handler)
                    handler.close()
        assert victim.read_text() == "precious\n"

    def test_the_history(self, run_dir: Path, victim: Path) -> None:
        (run_dir / "history.jsonl").symlink_to(victim)
        log = RecordingLog()
        history = HistoryRecorder.for_run_dir(run_dir, now=lambda: 1.0, log=log)
        history.notify(SupervisorStarted())
        history.close()
        assert victim.read_text() == "precious\n" and "history_write_failed" in log.names()


class TestBeatsAreOurs:
    def test_a_symlinked_node_beat_is_not_read(self, run_dir: Path, tmp_path: Path) -> None:
        target = tmp_path / "beat.json"
        target.write_text(BEAT)
        (run_dir / "heartbeat.json").symlink_to(target)
        assert read_beat(run_dir / "heartbeat.json") == (None, [])

    @as_root
    def test_another_users_rank_beat_never_counts(self) -> None:
        """A run dir others may enter, with a sticky, world-writable heartbeats/ (allowed: nobody renames ours),
        where another user wrote rank-7.json (as that user): no beat of rank 7, so no rank that stalls and no
        healthy job killed as hung."""
        with tempfile.TemporaryDirectory() as base:
            os.chmod(base, 0o755)
            self._foreign_rank_beat(Path(base))

    def _foreign_rank_beat(self, run_dir: Path) -> None:
        assert run_dir_problem(run_dir) is None
        folder = run_dir / RANK_HEARTBEAT_DIR
        folder.mkdir(mode=0o700)
        os.chmod(folder, 0o1777)
        assert run_dir_problem(run_dir) is None
        (folder / "rank-0.json").write_text(BEAT)
        pid = os.fork()
        if pid == 0:  # the other user, for real
            try:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                (folder / "rank-7.json").write_text(BEAT)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert os.stat(folder / "rank-7.json").st_uid == NOBODY
        seen = read_rank_beats(folder)
        assert sorted(seen.beats) == [0] and any("uid 65534" in p for p in seen.problems), seen
        os.chown(folder / "rank-0.json", NOBODY, NOBODY)
        (run_dir / "heartbeat.json").write_text(BEAT)
        os.chown(run_dir / "heartbeat.json", NOBODY, NOBODY)
        assert read_beat(run_dir / "heartbeat.json") == (None, [])


class TestNoOpenBlocksOnAFifo:
    """A FIFO planted as the next attempt's log (or supervisor.log, reopened at rotation): the open is refused at
    once. It blocked the event loop in open() for good, SIGTERM included (seen with the real CLI)."""

    def _refused_at_once(self, fifo: Path, opener) -> None:  # type: ignore[no-untyped-def]
        os.mkfifo(fifo)
        outcome: list[object] = []
        t = threading.Thread(target=lambda: outcome.append(_call(opener)), daemon=True)
        t.start()
        t.join(10)
        if t.is_alive():  # let the blocked open go, then fail
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        assert outcome and isinstance(outcome[0], OSError), outcome  # ENXIO (no reader) or EINVAL

    def test_an_attempt_log(self, run_dir: Path) -> None:
        self._refused_at_once(run_dir / "attempt-0002.log", lambda: joblog.open_log(run_dir / "attempt-0002.log"))

    def test_the_supervisor_log(self, run_dir: Path) -> None:
        logger = logging.getLogger("supervisor")
        before = logger.handlers[:]
        try:
            self._refused_at_once(run_dir / LOG_FILE, lambda: configure(run_dir, max_bytes=2**20, backups=1,
                                                                         console=False))
        finally:
            for handler in logger.handlers[:]:
                if handler not in before:
                    logger.removeHandler(handler)
                    handler.close()


def _call(f):  # type: ignore[no-untyped-def]
    try:
        return f()
    except OSError as exc:
        return exc
