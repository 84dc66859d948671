"""Tests for supervisor.checkpoints.claim: one job per checkpoint root (pure decisions as tables, then real files)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

import psutil
import pytest

from supervisor.checkpoints.claim import (
    CLAIM_MAX_AGE_S,
    Holder,
    RootClaim,
    SlurmRun,
    claim_homes,
    conflicts,
    holder_state,
    identity_home,
    live_holders,
)
from supervisor.checkpoints.lease import Here
from supervisor.errors import ClaimedError
from supervisor.host.boot import start_ticks

NOW = 1_700_000_000.0
HOST = "node-a"


HERE = Here(HOST)


def holder(*, host: str = HOST, pid: int = 42, start: int | None = 5, written: float | None = NOW,
           job: str | None = None, refresh_s: float = 300.0) -> Holder:
    return Holder(path=Path("x.json"), job=job, pid=pid, host=host, start=start, config="/c/job.toml",
                  run_dir="/c/.fsdp-supervisor", written=written, refresh_s=refresh_s)


def started(pid: int) -> int | None:
    return {42: 5, 43: 99}.get(pid)  # 42 runs (since tick 5), 43 is another process now, the rest are gone


@pytest.mark.parametrize(("h", "stale"), [
    (holder(), None),  # this host, process alive with its start time
    (holder(pid=43), "pid 43 is another process now"),  # a reused pid
    (holder(pid=44), "its process (pid 44) is gone"),
    (holder(start=None), None),  # no start time recorded: the pid alone
    (holder(host="node-b", written=NOW - 60), None),  # another host, refreshed a minute ago
    (holder(host="node-b", written=NOW - CLAIM_MAX_AGE_S - 1), "last refreshed"),
    (holder(host="node-b", written=NOW - CLAIM_MAX_AGE_S - 1, refresh_s=3600), None),  # slow refresher: 3 periods
    (holder(host="node-b", written=NOW - 3 * 3600 - 1, refresh_s=3600), "last refreshed"),
    (holder(host="node-b", written=None), "no usable time"),  # only times from the future: never live forever
])
def test_holder_state(h: Holder, stale: str | None) -> None:
    """Live or stale, and why: by process on this host, by age of the last refresh from another host."""
    why = holder_state(h, here=HERE, now=NOW, started=started)
    assert why is None if stale is None else stale in (why or "")


@pytest.mark.parametrize(("mine", "theirs", "conflict"), [
    (None, None, True),  # two single-node jobs
    (None, "rdzv h:1 run-7", True),
    ("rdzv h:1 run-7", None, True),
    ("rdzv h:1 run-7", "rdzv h:1 run-7", False),  # two nodes of one multi-node job share the root
    ("rdzv h:1 run-7", "rdzv h:1 run-8", True),  # another submission
])
def test_conflicts(mine: str | None, theirs: str | None, conflict: bool) -> None:
    assert bool(conflicts(mine, [holder(job=theirs)])) is conflict


def _plant(root: Path, *, pid: int, start: int | None, job: str | None = None, host: str | None = None,
           when: float | None = None, config: str = "/other/job.toml", slurm: dict | None = None) -> Path:
    """Another supervisor's claim file, as its RootClaim would write it."""
    folder = claim_homes(root)[0]
    folder.mkdir(mode=0o700, exist_ok=True)
    host = host or socket.gethostname()
    path = folder / f"{host}-{pid}.json"
    path.write_text(json.dumps({"job": job, "pid": pid, "host": host, "start": start, "config": config,
                                "run_dir": "/other/.fsdp-supervisor", "time": when or time.time(), "refresh_s": 300,
                                "slurm": slurm}))
    if when is not None:
        os.utime(path, (when, when))
    return path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "ckpts"
    r.mkdir()
    return r


def claim(root: Path, job: str | None = None, slurm: SlurmRun | None = None) -> RootClaim:
    return RootClaim(root, job=job, config="/me/job.toml", run_dir="/me/.fsdp-supervisor", refresh_s=300, slurm=slurm)


PARENT = os.getppid()  # a live process that is not this one: another supervisor, for the claim's purposes


class TestRootClaim:
    def test_taken_next_to_the_resolved_root_owner_only(self, root: Path, tmp_path: Path) -> None:
        """A symlinked `dir` claims its target: `.<target>.fsdp-claim/<host>-<pid>.json`, 0700/0600."""
        link = tmp_path / "link"
        link.symlink_to(root)
        c = claim(link)
        assert c.acquire() == []
        assert c.path is not None and c.path.parent == root.parent / ".ckpts.fsdp-claim"
        assert c.path.name.startswith(f"{socket.gethostname()}-{os.getpid()}")
        assert (os.stat(c.path.parent).st_mode & 0o777, os.stat(c.path).st_mode & 0o777) == (0o700, 0o600)
        doc = json.loads(c.path.read_text())
        assert doc["pid"] == os.getpid() and doc["config"] == "/me/job.toml" and doc["job"] is None
        c.release()
        assert not c.path.exists()

    def test_a_live_claim_of_another_job_refuses_naming_it(self, root: Path) -> None:
        """Exit 2 (ClaimedError) naming pid, host and config; nothing of ours is written."""
        _plant(root, pid=PARENT, start=start_ticks(PARENT))
        c = claim(root)
        with pytest.raises(ClaimedError) as err:
            c.acquire()
        msg = str(err.value)
        assert f"supervisor pid {PARENT} on {socket.gethostname()}, config /other/job.toml" in msg
        assert err.value.exit_code == 2 and "\n" not in msg and not c.held
        assert [h.pid for h in live_holders(root)] == [PARENT]

    def test_nodes_of_one_multinode_job_share(self, root: Path) -> None:
        """Same rendezvous: both hold the root; another rendezvous is refused."""
        _plant(root, pid=PARENT, start=start_ticks(PARENT), job="rdzv node-a:29500 run-7")
        assert claim(root, job="rdzv node-a:29500 run-7").acquire() == []
        with pytest.raises(ClaimedError):
            claim(root, job="rdzv node-a:29500 run-8").acquire()

    @pytest.mark.parametrize("kind", ["dead pid", "reused pid", "old, other host", "future, other host"])
    def test_a_stale_claim_is_taken_over_with_a_warning(self, root: Path, kind: str) -> None:
        """A dead holder on this host (or a pid now another process's), an old one from another host, one dated
        next year: taken over, each with one warning line, its file removed."""
        if kind == "dead pid":
            gone = next(p for p in range(4_000_000, 4_100_000) if not psutil.pid_exists(p))
            planted = _plant(root, pid=gone, start=1)
        elif kind == "reused pid":
            planted = _plant(root, pid=PARENT, start=1)
        elif kind == "old, other host":
            planted = _plant(root, pid=PARENT, start=None, host="node-z", when=time.time() - CLAIM_MAX_AGE_S - 60)
        else:
            planted = _plant(root, pid=PARENT, start=None, host="node-z", when=time.time() + 365 * 86400)
        notes = claim(root).acquire()
        assert [e for e, _ in notes] == ["root_claim_taken_over"] and "config /other/job.toml" in notes[0][1]
        assert not planted.exists()

    def test_checked_before_a_launch(self, root: Path) -> None:
        """check(): a removed claim file is written again; a live claim of another job that appeared is named."""
        c = claim(root)
        c.acquire()
        assert c.path is not None
        c.path.unlink()
        assert c.check() is None and c.path.exists()
        _plant(root, pid=PARENT, start=start_ticks(PARENT))
        assert f"pid {PARENT}" in (c.check() or "")

    def test_one_directory_reached_by_another_path_is_one_claim(self, root: Path) -> None:
        """A bind mount gives one root two paths, so two folders next to it: the identity home (by device and
        inode, in our cache dir) is where both meet. A live holder found only there refuses; a record there that
        names a root now another directory (deleted, its inode number reused) does not."""
        by_id = identity_home(root)
        assert by_id is not None
        by_id[0].mkdir(mode=0o700, parents=True)
        record = {"job": None, "pid": PARENT, "host": socket.gethostname(), "config": "/other/job.toml",
                  "start": start_ticks(PARENT), "run_dir": "/other/run", "time": time.time()}
        planted = by_id[0] / f"{socket.gethostname()}-{PARENT}.json"
        planted.write_text(json.dumps({**record, "root": str(root.parent)}))  # another directory now
        c = claim(root)
        assert c.acquire() == [] and c.id_path is not None and c.id_path.parent == by_id[0]
        assert json.loads(c.id_path.read_text())["root"] == str(root)
        c.release()
        assert not c.id_path.exists()
        planted.write_text(json.dumps({**record, "root": str(root)}))  # written by a supervisor through another path
        with pytest.raises(ClaimedError, match=f"supervisor pid {PARENT} "):
            claim(root).acquire()
        assert [h.pid for h in live_holders(root)] == [PARENT]

    def test_a_claim_folder_removed_mid_run_is_written_again_by_the_next_pass(self, root: Path) -> None:
        """`rm -rf .ckpts.fsdp-claim` while the job runs: the next pass (refresh) writes it again, so a second job
        is refused instead of finding the root free until our next launch."""
        c = claim(root)
        c.acquire()
        assert c.path is not None and c.id_path is not None
        shutil.rmtree(c.path.parent)
        shutil.rmtree(c.id_path.parent)
        c.refresh()
        assert c.path.exists() and c.id_path.exists()
        assert [h.pid for h in live_holders(root)] == [os.getpid()]

    def test_a_cache_dir_inside_the_root_holds_no_claim(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """`FSDP_SUPERVISOR_CACHE_DIR=ckpts/.cache`: the claim stays next to the root, nothing goes inside it."""
        monkeypatch.setenv("FSDP_SUPERVISOR_CACHE_DIR", str(root / ".cache"))
        c = claim(root)
        assert c.acquire() == [] and c.id_path is None and claim_homes(root) == [root.parent / ".ckpts.fsdp-claim"]
        assert os.listdir(root) == []

    @pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the folder to another user")
    def test_a_folder_not_ours_moves_the_claim_to_the_cache_dir(self, root: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
        """Another user's `.ckpts.fsdp-claim` (a shared /tmp): never used; the claim goes to our cache dir with a
        warning, and a second claim still meets it there."""
        monkeypatch.setenv("FSDP_SUPERVISOR_CACHE_DIR", str(tmp_path / "cache"))
        theirs = claim_homes(root)[0]
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        c = claim(root)
        notes = c.acquire()
        assert [e for e, _ in notes] == ["root_claim_elsewhere"] and "belongs to uid 65534" in notes[0][1]
        assert c.path is not None and c.path.parent == claim_homes(root)[1] and os.listdir(theirs) == []
        assert [h.pid for h in live_holders(root)] == [os.getpid()]  # `status` and the next `run` look there too


def test_a_holder_in_another_pid_namespace_is_judged_by_age() -> None:
    """A container sharing our host name but not our pids: its pid means nothing here, so its claim lives by its
    refreshes (as from another host), not by whether some process of ours has that number."""
    h = Holder(path=Path("x.json"), job=None, pid=44, host=HOST, start=5, config="c", run_dir="r",
               written=NOW - 60, refresh_s=300, pidns=111)
    assert holder_state(h, here=Here(HOST, 222), now=NOW, started=started) is None
    assert holder_state(h, here=Here(HOST, 111), now=NOW, started=started) == "its process (pid 44) is gone"


class TestSlurmRuns:
    """A Slurm job requeued after its supervisors were SIGKILLed (KillWait ran out, the OOM killer, a lost node) may
    start on other nodes, whose supervisors see the dead ones' claims as from another host: live for 15 minutes. Slurm
    runs one job once at a time (a requeued job starts only once every process of its previous run has ended), so a
    claim of an earlier run of the same Slurm job is stale: without that, the requeued job exited 2, not requeued."""

    JOB = SlurmRun(cluster="c1", job_id="4242", restart=1)

    @pytest.mark.parametrize(("theirs", "stale"), [
        (SlurmRun("c1", "4242", 0), True),  # the run before this one
        (SlurmRun("c1", "4242", 1), False),  # this very run (another node of it, or a second supervisor of ours)
        (SlurmRun("c1", "4243", 0), False),  # another Slurm job
        (SlurmRun("c2", "4242", 0), False),  # the same number on another cluster
        (None, False),  # not under Slurm
    ])
    def test_an_earlier_run_of_this_slurm_job_is_stale(self, theirs: SlurmRun | None, stale: bool) -> None:
        h = Holder(path=Path("x.json"), job=None, pid=44, host="node-b", start=5, config="c", run_dir="r",
                   written=NOW - 60, refresh_s=300, slurm=theirs)
        why = holder_state(h, here=HERE, now=NOW, started=started, slurm=self.JOB)
        assert (why is not None) is stale and (not stale or "earlier run of Slurm job 4242" in (why or ""))

    def test_on_this_host_the_process_still_decides(self) -> None:
        """A live supervisor of an earlier run on this very host (Slurm's process tracking missed it) stays live."""
        h = Holder(path=Path("x.json"), job=None, pid=42, host=HOST, start=5, config="c", run_dir="r",
                   written=NOW - 60, refresh_s=300, slurm=SlurmRun("c1", "4242", 0))
        assert holder_state(h, here=HERE, now=NOW, started=started, slurm=self.JOB) is None

    def test_from_the_environment(self) -> None:
        env = {"SLURM_JOB_ID": "4242", "SLURM_CLUSTER_NAME": "c1", "SLURM_RESTART_COUNT": "2"}
        assert SlurmRun.from_env(env) == SlurmRun("c1", "4242", 2)
        assert SlurmRun.from_env({"SLURM_JOB_ID": "7"}) == SlurmRun("", "7", 0)  # the first run: no count yet
        assert SlurmRun.from_env({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "x"}) == SlurmRun("", "7", 0)
        assert SlurmRun.from_env({}) is None

    def test_requeued_elsewhere_takes_over_the_earlier_runs_claim(self, root: Path) -> None:
        """The earlier run's claim from another host (another rendezvous too: node 0 moved) is taken over with a
        warning, and ours records our run; a live claim of another Slurm job from another host still refuses."""
        planted = _plant(root, pid=PARENT, start=None, host="node-z", job="rdzv 10.0.0.1:24242 fsdp-4242",
                         slurm={"cluster": "c1", "job": "4242", "restart": 0})
        c = claim(root, job="rdzv 10.0.0.2:24242 fsdp-4242", slurm=self.JOB)
        notes = c.acquire()
        assert [e for e, _ in notes] == ["root_claim_taken_over"] and "earlier run of Slurm job 4242" in notes[0][1]
        assert not planted.exists() and c.path is not None
        assert json.loads(c.path.read_text())["slurm"] == {"cluster": "c1", "job": "4242", "restart": 1}
        c.release()
        _plant(root, pid=PARENT, start=None, host="node-z", slurm={"cluster": "c1", "job": "4243", "restart": 0})
        with pytest.raises(ClaimedError):
            claim(root, slurm=self.JOB).acquire()
