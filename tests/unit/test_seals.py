"""Seals of checkpoints without checksums of their own, and the check before a launch (supervisor/checkpoints/seals.py,
supervisor/daemon/integrity.py): read every byte, never trust size or times."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor.checkpoints.seals import check, expected, seal, seal_path
from supervisor.daemon import integrity
from supervisor.daemon.core import Core
from supervisor.daemon.integrity import good_ones, seals_idle
from supervisor.errors import SidecarError
from tests.fakes import FakeSystem, RecordingLog
from tests.jobs.dcp_files import write_checkpoint, write_lightning_checkpoint
from tests.unit.test_core import exit_job, make_core


def _flip(path: Path, offset: int) -> None:
    """One bit changed in place, the file's size and mtime put back (only its ctime tells)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture
def make_checkpoint() -> Callable[[Path, str], Path]:
    """A plain DCP dir (no manifest: the supervisor seals it), written without torch: the unit tier runs in venvs
    without it (conftest's `make_checkpoint` copies one torch wrote, for the integration tier)."""

    def make(root: Path, name: str) -> Path:
        return write_checkpoint(root, int(name.rsplit("_", 1)[1]), name=name, shards=1, manifest=False)

    return make


Launch = Callable[..., tuple[Core, FakeSystem, RecordingLog, Path]]


@pytest.fixture
def launched(tmp_path: Path, make_checkpoint: Callable[[Path, str], Path]) -> Launch:
    """`launched(10, 20, **make_core's sections)`: Core over a root of plain saves step_10, step_20, begun, with its
    first pass and every seal done (the job launched from the newest)."""

    def launch(*steps: int, **sections: str) -> tuple[Core, FakeSystem, RecordingLog, Path]:
        core, fake, log = make_core(tmp_path, **sections)
        for step in steps:
            make_checkpoint(core.cfg.checkpoints.dir, f"step_{step}")
        core.begin(None)
        core.house.wait_idle(30)
        assert seals_idle(30)
        return core, fake, log, core.cfg.checkpoints.dir

    return launch


@pytest.fixture
def plain(tmp_path: Path, make_checkpoint: Callable[[Path, str], Path]) -> tuple[Path, Path]:
    root = tmp_path / "ckpts"
    return root, make_checkpoint(root, "step_10")


def test_a_seal_is_kept_outside_the_root_and_checks_every_byte(plain: tuple[Path, Path]) -> None:
    root, ck = plain
    assert expected(root, ck) is None
    assert seal(root, ck) and not seal(root, ck)  # sealed once; its files unchanged since: not again
    path = seal_path(root, ck.name)
    assert path.parent == root.parent / ".ckpts.fsdp-seals" and oct(path.parent.stat().st_mode)[-3:] == "700"
    assert not any(".fsdp" in p.name for p in ck.iterdir())  # nothing of ours inside the checkpoint
    source, sums = expected(root, ck)  # type: ignore[misc]
    assert source == "seal" and set(sums) == {p.name for p in ck.iterdir()}
    assert check(root, ck, sums) is None
    shard = next(p for p in ck.iterdir() if p.suffix == ".distcp")
    _flip(shard, shard.stat().st_size // 2)
    assert not seal(root, ck)  # same inode, size and times: rot is never sealed over
    problem = check(root, ck, sums)
    assert problem == f"{shard} bytes 0-{shard.stat().st_size} do not match their xxh3_64 checksum", problem


def _rewrite(path: Path, flip: bool) -> None:
    data = bytearray(path.read_bytes())
    if flip:
        data[0] ^= 1
    tmp = path.with_name("new")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, path)


def test_a_recommit_is_sealed_again_a_cut_one_or_a_write_after_commit_is_not(plain: tuple[Path, Path]) -> None:
    """Lightning's last.ckpt re-committed in place (shards, then the last file): a new seal that matches. Shards
    rewritten with no last file after them (a rewrite cut short, a job writing after its commit): the old seal
    stays, and the check fails."""
    root, ck = plain
    seal(root, ck)
    shard = next(p for p in ck.iterdir() if p.suffix == ".distcp")
    _rewrite(shard, flip=True)
    assert not seal(root, ck)
    assert "do not match" in (check(root, ck, expected(root, ck)[1]) or "")  # type: ignore[index]
    _rewrite(ck / ".metadata", flip=False)  # the commit's last file, after the shards
    assert seal(root, ck)
    assert check(root, ck, expected(root, ck)[1]) is None  # type: ignore[index]
    _rewrite(shard, flip=True)  # written after that commit
    assert not seal(root, ck) and check(root, ck, expected(root, ck)[1]) is not None  # type: ignore[index]


def test_a_lightning_rewrite_cut_before_meta_pt_or_a_metadata_copied_in_keeps_the_old_seal(tmp_path: Path) -> None:
    """Lightning rewrites last.ckpt in place: DCP files (`.metadata` last), then `meta.pt`. Cut before `meta.pt`,
    the new shards sit under the old `meta.pt`: not a re-commit, the old seal fails. A `.metadata` copied in from
    another checkpoint (every shard left as it was) is none either."""
    root = tmp_path / "ckpts"
    ck = write_lightning_checkpoint(root, 20, name="last.ckpt")
    assert seal(root, ck)
    for shard in sorted(ck.glob("*.distcp")):
        _rewrite(shard, flip=True)
    _rewrite(ck / ".metadata", flip=False)
    assert not seal(root, ck)
    assert "do not match" in (check(root, ck, expected(root, ck)[1]) or "")  # type: ignore[index]
    _rewrite(ck / "meta.pt", flip=False)  # the re-commit finished: sealed again, and good
    assert seal(root, ck) and check(root, ck, expected(root, ck)[1]) is None  # type: ignore[index]
    plain = write_checkpoint(root, 10, manifest=False)
    assert seal(root, plain)
    (plain / ".metadata").write_bytes((write_checkpoint(tmp_path / "b", 30, manifest=False, tensors={"w": 77})
                                       / ".metadata").read_bytes())
    assert not seal(root, plain) and check(root, plain, expected(root, plain)[1]) is not None  # type: ignore[index]


def test_rot_then_a_chmod_of_every_file_is_not_a_recommit(plain: tuple[Path, Path]) -> None:
    """`chmod -R` (or a chown) after the bytes rotted gives every file a new ctime, the last file's last: no file was
    rewritten (same inode, size and mtime), so the old seal stays and the rot is found, never sealed over."""
    root, ck = plain
    assert seal(root, ck)
    _flip(next(p for p in ck.iterdir() if p.suffix == ".distcp"), 3)
    for path in sorted(ck.iterdir(), key=lambda p: p.name == ".metadata"):
        path.chmod(0o640)
    assert not seal(root, ck) and check(root, ck, expected(root, ck)[1]) is not None  # type: ignore[index]


def test_cut_and_missing_files_fail(plain: tuple[Path, Path]) -> None:
    root, ck = plain
    seal(root, ck)
    sums = expected(root, ck)[1]  # type: ignore[index]
    shard = next(p for p in ck.iterdir() if p.suffix == ".distcp")
    size = shard.stat().st_size
    os.truncate(shard, size - 1)
    assert check(root, ck, sums) == f"{shard} has {size - 1} bytes, its checksums cover {size}"
    shard.unlink()
    assert check(root, ck, sums) == f"{shard} is missing"


def test_a_seals_folder_not_ours_is_refused(plain: tuple[Path, Path]) -> None:
    root, ck = plain
    folder = root.parent / ".ckpts.fsdp-seals"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)  # group- and world-writable: anybody could forge a seal in it
    with pytest.raises(SidecarError):
        seal(root, ck)
    with pytest.raises(SidecarError):
        expected(root, ck)


def test_trainer_checkpoints_use_their_manifest(tmp_path: Path) -> None:
    """A manifest with checksums is what the check uses; nothing is sealed for it."""
    ck = write_checkpoint(tmp_path / "ckpts", 5)
    raw = json.loads((ck / "manifest.json").read_text())
    raw["checksums"] = {"algorithm": "xxh3_64", "files": {".metadata": [[0, (ck / ".metadata").stat().st_size,
                                                                          "0000000000000000"]]}}
    (ck / "manifest.json").write_text(json.dumps(raw))
    source, sums = expected(tmp_path / "ckpts", ck)  # type: ignore[misc]
    assert source == "manifest"
    assert "ckpt" in (check(tmp_path / "ckpts", ck, sums) or "")  # a wrong digest: the .metadata fails


class TestBeforeLaunch:
    def test_a_rotten_resume_point_is_quarantined_as_corrupt_and_the_one_before_used(
            self, tmp_path: Path, launched: Launch) -> None:
        """Sealed when first seen complete; rotten afterwards (size and mtime unchanged); the pass before the next
        launch reads it, quarantines it (`corrupt: <file> bytes ...`) and the job gets the one before."""
        core, fake, log, ck = launched(10, 20)
        assert fake.spawned[-1].argv[-1] == str(ck / "step_20")
        assert seal_path(ck, "step_10").exists() and seal_path(ck, "step_20").exists()
        shard = next(p for p in (ck / "step_20").iterdir() if p.suffix == ".distcp")
        _flip(shard, 3)
        exit_job(core, fake, 1)
        fake.advance(10, core)
        assert fake.spawned[-1].argv[-1] == str(ck / "step_10")
        corrupt = [f for e, f in log.events if e == "checkpoint_corrupt"]
        assert len(corrupt) == 1 and f"{shard} bytes 0-" in corrupt[0]["message"], log.events
        marker = json.loads((ck / "step_20" / ".quarantined").read_text())
        assert marker["reason"].startswith(f"corrupt: {shard} bytes 0-")
        assert (ck / "step_20").exists()  # kept for a person to look at
        from supervisor.checkpoints import DiskUsage, RetentionRules, plan_retention, scan

        infos = {c.name: c for c in scan(ck)}
        assert infos["step_20"].state == "corrupt" and (infos["step_20"].reason or "").startswith(f"{shard} bytes 0-")
        plan = plan_retention(list(infos.values()), rules=RetentionRules(keep_last=1),
                              disk=DiskUsage(total_bytes=1 << 40, free_bytes=1 << 39), protect=set(), now=1e10)
        assert [d.path for d in plan.deletions] == []  # step_10 is the newest good; the corrupt one is a human's

    def test_a_removed_seal_is_made_again_and_the_launch_still_reads(
            self, tmp_path: Path, make_checkpoint: Callable[[Path, str], Path]) -> None:
        core, fake, _ = make_core(tmp_path)
        ck = core.cfg.checkpoints.dir
        make_checkpoint(ck, "step_10")
        core.begin(None)
        shutil.rmtree(seal_path(ck, "step_10").parent)
        exit_job(core, fake, 1)
        fake.advance(10, core)
        assert fake.spawned[-1].argv[-1] == str(ck / "step_10") and seal_path(ck, "step_10").exists()

    def test_retention_in_the_pass_that_takes_the_scrubs_finding_keeps_the_rotten_one(
            self, make_checkpoint: Callable[[Path, str], Path], launched: Launch) -> None:
        """A kept checkpoint rots and the background scrub finds it; a newer save pushes it out of keep_last before
        the next pass: that pass quarantines it first, so its retention sees it corrupt (left for a human), not as
        a complete one no rule keeps."""
        core, fake, log, ck = launched(10, 20, checkpoints="keep_last = 2\nscrub_interval_s = 30\nretention_interval_s = 30")
        _flip(next(p for p in (ck / "step_10").iterdir() if p.suffix == ".distcp"), 3)
        fake.advance(31, core)  # the scrub starts, in the background
        core.house.wait_idle(30)
        assert seals_idle(30) and not (ck / "step_10" / ".quarantined").exists()  # found, not yet quarantined
        make_checkpoint(ck, "step_30")
        fake.advance(31, core)
        core.house.wait_idle(30)
        assert [f for e, f in log.events if e == "checkpoint_corrupt"], log.events
        assert (ck / "step_10" / ".quarantined").exists(), [f for e, f in log.events if e == "retention_deleted"]

    @pytest.mark.parametrize("every", [0, 100])
    def test_the_scrub_finds_rot_in_a_kept_checkpoint(self, tmp_path: Path, every: int,
                                                      launched: Launch) -> None:
        """`scrub_interval_s`: every kept checkpoint is read again in a pass that often, not only the resume point;
        one that fails is quarantined as corrupt while the job runs. 0: never."""
        core, fake, log, ck = launched(10, 20, checkpoints=f"scrub_interval_s = {every}\nretention_interval_s = 30")
        _flip(next(p for p in (ck / "step_10").iterdir() if p.suffix == ".distcp"), 3)
        for _ in range(8):
            fake.advance(31, core)
            core.house.wait_idle(30)
        assert seals_idle(30)
        corrupt = [f["message"] for e, f in log.events if e == "checkpoint_corrupt"]
        assert len(corrupt) == (1 if every else 0) and all(str(ck / "step_10") in m for m in corrupt), corrupt
        assert (ck / "step_10" / ".quarantined").exists() == bool(every)


class TestCorruptExit:
    def test_a_load_that_fails_its_checksums_quarantines_at_once_and_relaunches_without_backoff(
            self, tmp_path: Path, launched: Launch) -> None:
        """The job's own load found rot the pass before its launch did not (it came after, or the job chose its
        own checkpoint): exit `corrupt`, the checkpoint quarantined naming file and range, relaunched at once from
        the one before, no restart counted against the job."""
        core, fake, log, ck = launched(10, 20, restart="quarantine_after = 5\nbackoff_initial_s = 30")
        shard = ck / "step_20" / "__0_0.distcp"
        (core.run_dir / "logs" / "attempt-0001.log").write_text(
            "[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1, in <module>\n"
            f"[rank0]: supervisor.errors.CheckpointCorruptError: checkpoint corrupt: {shard} bytes 5-9 do not match "
            "their xxh3_64 checksum recorded at save\n")
        exit_job(core, fake, 1)
        fake.advance(0.5, core)
        core.house.wait_idle(30)
        assert seals_idle(30)
        fake.advance(0.5, core)
        assert core.status.last_exit is not None and core.status.last_exit.reason == "corrupt"
        assert fake.spawned[-1].argv[-1] == str(ck / "step_10") and len(fake.spawned) == 2
        q = [f for e, f in log.events if e == "quarantined"]
        assert len(q) == 1 and f"{shard} bytes 5-9" in q[0]["reason"], q
        backoff = [f for e, f in log.events if e == "backoff"]
        assert backoff[-1]["delay_s"] == 0 and backoff[-1]["reason"] == "corrupt"


def test_a_check_being_read_never_holds_up_the_supervisors_exit(tmp_path: Path) -> None:
    """A SIGTERM during the check before a launch of a big checkpoint: the supervisor stops within a second
    (invariant 8). The check's readers are daemon threads; an executor's would be joined at exit until the last
    byte was read (here: never)."""
    code = """if True:
        import sys, threading
        from pathlib import Path
        from supervisor.checkpoints import seals
        reading = threading.Event()
        def stuck(path, segments, mb_s):
            reading.set()
            threading.Event().wait()
        seals._hash_file = stuck
        threading.Thread(target=seals.check_files, args=(Path(sys.argv[1]), {"a": [(0, 1, "0")]}), daemon=True).start()
        reading.wait()
    """
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], timeout=60, check=True)


def test_a_link_to_a_rotten_checkpoint_is_never_the_resume_point(tmp_path: Path) -> None:
    """Lightning's `last.ckpt` as a symlink to its newest save: when that save's bytes fail, the link (which holds
    no files of its own to check) is as corrupt as its target; the job gets the save before, not the link."""
    from supervisor.checkpoints import scan
    from supervisor.daemon.integrity import good_ones
    from supervisor.policy.resume import Launch, plan_resume

    root = tmp_path / "ckpts"
    older, newest = write_lightning_checkpoint(root, 20), write_lightning_checkpoint(root, 30)
    (root / "last.ckpt").symlink_to(newest.name)
    assert seal(root, older) and seal(root, newest)
    _flip(newest / "__0_0.distcp", 100)
    found = scan(root)
    judged, good, findings = good_ones(found, [c for c in found if c.complete], verify=True, roots=(root, None))
    plan = plan_resume(judged, resume_args=["--resume", "{checkpoint}"], allow_fresh_start=False)
    assert [c.path for c in good] == [older] and [f.kind for f in findings] == ["checkpoint_corrupt"], findings
    assert isinstance(plan, Launch) and plan.checkpoint is not None and plan.checkpoint.path == older, plan


def test_a_pass_never_waits_for_a_background_seal(plain: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A new checkpoint without checksums is sealed on a thread of its own: the pass (a commit's detection, a job
    exit's judgement) goes on while it hashes (a 789 GB checkpoint at the idle bandwidth takes an hour)."""
    import threading

    from supervisor.checkpoints import scan

    root, ck = plain
    release, started = threading.Event(), threading.Event()

    def slow_seal(root: Path, path: Path, mb_s: float | None = None) -> bool:
        started.set()
        release.wait(30)
        return seal(root, path, mb_s=mb_s)

    monkeypatch.setattr(integrity, "seal", slow_seal)
    found = scan(root)
    done = threading.Thread(target=good_ones, args=(found, list(found)), kwargs={"verify": False, "roots": (root, None)})
    done.start()
    done.join(10)
    try:
        assert not done.is_alive() and started.wait(10)  # the pass returned while the seal still reads
        assert not seal_path(root, ck.name).exists()
    finally:
        release.set()
    assert seals_idle(30) and seal_path(root, ck.name).exists()


def test_integrity_off_seals_nothing_and_reads_nothing_before_a_launch(
        tmp_path: Path, launched: Launch) -> None:
    """`[checkpoints] integrity = false`: a complete checkpoint is resumed unread and nothing is sealed."""
    core, fake, log, ck = launched(10, checkpoints="keep_last = 0\nintegrity = false")
    assert fake.spawned[-1].argv[-1] == str(ck / "step_10") and not seal_path(ck, "step_10").parent.exists()


def _with_checksums(ck: Path) -> Path:
    """What the trainer library writes: its manifest's `checksums` (here one range per file, right digests)."""
    from supervisor.checkpoints.integrity import digest

    raw = json.loads((ck / "manifest.json").read_text())
    files = {p.name: [[0, p.stat().st_size, digest(p.read_bytes())]] for p in ck.iterdir() if p.name != "manifest.json"}
    (ck / "manifest.json").write_text(json.dumps({**raw, "checksums": {"algorithm": "xxh3_64", "files": files}}))
    return ck


@pytest.mark.parametrize(("checksums", "loads_checked", "reads"), [
    ("manifest", True, 0), ("manifest", False, 1), ("seal", True, 1), ("seal", False, 1)])
def test_the_launch_reads_the_resume_point_only_when_its_job_does_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checksums: str, loads_checked: bool, reads: int) -> None:
    """A checkpoint of the trainer library is checked by its own load as it reads it (no second read: recovery
    time), once the job's heartbeat said its load is the library's (`checks_loads`): the pass before the launch does
    not read it then. Before that (a script that saves with the library, loads with plain `dcp.load`), and for a
    sealed one (a third-party layout), the pass reads it."""
    from supervisor.checkpoints import scan

    root = tmp_path / "ckpts"
    ck = write_checkpoint(root, 10, shards=1, manifest=checksums == "manifest")
    assert _with_checksums(ck) if checksums == "manifest" else seal(root, ck)
    assert (expected(root, ck) or ("",))[0] == checksums
    read: list[Path] = []
    monkeypatch.setattr(integrity, "check", lambda root, path, sums, **kw: read.append(path))
    found = scan(root)
    _, good, findings = good_ones(found, list(found), verify=True, roots=(root, None), loads_checked=loads_checked)
    assert read == [ck] * reads and [c.path for c in good] == [ck] and findings == []


def test_the_scrub_reads_nothing_in_the_pass(plain: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """`scrub_interval_s`: the pass that starts the scrub returns without reading a checkpoint's bytes (a daily read
    of a large root would hold up every commit's notice and relaunch behind it); the background reads, idle and at
    bounded bandwidth, and the next pass quarantines what it found."""
    import threading

    from supervisor.checkpoints import scan, seals

    root, ck = plain
    assert seal(root, ck)
    _flip(next(p for p in ck.iterdir() if p.suffix == ".distcp"), 3)
    real, release = seals._hash_file, threading.Event()
    readers: list[tuple[threading.Thread, float | None]] = []

    def reader(path: Path, segments: list[tuple[int, int, str]] | None, mb_s: float | None) -> object:
        readers.append((threading.current_thread(), mb_s))
        release.wait(30)
        return real(path, segments, mb_s)

    monkeypatch.setattr(seals, "_hash_file", reader)
    found = scan(root)
    returned: list[tuple[object, ...]] = []
    pass_ = threading.Thread(target=lambda: returned.append(
        good_ones(found, list(found), verify=False, roots=(root, None), scrub=True)))
    pass_.start()
    pass_.join(10)
    try:
        assert returned and returned[0][2] == [], "the pass waited for the scrub"
        assert all(t is not pass_ for t, _ in readers)
    finally:
        release.set()
    assert seals_idle(30) and readers and {mb_s for _, mb_s in readers} == {seals.SEAL_MB_S}
    assert not (ck / ".quarantined").exists()  # found, quarantined by the next pass (before its retention)
    found = scan(root)
    judged, good, findings = good_ones(found, list(found), verify=False, roots=(root, None))
    assert good == [] and [f.kind for f in findings] == ["checkpoint_corrupt"] and judged[0].state == "corrupt"
    assert json.loads((ck / ".quarantined").read_text())["reason"].startswith("corrupt: ")


def test_a_seal_made_under_another_lineage_of_the_root_is_not_trusted(tmp_path: Path) -> None:
    """A seal records the root's lineage (checkpoints/lineage.py). The root removed and made anew (a new lineage) with
    a checkpoint of the same name: the seal left next to it is the other run's, describes other bytes, and is no
    seal; the checkpoint is sealed anew, never judged (quarantined) by it."""
    from supervisor.checkpoints.lineage import root_lineage

    root = tmp_path / "ckpts"
    root.mkdir()
    first = root_lineage(root, create=True)
    ck = write_checkpoint(root, 10, shards=1, manifest=False)
    assert seal(root, ck) and json.loads(seal_path(root, ck.name).read_text())["lineage"] == first
    old = seal_path(root, ck.name).read_bytes()
    shutil.rmtree(root)  # started over: the seals' folder next to the root survives
    root.mkdir()
    second = root_lineage(root, create=True)
    ck = write_checkpoint(root, 10, shards=1, manifest=False, tensors={"other": 8})
    doc = json.loads(old)
    doc["ids"] = {n: [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
                  for n, st in ((p.name, p.stat()) for p in ck.iterdir())}  # as if it described these very files
    seal_path(root, ck.name).write_text(json.dumps(doc))
    assert expected(root, ck) is None
    assert seal(root, ck) and json.loads(seal_path(root, ck.name).read_text())["lineage"] == second
    source, sums = expected(root, ck)  # type: ignore[misc]
    assert source == "seal" and check(root, ck, sums) is None


def test_corrupt_is_counted_apart_in_status_and_the_history(
        tmp_path: Path, make_checkpoint: Callable[[Path, str], Path]) -> None:
    """A checkpoint found corrupt by the check before a launch, and one by the job's own load: each is a `quarantined`
    record with the reason `corrupt: ...` in the history, counted as `corrupt` (not among `quarantines`) by the
    report, listed as `corrupt` by `status` (text and state.json) and `corrupt` in `checkpoints list`."""
    from supervisor.checkpoints import scan
    from supervisor.daemon.core import Core
    from supervisor.daemon.recorder import HistoryRecorder
    from supervisor.history.fold import summarize
    from supervisor.history.records import HISTORY_FILE, read_history
    from supervisor.observe.statusview import render_status
    from supervisor.policy.state import Status

    core, fake, log = make_core(tmp_path)
    core = Core(core.cfg, fake, log, history=HistoryRecorder.for_run_dir(core.cfg.run_dir, now=fake.now, log=log))
    ck = core.cfg.checkpoints.dir
    for name in ("step_10", "step_20", "step_30"):
        make_checkpoint(ck, name)
    core.begin(None)
    core.house.wait_idle(30)
    assert seals_idle(30) and fake.spawned[-1].argv[-1] == str(ck / "step_30")
    _flip(ck / "step_30" / "__0_0.distcp", 3)  # found by the pass before the next launch
    exit_job(core, fake, 1)
    fake.advance(10, core)
    core.house.wait_idle(30)
    assert fake.spawned[-1].argv[-1] == str(ck / "step_20")
    (core.run_dir / "logs" / "attempt-0002.log").write_text(  # found by the job's own load
        "[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1, in <module>\n"
        f"[rank0]: supervisor.errors.CheckpointCorruptError: checkpoint corrupt: {ck}/step_20/__0_0.distcp bytes "
        "5-9 do not match their xxh3_64 checksum recorded at save\n")
    exit_job(core, fake, 1)
    for _ in range(3):
        fake.advance(0.5, core)
        core.house.wait_idle(30)
    assert fake.spawned[-1].argv[-1] == str(ck / "step_10")
    bad = [str(ck / "step_30"), str(ck / "step_20")]
    assert sorted(core.status.corrupt) == sorted(bad) and sorted(core.status.quarantined) == sorted(bad)
    assert sorted(Status.from_json(json.dumps(core.status.to_json())).corrupt) == sorted(bad)
    text = render_status(core.status, running=True, now=fake.now())
    assert "corrupt: 2: " in text and "quarantined:" not in text, text
    assert {c.name: c.state for c in scan(ck)} == {"step_10": "complete", "step_20": "corrupt", "step_30": "corrupt"}
    recs = read_history(core.run_dir / HISTORY_FILE)[0]
    assert sorted(r["path"] for r in recs if r["kind"] == "quarantined" and r["reason"].startswith("corrupt: ")) == \
        sorted(bad), [r for r in recs if r["kind"] == "quarantined"]
    summary = summarize(recs).to_json()
    assert (summary["corrupt"], summary["quarantines"]) == (2, 0), summary


def test_one_pass_seals_every_checkpoint_without_a_seal(tmp_path: Path) -> None:
    """A root found with several unsealed checkpoints (a first `run` over an existing root): the background seals each
    of them, not only the newest (which, sealed, would otherwise take every later pass's turn)."""
    from supervisor.checkpoints import scan

    root = tmp_path / "ckpts"
    cks = [write_checkpoint(root, step, shards=1, manifest=False) for step in (10, 20, 30)]
    assert seal(root, cks[-1])
    found = scan(root)
    good_ones(found, list(found), verify=False, roots=(root, None))
    assert seals_idle(30) and all(seal_path(root, ck.name).exists() for ck in cks)


@pytest.mark.parametrize("planted", ["another uid", "a symlink"])
def test_a_launch_never_resumes_unchecked_when_the_seals_folder_is_not_ours(tmp_path: Path, planted: str) -> None:
    """Outside attack (issue 34): the seals' folder replaced by another uid's, or by a symlink to a copy, after a bit of
    the sealed resume point rotted. The check cannot be made: the pass before the launch fails (the launch waits and
    is refused in the end, naming the folder), it never hands over the rotten checkpoint unread."""
    from supervisor.checkpoints import scan
    from supervisor.errors import CheckpointError

    root = tmp_path / "ckpts"
    older = write_checkpoint(root, 8, name="step_8", shards=1, manifest=False)
    newest = write_checkpoint(root, 10, name="step_10", shards=1, manifest=False)
    assert seal(root, older) and seal(root, newest)
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    _flip(shard, shard.stat().st_size // 2)
    folder = seal_path(root, newest.name).parent
    if planted == "another uid":
        os.chown(folder, 65534, 65534)
    else:
        shutil.copytree(folder, tmp_path / "elsewhere")
        shutil.rmtree(folder)
        folder.symlink_to(tmp_path / "elsewhere")
    found = scan(root)
    with pytest.raises(CheckpointError, match=f"cannot check {newest} before the launch: .*fsdp-seals"):
        good_ones(found, list(found), verify=True, roots=(root, None))
    _, good, _ = good_ones(found, list(found), verify=False, roots=(root, None))  # a pass without a launch goes on
    assert [c.path for c in good] == [newest, older]


@pytest.mark.parametrize("layout", ["transformers", "flat DCP"])
def test_a_file_added_to_a_sealed_checkpoint_after_its_commit_fails_its_seal(tmp_path: Path, layout: str) -> None:
    """Outside attack (issue 34): a job writes a new file into a sealed checkpoint after its commit (transformers
    loads `rng_state_<rank>.pth` when there). The seal never covered its bytes: the checkpoint is not resumed
    unchecked, it fails its seal and the one before is the resume point."""
    from supervisor.checkpoints import scan
    from tests.jobs.dcp_files import write_trainer_checkpoint

    root = tmp_path / "ckpts"
    if layout == "transformers":
        older, newest = write_trainer_checkpoint(root, 8), write_trainer_checkpoint(root, 10)
    else:
        older = write_checkpoint(root, 8, name="step_8", shards=1, manifest=False)
        newest = write_checkpoint(root, 10, name="step_10", shards=1, manifest=False)
    assert seal(root, older) and seal(root, newest)
    (newest / "rng_state_2.pth").write_bytes(b"written after the commit and the seal")
    assert not seal(root, newest)  # no re-commit: the seal made at the commit stands
    found = scan(root)
    judged, good, _ = good_ones(found, [c for c in found if c.complete], verify=True, roots=(root, None))
    assert [c.path for c in good] == [older]
    assert {c.path: c.reason for c in judged}[newest] == f"{newest / 'rng_state_2.pth'} was written after its seal"
